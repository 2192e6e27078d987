"""The bench's pure parts for issues 30 and 34: the agent replay's timed request (one token out, each API's own
field, the recorded body untouched) and bench.speculative's acceptance and markdown table."""

from __future__ import annotations

from bench.agent_replay import capped
from bench.agent_traffic import Recorded
from bench.speculative import acceptance, markdown


def test_the_replay_times_a_turn_with_one_token_out_in_each_api_s_own_field() -> None:
    body = {"model": "m", "max_tokens": 128000, "messages": [{"role": "user", "content": "hi"}]}
    for path, field in (("/v1/messages", "max_tokens"), ("/v1/chat/completions", "max_tokens"),
                        ("/v1/responses", "max_output_tokens")):
        r = Recorded(0, path, body, "marker", None)
        timed = capped(r, r.body, 1)
        assert timed[field] == 1 and timed["messages"] == body["messages"]
    assert body["max_tokens"] == 128000  # the recorded body, sent whole afterwards, keeps its own


def test_acceptance_is_kept_over_drafted_across_every_run() -> None:
    assert acceptance([{"drafted": 8, "accepted": 2}, {"drafted": 4, "accepted": 4}]) == 0.5
    assert acceptance([{"drafted": 0, "accepted": 0}]) is None


def test_the_markdown_table_has_a_row_per_mode_with_ratio_spread_acceptance_and_costs() -> None:
    row = {"decode_ms_per_token_p50": 2.5, "spread": [2.4, 2.6], "speedup_vs_off_p50": 0.98,
           "speedup_spread": [0.95, 1.01], "drafted": 40, "accepted": 3, "acceptance": 0.075,
           "priced": {"plain_ms": 2.4, "verify_ms": 3.1, "draft_ms": 0.5, "break_even": 1.84}}
    off = {"decode_ms_per_token_p50": 2.45, "spread": [2.4, 2.5], "speedup_vs_off_p50": 1.0,
           "speedup_spread": [1.0, 1.0], "drafted": 0, "accepted": 0, "acceptance": None, "priced": None}
    md = markdown({"command": "python -m bench.speculative", "commit": "abc1234", "rounds": 5, "tokens": 128,
                   "parity": True, "summary": {"off": off, "draft": row}})
    lines = md.splitlines()
    assert "| draft | 2.50 [2.40-2.60] | 0.980 [0.950-1.010] | 40 / 3 | 0.075 | 2.400 / 3.100 / 0.500, 1.84 |" in lines
    assert "| off | 2.45 [2.40-2.50] | 1.000 [1.000-1.000] | 0 / 0 | - | - |" in lines
    assert "parity (every mode's ids equal): True" in md
