"""Prompt-cache settings: the `[cache]` section, per-model `cache = {...}` overrides, worker arguments.

    [cache]                      # every model
    enabled = true               # both tiers; false turns the caches off
    hot_budget = "1GiB"          # hot (in-memory) prefix cache; 0 turns it off
    ssd = true                   # SSD cache on or off
    ssd_dir = "/fast/disk/mlxsup-cache"   # default: <state_dir>/cache
    ssd_cap = "8GiB"             # per model: least recently used blocks go beyond it
    block_tokens = 64
    kv_bits = 8                  # K/V quantized (4 or 8), the running cache and the cached blocks; absent: full
    kv_group_size = 64           # its quantization groups along a head's dimension (32, 64 or 128)
    snapshot_every = 4096        # sliding-window / recurrent models: also snapshot every N prompt tokens

    [models.assistant]
    path = "..."
    cache = { hot_budget = "4GiB", ssd = false }   # the same keys, for this model only

A model's SSD blocks live in `<ssd_dir>/<model fingerprint>` (protocol/cachedir.py). Unset
keys inherit: model override > [cache] section > DEFAULTS.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from supervisor.units import is_number, parse_size


@dataclass(frozen=True)
class CacheConfig:
    enabled: bool | None = None
    hot_budget: int | None = None
    ssd: bool | None = None
    ssd_dir: Path | None = None
    ssd_cap: int | None = None
    block_tokens: int | None = None
    kv_bits: int | None = None  # 0: as computed (the default)
    kv_group_size: int | None = None
    snapshot_every: int | None = None

    def over(self, base: CacheConfig) -> CacheConfig:
        """This config with its unset keys taken from `base`."""
        return CacheConfig(**{f.name: getattr(base, f.name) if getattr(self, f.name) is None else getattr(self, f.name)
                              for f in fields(self)})

    @property
    def hot_on(self) -> bool:
        return bool(self.enabled) and bool(self.hot_budget)

    @property
    def ssd_on(self) -> bool:
        return bool(self.enabled) and bool(self.ssd)

    def ssd_root(self, state_dir: Path) -> Path:
        return self.ssd_dir if self.ssd_dir is not None else state_dir / "cache"

    def worker_args(self, state_dir: Path) -> list[str]:
        """The worker's command-line arguments for this (fully resolved) config."""
        args = ["--hot-cache-bytes", str(self.hot_budget if self.hot_on else 0),
                "--cache-block-tokens", str(self.block_tokens), "--cache-snapshot-every", str(self.snapshot_every)]
        if self.kv_bits:
            args += ["--cache-kv-bits", str(self.kv_bits), "--cache-kv-group-size", str(self.kv_group_size)]
        if self.ssd_on:
            args += ["--ssd-cache-root", str(self.ssd_root(state_dir)), "--ssd-cache-bytes", str(self.ssd_cap)]
        return args


DEFAULTS = CacheConfig(enabled=True, hot_budget=2**30, ssd=True, ssd_dir=None, ssd_cap=8 * 2**30, block_tokens=64,
                       kv_bits=0, kv_group_size=64, snapshot_every=4096)


def parse_cache(table: object, where: str, base: Path) -> CacheConfig:
    """A CacheConfig from a TOML table; ValueError names the key (`where` is its prefix)."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: must be a table")
    values: dict = {}
    for key, value in table.items():
        name = f"{where}.{key}"
        if key in ("enabled", "ssd"):
            if not isinstance(value, bool):
                raise ValueError(f"{name}: must be true or false")
        elif key in ("hot_budget", "ssd_cap"):
            try:
                value = parse_size(value)
            except (ValueError, AttributeError):
                raise ValueError(f"{name}: expected a size such as 512MiB or 8GB, got {value!r}") from None
            if value < 0:
                raise ValueError(f"{name}: must not be negative")
        elif key == "ssd_dir":
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name}: must be a folder path")
            value = Path(value).expanduser()
            value = value if value.is_absolute() else (base / value).resolve()
        elif key == "block_tokens":
            if not is_number(value, integer=True) or not 1 <= value <= 4096:
                raise ValueError(f"{name}: must be an integer from 1 to 4096")
        elif key == "kv_bits":
            if not is_number(value, integer=True) or value not in (0, 4, 8):
                raise ValueError(f"{name}: must be 4 or 8 (or 0: not quantized)")
        elif key == "kv_group_size":
            if not is_number(value, integer=True) or value not in (32, 64, 128):
                raise ValueError(f"{name}: must be 32, 64 or 128")
        elif key == "snapshot_every":
            if not is_number(value, integer=True) or value < 0:
                raise ValueError(f"{name}: must be a number of tokens, 0 or more")
        else:
            raise ValueError(f"{name}: unknown key")
        values[key] = value
    return CacheConfig(**values)
