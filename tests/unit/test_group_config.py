"""Worker groups' pure parts: the `group` table of a model, each rank's command line, the status lines."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from supervisor.cli.views import group_lines
from supervisor.group import GroupHost, GroupSpec, parse_group, rank_commands
from supervisor.registry import from_config

ARGV = ["/usr/bin/python3", "-m", "worker", "--endpoint", "ipc:///x", "--lifeline", "--model-id", "m"]


def test_defaults_put_every_rank_on_this_machine() -> None:
    g = parse_group({"ranks": 2}, "models.m.group")
    assert g == GroupSpec(2, "ring", "tensor", (GroupHost("127.0.0.1", "127.0.0.1"),) * 2)
    assert g.local_ranks == 2


@pytest.mark.parametrize(("entry", "complaint"), [
    ({"ranks": 1}, "ranks: expected an integer of at least 2"),
    ({"ranks": True}, "ranks: expected an integer"),
    ({"ranks": 2, "backend": "tcp"}, "backend: expected one of ring, nccl, jaccl, mpi"),
    ({"ranks": 2, "shard": "data"}, "shard: expected one of tensor, pipeline"),
    ({"ranks": 2, "hosts": ["127.0.0.1"]}, "hosts: expected a list of 2 hosts"),
    ({"ranks": 2, "hosts": ["mac2", "127.0.0.1"]}, "rank 0 runs on this machine"),
    ({"ranks": 2, "hosts": ["127.0.0.1", {"ssh": "mac2"}]}, "a host is a name or address"),
    ({"ranks": 2, "port": 70000}, "port: expected a port number"),
    ({"ranks": 2, "rank": 0}, "group.rank: unknown key"),
    ("two", "expected a table"),
])
def test_a_bad_group_table_names_the_key(entry: object, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        parse_group(entry, "models.m.group")


def test_a_model_entry_takes_a_group(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    (spec,) = from_config({"m": {"path": "m", "group": {"ranks": 2, "shard": "pipeline"}}}, tmp_path)
    assert spec.group is not None and spec.group.shard == "pipeline"
    with pytest.raises(ValueError, match="models.m.group.ranks"):
        from_config({"m": {"path": "m", "group": {"ranks": 0}}}, tmp_path)


def test_ring_ranks_get_their_rank_and_every_address() -> None:
    g = parse_group({"ranks": 2, "port": 5000}, "g")
    (args0, env0), (args1, env1) = rank_commands(g, ARGV)
    assert args0[:len(ARGV)] == ARGV and args1[:len(ARGV)] == ARGV
    assert args0[args0.index("--group-rank") + 1] == "0" and args1[args1.index("--group-rank") + 1] == "1"
    assert args1[args1.index("--group-hosts") + 1] == "127.0.0.1:5000,127.0.0.1:5001"
    assert env0 == env1 == {}


def test_free_ports_are_picked_when_none_is_given() -> None:
    (args0, _), _ = rank_commands(parse_group({"ranks": 2}, "g"), ARGV)
    ports = [int(a.rpartition(":")[2]) for a in args0[args0.index("--group-hosts") + 1].split(",")]
    assert len(set(ports)) == 2 and all(ports)


def test_nccl_gives_each_rank_of_a_host_its_own_gpu_and_rank_0_the_rendezvous() -> None:
    g = parse_group({"ranks": 2, "backend": "nccl", "port": 6000}, "g")
    (args0, env0), (args1, env1) = rank_commands(g, ARGV)
    assert (env0, env1) == ({"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"})
    assert args1[args1.index("--group-hosts") + 1] == "127.0.0.1:6000"


def test_a_remote_rank_is_an_ssh_command_keeping_stdin_as_its_lifeline() -> None:
    g = parse_group({"ranks": 2, "backend": "nccl", "port": 6000, "python": "/opt/py/bin/python3",
                     "hosts": ["127.0.0.1", {"ssh": "user@mac2", "ip": "10.0.0.2"}]}, "g")
    _, (remote, env) = rank_commands(g, ARGV)
    assert remote[:4] == ["ssh", "-o", "BatchMode=yes", "user@mac2"] and env == {}
    words = shlex.split(remote[4])
    assert "CUDA_VISIBLE_DEVICES=0" in words  # the first rank on that host
    assert words[words.index("/opt/py/bin/python3") + 1:][:2] == ["-m", "worker"]
    assert "--lifeline" in words and words[words.index("--group-rank") + 1] == "1"


def test_status_lists_a_groups_ranks() -> None:
    status = {"models": [
        {"id": "solo", "state": "ready", "pid": 5},
        {"id": "g", "state": "ready", "pid": 10, "ranks": [
            {"rank": 0, "host": "127.0.0.1", "pid": 10, "memory_bytes": 2**30},
            {"rank": 1, "host": "mac2", "pid": 11, "memory_bytes": None}]}]}
    assert group_lines(status) == ["group g: 2 ranks: rank 0 127.0.0.1 pid 10 1 GiB, rank 1 mac2 pid 11"]


def test_jaccl_passes_every_hosts_rdma_devices_and_needs_them() -> None:
    hosts = [{"ssh": "", "ip": "10.0.0.1", "rdma": ["", "rdma_en3"]},
             {"ssh": "mac2", "ip": "10.0.0.2", "rdma": ["rdma_en3", ""]}]
    g = parse_group({"ranks": 2, "backend": "jaccl", "port": 7000, "hosts": hosts}, "g")
    (args0, _), _ = rank_commands(g, ARGV)
    assert args0[args0.index("--group-hosts") + 1] == "10.0.0.1:7000"
    assert json.loads(args0[args0.index("--group-rdma") + 1]) == [[None, "rdma_en3"], ["rdma_en3", None]]
    with pytest.raises(ValueError, match="jaccl needs every host's rdma"):
        parse_group({"ranks": 2, "backend": "jaccl"}, "g")
