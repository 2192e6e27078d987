"""The effective configuration in the config file's own shape, and as TOML text.

`GET /api/config` answers with `effective(...)` of the running daemon (what `mlxsup config show`
and the dashboard read); `config show --local` builds the same from the files and variables a
`serve` would read now. Invariants: the API key never appears (only whether one is set); the
`config` part has the sections and keys a config file takes ([server], [memory], [cache],
[models.ID]), so `to_toml()` of it is a file `serve --config` accepts; unset values are
written as comments, since TOML has no null.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

from supervisor.config import _MEMORY_KEYS, _SERVER_KEYS, Settings
from supervisor.registry import ModelSpec

_SIZE_KEYS = {"ceiling", "reserve", "worker_overhead", "hot_budget", "ssd_cap"}
_SIZE_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def effective(settings: Settings, models: Iterable[ModelSpec], ceiling_bytes: int) -> dict[str, Any]:
    """The daemon's configuration: where it came from, and the values in effect (secrets redacted)."""
    server = {key: getattr(settings, key) for key in _SERVER_KEYS}
    server["api_key"] = "<set>" if settings.api_key else None
    memory = {key: getattr(settings, attr) for key, attr in _MEMORY_KEYS.items()}
    cache = {f.name: getattr(settings.cache, f.name) for f in fields(settings.cache)}
    model_table = {}
    for spec in models:
        entry: dict[str, Any] = {"path": spec.path, "aliases": list(spec.aliases), "ttl_s": spec.ttl_s,
                                 "pinned": spec.pinned}
        if spec.worker_args:
            entry["worker_args"] = list(spec.worker_args)
        overrides = {f.name: getattr(spec.cache, f.name) for f in fields(spec.cache)
                     if getattr(spec.cache, f.name) is not None}
        if overrides:
            entry["cache"] = overrides
        model_table[spec.id] = entry
    view = {"config_file": settings.config_file, "demo": settings.demo, "ceiling_effective_bytes": ceiling_bytes,
            "config": {"server": server, "memory": memory, "cache": cache, "models": model_table}}
    return json.loads(json.dumps(view, default=str))  # paths as strings: plain JSON data


def to_toml(config: dict[str, Any]) -> str:
    """TOML for the `config` part of `effective()` (sections of scalars, lists and inline tables)."""
    lines: list[str] = []
    for section in ("server", "memory", "cache"):
        lines += [f"[{section}]", *_pairs(config.get(section, {})), ""]
    for model_id, entry in config.get("models", {}).items():
        lines += [f"[models.{_key(model_id)}]", *_pairs(entry), ""]
    return "\n".join(lines)


def _pairs(table: dict[str, Any]) -> list[str]:
    return [f"# {_key(k)} = (not set)" if v is None else
            "# api_key = (set, not shown)" if k == "api_key" else f"{_key(k)} = {_value(v, k)}" for k, v in table.items()]


def _key(name: str) -> str:
    bare = name and all(c.isalnum() or c in "_-" for c in name)
    return name if bare else json.dumps(name)


def _value(value: Any, key: str = "") -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and key in _SIZE_KEYS:
        return json.dumps(_size(value))
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(v, k)}" for k, v in value.items() if v is not None) + " }"
    raise TypeError(f"no TOML for {value!r}")


def _size(n: int) -> str | int:
    """'48GiB' for a whole number of a unit, else the bytes (both are sizes the config file takes)."""
    for unit, scale in _SIZE_UNITS:
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return n
