"""`[models.ID]` sampling defaults (issue 49, item 1): served, shown in /v1/models/{id} and the status, and a bad
value refused at start naming its key."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.conftest import MLXSUP, Daemon


def config(tmp_path: Path, model_dir: Path, lines: str) -> Path:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[models.warm]\npath = "{model_dir / "tiny"}"\n{lines}\n')
    return cfg


def test_a_model_s_config_sampling_applies_and_is_shown(daemon_factory: Callable[..., Daemon], model_dir: Path,
                                                        tmp_path: Path) -> None:
    d = daemon_factory("--config", str(config(tmp_path, model_dir, "temperature = 0.7\ntop_k = 40")))
    shown = httpx.get(f"{d.v1}/models/warm", timeout=30).json()["sampling"]
    assert shown == {"temperature": {"value": 0.7, "source": "config"}, "top_p": {"value": 1.0, "source": "server"},
                     "top_k": {"value": 40, "source": "config"}, "min_p": {"value": 0.0, "source": "server"},
                     "repetition_penalty": {"value": 1.0, "source": "server"}}
    assert d.model("warm")["sampling"] == shown
    body = {"model": "warm", "prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True}
    for extra in ({}, {"temperature": 0}):
        r = httpx.post(f"{d.v1}/completions", json={**body, **extra}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    greedy = [httpx.post(f"{d.v1}/completions", json={**body, "temperature": 0}, timeout=120).json()
              ["choices"][0]["text"] for _ in range(2)]
    assert greedy[0] == greedy[1]


def test_a_bad_sampling_value_in_the_config_stops_serve_naming_it(model_dir: Path, tmp_path: Path) -> None:
    cfg = config(tmp_path, model_dir, "temperature = 9")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MLXSUP_")}
    run = subprocess.run([*MLXSUP, "serve", "--port", "0", "--config", str(cfg), "--state-dir", str(tmp_path / "s")],
                         capture_output=True, text=True, timeout=120, env=clean)
    assert run.returncode != 0 and "models.warm.temperature: must be a number from 0 to 2, got 9" in run.stderr, \
        run.stderr
    assert not (tmp_path / "s" / "daemon.json").exists()
