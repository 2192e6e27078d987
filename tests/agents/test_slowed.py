"""Issue 47: the real Codex completes its first request against a worker whose prefill takes longer than Codex's idle
timeout, with no retry: the stream carries Responses' own `response.in_progress` events while the prompt is
prefilled (supervisor/gateway/waits.py), which reset Codex's stream idle timer; the worker, slowed by the `slowed`
fault (worker/faults.py: 1/20 of the time from its 4th step), is not killed as hung (its watchdog's Pulses).

Codex's idle timeout is its own setting, `stream_idle_timeout_ms` of its model provider (300 s by default), made
short here (3 s), and the worker slowed 2x ($MLXSUP_TEST_SLOW_FACTOR), so that its first prefill outlasts it many
times over in a test of minutes. The daemon's log shows it: every
request served 200, none left by its client (499), the first one's time to first token past the idle timeout.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agents.conftest import KEY, SCRIPT
from tests.agents.proxy import OutsideRefused, RecordingProxy
from tests.agents.test_programs import DONE, Setup, _setup, daemon_log, made, run
from tests.conftest import MLXSUP, Daemon, start_daemon

IDLE_MS = 3000
SLOW_FACTOR = 2  # the worker runs half the time: its first prefill (~19k tokens) still takes many idle timeouts
SERVED = re.compile(r"\[request\] model=\S+ endpoint=(\S+) status=(\d+) outcome=(\S+) .*?ttft_ms=(\d+|-)")


@pytest.fixture(scope="module")
def slowed_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("slowed")
    model = root / "qwen3"
    subprocess.run([*MLXSUP, "make-model", str(model), "--arch", "qwen3", "--preset", "tiny"], check=True,
                   capture_output=True)
    script = root / "script.json"
    script.write_text(json.dumps(SCRIPT))
    config = root / "mlxsup.toml"
    config.write_text(f'[server]\napi_key = "{KEY}"\nsse_keepalive_s = 1.0\n'
                      f'[models.qwen3]\npath = "{model}"\n'
                      f'worker_args = ["--script", "{script}", "--fault", "slowed"]\n')
    d = start_daemon(root / "state", "--config", str(config), env={"MLXSUP_TEST_SLOW_FACTOR": str(SLOW_FACTOR)})
    yield d
    assert d.stop() == 0


@pytest.fixture
def slowed(tmp_path: Path, agent_bin: Path, slowed_daemon: Daemon) -> Iterator[Setup]:
    yield from _setup(tmp_path, agent_bin, slowed_daemon)


def test_codex_waits_out_a_prefill_longer_than_its_idle_timeout(slowed: Setup) -> None:
    s = slowed
    (s.home / ".codex").mkdir()
    with RecordingProxy(s.daemon.url) as proxy, OutsideRefused() as outside:
        (s.home / ".codex" / "config.toml").write_text(
            'model = "qwen3"\nmodel_provider = "mlxsup"\ncheck_for_update_on_startup = false\n'
            '[features]\nplugins = false\n[analytics]\nenabled = false\n[model_providers.mlxsup]\nname = "mlxsup"\n'
            f'base_url = "{proxy.url}/v1"\nenv_key = "MLXSUP_KEY"\nwire_api = "responses"\n'
            f"stream_idle_timeout_ms = {IDLE_MS}\n")
        ran = run(["codex", "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                   "Create the file made.txt. CODEX-STEP-1"], s, {"MLXSUP_KEY": KEY}, outside, timeout=900)
    assert ran.rc == 0, ran.err[-3000:]
    assert DONE in ran.out and made(s)
    served = SERVED.findall(daemon_log(s))
    assert served and all(status == "200" and outcome == "completed" for _, status, outcome, _ in served), served
    first_ttft = int(served[0][3])
    assert first_ttft > 2 * IDLE_MS, served  # the prefill outlasted Codex's idle timeout, and no retry came
    assert len(proxy.seen) == len(served)  # each request it sent was served once: none given up and sent again
    events = [json.loads(line[5:])["type"] for line in proxy.seen[0].response.decode().splitlines()
              if line.startswith("data:")]
    assert events.count("response.in_progress") >= first_ttft // 1000 // 2, events[:10]
