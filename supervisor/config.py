"""The supervisor's settings, where its files live, and the TOML config file.

Precedence: command line > config file > defaults. A bad file is rejected at start with the
key and the reason (ConfigError), never half-applied.
"""

from __future__ import annotations

import os
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.cache_config import DEFAULTS as CACHE_DEFAULTS
from supervisor.cache_config import CacheConfig, parse_cache
from supervisor.registry import ModelSpec, from_config
from supervisor.units import parse_size

DEFAULT_PORT = 8800
DEMO_MODEL_ID = "demo"


class ConfigError(ValueError):
    pass


def default_state_dir() -> Path:
    if env := os.environ.get("MLXSUP_STATE_DIR"):
        return Path(env)
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "mlxsup"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "mlxsup"


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    state_dir: Path = field(default_factory=default_state_dir)
    model_dirs: list[Path] = field(default_factory=list)
    models: list[ModelSpec] = field(default_factory=list)
    demo: bool = False
    heartbeat_s: float = 1.0
    max_batch_size: int = 32
    evict_timeout_s: float = 10.0  # drain deadline of an evict that names none
    settle_grace_s: float = 5.0  # past the drain deadline, time to close caches and settle
    kill_timeout_s: float = 5.0  # after SIGTERM, before SIGKILL
    shutdown_drain_s: float = 5.0
    max_body_bytes: int = 8 * 1024 * 1024
    log_level: str = "info"
    # lifecycle
    default_ttl_s: float | None = None  # idle TTL of models that set none; None: never
    memory_ceiling_bytes: int | None = None  # None: total RAM minus the reserve
    memory_reserve_bytes: int | None = None  # None: max(2 GiB, 15% of RAM)
    worker_overhead_bytes: int = 256 * 2**20  # a loading worker's estimate: weights + this
    max_loaded_models: int | None = None
    pressure_soft: float = 0.90  # fraction of system memory in use: evict idle workers
    pressure_hard: float = 0.97  # abort and evict the least recently used busy worker
    housekeeping_s: float = 0.5  # TTL and pressure checks
    cache: CacheConfig = CACHE_DEFAULTS  # prompt caches: the [cache] section over the defaults

    def model_cache(self, spec: ModelSpec) -> CacheConfig:
        """A model's effective cache settings: its own overrides, then [cache], then the defaults."""
        return spec.cache.over(self.cache)

    def ceiling(self, total: int) -> int:
        if self.memory_ceiling_bytes is not None:
            return self.memory_ceiling_bytes
        reserve = self.memory_reserve_bytes
        if reserve is None:
            reserve = max(2 * 2**30, int(total * 0.15))
        return max(0, total - reserve)

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def daemon_file(self) -> Path:
        return self.state_dir / "daemon.json"


_SERVER_KEYS: dict[str, type | tuple[type, ...]] = {
    "host": str, "port": int, "state_dir": str, "model_dirs": list, "heartbeat_s": (int, float),
    "max_batch_size": int, "evict_timeout_s": (int, float), "settle_grace_s": (int, float),
    "kill_timeout_s": (int, float), "shutdown_drain_s": (int, float), "max_body_bytes": int, "log_level": str,
    "default_ttl_s": (int, float), "housekeeping_s": (int, float),
}
_MEMORY_KEYS = {
    "ceiling": "memory_ceiling_bytes", "reserve": "memory_reserve_bytes", "worker_overhead": "worker_overhead_bytes",
    "max_loaded_models": "max_loaded_models", "pressure_soft": "pressure_soft", "pressure_hard": "pressure_hard",
}


def _apply_memory(section: dict, settings: "Settings", path: Path) -> None:
    for key, value in section.items():
        attr = _MEMORY_KEYS.get(key)
        if attr is None:
            raise ConfigError(f"{path}: memory.{key}: unknown key")
        try:
            if key in ("pressure_soft", "pressure_hard"):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                    raise ValueError("a fraction between 0 and 1")
                value = float(value)
            elif key == "max_loaded_models":
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError("a positive integer")
            else:
                value = parse_size(value)
        except ValueError as exc:
            raise ConfigError(f"{path}: memory.{key}: expected {exc}") from None
        setattr(settings, attr, value)


def load_file(path: Path, settings: Settings) -> Settings:
    """Apply a TOML config file onto `settings`."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    unknown = set(data) - {"server", "models", "memory", "cache"}
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {sorted(unknown)}")
    for key, value in data.get("server", {}).items():
        expected = _SERVER_KEYS.get(key)
        if expected is None:
            raise ConfigError(f"{path}: server.{key}: unknown key")
        if not isinstance(value, expected) or isinstance(value, bool):
            raise ConfigError(f"{path}: server.{key}: expected {expected}, got {value!r}")
        if key == "state_dir":
            value = Path(value).expanduser()
        elif key == "model_dirs":
            value = [Path(v).expanduser() for v in value]
        setattr(settings, key, value)
    _apply_memory(data.get("memory", {}), settings, path)
    try:
        settings.cache = parse_cache(data.get("cache", {}), "cache", path.parent).over(CACHE_DEFAULTS)
        settings.models = from_config(data.get("models", {}), path.parent)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return settings


def runtime_dir(state_dir: Path) -> Path:
    """A private (0700) directory for the ZeroMQ socket, short enough for the ipc path limit."""
    preferred = state_dir / "run"
    if len(str(preferred / "router.sock")) < 100:
        preferred.mkdir(parents=True, exist_ok=True)
        os.chmod(preferred, 0o700)
        return preferred
    return Path(tempfile.mkdtemp(prefix="mlxsup-"))
