"""A worker group's ranks as processes: rank 0's engine, and the whole life of every other rank.

`python -m worker ... --group-rank R --group-size N` (supervisor/group.py starts every rank).
Rank 0 goes on as an ordinary worker (worker/__main__.py) whose engine is mlx_engine/group.py's
LeaderEngine; `run_follower` is everything another rank does: join the group, load its shard,
follow rank 0's schedule until rank 0 says stop. A follower opens no socket and sends nothing:
its stderr is its only voice (the supervisor keeps it in the rank's log).

Invariants: a follower never outlives its group for long: it exits at rank 0's stop; SIGTERM ends
it at once (the default action: its orderly exit is rank 0's to order); its lifeline (stdin)
ends it within the lifeline's grace when the supervisor, or the ssh that started it, is gone;
any error ends it with EXIT_CRASHED or EXIT_LOAD_FAILED, which the supervisor reads as the group's crash.
Prompt caches are off in a group for now: every rank would have to keep the same entries of its
own shard (and the SSD tier would share one folder between ranks).
"""

from __future__ import annotations

import argparse
import logging
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

from protocol.messages import EXIT_CRASHED, EXIT_LOAD_FAILED

if TYPE_CHECKING:
    from worker.mlx_engine.engine import Engine
    from worker.mlx_engine.group import Group, GroupArgs, LeaderEngine


def group_args(args: argparse.Namespace) -> GroupArgs:
    from worker.mlx_engine.group import GroupArgs

    hosts = tuple(h for h in args.group_hosts.split(",") if h)
    return GroupArgs(args.group_rank, args.group_size, args.group_backend, args.group_shard, hosts, args.group_rdma)


def _engine(args: argparse.Namespace, report: Callable[[str, float], None]) -> tuple[Engine, Group]:
    from worker.mlx_engine.engine import Engine
    from worker.mlx_engine.group import join_group, sharded_loader

    ga = group_args(args)
    group = join_group(ga)
    engine = Engine(args.model_path, max_batch_size=args.max_batch_size, prefill_step_size=args.prefill_step_size,
                    report=report, cache=None, model_id=args.model_id, step_target_s=args.step_target_s,
                    loader=sharded_loader(group, ga.shard), strict_context=args.strict_context,
                    max_context=args.max_context,
                    attention=args.attention, warm="off")  # a time-bounded warm-up would stop at another step on each rank: a collective hang
    return engine, group


def leader_engine(args: argparse.Namespace, report: Callable[[str, float], None], cache: object) -> LeaderEngine:
    """Rank 0's engine (an EngineApi): the group joined, its shard loaded, each step's schedule shared."""
    from worker.mlx_engine.group import LeaderEngine

    if cache is not None:
        logging.getLogger(__name__).info("[group] model=%s prompt caches are off in a group", args.model_id)
    engine, group = _engine(args, report)
    return LeaderEngine(engine, group)


def run_follower(args: argparse.Namespace, log: logging.Logger) -> int:
    """A rank other than 0, from joining the group to rank 0's stop; the exit code."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    rank = args.group_rank
    try:
        from protocol.modelconfig import check_model

        check_model(args.model_path)  # as rank 0 does (worker/__main__.py): a hostile config builds nothing
        engine, group = _engine(args, lambda *_: None)
    except Exception:
        log.exception("[load] model=%s rank=%d failed", args.model_id, rank)
        return EXIT_LOAD_FAILED
    log.info("[load] model=%s rank=%d of %d ready in %.2fs; following rank 0", args.model_id, rank,
             args.group_size, engine.load_s)
    from worker.mlx_engine.group import follow

    try:
        return follow(engine, group, args.model_id)
    except Exception:
        log.exception("[crash] model=%s rank=%d: unexpected error; exiting with code %d", args.model_id, rank,
                      EXIT_CRASHED)
        return EXIT_CRASHED
