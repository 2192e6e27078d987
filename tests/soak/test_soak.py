"""Soak: 64 concurrent clients against loopback for a few thousand requests, with random client
disconnects, random evictions and a worker SIGKILL now and then; and the hostile side of issue 25
among them: a worker of a mismatched protocol version loaded every few seconds, a worker that writes
a 1 MiB line to stderr, schemas llguidance cannot hold and `logit_bias` ids past the vocabulary; and those of
issue 48: uploads that stall (headers and part of a body, then nothing), each answered 408 once the soak's
`body_timeout_s` has passed and its connection closed, and a client that sends megabytes of images to the text
models, each a 400. Bounded in count and time.

Run on its own (it is excluded from the default run):
    .venv/bin/python -m pytest -m soak -s tests/soak
SOAK_REQUESTS (default 3000), SOAK_SECONDS (default 600) and SOAK_CLIENTS (default 64) tune it.

Afterwards every request either completed or got a well-formed error (none hung past its
deadline, no stream cut silently), no leases or requests are left in the router or the workers,
no process is left behind, and the supervisor's memory growth is reported and bounded. Hostile
requests get a 400 and crash nothing (the models they go to, `tiny` and `loud`, are never SIGKILLed
by the chaos, so any crash of theirs is a request's doing), and `/health`, probed all along, answers
within HEALTH_LIMIT_S at the 95th percentile and HEALTH_MAX_S always (measured from a thread), stalled uploads
and image bodies among the requests. A request
whose worker was SIGKILLed is resumed on the next one (supervisor/resume.py): no `worker_crashed`
reaches a client unless its request hit a bound (resumed max_resumes times already), and
nothing stays suspended.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import os
import random
import signal
import struct
import threading
import time
import zlib
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import jsonschema
import psutil
import pytest

from tests.conftest import Daemon, wait_for

pytestmark = pytest.mark.soak

REQUESTS = int(os.environ.get("SOAK_REQUESTS", 3000))
SECONDS = float(os.environ.get("SOAK_SECONDS", 600))
CLIENTS = int(os.environ.get("SOAK_CLIENTS", 64))
REQUEST_DEADLINE_S = 60.0
HEALTH_LIMIT_S = 0.1
HEALTH_MAX_S = 1.0
KILLABLE = "tiny2"  # the only model the chaos SIGKILLs: crashes of the others would be the requests' doing
RECURSIVE = {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "description": "d" * 70_000,
                                                  "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}}}
HOSTILE_SCHEMAS = [{"$ref": "#"}, RECURSIVE, {"anyOf": [{"const": f"v{i}"} for i in range(3000)]}]
BODY_TIMEOUT_S = 5.0  # the soak's server.body_timeout_s: a stalled upload is answered 408 after it
STALLERS = 4  # stalled uploads at any time
IMAGES_PER_REQUEST = 3  # of about 1 MiB each (PNGs of noise): a 4 MiB body, under max_body_bytes


async def hostile_request(http: httpx.AsyncClient, url: str, rng: random.Random) -> str:
    """A request a worker must refuse at the door (400), never crash on or answer unconstrained."""
    body: dict = {"model": rng.choice(["tiny", "loud"]), "max_tokens": 8,
                  "messages": [{"role": "user", "content": f"hostile {rng.random()}"}]}
    if rng.random() < 0.5:
        body["logit_bias"] = {str(rng.choice([2**31 - 1, 10**6, 50_000 + rng.randint(0, 9999)])): 5}
    else:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "h", "schema": rng.choice(HOSTILE_SCHEMAS)}}
    body["stream"] = rng.random() < 0.5
    r = await http.post(url + "/v1/chat/completions", json=body)
    if r.status_code == 400:
        return "refused"
    if r.status_code != 200:
        return failed(r.json()["error"])
    if not body["stream"]:
        choice = r.json()["choices"][0]
        content, finish = choice["message"]["content"], choice["finish_reason"]
    else:
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        if any("error" in e for e in events):
            return "refused-in-stream"
        assert r.text.rstrip().endswith("data: [DONE]"), f"a hostile stream was cut: {r.text[-300:]}"
        choices = [e["choices"][0] for e in events if e.get("choices")]
        content = "".join(c["delta"].get("content") or "" for c in choices)
        finish = next((c["finish_reason"] for c in choices if c.get("finish_reason")), None)
    # served: only where the constraint held (a schema llguidance can hold, as an anyOf of consts may be)
    assert "response_format" in body, f"an out-of-vocabulary logit_bias was served: {body['logit_bias']}"
    if finish == "length":
        return "constrained-cut"  # max_tokens 8 ended it before the JSON closed
    jsonschema.validate(json.loads(content), body["response_format"]["json_schema"]["schema"])
    return "constrained"


async def foreign_loads(d: Daemon, stop: asyncio.Event, log: collections.Counter) -> None:
    """A worker of another protocol version, loaded every few seconds: each is refused and reaped."""
    async with httpx.AsyncClient(timeout=60) as http:
        while not stop.is_set():
            r = await http.post(f"{d.url}/api/models/future/load", json={})
            log[f"foreign-load-{r.status_code}"] += 1
            await asyncio.sleep(3.0)


async def stalled_upload(d: Daemon, stop: asyncio.Event, log: collections.Counter) -> None:
    """Headers and part of a body, then nothing: answered 408 within body_timeout_s (and a little), the
    connection closed after it; never held, never answered otherwise."""
    parts = urlsplit(d.url)
    while not stop.is_set():
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n" + b'{"model": "tiny", "messages": [{"role": "user", ')
        await writer.drain()
        t0 = time.monotonic()
        try:
            got = await asyncio.wait_for(reader.read(), BODY_TIMEOUT_S + REQUEST_DEADLINE_S)  # to the close
        except TimeoutError:
            got = b"HUNG"
        took = time.monotonic() - t0
        writer.close()
        status = got.split(b" ", 2)[1].decode() if got.startswith(b"HTTP/1.1 ") else got[:20].decode(errors="replace")
        log[f"stalled-upload-{status}"] += 1
        if took > BODY_TIMEOUT_S + 10:
            log["stalled-upload-late"] += 1


def noise_png(side: int, seed: int) -> bytes:
    """A valid RGB PNG of random pixels (it does not compress): about 3 * side**2 bytes."""
    rng = random.Random(seed)
    rows = b"".join(b"\0" + rng.randbytes(3 * side) for _ in range(side))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows, 1)) + chunk(b"IEND", b""))


async def image_heavy(d: Daemon, stop: asyncio.Event, rng: random.Random, log: collections.Counter) -> None:
    """Megabytes of images, in every request, to the text models: each a 400 that names why, harming nothing
    (its body is read, decoded off the loop and refused before any worker sees it)."""
    urls = [f"data:image/png;base64,{base64.b64encode(noise_png(600, i)).decode()}" for i in range(IMAGES_PER_REQUEST)]
    bodies = [json.dumps({"model": model, "max_tokens": 8, "stream": stream, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is in these?"}, *({"type": "image_url", "image_url": {"url": u}} for u in urls)]}]
    }).encode() for model in ("tiny", "tiny2", "loud") for stream in (False, True)]
    async with httpx.AsyncClient(timeout=REQUEST_DEADLINE_S) as http:
        while not stop.is_set():
            r = await http.post(d.url + "/v1/chat/completions", content=rng.choice(bodies),
                                headers={"Content-Type": "application/json"})
            log[f"images-{r.status_code}"] += 1
            if r.status_code == 400:
                assert "reads no images" in r.json()["error"]["message"], r.text
            await asyncio.sleep(rng.uniform(0.05, 0.3))


def health_probe(url: str, stop: threading.Event, latencies: list[float]) -> None:
    """/health every 50 ms from a thread of its own, so the clients' busy loop does not delay the measurement."""
    with httpx.Client(timeout=10) as http:
        while not stop.is_set():
            t0 = time.monotonic()
            r = http.get(url + "/health")
            latencies.append(time.monotonic() - t0)
            assert r.status_code == 200
            stop.wait(0.05)


