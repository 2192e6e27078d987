"""The supervisor's settings, where its files live, and the TOML config file.

Precedence: command line > environment (MLXSUP_*) > config file > defaults. The file is
`--config`, else $MLXSUP_CONFIG, else ~/.config/mlxsup/config.toml when it exists. A bad file
or variable is rejected at start with the key and the reason (ConfigError), never half-applied.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from supervisor.cache_config import DEFAULTS as CACHE_DEFAULTS
from supervisor.cache_config import CacheConfig, parse_cache
from supervisor.draft_config import SERVER_MODES
from supervisor.hosts import host_name, is_loopback, parse_origin
from supervisor.registry import ModelSpec, from_config
from supervisor.units import is_number, parse_size

DEFAULT_PORT = 8800
DEMO_MODEL_ID = "demo"
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"  # the demo's folder name (state_dir/demo/...)
IMPORT_DIR = "models"  # state_dir/models: the model folder every serve watches, `mlxsup import`'s default
ROUTER_SOCKET = "router.sock"  # the router's ipc:// socket, in the runtime directory
IPC_PATH_LIMIT = 100  # an ipc:// socket path must be shorter (sun_path: 104 bytes on macOS, 108 on Linux)


def router_socket(run_dir: Path) -> Path | None:
    """Where the router's ipc:// socket lives, or None when that path is too long for one."""
    path = run_dir / ROUTER_SOCKET
    return path if len(str(path)) < IPC_PATH_LIMIT else None


class ConfigError(ValueError):
    pass


def default_state_dir() -> Path:
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "mlxsup"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "mlxsup"


def default_config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "mlxsup" / "config.toml"


