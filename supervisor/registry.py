"""Which models exist: discovered under model directories and listed in the TOML config.

A model directory is any directory holding `config.json` and at least one `*.safetensors`;
its id is the directory's name. A `--model-dir` is a folder of such directories, or one itself.
The Hugging Face cache is searched too (ids `org/name`). Config entries (`[models.ID]` with
`path`, `aliases`, and per-model worker and cache options) override discovered ones of the same
id. A model is reachable by its id, its aliases, and its short name (`NAME` of `ORG/NAME`) where no
other model has that name. A name that resolves to nothing makes the registry look at its folders
again (at most once per RESCAN_S), so a model put there later is served without a restart; models are
only ever added while the daemon runs, never dropped, but one whose folder is gone (`mlxsup rm`) is not
found until it is there again. A repo the cache holds under a pull mark (hub/store.py: a pull under way
or cut) is not discovered, and a request for it is a 503 (downloading) or a 404 that says to pull it
again. A weights index naming a shard that is not there makes no model. Each model's kind (chat or
embedding) is read from its files (protocol/modelkind.py), as its worker reads it to choose its engine, and a
generating model's memory past its weights from its config (protocol/modelconfig.py: admission's estimate).
"""

from __future__ import annotations

import glob
import json
import logging
import time
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from protocol.modelconfig import MemoryEstimate, model_estimate
from protocol.modelkind import CHAT, VISION, model_kind
from protocol.sampling import FIELDS as SAMPLING_FIELDS
from protocol.sampling import Sampling
from protocol.sampling import check as check_sampling
from protocol.sampling import read as read_sampling
from supervisor.cache_config import CacheConfig, parse_cache
from supervisor.draft_config import KEYS as DRAFT_KEYS
from supervisor.draft_config import speculative_args
from supervisor.errors import ModelDownloading, ModelNotFound
from supervisor.group import GroupSpec, parse_group
from supervisor.hub import store
from supervisor.units import is_number

RESCAN_S = 2.0
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    id: str
    path: Path
    aliases: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()
    weights_bytes: int = 0
    ttl_s: float | None = None  # idle time before eviction; None: the server's default
    pinned: bool = False  # loaded at start-up; only an explicit evict removes it
    cache: CacheConfig = CacheConfig()  # overrides of the [cache] section; unset keys inherit
    group: GroupSpec | None = None  # served by a worker group of several ranks (supervisor/group.py)
    kind: str = CHAT  # protocol/modelkind.py: chat or embedding (which routes serve it)
    # a generating model's memory past its weights, from its config (protocol/modelconfig.py): admission's estimate
    # counts runtime_bytes (a first request's KV and logits); the KV a token costs caps its published context
    runtime_bytes: int = 0
    kv_bytes_per_token: int = 0
    kv_dtype_bytes: int = 2  # its K/V's element width: the cap at [cache] kv_bits counts quantized K/V from it
    kv_tokens: int = 0  # the first request's tokens whose KV runtime_bytes counts (the estimate recounts it at kv_bits)
    sampling: Sampling = Sampling()  # `[models.ID]` sampling defaults (supervisor/sampling.py)

    @cached_property
    def model_sampling(self) -> Sampling:
        """The folder's own sampling defaults (generation_config.json), read once, on first use; a value it
        holds out of range is logged and ignored."""
        sampling, problems = read_sampling(self.path)
        for problem in problems:
            log.warning("[model] %s: %s", self.id, problem)
        return sampling


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors")) and _shards_present(path)


def _shards_present(path: Path) -> bool:
    """Every file the weights' index names is there (a half-copied folder of several shards is no model yet)."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return True
    try:
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
    except (OSError, ValueError, AttributeError):
        return False
    return all(isinstance(s, str) and (path / s).is_file() for s in shards)


def weights_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def memory_facts(path: Path, kind: str) -> MemoryEstimate:
    """A model's bytes past its weights, from its config.json: a generating model's (chat, vision) runtime bytes
    and KV bytes per token; none for an embedding or rerank model (no KV kept, no logits over a vocabulary)."""
    return model_estimate(path) if kind in (CHAT, VISION) else MemoryEstimate()


def _spec(model_id: str, path: Path) -> ModelSpec:
    """A discovered model's spec: its weights and kind read from its files."""
    kind = model_kind(path)
    facts = memory_facts(path, kind)
    return ModelSpec(model_id, path, weights_bytes=weights_bytes(path), kind=kind, runtime_bytes=facts.runtime_bytes,
                     kv_bytes_per_token=facts.kv_bytes_per_token, kv_dtype_bytes=facts.kv_dtype_bytes,
                     kv_tokens=facts.kv_tokens)


