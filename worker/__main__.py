"""Entry point: `python -m worker --model-path DIR --model-id ID --endpoint EP --identity ID`.

Started by the supervisor by exec, one process per model. With `--spare` instead of a model,
the worker pays its imports (about a second: transformers, mlx-lm), reports Standby and waits;
a Load message then gives it the model's arguments, parsed exactly as if they had been on its
command line, and it goes on as that model's worker. The exit, whoever asks for it (SIGTERM,
the lifeline on stdin, an Evict), is worker/shutdown.py's; the faults `--fault` injects for
tests are worker/faults.py's, and the replies `--script` scripts worker/mlx_engine/scripted.py's.
DUMP_STACKS_SIGNAL (SIGUSR1) makes faulthandler write every thread's Python stack to stderr,
which the supervisor keeps in this worker's log: it asks for them before it kills a hung worker.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import importlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, cast

from protocol.messages import DUMP_STACKS_SIGNAL, EXIT_CRASHED, EXIT_LOAD_FAILED, EXIT_OK
from protocol.modelkind import AUDIO_KINDS, EMBEDDING, RERANK, VISION, is_dflash, model_kind
from worker.faults import FAULTS, Faults
from worker.image_decode import DECODE_DEADLINE_S, MAX_JPEG_SCANS
from worker.shutdown import Shutdown, install_signal_handlers, leave, watch_lifeline

if TYPE_CHECKING:
    import zmq

    from worker.engine_api import EngineApi
    from worker.loop import WorkerLoop
    from worker.watchdog import Watchdog

# MLX CUDA raises "Cache thrashing is happening" out of whatever op meets one of its per-shape caches' miss number
# 2 x its capacity over the process's life (CUDA graphs: 400; cuDNN attention graphs: 256, one per new prefill
# shape); in a worker that is a crash. A server meets new shapes for as long as it runs (a long prompt's every new
# length), so a miss must cost a rebuild, never the worker: the check is off (bench/cuda_thrash.py shows both). Set
# before MLX is imported; a value in the worker's environment wins.
MLX_ENV = {"MLX_ENABLE_CACHE_THRASHING_CHECK": "0"}


def mlx_environment(environ: dict[str, str] | os._Environ = os.environ) -> None:
    for key, value in MLX_ENV.items():
        environ.setdefault(key, value)


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
    p.add_argument("--warm-batch-shapes", choices=("auto", "on", "off"), default="auto",
                   help="run every batch size once on dummy tokens while idle, after Ready (auto: on a GPU only)")
    p.add_argument("--warm-budget-s", type=float, default=10.0, help="the most seconds the batch-shape warm-up takes")
    p.add_argument("--admit-window-ms", type=int, default=2,
                   help="after a submit, wait this long for more before stepping, so a burst is prefilled together")
    p.add_argument("--burst-wait-ms", type=int, default=10,
                   help="as --admit-window-ms, after a submit whose gateway has more requests coming (Submit.more)")
    p.add_argument("--solo", choices=("auto", "compiled", "ahead", "plain", "off"), default="auto",
                   help="a request alone decodes the generate_step way (worker/mlx_engine/solo.py): its steps compiled"
                        " where the model's caches allow (decode_graph.py); ahead: each step's graph built on a thread"
                        " while the step before it launches, where that measures faster (worker/pace.py); or plain;"
                        " auto: compiled, ahead where MLX runs on CUDA; off: always batched")
    p.add_argument("--attention", choices=("auto", "fast", "routed"), default="auto",
                   help="routed: a short prefill's attention runs unfused, not through cuDNN, which builds a graph per"
                        " new prompt shape (worker/mlx_engine/attention.py); fast: always MLX's fused kernels;"
                        " auto: routed on CUDA only")
    p.add_argument("--strict-context", action="store_true",
                   help="refuse a request whose prompt + max_tokens passes the context (default: clamp max_tokens)")
    p.add_argument("--max-context", type=int, default=None,
                   help="the most context this worker publishes and serves, below its config's (the supervisor's: what"
                        " its memory ceiling leaves for the model's KV); never past protocol.modelconfig.MAX_CONTEXT")
    p.add_argument("--speculative", choices=("auto", "off", "prompt-lookup", "draft", "mtp", "dflash"), default="auto",
                   help="requests draft tokens and verify them in one pass (worker/mlx_engine/speculative.py; greedy"
                        " ones decoding together in lockstep):"
                        " from its own prompt and output (prompt-lookup), with --draft's model, with --draft's DFlash"
                        " drafter (dflash), or with the checkpoint's MTP head (mtp); auto (the default): --draft's"
                        " kind with --draft, else where MLX runs on a GPU the MTP head if the checkpoint has one we"
                        " load, else prompt-lookup; off on a CPU")
    p.add_argument("--draft", type=Path, default=None, help="the draft model's folder (the same tokenizer)")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="the most tokens drafted per verification (default 4; a DFlash drafter's block size - 1)")
    p.add_argument("--lifeline", action="store_true", help="exit when stdin reaches EOF")
    p.add_argument("--hot-cache-bytes", type=int, default=0, help="hot prefix cache budget (0: off)")
    p.add_argument("--ssd-cache-root", type=Path, default=None,
                   help="SSD cache root; blocks go to ROOT/<model fingerprint> (absent: off)")
    p.add_argument("--ssd-cache-bytes", type=int, default=8 * 2**30, help="SSD cache size cap")
    p.add_argument("--cache-block-tokens", type=int, default=64)
    p.add_argument("--cache-close-s", type=float, default=3.0, help="how long closing waits for SSD writes")
    p.add_argument("--cache-kv-bits", type=int, choices=(4, 8), default=None,
                   help="K/V quantized to this many bits: the running cache's attention layers and the cached blocks"
                        " (worker/mlx_engine/quantized_kv.py; absent: full precision)")
    p.add_argument("--cache-kv-group-size", type=int, choices=(32, 64, 128), default=64,
                   help="the K/V quantization's group size along a head's dimension")
    p.add_argument("--cache-snapshot-every", type=int, default=4096,
                   help="with sliding-window or recurrent layers, also snapshot every N prompt tokens (0: end only)")
    p.add_argument("--image-decode-deadline-s", type=float, default=DECODE_DEADLINE_S,
                   help="a vision model: a request's images decode on a thread while the loop goes on, within this"
                        " many seconds; past it the request is refused (worker/image_decode.py)")
    p.add_argument("--jpeg-max-scans", type=int, default=MAX_JPEG_SCANS,
                   help="a vision model: a JPEG of more scans is refused before decoding (a progressive JPEG has"
                        " about 10, and each scan is a pass over the whole picture; 0: no limit)")
    p.add_argument("--max-window-tokens", type=int, default=0,
                   help="a speech-to-text model: the most tokens it writes per 30-second window (0: the model's own"
                        " limit; tests cap random-weight models, which never stop by themselves)")
    p.add_argument("--fault", action="append", default=[], choices=sorted(FAULTS),
                   help="testing only: misbehave on purpose (repeatable): "
                   + "; ".join(f"{name}: {what}" for name, what in sorted(FAULTS.items())))
    p.add_argument("--script", type=Path, default=None,
                   help="testing only: answer matching chat requests with the replies of this JSON script"
                        " (worker/mlx_engine/scripted.py)")
    p.add_argument("--group-rank", type=int, default=None,
                   help="a worker group's rank (0 leads and talks to the supervisor; see worker/group_main.py)")
    p.add_argument("--group-size", type=int, default=1)
    p.add_argument("--group-backend", default="ring", help="mx.distributed backend: ring, nccl, jaccl, mpi")
    p.add_argument("--group-shard", choices=("tensor", "pipeline"), default="tensor")
    p.add_argument("--group-hosts", default="", help="ring: every rank's ip:port, comma-separated; nccl, jaccl: rank 0's")
    p.add_argument("--group-rdma", default="", help="jaccl: every host's RDMA device towards each rank (JSON)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if not args.spare and (args.model_path is None or args.model_id is None):
        p.error("--model-path and --model-id are required (or --spare)")
    if args.speculative == "auto" and args.draft is not None:
        args.speculative = "dflash" if is_dflash(args.draft) else "draft"
    if (args.speculative in ("draft", "dflash") and args.draft is None) or (args.num_draft_tokens is not None and args.num_draft_tokens < 1):
        p.error(f"--speculative {args.speculative} needs --draft, and --num-draft-tokens is at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    mlx_environment()  # before anything imports MLX
    args = parse_args(argv)
    # no time stamp: the supervisor stamps each line as it reads it, into the daemon's log and the model's
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    name_process(args.model_id if not args.group_rank else f"{args.model_id} rank {args.group_rank}", argv)
    log = logging.getLogger("worker")
    # Evidence before a kill: the supervisor asks a worker it declares hung for every thread's Python
    # stack; faulthandler writes it from the signal itself (no GIL, no loop needed) to stderr, its log.
    faulthandler.register(DUMP_STACKS_SIGNAL, file=sys.stderr, all_threads=True)

    import zmq

    shutdown = Shutdown()
    install_signal_handlers(shutdown)
    if args.lifeline:
        watch_lifeline(shutdown)
    if args.group_rank:  # a follower rank: no socket, it hears everything from rank 0 through the group
        from worker.group_main import run_follower

        leave(run_follower(args, log))

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, args.identity.encode())
    sock.setsockopt(zmq.SNDHWM, 1_000_000)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(args.endpoint)
    code = EXIT_CRASHED  # until serving returns a code of its own
    try:
        if args.spare:
            model_args = stand_by(sock, shutdown, log)
            if model_args is None:
                code = EXIT_OK
                return code
            argv = [a for a in argv if a != "--spare"] + model_args
            args = parse_args(argv)
            name_process(args.model_id, argv)
        faults = Faults(args.fault)
        faults.apply_to_signals()
        code = serve_model(args, sock, shutdown, faults, log)
    except Exception:
        log.exception("[crash] model=%s: unexpected error; exiting with code %d", args.model_id, EXIT_CRASHED)
    finally:
        sock.close()  # LINGER: Bye and the last messages leave before this returns
        ctx.term()
        if args.model_path is not None:
            leave(code)
    return code


def name_process(model_id: str | None, argv: list[str]) -> None:
    """Title the process by its model, so `ps` and Activity Monitor tell which worker serves which
    (a spare keeps its first command line otherwise). The arguments stay in it for tools that match them."""
    try:
        from setproctitle import setproctitle
    except ImportError:  # an install without it: the plain command line
        return
    setproctitle(f"mlxsup-worker {model_id or '(spare)'}: python -m worker {' '.join(argv)}")


def vision_installed() -> bool:
    """mlx-vlm is there (the `vision` extra): without it a vision model's folder is served as text, by mlx-lm."""
    import importlib.util

    return importlib.util.find_spec("mlx_vlm") is not None


