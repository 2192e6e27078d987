"""Issue 47: the real Codex and Claude Code complete their first request against a prefill longer than their own
timeouts, with no retry or a retry that picks up where the attempt stopped. Codex, with no retry: the stream carries Responses' own `response.in_progress` events while the prompt is
prefilled (supervisor/gateway/waits.py), which reset Codex's stream idle timer; the worker, slowed by the `slowed`
fault (worker/faults.py: 1/20 of the time from its 4th step), is not killed as hung (its watchdog's Pulses).

Codex's idle timeout is its own setting, `stream_idle_timeout_ms` of its model provider (300 s by default), made
short here (3 s), and the worker slowed 2x ($MLXSUP_TEST_SLOW_FACTOR), so that its first prefill outlasts it many
times over in a test of minutes. The daemon's log shows it: every
request served 200, none left by its client (499), the first one's time to first token past the idle timeout.
Claude Code, with API_TIMEOUT_MS made 20 s against its ~33k-token first prompt (~80 s to prefill here): each attempt
it gives up on is picked up by the next from its last block (the prefill's checkpoints), or it waits it out (its
`ping` events): the daemon's log shows which.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agents.conftest import KEY, start_scripted
from tests.agents.proxy import OutsideRefused, RecordingProxy
from tests.agents.test_programs import DONE, Setup, _setup, daemon_log, made, run
from tests.conftest import Daemon

IDLE_MS = 3000
SLOW_FACTOR = 2  # the worker runs half the time: its first prefill (~19k tokens) still takes many idle timeouts
SERVED = re.compile(r"\[request\] model=\S+ endpoint=(\S+) status=(\d+) outcome=(\S+) .*?ttft_ms=(\d+|-)")


@pytest.fixture(scope="module")
def slowed_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_scripted(tmp_path_factory.mktemp("slowed"), server="sse_keepalive_s = 1.0\n",
                       worker_args=("--fault", "slowed"), env={"MLXSUP_TEST_SLOW_FACTOR": str(SLOW_FACTOR)})
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


USAGE = re.compile(r"\[usage\] rid=(\S+) prompt=(\d+) cached=(\d+) prefilled=(\d+)( aborted)?")
BLOCK = 64  # the prompt caches' block (the default)


@pytest.fixture
def plain(tmp_path: Path, agent_bin: Path, scripted_daemon: Daemon) -> Iterator[Setup]:
    """The suite's scripted daemon, not slowed: Claude Code's first prompt takes long enough on this CPU as it is."""
    yield from _setup(tmp_path, agent_bin, scripted_daemon)


def test_claude_code_with_a_short_request_timeout_retries_from_where_it_stopped(plain: Setup) -> None:
    """Claude Code gives up on a request at its own limit (API_TIMEOUT_MS here made shorter than its ~34k-token first
    prompt's prefill on this CPU) and sends it again: each retry must pick up what the attempt before it prefilled
    (its blocks went to the hot cache as they were computed, and its abort kept the rest), re-prefilling at most one
    block of it; or, where the program waits after all, no retry happens. The daemon's log shows which."""
    s = plain
    with RecordingProxy(s.daemon.url) as proxy, OutsideRefused() as outside:
        env = {"ANTHROPIC_BASE_URL": proxy.url, "ANTHROPIC_API_KEY": KEY, "API_TIMEOUT_MS": "20000"}
        ran = run(["claude", "-p", "Create the file made.txt. CLAUDE-STEP-1", "--output-format", "json",
                   "--allowedTools", "Bash"], s, env, outside, proxy)
    assert ran.rc is not None, ran.said()
    assert json.loads(ran.out)["is_error"] is False and made(s)
    attempts = USAGE.findall(daemon_log(s))
    assert attempts, "no request of Claude Code's reached the worker"
    by_prompt: dict[int, list[tuple[int, int, bool]]] = {}
    for _, prompt, cached, prefilled, aborted in attempts:
        by_prompt.setdefault(int(prompt), []).append((int(cached), int(prefilled), bool(aborted)))
    for prompt, tries in by_prompt.items():
        for (c0, p0, aborted), (c1, _, _) in zip(tries, tries[1:]):
            if aborted:  # given up and sent again: the retry starts from what the attempt had
                assert c1 >= c0 + p0 - BLOCK, (prompt, tries)
    if not any(aborted for *_, aborted in attempts):  # no retry: then it waited past its own limit, kept by pings
        first_ttft = int(SERVED.findall(daemon_log(s))[0][3])
        assert first_ttft > 20000, f"the first prompt took {first_ttft} ms: shorter than the limit, this shows nothing"