def discover(model_dir: Path) -> list[ModelSpec]:
    if not model_dir.is_dir():
        return []
    if is_model_dir(model_dir):  # a model folder itself, not a folder of them
        return [_spec(model_dir.resolve().name, model_dir.resolve())]
    found = []
    for sub in sorted(model_dir.iterdir()):
        if sub.is_dir() and is_model_dir(sub):
            found.append(_spec(sub.name, sub.resolve()))
    return found


def discover_hf(hub: Path) -> list[ModelSpec]:
    """Models in a Hugging Face cache (`models--ORG--NAME/snapshots/REV/`), named `ORG/NAME`.

    The snapshot is the one `refs/main` names, else the newest; only MLX-loadable snapshots
    (config.json and *.safetensors) count.
    """
    if not hub.is_dir():
        return []
    found = []
    for repo in sorted(hub.glob("models--*")):
        if (repo / store.MARK).exists():  # a pull under way or cut: not a model until it completes
            continue
        snapshots = repo / "snapshots"
        ref = repo / "refs" / "main"
        snapshot = snapshots / ref.read_text().strip() if ref.is_file() else None
        if snapshot is None or not snapshot.is_dir():
            candidates = sorted(snapshots.glob("*"), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
            snapshot = candidates[-1] if candidates else None
        if snapshot is not None and is_model_dir(snapshot):
            model_id = repo.name[len("models--"):].replace("--", "/")
            found.append(_spec(model_id, snapshot.resolve()))
    return found


def from_config(models: dict, base: Path) -> list[ModelSpec]:
    """Specs from the config's `[models]` table; relative paths are taken from the config's folder."""
    specs = []
    for model_id, entry in models.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise ValueError(f"models.{model_id}: needs a 'path' string")
        path = Path(entry["path"]).expanduser()
        path = (base / path).resolve() if not path.is_absolute() else path
        if not is_model_dir(path):
            raise ValueError(f"models.{model_id}.path: {path} holds no config.json and *.safetensors")
        unknown = set(entry) - {"path", "aliases", "worker_args", "ttl_s", "pinned", "cache", "group", *DRAFT_KEYS,
                             *SAMPLING_FIELDS}
        if unknown:
            raise ValueError(f"models.{model_id}.{sorted(unknown)[0]}: unknown key")
        aliases = entry.get("aliases", [])
        args = entry.get("worker_args", [])
        if not all(isinstance(a, str) for a in [*aliases, *args]):
            raise ValueError(f"models.{model_id}: aliases and worker_args must be lists of strings")
        ttl = entry.get("ttl_s")
        if ttl is not None and (not is_number(ttl) or ttl < 0):
            raise ValueError(f"models.{model_id}.ttl_s: must be a non-negative number of seconds")
        pinned = entry.get("pinned", False)
        if not isinstance(pinned, bool):
            raise ValueError(f"models.{model_id}.pinned: must be true or false")
        cache = parse_cache(entry.get("cache", {}), f"models.{model_id}.cache", base)
        group = parse_group(entry["group"], f"models.{model_id}.group") if "group" in entry else None
        drafting, draft_bytes = speculative_args(entry, f"models.{model_id}", base)  # before worker_args: they win
        kind = model_kind(path)
        facts = memory_facts(path, kind)
        specs.append(ModelSpec(model_id, path, tuple(aliases), (*drafting, *args), weights_bytes(path) + draft_bytes,
                               None if ttl is None else float(ttl), pinned, cache, group, kind,
                               runtime_bytes=facts.runtime_bytes, kv_bytes_per_token=facts.kv_bytes_per_token,
                               kv_dtype_bytes=facts.kv_dtype_bytes, kv_tokens=facts.kv_tokens))
    return [replace(spec, sampling=check_sampling(models[spec.id], f"models.{spec.id}")) for spec in specs]


@dataclass
class Registry:
    specs: dict[str, ModelSpec] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    model_dirs: list[Path] = field(default_factory=list)
    hf_cache: Path | None = None
    _scanned_at: float = 0.0

    @classmethod
    def build(cls, model_dirs: list[Path], configured: list[ModelSpec], hf_cache: Path | None = None) -> Registry:
        """Hugging Face cache < model directories < config entries, for the same id."""
        reg = cls(model_dirs=list(model_dirs), hf_cache=hf_cache)
        reg.specs.update((spec.id, spec) for spec in reg._scan())
        for spec in configured:
            reg.specs[spec.id] = spec
        for spec in reg.specs.values():
            for alias in spec.aliases:
                reg.aliases[alias] = spec.id
        return reg

    def _scan(self) -> list[ModelSpec]:
        self._scanned_at = time.monotonic()
        found = discover_hf(self.hf_cache) if self.hf_cache else []
        for d in self.model_dirs:
            found += discover(d)
        return found

    def watched(self) -> list[Path]:
        """The folders where new models can appear while the daemon runs."""
        return [d for d in [*self.model_dirs, self.hf_cache] if d is not None and d.is_dir()]

    def can_grow(self) -> bool:
        return bool(self.watched())

    def refresh(self, force: bool = False) -> None:
        """Add models that appeared in the watched folders since the last look (rate-limited unless forced)."""
        if not force and time.monotonic() - self._scanned_at < RESCAN_S:
            return
        for spec in self._scan():
            known = self.specs.get(spec.id)
            if known is None or not known.path.is_dir():  # new, or removed and pulled again
                self.specs[spec.id] = spec

    def _lookup(self, name: str) -> ModelSpec | None:
        """By id, alias, or a short name no other model shares; None for a model whose folder is gone."""
        spec = self.specs.get(self.aliases.get(name, name))
        if spec is None and "/" not in name:
            named = [s for s in self.specs.values() if s.id.rpartition("/")[2] == name]
            spec = named[0] if len(named) == 1 else None
        return spec if spec is None or spec.path.is_dir() else None

    def _just_pulled(self, name: str) -> bool:
        """A cache entry of that name (repo id or short name) with no pull mark is there: a pull has just
        completed, so the registry looks now, not RESCAN_S later."""
        if self.hf_cache is None:
            return False
        pattern = f"models--{name.replace('/', '--')}" if "/" in name else f"models--*--{glob.escape(name)}"
        return any(f.is_dir() and not (f / store.MARK).exists() for f in self.hf_cache.glob(glob.escape(pattern)
                   if "/" in name else pattern))

    def resolve(self, name: str) -> ModelSpec:
        spec = self._lookup(name)
        if spec is None:
            self.refresh(force=self._just_pulled(name))
            spec = self._lookup(name)
        if spec is None:
            for mark in store.marks(self.hf_cache).values():
                if name in (mark.repo_id, mark.repo_id.rpartition("/")[2]):
                    err: ModelNotFound | ModelDownloading = ModelDownloading(mark.message(), param="model") \
                        if mark.state == store.DOWNLOADING else ModelNotFound(mark.message(), param="model")
                    raise err
            same = sorted(s.id for s in self.specs.values() if s.id.rpartition("/")[2] == name)
            if len(same) > 1:
                raise ModelNotFound(f"The model name '{name}' is ambiguous: say which of {', '.join(same)}.",
                                    param="model")
            available = ", ".join(sorted(self.specs)) or "none"
            raise ModelNotFound(f"The model '{name}' does not exist. Available models: {available}. (Only the "
                                "Anthropic and Responses APIs, which coding agents speak, map a vendor's model name "
                                "to a local one: `model_aliases`, `default_model`, else the one chat model there is; "
                                "the OpenAI chat API serves models by their own names.)", param="model")
        return spec

    def ids(self) -> list[str]:
        return sorted(self.specs)

    def on_disk(self) -> list[ModelSpec]:
        """The models whose folders are there now, by id."""
        return [self.specs[m] for m in sorted(self.specs) if self.specs[m].path.is_dir()]