def default_hf_cache() -> Path:
    if hub := os.environ.get("HF_HUB_CACHE"):
        return Path(hub)
    if home := os.environ.get("HF_HOME"):
        return Path(home) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


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
    body_timeout_s: float = 60.0  # a request's body not whole this long after it arrived: 408, connection closed
    log_level: str = "info"
    sse_keepalive_s: float = 2.0  # a stream waiting (queued, loading, prefilling) gets its API's keep-alive this often
    # lifecycle
    default_ttl_s: float | None = None  # idle TTL of models that set none; None: never
    memory_ceiling_bytes: int | None = None  # None: total RAM minus the reserve
    memory_reserve_bytes: int | None = None  # None: max(2 GiB, 15% of RAM)
    worker_overhead_bytes: int = 256 * 2**20  # a loading worker's estimate: weights + this
    max_loaded_models: int | None = None
    pressure_soft: float = 0.90  # fraction of system memory in use: evict idle workers
    pressure_hard: float = 0.97  # abort and evict the least recently used busy worker
    housekeeping_s: float = 0.5  # TTL, pressure and hang checks
    # faults
    hang_timeout_s: float = 30.0  # a ready worker's loop silent this long (or far past a long step's prediction): kill
    load_timeout_s: float = 600.0
    # an embedding or rerank request fails (504) once its worker has sent no heartbeat for this long: a silence
    # limit, not a deadline (the worker heartbeats between its batches, so long work on a slow host completes)
    embed_timeout_s: float = 600.0
    # audio: a transcription's multipart body at most this big (OpenAI's 25 MB), its audio this long
    audio_max_bytes: int = 25 * 1024 * 1024
    max_audio_s: float = 3600.0
    prefill_step_size: int = 2048  # the most prompt tokens of a sequence one engine step prefills
    step_target_s: float = 0.25  # an engine step's target duration: prefill chunks are sized to it
    speculative: str = "auto"  # every model's drafting unless its entry says: auto (prompt lookup on a GPU), off, prompt-lookup
    warm_batch_shapes: str = "auto"  # idle workers run each batch size once (after Ready, a step at a time): auto (GPU only), on, off
    crash_limit: int = 3  # crashes within crash_window_s mark the model failed
    crash_window_s: float = 60.0
    crash_cooldown_s: float = 60.0  # a failed model is tried again after this, or on an explicit load
    restart_backoff_s: float = 0.5  # doubled per recent crash, capped at restart_backoff_max_s
    restart_backoff_max_s: float = 10.0
    # a model's requests wait in the supervisor (for a load, room for it, a swap, a place on its worker) in arrival
    # order: at most max_queued_requests at once (one more: 429), each at most queue_timeout_s (then 503), both with
    # Retry-After; max_running_requests bounds those on its worker at once (its batch and its own queue; 0: twice
    # max_batch_size)
    max_queued_requests: int = 64
    queue_timeout_s: float = 600.0
    max_running_requests: int = 0
    max_resumes: int = 2  # a request whose worker crashed or was evicted under pressure resumes at most so often
    resume_timeout_s: float = 120.0  # ... and within this long of each suspension, else it fails
    api_key: str | None = None  # when set, every route but /health and the bare /ui page needs "Authorization: Bearer <key>"
    insecure_no_key: bool = False  # serve beyond loopback without an api_key (else `serve` refuses to start)
    allowed_hosts: list[str] = field(default_factory=list)  # Host names beyond localhost, loopback and `host`
    allowed_origins: list[str] = field(default_factory=list)  # web origins whose pages may call the API (CORS)
    hf_cache: Path | None = field(default_factory=default_hf_cache)  # None: no Hugging Face discovery
    spare_workers: int = 1  # a process with its imports done, waiting for the next load (0: none)
    cache: CacheConfig = CACHE_DEFAULTS  # prompt caches: the [cache] section over the defaults
    config_file: Path | None = None  # the file these settings were read from (set by resolve)
    # names clients ask for that no model has (Claude Code's, Codex's): glob pattern -> model id, first match
    # wins; then `default_model` for any name left unknown (None: a 404 names the models there are)
    model_aliases: dict[str, str] = field(default_factory=dict)
    default_model: str | None = None
    response_store_count: int = 1000  # /v1/responses kept for previous_response_id, least recently used out
    response_store_bytes: int = 64 * 2**20
    # the old refusals, for those who want them: max_tokens past the context is a 400 (else it is clamped to the
    # context, and the API says the context ended it); a field the API does not know is a 400 (else ignored, logged)
    strict_context: bool = False
    strict_fields: bool = False
    # images (a vision model's requests; supervisor/gateway/images.py): checked before any worker sees them;
    # image URLs are fetched by the daemon only with image_fetch (it reaches what the daemon reaches)
    image_max_bytes: int = 20 * 2**20
    image_max_pixels: int = 50_000_000
    image_max_count: int = 8  # per request
    image_fetch: bool = False
    image_fetch_timeout_s: float = 10.0
    # a second listener serving the same app where apps look for Ollama (gateway/ollama_listener.py): "HOST:PORT" or "off"
    ollama_listen: str = "127.0.0.1:11434"

    def security_warning(self) -> str | None:
        """What is wrong with listening where this daemon listens (its port, and Ollama's: `ollama_listen`) without
        a key; None: nothing."""
        if self.api_key:
            return None
        try:
            ollama = listen_address(self.ollama_listen)
        except ValueError:
            ollama = None
        for host, setting in ((self.host, "host"), *([(ollama[0], "ollama_listen")] if ollama else [])):
            if not is_loopback(host_name(host) or host):
                return (f"listening on {host} without an API key ([server] {setting}): anyone who can reach this "
                        "address can use every model and admin route (the Host check is not authentication); set "
                        "[server] api_key or MLXSUP_API_KEY, or listen on 127.0.0.1")
        return None

    def model_cache(self, spec: ModelSpec) -> CacheConfig:
        """A model's effective cache settings: its own overrides, then [cache], then the defaults."""
        return spec.cache.over(self.cache)

    def model_ttl(self, spec: ModelSpec) -> float | None:
        """A model's idle TTL: its own, else the server's default; None: never."""
        return spec.ttl_s if spec.ttl_s is not None else self.default_ttl_s

    @property
    def running_limit(self) -> int:
        """The most requests of one model on its worker at once."""
        return self.max_running_requests or 2 * self.max_batch_size

    def worker_log(self, model_id: str) -> Path:
        """The log file of a model's worker (`spare` for the spare's)."""
        return self.log_dir / f"worker-{model_id.replace('/', '--')}.log"

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

    @property
    def import_dir(self) -> Path:
        """The model folder every `serve` watches besides `model_dirs`, and `mlxsup import` writes to where no
        model folder is configured (so a model imported beside any daemon, the demo's included, is served)."""
        return self.state_dir / IMPORT_DIR

    @property
    def demo_path(self) -> Path:
        """Where `serve --demo` imports its model, once: outside every watched folder (served as `demo` alone)."""
        return self.state_dir / "demo" / DEMO_MODEL_NAME

    def watched_dirs(self) -> list[Path]:
        """The folders of model folders `serve` looks in: `model_dirs`, then the import folder."""
        return list(dict.fromkeys([*self.model_dirs, self.import_dir]))


