"""One streaming OpenAI chat client for both HTTP sides (mlxsup and mlx_lm.server).

A minimal HTTP/1.1 client on asyncio streams (about as thin as a Python client gets, so both
servers are measured through the same, cheap path). Each request gets its own TCP connection,
opened *before* the clock starts: `run_concurrent` opens all of them one by one, then sends every
request at once. Why: mlx_lm.server's ThreadingHTTPServer listens with a backlog of 5
(socketserver's default), and 32 simultaneous connects lose SYNs (1 s retransmits) or get reset;
that is a real limitation worth knowing (`connect_burst_probe` below records it) but not the
serving throughput the benchmark compares. A keep-alive client would hold its connections open
anyway.

Each SSE event is timestamped when its bytes arrive (before JSON decoding); only events that
carry content count for the token timeline; the final `usage` (stream_options.include_usage)
proves how many tokens were generated. `times` are time.perf_counter() seconds relative to the
request's send; `mono_ns` are the same arrivals on time.monotonic_ns() (for the worker trace).
"""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit


def chat_body(model: str, messages: list, max_tokens: int, extra: dict | None = None) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    body.update(extra or {})
    return body


def new_record(text: bool = False) -> dict:
    """An empty timeline; `text`: it also keeps the content's pieces, in order, in "parts"."""
    rec = {"start": None, "times": [], "mono_ns": [], "rid": None, "usage": None, "error": None, "events": 0,
           "chars": 0, "done": False}
    return rec | {"parts": []} if text else rec


async def _connect(url: str, timeout: float = 10.0):
    u = urlsplit(url)
    return await asyncio.wait_for(asyncio.open_connection(u.hostname, u.port), timeout)


async def stream_chat(url: str, body: dict, timeout_s: float, first_token: asyncio.Event | None = None,
                      conn=None, rec: dict | None = None) -> dict:
    """POST a streaming chat completion; return its timeline. Never raises for HTTP/stream errors.

    `rec` (from new_record()) lets the caller watch the timeline while it grows."""
    rec = new_record() if rec is None else rec
    writer = None
    try:
        if conn is None:
            conn = await _connect(url)
        reader, writer = conn
        await asyncio.wait_for(_exchange(url, reader, writer, json.dumps(body).encode(), rec, first_token), timeout_s)
    except TimeoutError:
        rec["error"] = f"timeout after {timeout_s}s"
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if writer is not None:
            writer.close()
    return rec


async def open_connections(url: str, n: int) -> list:
    """n connections, opened one by one (off the clock); all closed again if one fails."""
    conns = []
    try:
        for _ in range(n):
            conns.append(await _connect(url))
    except Exception:
        for _, w in conns:
            w.close()
        raise
    return conns


async def run_concurrent(url: str, bodies: list[dict], timeout_s: float) -> list[dict]:
    """Open one connection per request (sequentially, off the clock), then send all requests at once."""
    conns = await open_connections(url, len(bodies))
    return list(await asyncio.gather(*(stream_chat(url, b, timeout_s, conn=c) for b, c in zip(bodies, conns))))


async def _exchange(url: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes,
                    rec: dict, first_token) -> None:
    u = urlsplit(url)
    head = (f"POST {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    rec["start"] = time.perf_counter()
    writer.write(head + payload)
    await writer.drain()
    status_and_headers = await reader.readuntil(b"\r\n\r\n")
    lines = status_and_headers.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
    chunked = "chunked" in headers.get("transfer-encoding", "").lower()
    if status != 200:
        rest = await _read_body(reader, chunked, headers)
        rec["error"] = f"HTTP {status}: {rest[:300]!r}"
        return
    buf = b""
    while True:
        if chunked:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                break
            data = (await reader.readexactly(size + 2))[:-2]
        else:
            data = await reader.read(65536)
            if not data:
                break
        t, tn = time.perf_counter(), time.monotonic_ns()
        buf += data
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            _event(event, t, tn, rec, first_token)


async def _read_body(reader, chunked: bool, headers: dict) -> bytes:
    if chunked:
        out = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                return out
            out += (await reader.readexactly(size + 2))[:-2]
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    return await reader.read(65536)


def _event(event: bytes, t: float, tn: int, rec: dict, first_token) -> None:
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue  # comments (mlx_lm.server's ": keepalive"), event names
        payload = line[5:].strip()
        if payload == b"[DONE]":
            rec["done"] = True
            continue
        try:
            obj = json.loads(payload)
        except ValueError:
            rec["error"] = f"bad SSE payload {payload[:100]!r}"
            continue
        rec["events"] += 1
        if "error" in obj:
            rec["error"] = obj["error"] if isinstance(obj["error"], (str, dict)) else str(obj["error"])
            continue
        if obj.get("usage"):
            rec["usage"] = obj["usage"]
        rec["rid"] = rec["rid"] or obj.get("id")
        for choice in obj.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content") or choice.get("text") or ""
            if text:
                rec["times"].append(t - rec["start"])
                rec["mono_ns"].append(tn)
                rec["chars"] += len(text)
                if "parts" in rec:
                    rec["parts"].append(text)
                if first_token is not None and len(rec["times"]) == 1:
                    first_token.set()


async def connect_burst_probe(url: str, n: int, body: dict, timeout_s: float) -> dict:
    """n requests connecting at the same instant (no pre-opened connections): how many fail, worst TTFT."""
    recs = await asyncio.gather(*(stream_chat(url, body, timeout_s) for _ in range(n)))
    ttft = [r["times"][0] for r in recs if r["times"]]
    return {"n": n, "failed": sum(1 for r in recs if r["error"] or not r["times"]),
            "errors": sorted({str(r["error"])[:80] for r in recs if r["error"]})[:3],
            "ttft_max_s": max(ttft) if ttft else None}
