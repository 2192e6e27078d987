"""Bench-only tracing of mlxsup's worker, for the gateway-overhead measurement. Inert unless
MLXSUP_BENCH_TRACE_DIR is set; the harness puts bench/trace first on PYTHONPATH of one dedicated
daemon (never the one whose throughput is reported), and the worker inherits it.

It patches, at import, without editing worker/:
- the engine's BatchGenerator.next (per instance): stamps time.monotonic_ns() when a step's tokens
  are on the host, i.e. when the worker has *produced* them;
- WorkerLoop.send: after each Tokens / Finished message leaves on ZeroMQ, keeps
  (kind, t_produced_ns, t_sent_ns, [(rid, text_len), ...]) in memory (a list append per step).
At interpreter exit (the worker exits after an evict) the records go to DIR/trace-<pid>.jsonl.
The client's arrival times (also monotonic_ns, one system clock) are matched chunk by chunk.
Any other sitecustomize on the path is still run afterwards.
"""

import os
import sys

_DIR = os.environ.get("MLXSUP_BENCH_TRACE_DIR")


def _patch_server(server) -> None:
    import atexit
    import json
    import time

    from protocol.messages import Finished, Tokens
    from worker.mlx_engine import engine as engine_mod

    records: list = []
    state = {"t_gen": 0}
    monotonic_ns = time.monotonic_ns

    orig_step = engine_mod.Engine.step

    def step(self):
        gen = self.gen
        if not getattr(gen, "_bench_traced", False):
            orig_next = gen.next

            def traced_next():
                out = orig_next()
                state["t_gen"] = monotonic_ns()
                return out

            gen.next = traced_next
            gen._bench_traced = True
        return orig_step(self)

    engine_mod.Engine.step = step

    orig_send = server.WorkerLoop.send

    def send(self, msg):
        orig_send(self, msg)
        if isinstance(msg, Tokens):
            records.append(("T", state["t_gen"], monotonic_ns(), [(c[0], len(c[1])) for c in msg.chunks]))
        elif isinstance(msg, Finished):
            records.append(("F", state["t_gen"], monotonic_ns(), [(msg.rid, len(msg.text))]))

    server.WorkerLoop.send = send

    def dump() -> None:
        with open(os.path.join(_DIR, f"trace-{os.getpid()}.jsonl"), "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")

    atexit.register(dump)


if _DIR:
    import importlib.abc
    import importlib.machinery

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "worker.loop":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                try:
                    _patch_server(module)
                except Exception as exc:  # tracing must never break the worker
                    print(f"[bench-trace] could not patch: {exc!r}", file=sys.stderr)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, _Hook())

# Chain to the next sitecustomize on the path, if any (this one shadows it).
_here = os.path.dirname(os.path.abspath(__file__))
for _p in list(sys.path):
    if not _p or os.path.abspath(_p) == _here:
        continue
    _f = os.path.join(_p, "sitecustomize.py")
    if os.path.isfile(_f):
        with open(_f) as _fh:
            exec(compile(_fh.read(), _f, "exec"), {"__name__": "sitecustomize", "__file__": _f})
        break
