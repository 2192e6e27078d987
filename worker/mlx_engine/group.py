"""A worker group's MLX side: one model sharded over N ranks with `mx.distributed`, rank 0 leading.

The supervisor starts every rank (supervisor/group.py) with the same model arguments and its own
`--group-rank`; `join_group` turns those into what MLX's launcher would have set (MLX_RANK, a ring
hostfile, NCCL's rendezvous) and initialises the group. `sharded_loader` loads the model the way
mlx-lm's `sharded_load` does: tensor parallel through the model's `shard()`, pipeline parallel
through its text model's `pipeline()`.

Rank 0 is an ordinary worker to the supervisor: its loop drives a `LeaderEngine`, which wraps the
engine and, before every step, shares the step's schedule with the other ranks through the group
itself (`all_sum` of a small header, then of a msgpack buffer when there is one, as mlx_lm.server
shares requests): the Submits admitted and the requests aborted since the last step, in order, and
the prefill chunk the leader's cost model chose. The other ranks run `follow`: apply the schedule to the same engine,
run the same step, emit nothing. Settling the leader shares `stop`, and every follower runs its
own close and exits. No transport of our own: the schedule travels on MLX's.

Invariants: every rank's engine sees the same requests in the same order at the same step with the
same prefill chunk, so every collective inside a step matches; the random state is seeded alike on
every rank (rank 0's seed), so a sampled request samples alike. The loop reaches the engine only
through submit, abort, fail_all, plan_step, step and settle here: a new engine entry point that
changes the batch must be shared the same way.
A rank that dies or hangs leaves the others blocked in a collective: the supervisor, which watches
every rank, ends them all (the group's crash), and rank 0's heartbeats stop while it waits.
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import msgpack
import numpy as np
from mlx_lm.generate import generation_stream
from mlx_lm.utils import load_model, load_tokenizer

from protocol.codec import decode, encode
from protocol.messages import EXIT_CRASHED, EXIT_OK, Failed, Finished, Submit
from worker.engine_api import RequestRejected
from worker.mlx_engine.engine import Engine
from worker.shutdown import leave
from worker.step_cost import StepPlan

log = logging.getLogger(__name__)

SHARDS = ("tensor", "pipeline")
Group = mx.distributed.Group


@dataclass(frozen=True)
class GroupArgs:
    """What a rank knows of its group (the worker's --group-* arguments)."""

    rank: int
    size: int
    backend: str  # ring | nccl | jaccl | mpi | any
    shard: str  # tensor | pipeline
    hosts: tuple[str, ...] = ()  # ring: every rank's "ip:port"; nccl, jaccl: rank 0's "ip:port"
    rdma: str = ""  # jaccl: JSON, every host's RDMA device towards each rank (mlx.launch's MLX_IBV_DEVICES)


def join_group(args: GroupArgs) -> mx.distributed.Group:
    """Set the environment MLX's launcher would have set for this rank, then initialise the group."""
    os.environ["MLX_RANK"] = str(args.rank)
    written = None  # a file MLX reads at init
    if args.backend == "ring":
        written = _write_json([[h] for h in args.hosts])
        os.environ["MLX_HOSTFILE"] = written
    elif args.backend == "nccl":
        ip, _, port = args.hosts[0].rpartition(":")
        os.environ.update(NCCL_HOST_IP=ip, NCCL_PORT=port, MLX_WORLD_SIZE=str(args.size))
    elif args.backend == "jaccl":
        written = _write_json(json.loads(args.rdma))
        os.environ.update(MLX_IBV_DEVICES=written, MLX_JACCL_COORDINATOR=args.hosts[0])
    t0 = time.perf_counter()
    group = mx.distributed.init(strict=True, backend=args.backend)
    if written is not None:
        os.unlink(written)  # read at init: it has done its work
    if group.size() != args.size or group.rank() != args.rank:
        raise RuntimeError(f"joined as rank {group.rank()} of {group.size()}, "
                           f"expected rank {args.rank} of {args.size}")
    # one random state on every rank, rank 0's (an int32 sum: every backend has it), so samplers draw alike
    mine = random.getrandbits(31) if args.rank == 0 else 0
    mx.random.seed(int(np.array(mx.distributed.all_sum(mx.array([mine], dtype=mx.int32), group=group))[0]))
    log.info("[group] rank=%d size=%d backend=%s shard=%s joined in %.2fs", args.rank, args.size, args.backend,
             args.shard, time.perf_counter() - t0)
    return group


def _write_json(value: object) -> str:
    with tempfile.NamedTemporaryFile("w", prefix="mlxsup-group-", suffix=".json", delete=False) as f:
        json.dump(value, f)
    return f.name


def _pipeline_target(model: nn.Module) -> nn.Module | None:
    """The text model that has `pipeline()` (`model.model`, or a multimodal layout's `language_model.model`)."""
    for path in (("model",), ("language_model", "model"), ("language_model",)):
        node: Any = model
        for name in path:
            node = getattr(node, name, None)
        if node is not None and hasattr(node, "pipeline"):
            return node
    return None


def sharded_loader(group: mx.distributed.Group, shard: str) -> Callable[[Path, Callable[[str, float], None]], tuple]:
    """A loader for Engine: this rank's shard of the model (and the tokenizer), warmed up on every rank."""

    def load(model_path: Path, report: Callable[[str, float], None]) -> tuple:
        report("reading", 0.0)
        model, config = load_model(model_path, lazy=True, strict=False)
        if shard == "tensor":
            if not hasattr(model, "shard"):
                raise ValueError(f"{config.get('model_type')} models do not support tensor parallelism")
            model.shard(group)
        else:
            target = _pipeline_target(model)
            if target is None:
                raise ValueError(f"{config.get('model_type')} models do not support pipeline parallelism")
            target.pipeline(group)
        tokenizer = load_tokenizer(model_path, {"trust_remote_code": True},
                                   eos_token_ids=config.get("eos_token_id", None))
        report("weights", 0.5)
        mx.eval(model.parameters())  # this rank's shard only: the rest was never read
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))  # every rank holds its shard
        report("warm-up", 1.0)
        mx.eval(model(mx.array([[0]])))
        return model, tokenizer

    return load