_SERVER_KEYS: dict[str, type | tuple[type, ...]] = {
    "host": str, "port": int, "state_dir": str, "model_dirs": list, "heartbeat_s": (int, float),
    "max_batch_size": int, "evict_timeout_s": (int, float), "settle_grace_s": (int, float),
    "kill_timeout_s": (int, float), "shutdown_drain_s": (int, float), "max_body_bytes": int, "log_level": str,
    "body_timeout_s": (int, float),
    "default_ttl_s": (int, float), "housekeeping_s": (int, float), "hang_timeout_s": (int, float),
    "load_timeout_s": (int, float), "prefill_step_size": int, "crash_limit": int, "crash_window_s": (int, float),
    "crash_cooldown_s": (int, float), "restart_backoff_s": (int, float), "restart_backoff_max_s": (int, float),
    "api_key": str, "sse_keepalive_s": (int, float), "hf_cache": str, "spare_workers": int,
    "allowed_hosts": list, "allowed_origins": list, "step_target_s": (int, float),
    "warm_batch_shapes": str, "speculative": str,
    "max_resumes": int, "resume_timeout_s": (int, float),
    "max_queued_requests": int, "queue_timeout_s": (int, float), "max_running_requests": int,
    "model_aliases": dict, "default_model": str, "response_store_count": int, "response_store_bytes": int,
    "insecure_no_key": bool, "strict_context": bool, "strict_fields": bool,
    "image_max_bytes": int, "image_max_pixels": int, "image_max_count": int, "image_fetch": bool,
    "image_fetch_timeout_s": (int, float),
    "embed_timeout_s": (int, float),
    "audio_max_bytes": int, "max_audio_s": (int, float),
    "ollama_listen": str,
}
_MEMORY_KEYS = {
    "ceiling": "memory_ceiling_bytes", "reserve": "memory_reserve_bytes", "worker_overhead": "worker_overhead_bytes",
    "max_loaded_models": "max_loaded_models", "pressure_soft": "pressure_soft", "pressure_hard": "pressure_hard",
}


def _apply_memory(section: dict, settings: Settings, path: Path) -> None:
    for key, value in section.items():
        attr = _MEMORY_KEYS.get(key)
        if attr is None:
            raise ConfigError(f"{path}: memory.{key}: unknown key")
        try:
            if key in ("pressure_soft", "pressure_hard"):
                if not is_number(value) or not 0 < value <= 1:
                    raise ValueError("a fraction between 0 and 1")
                value = float(value)
            elif key == "max_loaded_models":
                if not is_number(value, integer=True) or value < 1:
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
        if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
            raise ConfigError(f"{path}: server.{key}: expected {expected}, got {value!r}")
        if key in ("state_dir", "hf_cache"):
            value = Path(str(value)).expanduser() if value else None
        elif key == "model_dirs":
            value = [Path(v).expanduser() for v in cast(list, value)]
        elif key in ("allowed_hosts", "allowed_origins"):
            value = _web_names(key, cast(list, value), path)
        elif key == "max_running_requests" and cast(int, value) < 0:
            raise ConfigError(f"{path}: server.{key}: expected 0 (twice max_batch_size) or more, got {value!r}")
        elif key in ("max_queued_requests", "queue_timeout_s") and cast(float, value) <= 0:
            raise ConfigError(f"{path}: server.{key}: expected a positive number, got {value!r}")
        elif key == "warm_batch_shapes" and value not in ("auto", "on", "off"):
            raise ConfigError(f"{path}: server.warm_batch_shapes: expected 'auto', 'on' or 'off', got {value!r}")
        elif key == "speculative" and value not in SERVER_MODES:
            raise ConfigError(f"{path}: server.speculative: expected one of {', '.join(SERVER_MODES)}, got {value!r}")
        elif key == "model_aliases" and not all(isinstance(v, str) and v for v in cast(dict, value).values()):
            raise ConfigError(f"{path}: server.model_aliases: expected {{pattern = model id}}, got {value!r}")
        setattr(settings, key, value)
    _apply_memory(data.get("memory", {}), settings, path)
    try:
        settings.cache = parse_cache(data.get("cache", {}), "cache", path.parent).over(CACHE_DEFAULTS)
        settings.models = from_config(data.get("models", {}), path.parent)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return settings


