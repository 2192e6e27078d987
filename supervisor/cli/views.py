"""What the client commands print: the status table (as `ollama ps` does it), evict reports, sizes.

Pure functions of the API's JSON, so they are tested without a daemon. Sizes are binary units
scaled to the value (a 300 KiB cache is "300 KiB", not "0 MiB"); durations read as people say
them ("14m05s").
"""

from __future__ import annotations

from typing import Any

from supervisor.reports import EvictReport, ModelStatus

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in _UNITS:
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value >= 100 or value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"


def duration(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.0f}s" if s >= 10 else f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def until(m: ModelStatus) -> str:
    """When the model's idle TTL evicts it, if nothing uses it meanwhile."""
    if m.state not in ("ready", "loading"):
        return "-"
    if m.pinned:
        return "pinned"
    if m.ttl_s is None:
        return "no TTL"
    if m.leases or m.in_flight:
        return f"in use (TTL {duration(m.ttl_s)})"
    return f"in {duration(m.ttl_remaining_s)}"


def _cache(tier: dict | None, ssd: bool) -> str:
    if not tier:
        return "-"
    if ssd and not tier.get("enabled"):
        return "off"
    return f"{size(tier.get('bytes'))} ({tier.get('entries', 0)})"


def ollama_line(status: dict[str, Any]) -> str | None:
    """Where Ollama's API is served besides the daemon's port (gateway/ollama_listener.py), or why not; None: off."""
    listener = status.get("ollama_listener") or {}
    address, state = listener.get("address"), listener.get("state")
    if state == "listening":
        return f"Ollama's API also on http://{address}"
    if state in ("taken", "failed"):
        return (f"Ollama's address {address} is {'taken' if state == 'taken' else 'not available'} "
                f"({listener.get('error')}): Ollama's apps reach mlxsup only on its own port")
    return None


def memory_line(status: dict[str, Any]) -> str:
    """Models' memory against the admission ceiling, the system's, and the spare worker."""
    ceiling, used = status["ceiling_bytes"], status["used_bytes"]
    total = status["system_total_bytes"]
    in_use = total - status["system_available_bytes"]
    line = (f"memory: models {size(used)} of {size(ceiling)} ceiling ({used / max(ceiling, 1):.0%}); "
            f"system {size(in_use)} of {size(total)} in use ({in_use / max(total, 1):.0%})")
    if status.get("max_loaded_models"):
        line += f"; at most {status['max_loaded_models']} models"
    if status.get("stranded_bytes"):
        line += (f"; {size(status['stranded_bytes'])} STRANDED (wired memory exits did not give back; "
                 f"off the ceiling until a reboot)")
    spare = status.get("spare")
    if spare is None:
        line += "; no spare worker"
    else:
        line += f"; spare worker pid {spare['pid'] or '-'} {'standing by' if spare['standing_by'] else 'starting'}"
    return line


def drafting(m: ModelStatus) -> str:
    """Speculative decoding as the dashboard shows it: "-" where nothing drafts, else the worker's mode, "pricing"
    while it measures what drafting costs, and the part of its drafted tokens kept."""
    if not m.drafting or m.drafting == "off":
        return "-"
    if m.acceptance_rate is None:
        return m.drafting if m.drafting_priced else f"{m.drafting} (pricing)"
    return f"{m.drafting} {m.acceptance_rate:.0%}"


def status_table(status: dict[str, Any]) -> list[str]:
    rows = [("MODEL", "KIND", "STATE", "PID", "MEMORY", "SIZE", "CONTEXT", "DRAFTING", "IN-FLIGHT", "WAITING", "BATCH",
             "UNTIL",
             "HOT CACHE", "SSD CACHE", "RESUMED", "LAST ERROR")]
    for m in map(ModelStatus.from_dict, status["models"]):
        cache = m.cache or {}
        in_flight = f"{m.in_flight} ({m.suspended} suspended)" if m.suspended else str(m.in_flight)
        resumed = f"{m.resumed} ({m.resume_failed} failed)" if m.resume_failed else str(m.resumed)
        waiting = f"{m.waiting} ({duration(m.oldest_wait_s)})" if m.waiting else "0"
        waiting += f", {m.queue_refused} refused" if m.queue_refused else ""
        rows.append((m.id, m.kind, m.state, str(m.pid or "-"), size(m.memory_bytes), size(m.weights_bytes or None),
                     str(m.context_length or "-"), drafting(m), in_flight, waiting, str(m.batch_size), until(m),
                     _cache(cache.get("hot"), False), _cache(cache.get("ssd"), True), resumed,
                     (m.last_error or "")[:60]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows] + group_lines(status)


def group_lines(status: dict[str, Any]) -> list[str]:
    """One line per worker group: its ranks' hosts, pids and (on this machine) memory."""
    lines = []
    for m in map(ModelStatus.from_dict, status["models"]):
        if m.ranks:
            ranks = ", ".join(f"rank {r['rank']} {r['host']} pid {r['pid'] or '-'}"
                              + (f" {size(r.get('memory_bytes'))}" if r.get("memory_bytes") else "") for r in m.ranks)
            lines.append(f"group {m.id}: {len(m.ranks)} ranks: {ranks}")
    return lines


def evict_line(r: EvictReport) -> str:
    if not r.evicted:
        return f"{r.model}: not loaded"
    return (f"{r.model}: evicted pid {r.pid} in {r.duration_s or 0.0:.2f}s, returned {size(r.memory_before_bytes)} "
            f"(exit {r.exit}, aborted {r.aborted}, drained {r.drained}, signals {','.join(r.signals) or 'none'})")