# --- the schedule ----------------------------------------------------------------------------

SUBMIT, ABORT = "s", "a"


# On the generator's stream: the step it launched last may still be running its collectives there, and
# two streams using the group's connections at once mix their bytes (seen: a corrupted schedule).
# A step's schedule is a header, [ops length, prefill chunk, stop], then the ops (msgpack) only when
# there are any: a step that changes nothing costs one small all_sum. Rank 0 does not wait for its
# collectives (async_eval): they run in the stream's order, before the step it launches next, so the
# generator's pipelining survives; the other ranks wait, as they must, to read them.
# The bytes travel as int32 words (padded): every backend sums int32, not every one sums uint8.
HEADER = 3


def share(group: mx.distributed.Group, header: list[int], payload: bytes, wait: bool = False) -> list[mx.array]:
    """Rank 0: send the header, then `payload` if it has one, to every other rank; the arrays in flight."""
    sent = [mx.distributed.all_sum(mx.array(header, dtype=mx.int32), group=group, stream=generation_stream)]
    if payload:
        words = np.frombuffer(payload + b"\0" * (-len(payload) % 4), dtype="<i4")
        sent.append(mx.distributed.all_sum(mx.array(words), group=group, stream=generation_stream))
    for array in sent:  # one at a time, in order: evaluated together, their order would not be fixed
        (mx.eval if wait else mx.async_eval)(array)
    return sent