def failed(error: dict) -> str:
    """The outcome of an error: error:<code>, and `error:worker_crashed-unresumed` for a crash the
    supervisor did not resume though no bound stopped it (its message says why when one did)."""
    if error["code"] == "worker_crashed" and "not resumed" not in error["message"]:
        return "error:worker_crashed-unresumed"
    return f"error:{error['code']}"


async def one_request(http: httpx.AsyncClient, url: str, rng: random.Random) -> str:
    """Returns the outcome: completed | error:<code> | disconnected; raises on a malformed end."""
    if rng.random() < 0.05:
        return await hostile_request(http, url, rng)
    model = rng.choice(["tiny", "tiny2", "loud"])
    body = {"model": model, "prompt": f"soak {rng.random()}", "max_tokens": rng.randint(1, 48),
            "temperature": rng.choice([0, 0.8]), "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.3:
        r = await http.post(url + "/v1/completions", json=body)
        if r.status_code == 200:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")  # 0 tokens if EOS came first
            return "completed"
        return failed(r.json()["error"])
    body["stream"] = True
    disconnect_after = rng.randint(1, 5) if rng.random() < 0.15 else None
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return failed(json.loads(await r.aread())["error"])
        events = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "completed"
            data = json.loads(line[6:])
            if "error" in data:
                return failed(data["error"])
            events += 1
            if disconnect_after is not None and events >= disconnect_after:
                return "disconnected"
    raise AssertionError(f"stream of {model} ended with neither [DONE] nor an error event")


async def chaos(d: Daemon, stop: asyncio.Event, rng: random.Random, log: collections.Counter) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        while not stop.is_set():
            await asyncio.sleep(rng.uniform(0.5, 2.0))
            status = (await http.get(d.url + "/api/status")).json()
            d.seen_pids.update(m["pid"] for m in status["models"] if m["pid"])
            model = rng.choice([m for m in status["models"] if m["id"] != "future"])
            if rng.random() < 0.2 and model["pid"] and model["id"] == KILLABLE:
                os.kill(model["pid"], signal.SIGKILL)
                log["sigkill"] += 1
            else:
                mode = rng.choice(["now", "drain"])
                await http.post(f"{d.url}/api/models/{model['id']}/evict", json={"mode": mode, "timeout": 1})
                log[f"evict-{mode}"] += 1


def test_soak(daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "soak.toml"
    cfg.write_text(f'[server]\nmodel_dirs = ["{model_dir}"]\ncrash_limit = 1000\nrestart_backoff_s = 0.05\n'
                   f'body_timeout_s = {BODY_TIMEOUT_S}\n\n'
                   f'[models.loud]\npath = "{model_dir / "tiny"}"\nworker_args = ["--fault", "megabyte-lines"]\n\n'
                   f'[models.future]\npath = "{model_dir / "tiny"}"\nworker_args = ["--fault", "foreign-protocol"]\n')
    d = daemon_factory("--config", str(cfg))
    supervisor = psutil.Process(d.proc.pid)
    outcomes: collections.Counter = collections.Counter()
    chaos_log: collections.Counter = collections.Counter()
    rss: list[int] = []
    health: list[float] = []

    async def main() -> None:
        deadline = time.monotonic() + SECONDS
        issued = 0
        stop = asyncio.Event()
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
        async with httpx.AsyncClient(timeout=REQUEST_DEADLINE_S, limits=limits) as http:
            async def client(seed: int) -> None:
                nonlocal issued
                rng = random.Random(seed)
                while issued < REQUESTS and time.monotonic() < deadline:
                    issued += 1
                    try:
                        outcome = await asyncio.wait_for(one_request(http, d.url, rng), REQUEST_DEADLINE_S)
                    except TimeoutError:
                        outcome = "HUNG"
                    outcomes[outcome] += 1
                    if issued % 250 == 0:
                        rss.append(supervisor.memory_info().rss)

            side = [asyncio.create_task(chaos(d, stop, random.Random(7), chaos_log)),
                    asyncio.create_task(foreign_loads(d, stop, chaos_log)),
                    asyncio.create_task(image_heavy(d, stop, random.Random(11), chaos_log)),
                    *(asyncio.create_task(stalled_upload(d, stop, chaos_log)) for _ in range(STALLERS))]
            probing = threading.Event()
            probe = threading.Thread(target=health_probe, args=(d.url, probing, health), name="health-probe")
            probe.start()
            try:
                await asyncio.gather(*(client(i) for i in range(CLIENTS)))
            finally:
                stop.set()
                probing.set()
            await asyncio.gather(*side)
            probe.join(10)

    t0 = time.monotonic()
    asyncio.run(main())
    elapsed = time.monotonic() - t0

    def settled() -> bool:
        models = d.status()["models"]
        return all(m["in_flight"] == 0 and m["leases"] == 0 and m["worker_active"] == 0 and m["suspended"] == 0
                   for m in models)

    wait_for(settled, 30, interval=0.2, what="no leases and no requests left in the router or the workers")
    total = sum(outcomes.values())
    growth = (rss[-1] - rss[0]) if len(rss) > 1 else 0
    print(f"\nsoak: {total} requests in {elapsed:.0f}s with {CLIENTS} clients; outcomes {dict(outcomes)}; "
          f"chaos {dict(chaos_log)}; supervisor RSS {rss[0] / 2**20:.0f} -> {rss[-1] / 2**20:.0f} MiB "
          f"(growth {growth / 2**20:.1f} MiB over {len(rss)} samples)")
    models = d.status()["models"]
    resumed = {m["id"]: (m["resumed"], m["resume_failed"]) for m in models}
    print(f"soak: resumed (and failed to resume) per model: {resumed}")
    crashes = {m["id"]: m["crashes"] for m in models}
    health.sort()
    late = sum(1 for h in health if h >= HEALTH_LIMIT_S)
    print(f"soak: crashes per model {crashes}; /health {len(health)} probes, p50 {health[len(health) // 2] * 1e3:.1f} "
          f"ms, p99 {health[len(health) * 99 // 100] * 1e3:.1f} ms, max {health[-1] * 1e3:.1f} ms, {late} at or over "
          f"{HEALTH_LIMIT_S * 1e3:.0f} ms")
    assert crashes["tiny"] == 0 and crashes["loud"] == 0, "a request crashed a worker"
    assert chaos_log["foreign-load-503"] > 0, "no worker of another protocol version was refused"
    assert outcomes["refused"] + outcomes["refused-in-stream"] > 0, "no hostile request was refused"
    stalled = {k: n for k, n in chaos_log.items() if k.startswith("stalled-upload-")}
    assert stalled.get("stalled-upload-408", 0) > 0 and set(stalled) == {"stalled-upload-408"}, \
        f"a stalled upload was answered otherwise than 408 in time (or not at all): {stalled}"
    images = {k: n for k, n in chaos_log.items() if k.startswith("images-")}
    assert images.get("images-400", 0) > 0 and set(images) == {"images-400"}, f"images to a text model: {images}"
    # p95 within the limit; the max bounded well below the stalls of issue 25 (a spin: forever; a big body: 2.4 s).
    # On the 2-core box the supervisor relaying 64 streams is CPU-bound beside 4 workers and the clients: at 64
    # clients p99 was 104 ms (15 of 1112 probes over 100 ms, max 328 ms); at 32, p99 95 ms, max 232 ms
    assert health[len(health) * 95 // 100] < HEALTH_LIMIT_S, "the daemon's loop stalled: /health answered late"
    assert health[-1] < HEALTH_MAX_S, "the daemon's loop stalled: /health answered late"
    assert outcomes["HUNG"] == 0
    assert outcomes["error:worker_crashed-unresumed"] == 0, "a crash reached a client though it could resume"
    if chaos_log["sigkill"]:
        assert sum(r for r, _ in resumed.values()) > 0, "SIGKILLs under load, and nothing was resumed"
    assert outcomes["completed"] > total // 2
    assert all(k in ("completed", "disconnected", "refused", "refused-in-stream", "constrained",
                                  "constrained-cut") or k.startswith("error:")
               for k in outcomes)
    assert growth < 64 * 2**20, "supervisor memory grew without bound"
