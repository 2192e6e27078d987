"""A worker group as the router sees it, against fakes: one worker spawned with its group, never on the
spare; admission and status count this machine's ranks only; status lists every rank."""

from __future__ import annotations

from pathlib import Path

from supervisor.group import GroupHost, GroupSpec
from supervisor.registry import ModelSpec
from tests.unit.test_router import MIB, FakeProcess, World, scenario, settle

GROUP = GroupSpec(2, hosts=(GroupHost("127.0.0.1", "127.0.0.1"), GroupHost("mac2", "10.0.0.2")))


class FakeGroup(FakeProcess):
    """Rank 0 here (the handle's pid), rank 1 on another host (its local pid is its ssh)."""

    group: GroupSpec | None = None

    @property
    def local_pids(self) -> list[int]:
        return [self.pid] if self.pid is not None else []

    def describe(self) -> list[dict]:
        return [{"rank": 0, "host": "127.0.0.1", "pid": self.pid, "local": True, "exit": None},
                {"rank": 1, "host": "mac2", "pid": 9999, "local": False, "exit": None}]


class GroupWorld(World):
    def _spawn(self, model_id: str, argv: list[str], log_path: Path, group: GroupSpec | None = None) -> FakeProcess:
        process = (FakeGroup if group else FakeProcess)(model_id, argv, log_path, pid=100 + len(self.processes))
        process.group = group
        self.processes.append(process)
        return process


@scenario
async def test_a_group_is_spawned_with_its_group_never_on_the_spare_and_counts_this_machines_ranks(
        tmp_path: Path) -> None:
    w = GroupWorld(tmp_path, [ModelSpec("g", tmp_path, weights_bytes=400 * MIB, group=GROUP),
                              ModelSpec("m", tmp_path, weights_bytes=100 * MIB)], spare_workers=1)
    await settle()
    w.stand_by()
    spare = w.router.spare
    lease = await w.load("g")
    process = w.process("g")
    assert isinstance(process, FakeGroup) and process.group == GROUP and w.router.spare is spare
    assert w.router._estimate(w.worker("g").spec) == 200 * MIB  # half the weights live on this machine
    w.memory.sizes = {process.pid: 150 * MIB, 9999: 10 * 2**30}  # the ssh pid's size is not the remote rank's
    status = w.router.model_status("g")
    assert status.memory_bytes == 150 * MIB
    assert [(r["rank"], r["host"], r["memory_bytes"]) for r in status.ranks] == [(0, "127.0.0.1", 150 * MIB),
                                                                                (1, "mac2", None)]
    assert "ranks" in status.to_dict() and "ranks" not in w.router.model_status("m").to_dict()
    lease.release()
