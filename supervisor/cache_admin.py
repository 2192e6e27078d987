"""Prompt-cache administration for the router: clearing a tier, and the figures shown in status.

Clearing goes to the worker that owns the cache: a ready worker gets ClearCache and answers
with what it gave back. A loading worker is waited for; an evicting one is waited out, and
then, like a model that is not loaded, has no hot cache, while its SSD directory (which no
process owns now) is emptied here. That last step runs within one event-loop turn, so no
worker of the model can start in the middle of it.

Invariant (router rules): nothing here decides on state across an `await` without looking
again; the answer's `reclaimed_bytes` is what was actually freed (memory or disk bytes).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import TYPE_CHECKING

from protocol.cachedir import clear_dir, model_cache_dir
from protocol.messages import CacheCleared, CacheStats, ClearCache
from supervisor import errors

if TYPE_CHECKING:
    from supervisor.router import Router

log = logging.getLogger(__name__)

CLEAR_TIMEOUT_S = 60.0


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


async def clear(router: "Router", which: str, name: str | None) -> dict:
    ids = [router.registry.resolve(name).id] if name is not None else router.registry.ids()
    models = await asyncio.gather(*(_clear_model(router, model_id, which) for model_id in ids))
    return {"which": which, "entries": sum(m["entries"] for m in models),
            "reclaimed_bytes": sum(m["reclaimed_bytes"] for m in models), "models": models}


async def _clear_model(router: "Router", model_id: str, which: str) -> dict:
    while True:
        worker = router.workers.get(model_id)
        if worker is None:
            return _clear_unloaded(router, model_id, which)
        if worker.state == "evicting":
            await worker.gone.wait()
            continue
        if worker.state == "loading":
            try:
                await asyncio.shield(worker.ready)
            except errors.MlxsupError:
                pass
            continue
        rid = f"clear-{uuid.uuid4().hex[:12]}"
        answer: asyncio.Future = asyncio.get_running_loop().create_future()
        answer.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if we stop waiting
        worker.clears[rid] = answer
        if not router.transport.send(worker.identity, ClearCache(rid, which)):
            worker.clears.pop(rid, None)
            return _result(model_id, True, error="the worker is not reachable")
        try:
            msg: CacheCleared = await asyncio.wait_for(asyncio.shield(answer), CLEAR_TIMEOUT_S)
        except TimeoutError:
            worker.clears.pop(rid, None)
            return _result(model_id, True, error=f"no answer from the worker in {CLEAR_TIMEOUT_S:.0f}s")
        except errors.MlxsupError:
            continue  # it exited meanwhile: what it left on disk is cleared as for an unloaded model
        log.info("[cache] model=%s cleared=%s entries=%d bytes=%d", model_id, which, msg.entries,
                 msg.reclaimed_bytes)
        return _result(model_id, True, msg.entries, msg.reclaimed_bytes)


def _clear_unloaded(router: "Router", model_id: str, which: str) -> dict:
    spec = router.registry.specs[model_id]
    cfg = router.settings.model_cache(spec)
    if which != "ssd" or not cfg.ssd_on:
        return _result(model_id, False)
    try:
        entries, reclaimed = clear_dir(model_cache_dir(cfg.ssd_root(router.settings.state_dir), spec.path))
    except OSError as exc:
        return _result(model_id, False, error=f"could not clear the SSD cache: {exc}")
    log.info("[cache] model=%s cleared=ssd entries=%d bytes=%d (not loaded)", model_id, entries, reclaimed)
    return _result(model_id, False, entries, reclaimed)


def _result(model_id: str, loaded: bool, entries: int = 0, reclaimed: int = 0, error: str | None = None) -> dict:
    out = {"model": model_id, "loaded": loaded, "entries": entries, "reclaimed_bytes": reclaimed}
    if error is not None:
        out["error"] = error
    return out
