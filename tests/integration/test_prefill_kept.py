"""Prefill is never thrown away (issue 47): a worker SIGKILLed mid-prefill, its request resumed on a new worker,
restarts from the last block the first one wrote to the SSD, not from token 0. The worker is slowed (worker/faults.py
`slowed`: it runs 1/20 of the time), so its prefill is long enough to be killed in the middle of."""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

import httpx

from tests.conftest import assert_gone, wait_for

BLOCK = 64


def test_a_request_killed_mid_prefill_resumes_from_its_last_block_on_disk(daemon_factory, model_dir: Path,
                                                                          tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"""
[server]
heartbeat_s = 0.2
hang_timeout_s = 5.0
housekeeping_s = 0.1

[models.tiny]
path = "{model_dir / 'tiny'}"
worker_args = ["--fault", "slowed"]

[cache]
ssd_dir = "{ssd}"
""")
    d = daemon_factory("--config", str(cfg))
    pid = httpx.post(f"{d.url}/api/models/tiny/load", timeout=60).json()["pid"]
    prompt = " ".join(f"w{i}" for i in range(1100))
    reply: dict = {}

    def ask() -> None:
        r = httpx.post(d.v1 + "/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 3,
                                                    "temperature": 0}, timeout=600)
        reply.update(status=r.status_code, body=r.json())

    asker = threading.Thread(target=ask, name="asker")
    asker.start()
    written = wait_for(lambda: (n := len(list(ssd.rglob("*.kvb")))) >= 6 and n, 300, interval=0.02,
                       what="six of the prompt's blocks on disk")
    os.kill(pid, signal.SIGKILL)  # mid-prefill: it had written `written` blocks (maybe a few more by now)
    asker.join(600)
    assert not asker.is_alive() and reply["status"] == 200, reply
    usage = reply["body"]["usage"]
    prompt_tokens, cached = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    assert prompt_tokens > 20 * BLOCK
    assert cached >= int(written) * BLOCK, (cached, written)  # picked up from the disk, not from 0
    log = (d.state_dir / "daemon.log").read_text()
    lines = re.findall(r"\[usage\] rid=\S+ prompt=(\d+) cached=(\d+) prefilled=(\d+)", log)
    assert len(lines) == 1, lines  # only the resumed attempt finished
    p, c, f = map(int, lines[0])
    assert c == cached and f == p - c and f <= prompt_tokens - int(written) * BLOCK
    assert "suspended why=crash" in log
    status = d.model("tiny")
    assert status["pid"] != pid
    assert_gone([pid])
