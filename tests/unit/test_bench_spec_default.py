"""bench.spec_default's pure parts: the daemon's three entries, each side's figures from its record, ratios as
medians of per-round ratios, parity against in-process, and the targets on a GPU and on a CPU (made-up rounds)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from bench.spec_default import config, from_http, from_inproc, markdown, summarize, targets


def test_the_default_entry_leaves_speculative_out_and_the_others_set_it() -> None:
    models = tomllib.loads(config(Path("/m/smollm2")))["models"]
    assert models == {"spec-default": {"path": "/m/smollm2"},
                      "spec-off": {"path": "/m/smollm2", "speculative": "off"},
                      "spec-prompt-lookup": {"path": "/m/smollm2", "speculative": "prompt-lookup"}}


def test_stream_generate_s_eos_yield_is_no_token_and_a_length_end_keeps_every_one() -> None:
    stopped = from_inproc({"times": [0.5, 0.6, 0.7, 0.8, 0.9], "text": "abcd", "finish_reason": "stop"})
    assert stopped["tokens"] == 4 and stopped["decode_tok_s"] == pytest.approx(3 / 0.3)
    assert stopped["ttft_ms"] == pytest.approx(500)
    cut = from_inproc({"times": [0.5, 0.6, 0.7], "text": "abc", "finish_reason": "length"})
    assert cut["tokens"] == 3 and cut["decode_tok_s"] == pytest.approx(2 / 0.2)


def test_a_served_run_counts_its_usage_s_tokens_and_drafts_and_a_failed_one_raises() -> None:
    usage = {"completion_tokens": 9, "completion_tokens_details": {"accepted_prediction_tokens": 6,
                                                                   "rejected_prediction_tokens": 2}}
    rec = {"error": None, "times": [0.1, 0.3, 0.5], "usage": usage, "parts": ["a", "b", "c"]}
    x = from_http(rec)  # drafts arrive in bursts: 9 tokens in 3 events
    assert (x["tokens"], x["drafted"], x["accepted"], x["text"]) == (9, 8, 6, "abc")
    assert x["decode_tok_s"] == pytest.approx(8 / 0.4)
    plain = from_http(rec | {"usage": {"completion_tokens": 3}})
    assert (plain["drafted"], plain["accepted"]) == (0, 0)
    with pytest.raises(RuntimeError, match="HTTP 500"):
        from_http(rec | {"error": "HTTP 500: b'boom'"})


def run(tok_s: float, text: str = "same", drafted: int = 0, accepted: int = 0) -> dict:
    return {"tokens": 100, "ttft_ms": 20.0, "decode_tok_s": tok_s, "drafted": drafted, "accepted": accepted,
            "text": text}


ROUNDS = [  # the host fast in round 1, slow in round 2: per-round ratios see through it
    {"copy": {"inproc": run(100), "default": run(250, drafted=40, accepted=30), "off": run(95)},
     "chat": {"inproc": run(100), "default": run(98), "off": run(100)}},
    {"copy": {"inproc": run(50), "default": run(100, drafted=40, accepted=20), "off": run(50, text="other")},
     "chat": {"inproc": run(50), "default": run(50), "off": run(50)}},
    {"copy": {"inproc": run(100), "default": run(210, drafted=40, accepted=30), "off": run(100)},
     "chat": {"inproc": run(100), "default": run(95), "off": run(100)}},
]


def test_ratios_are_medians_of_per_round_ratios_with_parity_against_in_process() -> None:
    s = summarize(ROUNDS, ["copy", "chat"], ["inproc", "default", "off"])
    copy = s["copy"]
    assert copy["reference"] == "inproc"
    assert copy["ratios"]["default/inproc"] == {"p50": 2.1, "spread": [2.0, 2.5], "rounds": 3}
    assert "prompt-lookup/off" not in copy["ratios"]  # a side that did not run has no ratio
    assert copy["sides"]["default"]["acceptance"] == 0.6667  # kept over drafted, every round: 80 / 120
    assert copy["sides"]["default"]["decode_tok_s_p50"] == 210
    assert copy["sides"]["default"]["parity"] and not copy["sides"]["off"]["parity"]
    assert s["chat"]["ratios"]["default/off"]["p50"] == pytest.approx(0.98)


def test_gpu_targets_are_judged_on_a_gpu_only_and_the_chat_target_everywhere() -> None:
    s = summarize(ROUNDS, ["copy", "chat"], ["inproc", "default", "off", "prompt-lookup"])
    on_gpu = {t["what"]: t["met"] for t in targets(s, gpu=True)}
    assert on_gpu == {"default/inproc on copy": True, "default/off on chat": True,
                      "prompt-lookup/off on copy": None}  # prompt lookup never ran: not measured
    on_cpu = {t["what"]: t["met"] for t in targets(s, gpu=False)}
    assert on_cpu["default/inproc on copy"] is None and on_cpu["default/off on chat"] is True
    slower = summarize([{"chat": {"default": run(90), "off": run(100)}}], ["chat"], ["default", "off"])
    assert {t["what"]: t["met"] for t in targets(slower, gpu=False)}["default/off on chat"] is False


def test_the_markdown_has_a_row_per_side_a_row_per_ratio_and_the_targets() -> None:
    s = summarize(ROUNDS, ["copy"], ["inproc", "default", "off"])
    result = {"command": "python -m bench.spec_default --demo", "device": "Device(cpu, 0)", "rounds_run": 3,
              "max_tokens": 400, "model": "/m", "summary": s, "targets": targets(s, gpu=False),
              "all_processes_gone": True,
              "machine": {"git": {"commit": "abc", "dirty": False}, "cpu_model": "x", "logical_cores": 2, "gpus": []}}
    lines = markdown(result).splitlines()
    assert "| default | 210.0 [100.0-250.0] | 20 | 100 | 120 / 80 (0.667) | True |" in lines
    assert "| off | 95.0 [50.0-100.0] | 20 | 100 | 0 / 0 (-) | False |" in lines
    assert "| default/inproc | 2.100 [2.000-2.500] |" in lines
    assert "| default/inproc on copy | 2.0 | 2.100 [2.000-2.500] | not a target on a CPU |" in lines
