"""Entry point: `python -m worker --model-path DIR --model-id ID --endpoint EP --identity ID`.

Started by the supervisor by exec, one process per model. With `--spare` instead of a model,
the worker pays its imports (about a second: transformers, mlx-lm), reports Standby and waits;
a Load message then gives it the model's arguments, parsed exactly as if they had been on its
command line, and it goes on as that model's worker. Signal handlers only flip flags;
the lifeline thread watches stdin (a pipe from the supervisor) and flips `parent_gone` on EOF,
so the worker exits by itself when its supervisor dies, even by SIGKILL, on any OS. If the
loop does not get out in time after that, the lifeline ends the process hard.
DUMP_STACKS_SIGNAL (SIGUSR1) makes faulthandler write every thread's Python stack to stderr,
which the supervisor keeps in this worker's log: it asks for them before it kills a hung worker.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from protocol.messages import DUMP_STACKS_SIGNAL, EXIT_CRASHED, EXIT_LOAD_FAILED, EXIT_OK, EXIT_PARENT_GONE

PARENT_GONE_GRACE_S = 5.0
FAULTS = {
    "ignore-sigterm": "ignore SIGTERM",
    "hang-on-evict": "never finish the exit sequence",
    "slow-steps": "sleep 0.4 s in every engine step (a slow but live worker)",
    "foreign-protocol": "announce itself in another protocol version",
    "ssd-enospc": "the SSD cache's disk is full",
    "ssd-stall": "the SSD writer stops halfway through a block (to be killed mid-write)",
    "ssd-slow": "the SSD writer is slow",
    "crash-in-loop": "raise an unexpected exception in the loop while a request runs",
    "step-raises": "the engine's step raises (as MLX or mlx-lm may), leaving its generator unusable",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m worker")
    p.add_argument("--model-path", type=Path)
    p.add_argument("--model-id")
    p.add_argument("--spare", action="store_true", help="import, report Standby, wait for a Load naming the model")
    p.add_argument("--endpoint", required=True, help="the supervisor's ZeroMQ ROUTER endpoint")
    p.add_argument("--identity", required=True, help="this worker's routing identity")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--prefill-step-size", type=int, default=2048,
                   help="the most prompt tokens of one sequence an engine step prefills (time bounds it below)")
    p.add_argument("--step-target-s", type=float, default=0.25,
                   help="an engine step's target duration: each prefill chunk is sized to it from measured speed")
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
    args = p.parse_args(argv)
    if not args.spare and (args.model_path is None or args.model_id is None):
        p.error("--model-path and --model-id are required (or --spare)")
    return args


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
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("worker")
    # Evidence before a kill: the supervisor asks a worker it declares hung for every thread's Python
    # stack; faulthandler writes it from the signal itself (no GIL, no loop needed) to stderr, its log.
    faulthandler.register(DUMP_STACKS_SIGNAL, file=sys.stderr, all_threads=True)

    import zmq

    from worker.loop import Flags

    flags = Flags()
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
    code = EXIT_CRASHED  # until serving returns a code of its own
    try:
        if args.spare:
            model_args = stand_by(sock, flags, log)
            if model_args is None:
                code = EXIT_OK
                return code
            args = parse_args([a for a in argv if a != "--spare"] + model_args)
        if "ignore-sigterm" in args.fault:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        code = serve_model(args, sock, flags, log)
    except Exception:
        log.exception("[crash] model=%s: unexpected error; exiting with code %d", args.model_id, EXIT_CRASHED)
    finally:
        sock.close()  # LINGER: Bye and the last messages leave before this returns
        ctx.term()
        if args.model_path is not None:
            leave(code)
    return code


def leave(code: int) -> None:
    """Exit without interpreter and GPU teardown: the orderly part is done (Bye sent, caches closed),
    and process exit is the hard unload. Tearing down MLX's CUDA context alone took 1.3-1.5 s."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stand_by(sock, flags, log: logging.Logger) -> list[str] | None:
    """As a spare: import everything, report Standby, and wait for a Load (None: told to go)."""
    import zmq

    importlib.import_module("worker.mlx_engine.engine")  # the point of a spare: pay the imports before a model is asked for
    from protocol.codec import ProtocolError, decode, encode
    from protocol.messages import Evict, Load, Standby

    sock.send(encode(Standby(os.getpid())))
    log.info("[spare] on standby")
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not (flags.sigterm.is_set() or flags.parent_gone.is_set()):
        if not poller.poll(250):
            continue
        try:
            msg = decode(sock.recv())
        except ProtocolError as exc:
            log.warning("[protocol] dropped a malformed message: %s", exc)
            continue
        if isinstance(msg, Load) and all(isinstance(a, str) for a in msg.args):
            return list(msg.args)
        if isinstance(msg, Evict):
            return None
    return None


def serve_model(args: argparse.Namespace, sock, flags, log: logging.Logger) -> int:
    import zmq

    from protocol.codec import encode
    from protocol.messages import Progress
    from worker.loop import WorkerLoop

    try:
        from worker.mlx_engine.engine import Engine
        from worker.mlx_engine.prompt_cache import CacheOptions

        def report(stage: str, fraction: float) -> None:
            sock.send(encode(Progress(stage, round(fraction, 3))), zmq.NOBLOCK)

        cache = CacheOptions(args.hot_cache_bytes, args.ssd_cache_root, args.ssd_cache_bytes,
                             args.cache_block_tokens, args.cache_close_s, tuple(args.fault))
        engine = Engine(args.model_path, max_batch_size=args.max_batch_size,
                        prefill_step_size=args.prefill_step_size, report=report, cache=cache,
                        model_id=args.model_id, step_target_s=args.step_target_s)
    except Exception as exc:
        log.error("[load] model=%s path=%s failed: %s", args.model_id, args.model_path, exc)
        return EXIT_LOAD_FAILED
    log.info("[load] model=%s ready in %.2fs", args.model_id, engine.load_s)
    loop = WorkerLoop(sock, engine, args.model_id, flags, heartbeat_s=args.heartbeat_s, faults=set(args.fault))
    loop.announce()
    try:
        return loop.run()
    except Exception as exc:
        loop.fail_in_flight(exc)  # the clients hear of it now, while the socket still works
        raise


if __name__ == "__main__":
    sys.exit(main())
