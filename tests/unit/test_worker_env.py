"""A worker sees one CUDA device (supervisor.process.one_gpu), checked in a real spawned process too."""

from __future__ import annotations

import asyncio
import sys

import pytest

from supervisor.process import WorkerProcess, one_gpu


@pytest.mark.parametrize("base, extra, visible", [
    ({}, {}, "0"),  # nothing set: the first GPU, the one MLX would use
    ({"CUDA_VISIBLE_DEVICES": "2,3"}, {}, "2"),  # the operator's choice, narrowed to its first device
    ({"CUDA_VISIBLE_DEVICES": "GPU-abc, GPU-def"}, {}, "GPU-abc"),
    ({"CUDA_VISIBLE_DEVICES": ""}, {}, ""),  # GPUs hidden on purpose stay hidden
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "1"}, "1"),  # a group's rank names its own
])
def test_one_gpu(base: dict, extra: dict, visible: str) -> None:
    env = one_gpu({**base, "PATH": "/bin"}, extra)
    assert env["CUDA_VISIBLE_DEVICES"] == visible
    assert env["PATH"] == "/bin"


def test_a_spawned_worker_sees_one_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    code = "import os, sys; sys.stderr.write('visible=' + os.environ['CUDA_VISIBLE_DEVICES'] + '\\n')"

    async def run() -> list[str]:
        proc = WorkerProcess("m", [sys.executable, "-c", code])
        await proc.start()
        assert await proc.wait(30)
        return list(proc.stderr_tail)

    tail = asyncio.run(run())
    assert any(line.endswith("visible=1") for line in tail), tail