def receive(group: mx.distributed.Group) -> tuple[list[int], bytes]:
    """Any other rank: the header and payload rank 0 shared (every other rank adds zeros)."""
    header = mx.distributed.all_sum(mx.zeros((HEADER,), dtype=mx.int32), group=group, stream=generation_stream)
    values = [int(v) for v in np.array(header)]
    size = values[0]
    if not size:
        return values, b""
    words = mx.distributed.all_sum(mx.zeros(((size + 3) // 4,), dtype=mx.int32), group=group,
                                   stream=generation_stream)
    return values, np.array(words).astype("<i4").tobytes()[:size]


class LeaderEngine:
    """Rank 0's engine: the engine, with every step's schedule shared with the other ranks first.

    The loop knows it as any EngineApi; what it does not override goes to the engine unchanged.
    """

    def __init__(self, engine: Engine, group: mx.distributed.Group) -> None:
        self._engine = engine
        self._group = group
        self._ops: list[list] = []  # [SUBMIT, frame] | [ABORT, rid], in the order they happened
        self._stopped = False
        self._in_flight: list[mx.array] = []  # the last schedule's collectives, kept alive until they ran

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def __len__(self) -> int:
        return len(self._engine)

    def submit(self, msg: Submit) -> None:
        self._engine.submit(msg)  # RequestRejected: refused here, so no other rank hears of it
        self._ops.append([SUBMIT, encode(msg)])

    def abort(self, rid: str) -> bool:
        if not self._engine.abort(rid):
            return False
        self._ops.append([ABORT, rid])
        return True

    def fail_all(self, code: str, message: str) -> list[Failed]:
        self._ops.extend([ABORT, rid] for rid in self._engine.rids)
        return self._engine.fail_all(code, message)

    def plan_step(self) -> StepPlan:
        return self._engine.plan_step()

    def step(self) -> tuple[list[list], list[Finished | Failed]]:
        if self._engine._plan is None:
            self._engine.plan_step()
        try:
            self._share(chunk=self._engine.gen.prefill_step_size)
            return self._engine.step()
        except Exception:
            # Mostly a lost rank ("[ring] connection to a peer was lost"). It is the group's crash: exit now and
            # leave the requests to the supervisor, which suspends them for the next group (or fails them with
            # worker_crashed), as for a worker that died; failing them here would race it and beat the resume.
            log.exception("[crash] rank=0 a step of the group failed; exiting with code %d", EXIT_CRASHED)
            leave(EXIT_CRASHED)
            raise  # not reached

    def settle(self) -> int:
        self.stop_followers()
        return self._engine.settle()

    def stop_followers(self) -> None:
        """Tell the other ranks to run their exit (once)."""
        if not self._stopped:
            self._stopped = True
            self._share(stop=True)

    def _share(self, chunk: int = 0, stop: bool = False) -> None:
        ops, self._ops = self._ops, []
        payload = msgpack.packb(ops) if ops else b""
        self._in_flight = share(self._group, [len(payload), chunk, int(stop)], payload, wait=stop)


def follow(engine: Engine, group: mx.distributed.Group, model_id: str) -> int:
    """A rank other than 0: apply each schedule rank 0 shares, run the same step, emit nothing; EXIT_OK at stop."""
    steps = 0
    while True:
        (_, chunk, stop), payload = receive(group)
        for kind, what in msgpack.unpackb(payload) if payload else ():
            if kind == SUBMIT:
                msg = decode(what)
                if not isinstance(msg, Submit):
                    raise RuntimeError(f"rank {group.rank()} got a {msg.KIND} where rank 0 shares Submits")
                try:
                    engine.submit(msg)
                except RequestRejected as exc:  # rank 0 admitted it: the same engine must, or the group diverges
                    raise RuntimeError(f"rank {group.rank()} refused request {msg.rid} rank 0 admitted: {exc}") \
                        from None
            else:
                engine.abort(what)
        if stop:
            log.info("[group] model=%s rank=%d stop after %d steps", model_id, group.rank(), steps)
            engine.close_caches()
            engine.settle()
            return EXIT_OK
        engine.plan_step()
        engine.gen.prefill_step_size = chunk  # rank 0's chunk: every collective matches
        engine.step()
        steps += 1
