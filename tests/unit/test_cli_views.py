"""What the CLI prints, from the API's JSON: the status table and memory line, sizes, the effective
configuration as TOML that reads back as a config file; and its options, each with help."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest

from supervisor import __version__
from supervisor.cli import main
from supervisor.cli.commands import build_parser
from supervisor.cli.views import memory_line, size, status_table
from supervisor.config import Settings, load_file
from supervisor.config_view import effective, to_toml
from supervisor.registry import ModelSpec
from supervisor.reports import ModelStatus, SpareStatus, Status

GiB = 2**30
HOT = {"entries": 3, "bytes": 300 * 1024, "budget_bytes": GiB, "hits": 1, "misses": 2, "hit_tokens": 64}
SSD = {"enabled": False, "entries": 0, "bytes": 0, "cap_bytes": 0, "hits": 0, "misses": 0, "hit_tokens": 0,
       "dir": None, "error": None}


def status(*models: ModelStatus) -> dict:
    st = Status(20 * GiB, 90 * 2**20, 12 * GiB, 24 * GiB, 3, SpareStatus(9, True), list(models)).to_dict()
    return {"version": __version__, "uptime_s": 5.0, **st}


def test_sizes_are_scaled_to_the_value_so_a_small_cache_is_not_zero() -> None:
    assert [size(n) for n in (512, 300 * 1024, 1536 * 2**20, 20 * GiB, None)] == \
        ["512 B", "300 KiB", "1.5 GiB", "20 GiB", "-"]


def test_status_has_size_context_until_and_a_memory_line() -> None:
    ready = ModelStatus("chat", "ready", pid=7, memory_bytes=88 * 2**20, ttl_s=900, ttl_remaining_s=842.0,
                        idle_s=58.0, weights_bytes=899 * 1024, context_length=8192, generated_tokens=0,
                        cache={"block_tokens": 64, "hot": HOT, "ssd": SSD})
    pinned = ModelStatus("pin", "ready", pid=8, pinned=True, generated_tokens=0, context_length=4096,
                         drafting="prompt-lookup", drafting_priced=True, drafted_tokens=8, accepted_tokens=6)
    forever = ModelStatus("free", "ready", pid=10, generated_tokens=0, context_length=4096, drafting="prompt-lookup")
    busy = ModelStatus("busy", "ready", pid=11, ttl_s=60, ttl_remaining_s=60, leases=1, in_flight=1,
                       generated_tokens=0, context_length=4096, suspended=1, resumed=3, resume_failed=1)
    stopped = ModelStatus("idle", "stopped", ttl_s=900, weights_bytes=2 * GiB, kind="embedding")
    header, *rows = status_table(status(ready, pinned, forever, busy, stopped))
    assert header.split() == ["MODEL", "KIND", "STATE", "PID", "MEMORY", "SIZE", "CONTEXT", "DRAFTING", "IN-FLIGHT",
                              "WAITING", "BATCH", "UNTIL",
                              "HOT", "CACHE", "SSD", "CACHE", "RESUMED", "LAST", "ERROR"]
    by_model = dict(zip(["chat", "pin", "free", "busy", "idle"], rows))
    assert "899 KiB" in by_model["chat"] and "8192" in by_model["chat"] and "in 14m02s" in by_model["chat"]
    assert "300 KiB (3)" in by_model["chat"] and by_model["chat"].rstrip().endswith("off        0")  # SSD off, none resumed
    assert "pinned" in by_model["pin"] and "no TTL" in by_model["free"] and "in use (TTL 1m00s)" in by_model["busy"]
    assert "1 (1 suspended)" in by_model["busy"] and "3 (1 failed)" in by_model["busy"]  # resumed requests (issue 18)
    assert "2 GiB" in by_model["idle"] and by_model["idle"].split()[1:3] == ["embedding", "stopped"]
    assert by_model["chat"].split()[1:3] == ["chat", "ready"]
    # speculative decoding: nothing drafts ("-"), the worker still measuring its costs, and what was kept
    col = header.index("DRAFTING")
    assert [by_model[m][col:].split()[0] for m in ("chat", "free", "pin")] == ["-", "prompt-lookup", "prompt-lookup"]
    assert "prompt-lookup (pricing)" in by_model["free"] and "prompt-lookup 75%" in by_model["pin"]
    line = memory_line(status(ready))
    assert line == ("memory: models 90 MiB of 20 GiB ceiling (0%); system 12 GiB of 24 GiB in use (50%); "
                    "at most 3 models; spare worker pid 9 standing by")


def test_the_effective_configuration_is_toml_that_serve_accepts(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "w.safetensors").write_bytes(b"")
    settings = Settings(state_dir=tmp_path / "state", default_ttl_s=123.0, api_key="s3cret", memory_ceiling_bytes=48 * GiB,
                        allowed_origins=["http://localhost:3000"], pressure_soft=0.8)
    spec = ModelSpec("my/model", model, aliases=("default",), pinned=True)
    text = to_toml(effective(settings, [spec], 48 * GiB)["config"])
    assert "s3cret" not in text and "# api_key = (set, not shown)" in text and 'ceiling = "48GiB"' in text
    parsed = tomllib.loads(text)
    assert parsed["models"]["my/model"]["aliases"] == ["default"]
    path = tmp_path / "config.toml"
    path.write_text(text)
    again = load_file(path, Settings())
    assert (again.default_ttl_s, again.memory_ceiling_bytes, again.pressure_soft, again.allowed_origins) == \
        (123.0, 48 * GiB, 0.8, ["http://localhost:3000"])
    assert [(m.id, m.path, m.pinned) for m in again.models] == [("my/model", model, True)] and again.api_key is None


def _parsers(parser: argparse.ArgumentParser, name: str = "mlxsup") -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                found += _parsers(sub, f"{name} {sub_name}")
    return found


def test_every_option_has_help_and_there_is_a_version(capsys: pytest.CaptureFixture) -> None:
    missing = [f"{name} {a.dest}" for name, p in _parsers(build_parser()) for a in p._actions
               if not isinstance(a, argparse._SubParsersAction) and not a.help]
    assert not missing, f"options without help text: {missing}"
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == f"mlxsup {__version__}"
