"""`mlxsup make-model` has one list of architectures: the worker's make_model (FAMILIES). The supervisor keeps none
of its own (it never imports the worker): it hands every argument, --help included, to that module's parser."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from supervisor.cli import commands
from worker.mlx_engine.make_model import FAMILIES
from worker.mlx_engine.make_model.__main__ import build_parser as worker_parser

ROOT = Path(__file__).resolve().parents[2]


def _arch_choices(parser: Any) -> list[str]:
    (action,) = [a for a in parser._actions if "--arch" in a.option_strings]
    return list(action.choices)


def test_the_worker_parser_offers_every_family_it_writes() -> None:
    assert _arch_choices(worker_parser()) == list(FAMILIES)
    assert {"qwen3_vl", "gemma3_vl"} <= set(FAMILIES)


@pytest.mark.parametrize("argv", [["make-model", "D", "--arch", "qwen3_vl", "--preset", "small"],
                                  ["make-model", "--arch", "gemma3_vl", "D"], ["make-model", "--help"]])
def test_mlxsup_make_model_hands_every_argument_to_the_worker_module(
        argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[list[str]] = []

    def run(cmd: list[str]) -> subprocess.CompletedProcess:
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(commands.subprocess, "run", run)
    assert commands.main(argv) == 0
    assert ran == [[sys.executable, "-m", "worker.mlx_engine.make_model", *argv[1:]]]


def test_no_other_command_takes_arguments_it_does_not_know(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        commands.main(["status", "--arch", "llama"])
    assert "unrecognized arguments: --arch llama" in capsys.readouterr().err


def test_mlxsup_make_model_help_lists_the_worker_families() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys; from supervisor.cli.commands import main; sys.exit(main())",
                          "make-model", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage: mlxsup make-model" in out.stdout
    missing = [arch for arch in FAMILIES if arch not in out.stdout]
    assert not missing, f"mlxsup make-model --help does not offer {missing}"
