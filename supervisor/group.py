"""Worker groups: one model served by N ranks of MLX's distributed engine, one worker to the router.

A model's `group = { ranks = 2, backend = "ring", hosts = [...], shard = "tensor" }` (parse_group)
makes its worker a group. The supervisor starts every rank itself, as `mlx.launch` would: each
rank gets `--group-rank R` and the group's addresses (the ring's `ip:port` of every rank, or NCCL's
rendezvous at rank 0), which the worker turns into MLX_RANK, MLX_HOSTFILE or NCCL_HOST_IP/PORT and
MLX_WORLD_SIZE; on NCCL each rank on a host sees only its own GPU (CUDA_VISIBLE_DEVICES). A rank on
this machine is a WorkerProcess like any worker (exec, lifeline on stdin, its own log and pidfile);
a rank on another host is `ssh HOST 'cd ...; exec env ... python -m worker ...'`, whose stdin is the
lifeline: when the supervisor dies the connection closes and the remote rank's stdin reaches EOF.
Rank 0 always runs here: it is the worker the router talks to over the local ZeroMQ socket.

GroupProcess is the router's effects.WorkerHandle for the whole group. Invariants:
- `pid` is rank 0's; `exited` is set only once every rank has been reaped.
- Any rank's exit ends the group: a failed one (non-zero, a signal) has the others SIGKILLed at
  once, a clean one (rank 0 after its Bye, a follower at rank 0's stop) gives them
  CLEAN_EXIT_GRACE_S to follow. The group's `returncode` is that first exit's, so a follower's
  crash is the group's crash, and its stderr tail says which rank it was.
- SIGTERM goes to rank 0 (whose orderly exit stops the followers); SIGKILL and the stack-dump
  signals go to every rank. The kill ladder waits for, and escalates on, every rank.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import shlex
import signal
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from supervisor.ladder import kill_ladder
from supervisor.process import WorkerProcess, set_within
from supervisor.tasks import background

log = logging.getLogger(__name__)

BACKENDS = ("ring", "nccl", "jaccl", "mpi")
SHARDS = ("tensor", "pipeline")
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "")
CLEAN_EXIT_GRACE_S = 3.0  # after one rank's clean exit, how long the others have to follow before SIGKILL


@dataclass(frozen=True)
class GroupHost:
    ssh: str  # what `ssh` is given ("" or a loopback name: this machine, no ssh)
    ip: str  # the address other ranks reach this one at (the ring's, NCCL's rendezvous)
    rdma: tuple[str | None, ...] = ()  # jaccl: this host's RDMA device towards each rank (None towards itself)

    @property
    def local(self) -> bool:
        return self.ssh in LOCAL_HOSTS


@dataclass(frozen=True)
class GroupSpec:
    ranks: int
    backend: str = "ring"
    shard: str = "tensor"
    hosts: tuple[GroupHost, ...] = ()  # one per rank
    port: int = 0  # ring: rank r listens at port + r; nccl: rank 0's rendezvous (0: free ports picked at each start)
    python: str = ""  # the interpreter on remote hosts ("": this one's path)

    @property
    def local_ranks(self) -> int:
        return sum(1 for h in self.hosts if h.local)


def _host(value: object, where: str) -> GroupHost:
    if isinstance(value, str):
        return GroupHost(value, "127.0.0.1" if value in LOCAL_HOSTS else value)
    rdma = value.get("rdma", []) if isinstance(value, dict) else None
    if isinstance(value, dict) and isinstance(value.get("ssh", ""), str) and isinstance(value.get("ip"), str) \
            and not set(value) - {"ssh", "ip", "rdma"} and isinstance(rdma, list) \
            and all(d is None or isinstance(d, str) for d in rdma):
        return GroupHost(value.get("ssh", ""), value["ip"], tuple(d or None for d in rdma))
    raise ValueError(f"{where}: a host is a name or address, or {{ ssh = NAME, ip = ADDRESS, rdma = [...] }}; "
                     f"got {value!r}")


def parse_group(entry: object, where: str) -> GroupSpec:
    """A model's `group` table; ValueError naming the key and what it wants."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a table like {{ ranks = 2, backend = \"ring\" }}")
    unknown = set(entry) - {"ranks", "backend", "shard", "hosts", "port", "python"}
    if unknown:
        raise ValueError(f"{where}.{sorted(unknown)[0]}: unknown key")
    ranks = entry.get("ranks")
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 2:
        raise ValueError(f"{where}.ranks: expected an integer of at least 2, got {ranks!r}")
    backend = entry.get("backend", "ring")
    if backend not in BACKENDS:
        raise ValueError(f"{where}.backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    shard = entry.get("shard", "tensor")
    if shard not in SHARDS:
        raise ValueError(f"{where}.shard: expected one of {', '.join(SHARDS)}, got {shard!r}")
    raw_hosts = entry.get("hosts", ["127.0.0.1"] * ranks)
    if not isinstance(raw_hosts, list) or len(raw_hosts) != ranks:
        raise ValueError(f"{where}.hosts: expected a list of {ranks} hosts, one per rank")
    hosts = tuple(_host(h, f"{where}.hosts") for h in raw_hosts)
    if not hosts[0].local:
        raise ValueError(f"{where}.hosts: rank 0 runs on this machine (it talks to the supervisor); "
                         f"got {hosts[0].ssh!r}")
    if backend == "jaccl" and any(len(h.rdma) != ranks or h.rdma[r] is not None for r, h in enumerate(hosts)):
        raise ValueError(f"{where}.hosts: jaccl needs every host's rdma = [...], one RDMA device per rank and \"\" "
                         f"for itself (as in mlx.launch's hostfile)")
    port = entry.get("port", 0)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536 - ranks:
        raise ValueError(f"{where}.port: expected a port number, got {port!r}")
    python = entry.get("python", "")
    if not isinstance(python, str):
        raise ValueError(f"{where}.python: expected the path of the Python on the other hosts")
    return GroupSpec(ranks, backend, shard, hosts, port, python)


def free_ports(n: int) -> list[int]:
    """n ports free on this machine now (the ring binds them a moment later; a clash fails the load)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def rank_commands(group: GroupSpec, argv: list[str]) -> list[tuple[list[str], dict[str, str]]]:
    """Each rank's (command line, extra environment), from rank 0's worker argv."""
    if group.backend in ("nccl", "jaccl"):  # rank 0 (always here) hosts the rendezvous
        addresses = [f"{group.hosts[0].ip}:{group.port or free_ports(1)[0]}"]
    else:
        ports = [group.port + r for r in range(group.ranks)] if group.port else free_ports(group.ranks)
        addresses = [f"{h.ip}:{p}" for h, p in zip(group.hosts, ports)]
    seen: collections.Counter[str] = collections.Counter()
    commands = []
    for rank, host in enumerate(group.hosts):
        args = [*argv, "--group-rank", str(rank), "--group-size", str(group.ranks), "--group-backend", group.backend,
                "--group-shard", group.shard, "--group-hosts", ",".join(addresses)]
        if group.backend == "jaccl":
            args += ["--group-rdma", json.dumps([list(h.rdma) for h in group.hosts])]
        env = {}
        if group.backend == "nccl":  # one GPU per rank: the n-th rank on a host gets its n-th GPU
            env["CUDA_VISIBLE_DEVICES"] = str(seen[host.ssh])
        seen[host.ssh] += 1
        if host.local:
            commands.append((args, env))
        else:
            remote = [group.python or args[0], *args[1:]]
            script = f"cd {shlex.quote(os.getcwd())} 2>/dev/null; exec env " + " ".join(
                [shlex.quote(f"{k}={v}") for k, v in {**env, "PYTHONUNBUFFERED": "1"}.items()] + [shlex.join(remote)])
            commands.append((["ssh", "-o", "BatchMode=yes", host.ssh, script], {}))
    return commands


def rank_log(log_path: Path | None, rank: int) -> Path | None:
    if log_path is None or rank == 0:
        return log_path
    return log_path.with_name(f"{log_path.stem}.rank{rank}{log_path.suffix}")


class GroupProcess:
    """Every rank of one group, as one worker handle (see the module's invariants)."""

    def __init__(self, model_id: str, group: GroupSpec, argv: list[str], log_path: Path | None = None,
                 pid_dir: Path | None = None) -> None:
        self.model_id = model_id
        self.group = group
        self.ranks = [WorkerProcess(model_id if r == 0 else f"{model_id} rank {r}", args, rank_log(log_path, r),
                                    pid_dir, env=env)
                      for r, (args, env) in enumerate(rank_commands(group, argv))]
        self.returncode: int | None = None
        self.exited = asyncio.Event()
        self.notes: list[str] = []  # what the group saw happen, after rank 0's stderr in the tail
        self._watch: asyncio.Task | None = None

    @property
    def pid(self) -> int | None:
        return self.ranks[0].pid

    @property
    def stderr_tail(self) -> Sequence[str]:
        return [*self.ranks[0].stderr_tail, *self.notes]

    @property
    def local_pids(self) -> list[int]:
        """The pids of the ranks on this machine (a remote rank's local process is its ssh)."""
        return [p.pid for p, h in zip(self.ranks, self.group.hosts) if h.local and p.pid is not None]

    def describe(self) -> list[dict]:
        """Each rank: its host and pid (the local pid of a remote rank is its ssh), for status."""
        return [{"rank": r, "host": h.ssh or "127.0.0.1", "pid": p.pid, "local": h.local,
                 "exit": p.returncode} for r, (p, h) in enumerate(zip(self.ranks, self.group.hosts))]

    async def start(self) -> None:
        try:
            for rank in self.ranks:
                await rank.start()
        except OSError as exc:  # e.g. no ssh: the ranks started already go, the others never will
            log.error("[group] model=%s could not start every rank: %s", self.model_id, exc)
            for rank in self.ranks:
                rank.signal(signal.SIGKILL, f"another rank of its group could not start: {exc}")
            await asyncio.gather(*(r.exited.wait() for r in self.ranks if r.pid is not None))
            for rank in self.ranks:
                if rank.pid is None:  # never spawned: nothing to wait for (stop() must not wait on it)
                    rank.started.set()
                    rank.exited.set()
            self.exited.set()
            raise
        log.info("[group] model=%s started ranks=%d backend=%s shard=%s pids=%s", self.model_id, self.group.ranks,
                 self.group.backend, self.group.shard, [r.pid for r in self.ranks])
        self._watch = background(self._watch_ranks(), name=f"group[{self.model_id}]")

    async def _watch_ranks(self) -> None:
        waits = {asyncio.ensure_future(p.exited.wait()): r for r, p in enumerate(self.ranks)}
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        first = min(waits[d] for d in done)
        rc = self.ranks[first].returncode
        self.returncode = rc
        alive = [p for p in self.ranks if p.returncode is None]
        if rc == 0 and alive:
            await asyncio.wait([asyncio.ensure_future(p.exited.wait()) for p in alive], timeout=CLEAN_EXIT_GRACE_S)
            alive = [p for p in alive if p.returncode is None]
        why = f"rank {first} of its group exited (code {rc})"
        if rc != 0:
            self.notes.append(f"[group] rank {first} pid {self.ranks[first].pid} exited with code {rc}; "
                              f"the group's other ranks were ended")
            log.error("[group] model=%s %s: ending ranks %s", self.model_id, why,
                      [self.ranks.index(p) for p in alive])
        for p in alive:
            p.signal(signal.SIGKILL, why)
        await asyncio.gather(*waits)
        self.exited.set()

    def assign(self, model_id: str, log_path: Path | None) -> None:
        self.model_id = model_id  # a group is never a spare: nothing else changes

    def signal(self, sig: signal.Signals, why: str | None = None) -> None:
        targets = self.ranks[:1] if sig == signal.SIGTERM else self.ranks
        for rank in targets:
            rank.signal(sig, why)

    async def kill_after_stack_dump(self, timeout_s: float, why: str) -> None:
        """Every rank's stacks in its log (the hung one is seldom rank 0), then SIGKILL them all."""
        await asyncio.gather(*(r.dump_stacks(timeout_s) for r in self.ranks))
        log.error("[kill] model=%s pids=%s by=supervisor: SIGKILL the group; python stacks in its ranks' logs",
                  self.model_id, [r.pid for r in self.ranks])
        self.signal(signal.SIGKILL, why)

    async def wait(self, timeout: float | None) -> bool:
        """Wait for every rank to be reaped; True if they were within `timeout`."""
        return await set_within(self.exited, timeout)

    async def stop(self, grace_s: float, kill_timeout_s: float) -> dict:
        """The kill ladder over every rank: their own exit, SIGTERM (rank 0), SIGKILL (all); always reaped."""
        t0 = time.monotonic()
        for rank in self.ranks:
            await rank.started.wait()
        await kill_ladder(self, grace_s, kill_timeout_s, f"model={self.model_id} group pids={[r.pid for r in self.ranks]}")
        results = [await r.stop(kill_timeout_s, kill_timeout_s) for r in self.ranks]  # reaped: closes their pipes
        signals = sorted({s for res in results for s in res["signals"]})
        return {"exit": self.returncode, "signals": signals, "wait_s": time.monotonic() - t0,
                "ranks": [res["exit"] for res in results]}

