"""Prompt-cache administration for the router: clearing a tier, and the figures shown in status.

Clearing goes to the worker that owns the cache: a ready worker gets ClearCache and answers
with what it gave back (CacheCleared), by the router's one request/reply mechanism (`ask`),
which also waits out a load or an eviction. A model with no worker has no hot cache, while
its SSD directory (which no process owns then) is emptied here, in the very loop turn in which
`ask` found no worker, so no worker of the model can start in the middle of it. The directory is named by every
byte of the model's weights (protocol/cachedir.py), so it is found before `ask`, on a thread, from the weights'
digests its workers kept under the cache root (a stat each; a model with none kept has no blocks, and nothing of
it is hashed); each model's directory is its own, so each model is credited with exactly its blocks. An older mlxsup's directory for the
model (the sampled fingerprint's) is emptied with it and counted to it.

Invariant: the answer's `reclaimed_bytes` is what was actually freed (memory or disk bytes).
This module needs of the router only what CacheHost names.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from protocol.cachedir import clear_dir, known_cache_dir, legacy_cache_dir, retire
from protocol.messages import CacheCleared, CacheStats, ClearCache, Message
from supervisor import errors
from supervisor.config import Settings
from supervisor.registry import Registry

log = logging.getLogger(__name__)

CLEAR_TIMEOUT_S = 60.0


class CacheHost(Protocol):
    """What clearing needs of the router."""

    registry: Registry
    settings: Settings

    async def ask(self, model_id: str, build: Callable[[str], Message], timeout_s: float) -> Message | None: ...


def stats_view(msg: CacheStats | None) -> dict | None:
    """The cache figures of one worker, for GET /api/status."""
    if msg is None:
        return None
    return {
        "block_tokens": msg.block_tokens,
        "hot": {"entries": msg.hot_entries, "bytes": msg.hot_bytes, "budget_bytes": msg.hot_budget_bytes,
                "hits": msg.hot_hits, "misses": msg.hot_misses, "hit_tokens": msg.hot_hit_tokens},
        "ssd": {"enabled": msg.ssd_enabled, "entries": msg.ssd_entries, "bytes": msg.ssd_bytes,
                "cap_bytes": msg.ssd_cap_bytes, "hits": msg.ssd_hits, "misses": msg.ssd_misses,
                "hit_tokens": msg.ssd_hit_tokens, "dir": msg.ssd_dir, "error": msg.ssd_error},
    }


async def clear(host: CacheHost, which: str, name: str | None) -> dict:
    ids = [host.registry.resolve(name).id] if name is not None else host.registry.ids()
    models = await asyncio.gather(*(_clear_model(host, model_id, which) for model_id in ids))
    return {"which": which, "entries": sum(m["entries"] for m in models),
            "reclaimed_bytes": sum(m["reclaimed_bytes"] for m in models), "models": models}


async def _clear_model(host: CacheHost, model_id: str, which: str) -> dict:
    found: tuple[Path | None, Path] | str | None = None  # the model's SSD directory and an older mlxsup's, or why not
    spec = host.registry.specs[model_id]
    cfg = host.settings.model_cache(spec)
    if which == "ssd" and cfg.ssd_on:
        root = cfg.ssd_root(host.settings.state_dir)
        try:
            found = await asyncio.to_thread(lambda: (known_cache_dir(root, spec.path),
                                                     legacy_cache_dir(root, spec.path)))
        except OSError as exc:
            found = f"could not read the model's files to find its SSD cache: {exc}"
    try:
        reply = await host.ask(model_id, lambda rid: ClearCache(rid, which), CLEAR_TIMEOUT_S)
    except errors.WorkerDied:
        return _result(model_id, True, error="the worker is not reachable")
    except TimeoutError:
        return _result(model_id, True, error=f"no answer from the worker in {CLEAR_TIMEOUT_S:.0f}s")
    if reply is None:  # no worker, in this very turn: clear what it left on disk before any can start
        return _clear_unloaded(host, model_id, found)
    assert isinstance(reply, CacheCleared)
    log.info("[cache] model=%s cleared=%s entries=%d bytes=%d", model_id, which, reply.entries,
             reply.reclaimed_bytes)
    return _result(model_id, True, reply.entries, reply.reclaimed_bytes)


def _clear_unloaded(host: CacheHost, model_id: str, found: tuple[Path | None, Path] | str | None) -> dict:
    if found is None:  # the hot tier, or no SSD cache for this model
        return _result(model_id, False)
    if isinstance(found, str):
        return _result(model_id, False, error=found)
    directory, legacy = found  # directory None: no worker wrote blocks for the weights as they are now
    try:
        entries, reclaimed = clear_dir(directory) if directory is not None else (0, 0)
        old_entries, old_reclaimed = retire(legacy, directory or legacy.parent)
    except OSError as exc:
        return _result(model_id, False, error=f"could not clear the SSD cache: {exc}")
    entries, reclaimed = entries + old_entries, reclaimed + old_reclaimed
    log.info("[cache] model=%s cleared=ssd entries=%d bytes=%d (not loaded)", model_id, entries, reclaimed)
    return _result(model_id, False, entries, reclaimed)


def _result(model_id: str, loaded: bool, entries: int = 0, reclaimed: int = 0, error: str | None = None) -> dict:
    out = {"model": model_id, "loaded": loaded, "entries": entries, "reclaimed_bytes": reclaimed}
    if error is not None:
        out["error"] = error
    return out