def stand_by(sock: zmq.Socket, shutdown: Shutdown, log: logging.Logger) -> list[str] | None:
    """As a spare: import everything, report Standby, and wait for a Load (None: told to go)."""
    import zmq

    importlib.import_module("worker.mlx_engine.engine")  # a spare's point: pay the imports before a model is asked for
    from protocol.codec import ProtocolError, decode, encode
    from protocol.messages import Evict, Load, Standby

    sock.send(encode(Standby(os.getpid())))
    log.info("[spare] on standby")
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not shutdown.signalled():
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


def serve_model(args: argparse.Namespace, sock: zmq.Socket, shutdown: Shutdown, faults: Faults,
                log: logging.Logger) -> int:
    """Load the model, announce it, run the loop until the exit; the exit code (a crash raises)."""
    import zmq

    from protocol.codec import encode
    from protocol.messages import Progress
    from worker.channel import ZmqChannel
    from worker.loop import WorkerLoop

    try:
        from protocol.modelconfig import check_model
        from worker.mlx_engine.engine import Engine
        from worker.mlx_engine.prompt_cache import CacheOptions

        faults.while_loading()
        check_model(args.model_path)  # a hostile config is refused here, naming its field, before anything is built

        def report(stage: str, fraction: float) -> None:
            sock.send(encode(Progress(stage, round(fraction, 3))), zmq.NOBLOCK)

        cache = CacheOptions(args.hot_cache_bytes, args.ssd_cache_root, args.ssd_cache_bytes,
                             args.cache_block_tokens, args.cache_close_s, faults, args.cache_kv_bits,
                             args.cache_snapshot_every, args.cache_kv_group_size)
        engine: EngineApi
        if model_kind(args.model_path) in (EMBEDDING, RERANK):  # its own engine: a queue, no generation batch
            from worker.mlx_engine.embedder import load_engine

            if args.group_rank is not None:
                raise ValueError("an embedding or rerank model is served by one worker, not a group")
            engine = load_engine(args.model_path, report)
        elif model_kind(args.model_path) in AUDIO_KINDS:  # speech to text or text to speech: worker/audio_engine.py
            from worker.mlx_engine.audio_models import load_engine as load_audio

            engine = load_audio(args.model_path, report, args.max_window_tokens, args.image_decode_deadline_s)
        elif model_kind(args.model_path) == VISION and args.group_rank is None and vision_installed():
            from worker.mlx_engine.vision import vision_engine  # mlx-vlm's classes under the batch engine

            engine = vision_engine(args.model_path, report, max_batch_size=args.max_batch_size, cache=cache,
                                   prefill_step_size=args.prefill_step_size, model_id=args.model_id,
                                   step_target_s=args.step_target_s, warm=args.warm_batch_shapes,
                                   warm_budget_s=args.warm_budget_s, attention=args.attention,
                                   strict_context=args.strict_context, max_context=args.max_context,
                                   defer_stores=True, text_thread=True,
                                   decode_deadline_s=args.image_decode_deadline_s, jpeg_max_scans=args.jpeg_max_scans)
        elif args.group_rank is not None:  # rank 0 of a group: its engine shares each step's schedule
            from worker.group_main import leader_engine

            engine = leader_engine(args, report, cache)
        else:
            engine = Engine(args.model_path, max_batch_size=args.max_batch_size,
                            prefill_step_size=args.prefill_step_size, report=report, cache=cache,
                            model_id=args.model_id, step_target_s=args.step_target_s,
                            warm=args.warm_batch_shapes, warm_budget_s=args.warm_budget_s, solo=args.solo,
                            attention=args.attention, strict_context=args.strict_context,
                            max_context=args.max_context, speculative=args.speculative,
                            num_draft_tokens=args.num_draft_tokens,
                            draft=args.draft if args.speculative in ("draft", "dflash") else None, defer_stores=True,
                            text_thread=True, idle_pricing=True)
    except Exception as exc:
        log.error("[load] model=%s path=%s failed: %s", args.model_id, args.model_path, exc)
        return EXIT_LOAD_FAILED
    # the model's Python objects, the tokenizer's and the imports live as long as the worker: out of the collector's
    # full passes, which would otherwise walk them (~80k objects, ~50 ms) with every stream of the batch waiting
    gc.collect()
    gc.freeze()
    log.info("[load] model=%s ready in %.2fs frozen_objects=%d", args.model_id, engine.load_s, gc.get_freeze_count())
    if args.script is not None:  # a test's scripted replies, wired into this engine's decoding (scripted.py)
        from worker.mlx_engine import scripted

        scripted.install(engine, args.script)
    loop = WorkerLoop(ZmqChannel(sock), engine, args.model_id, shutdown, heartbeat_s=args.heartbeat_s, faults=faults,
                      admit_window_ms=args.admit_window_ms, admit_max=engine.prefill_batch_size,
                      burst_wait_ms=args.burst_wait_ms)
    watchdog = start_watchdog(sock, args.endpoint, loop, args.heartbeat_s, grouped=args.group_rank is not None)
    loop.announce()
    try:
        return loop.run()
    finally:
        watchdog.close()


def start_watchdog(sock: zmq.Socket, endpoint: str, loop: WorkerLoop, heartbeat_s: float,
                   grouped: bool = False) -> Watchdog:
    """The loop's watchdog (worker/watchdog.py), on a socket of its own under the worker's identity + WATCH_SUFFIX."""
    import zmq

    from protocol.codec import encode
    from protocol.messages import WATCH_SUFFIX, Pulse
    from worker.watchdog import Watchdog

    watch = sock.context.socket(zmq.DEALER)
    watch.setsockopt(zmq.IDENTITY, cast(bytes, sock.getsockopt(zmq.IDENTITY)) + WATCH_SUFFIX)
    watch.setsockopt(zmq.LINGER, 0)
    watch.connect(endpoint)

    def send(turn_s: float, window_s: float, cpu_s: float, where: str) -> None:
        watch.send(encode(Pulse(turn_s, window_s, cpu_s, where)), zmq.NOBLOCK)

    watchdog = Watchdog(lambda: loop.turn_at, send, after_s=1.5 * heartbeat_s, sample_s=heartbeat_s / 4,
                        on_close=watch.close, trust_mlx=not grouped)
    watchdog.start()
    return watchdog


if __name__ == "__main__":
    sys.exit(main())