OFF = ("", "off", "false", "no", "0")  # an `ollama_listen` that listens nowhere


def listen_address(value: str) -> tuple[str, int] | None:
    """(host, port) of an `ollama_listen` value ("HOST:PORT", or a port alone on 127.0.0.1); None: off; ValueError
    for one that is neither."""
    text = value.strip()
    if text.lower() in OFF:
        return None
    host, colon, port = text.rpartition(":")
    if not colon:
        host, port = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"ollama_listen: {value!r} is neither HOST:PORT nor 'off'")
    return host, int(port)


def _web_names(key: str, values: list, path: Path) -> list[str]:
    """allowed_hosts: host names or addresses, no port; allowed_origins: `scheme://host[:port]`."""
    for value in values:
        if key == "allowed_hosts":
            if not isinstance(value, str) or host_name(value) is None:
                raise ConfigError(f"{path}: server.{key}: expected host names without a port, got {value!r}")
        elif not isinstance(value, str) or parse_origin(value) is None:
            raise ConfigError(f"{path}: server.{key}: expected origins like 'http://localhost:3000', got {value!r}")
    return list(values)


def runtime_dir(state_dir: Path) -> Path:
    """A private (0700) directory for the ZeroMQ socket and worker pidfiles.

    `state_dir/run` when its socket path fits the ~100-byte ipc limit (104 on macOS), else a
    short one under the temp dir derived from the state dir, so a restart finds it again.
    """
    path = state_dir / "run"
    if router_socket(path) is None:
        digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
        path = Path(tempfile.gettempdir()) / f"mlxsup-{os.getuid()}-{digest}"
    path.mkdir(parents=True, exist_ok=True)
    if path.stat().st_uid != os.getuid():
        raise ConfigError(f"{path} belongs to another user")
    os.chmod(path, 0o700)
    return path


_ENV: dict[str, tuple[str, Callable[[str], object]]] = {
    "MLXSUP_HOST": ("host", str),
    "MLXSUP_PORT": ("port", int),
    "MLXSUP_STATE_DIR": ("state_dir", Path),
    "MLXSUP_MODEL_DIRS": ("model_dirs", lambda v: [Path(p) for p in v.split(os.pathsep) if p]),
    "MLXSUP_LOG_LEVEL": ("log_level", str),
    "MLXSUP_API_KEY": ("api_key", str),
    "MLXSUP_DEFAULT_MODEL": ("default_model", str),
    "MLXSUP_MEMORY_CEILING": ("memory_ceiling_bytes", parse_size),
    "MLXSUP_MAX_LOADED_MODELS": ("max_loaded_models", int),
    "MLXSUP_DEFAULT_TTL_S": ("default_ttl_s", float),
    "MLXSUP_HF_CACHE": ("hf_cache", lambda v: Path(v) if v else None),
    "MLXSUP_OLLAMA_LISTEN": ("ollama_listen", str),
}


def resolve(config: str | None = None, overrides: dict | None = None) -> tuple[Settings, Path | None]:
    """The effective settings: defaults, then the file, then MLXSUP_* variables, then `overrides`."""
    settings = Settings()
    explicit = config or os.environ.get("MLXSUP_CONFIG")
    path = Path(explicit).expanduser() if explicit else default_config_path()
    if path.is_file():
        load_file(path, settings)
    elif explicit:
        raise ConfigError(f"{path}: no such config file")
    for var, (attr, parse) in _ENV.items():
        if (raw := os.environ.get(var)) is not None:
            try:
                setattr(settings, attr, parse(raw))
            except ValueError as exc:
                raise ConfigError(f"${var}: {exc}") from None
    for attr, value in (overrides or {}).items():
        if value is not None:
            setattr(settings, attr, value)
    settings.config_file = path if path.is_file() else None
    return settings, settings.config_file
