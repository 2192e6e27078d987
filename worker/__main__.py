"""Entry point: `python -m worker --model-path DIR --model-id ID --endpoint EP --identity ID`.

Started by the supervisor by exec, one process per model. Signal handlers only flip flags;
the lifeline thread watches stdin (a pipe from the supervisor) and flips `parent_gone` on EOF,
so the worker exits by itself when its supervisor dies, even by SIGKILL, on any OS. If the
loop does not get out in time after that, the lifeline ends the process hard.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from protocol.messages import EXIT_LOAD_FAILED, EXIT_PARENT_GONE

PARENT_GONE_GRACE_S = 5.0
FAULTS = {
    "ignore-sigterm": "ignore SIGTERM",
    "hang-on-evict": "never finish the exit sequence",
    "slow-steps": "sleep 0.4 s in every engine step (a slow but live worker)",
    "foreign-protocol": "announce itself in another protocol version",
    "ssd-enospc": "the SSD cache's disk is full",
    "ssd-stall": "the SSD writer stops halfway through a block (to be killed mid-write)",
    "ssd-slow": "the SSD writer is slow",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m worker")
    p.add_argument("--model-path", type=Path, required=True)
    p.add_argument("--model-id", required=True)
    p.add_argument("--endpoint", required=True, help="the supervisor's ZeroMQ ROUTER endpoint")
    p.add_argument("--identity", required=True, help="this worker's routing identity")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--prefill-step-size", type=int, default=512,
                   help="prompt tokens per engine step: bounds a step's time, so heartbeats show prefill progress")
    p.add_argument("--lifeline", action="store_true", help="exit when stdin reaches EOF")
    p.add_argument("--hot-cache-bytes", type=int, default=0, help="hot prefix cache budget (0: off)")
    p.add_argument("--ssd-cache-root", type=Path, default=None,
                   help="SSD cache root; blocks go to ROOT/<model fingerprint> (absent: off)")
    p.add_argument("--ssd-cache-bytes", type=int, default=8 * 2**30, help="SSD cache size cap")
    p.add_argument("--cache-block-tokens", type=int, default=64)
    p.add_argument("--cache-close-s", type=float, default=3.0, help="how long closing waits for SSD writes")
    p.add_argument("--fault", action="append", default=[], choices=sorted(FAULTS),
                   help="testing only: misbehave on purpose (repeatable)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def watch_lifeline(flags) -> None:
    def run() -> None:
        try:  # the raw fd, not sys.stdin: a buffered reader's lock would block interpreter exit
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        flags.parent_gone.set()
        timer = threading.Timer(PARENT_GONE_GRACE_S, os._exit, args=(EXIT_PARENT_GONE,))
        timer.daemon = True
        timer.name = "lifeline-grace"
        timer.start()

    threading.Thread(target=run, name="lifeline", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("worker")

    import zmq

    from worker.server import Flags, WorkerLoop

    flags = Flags()
    if "ignore-sigterm" in args.fault:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: flags.sigterm.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor owns Ctrl-C and orders our exit
    if args.lifeline:
        watch_lifeline(flags)

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, args.identity.encode())
    sock.setsockopt(zmq.SNDHWM, 1_000_000)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(args.endpoint)
    try:
        try:
            from protocol.codec import encode
            from protocol.messages import Progress
            from worker.engine import Engine
            from worker.prompt_cache import CacheOptions

            def report(stage: str, fraction: float) -> None:
                sock.send(encode(Progress(stage, round(fraction, 3))), zmq.NOBLOCK)

            cache = CacheOptions(args.hot_cache_bytes, args.ssd_cache_root, args.ssd_cache_bytes,
                                 args.cache_block_tokens, args.cache_close_s, tuple(args.fault))
            engine = Engine(args.model_path, max_batch_size=args.max_batch_size,
                            prefill_step_size=args.prefill_step_size, report=report, cache=cache,
                            model_id=args.model_id)
        except Exception as exc:
            log.error("[load] model=%s path=%s failed: %s", args.model_id, args.model_path, exc)
            return EXIT_LOAD_FAILED
        log.info("[load] model=%s ready in %.2fs", args.model_id, engine.load_s)
        loop = WorkerLoop(sock, engine, args.model_id, flags, heartbeat_s=args.heartbeat_s, faults=set(args.fault))
        loop.announce()
        return loop.run()
    finally:
        sock.close()
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
