"""Cache settings: the [cache] section, per-model overrides, validation, and the worker's arguments."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.cache_config import DEFAULTS
from supervisor.config import ConfigError, Settings, load_file
from supervisor.process import model_args, worker_argv


def model(root: Path, name: str) -> Path:
    d = root / name
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\0" * 16)
    return d


def load(tmp_path: Path, text: str) -> Settings:
    path = tmp_path / "mlxsup.toml"
    path.write_text(text)
    return load_file(path, Settings(state_dir=tmp_path / "state"))


def test_defaults_put_the_ssd_cache_under_the_state_dir(tmp_path: Path) -> None:
    model(tmp_path, "m")
    st = load(tmp_path, '[models.m]\npath = "m"\n')
    args = st.model_cache(st.models[0]).worker_args(st.state_dir)
    assert args == ["--hot-cache-bytes", str(DEFAULTS.hot_budget), "--cache-block-tokens", "64",
                    "--cache-snapshot-every", "4096", "--ssd-cache-root", str(tmp_path / "state" / "cache"), "--ssd-cache-bytes", str(DEFAULTS.ssd_cap)]


def test_section_and_model_overrides(tmp_path: Path) -> None:
    model(tmp_path, "a")
    model(tmp_path, "b")
    st = load(tmp_path, """
[cache]
hot_budget = "256MiB"
ssd_dir = "disk"
ssd_cap = "2GB"

[models.a]
path = "a"
cache = { ssd = false, hot_budget = "1GiB" }

[models.b]
path = "b"
cache = { enabled = false }
""")
    a, b = (st.model_cache(s) for s in st.models)
    assert a.hot_budget == 2**30 and not a.ssd_on and a.block_tokens == 64
    assert a.worker_args(st.state_dir) == ["--hot-cache-bytes", str(2**30), "--cache-block-tokens", "64",
                                           "--cache-snapshot-every", "4096"]
    assert not b.hot_on and not b.ssd_on and b.ssd_cap == 2 * 10**9 and b.ssd_dir == tmp_path / "disk"
    argv = worker_argv("ipc://x", "b#1", 1.0, model_args(Path("/m"), "b", 8, 512, ("--fault", "ssd-slow"),
                                                        tuple(b.worker_args(st.state_dir))))
    assert argv[-8:] == ["--hot-cache-bytes", "0", "--cache-block-tokens", "64", "--cache-snapshot-every", "4096",
                         "--fault", "ssd-slow"]
    assert argv[argv.index("--log-level") + 1] == "INFO"  # the daemon's level, which the worker logs at too
    assert "DEBUG" in worker_argv("ipc://x", "b#1", 1.0, ["--spare"], "debug")


def test_kv_bits_and_snapshot_every(tmp_path: Path) -> None:
    model(tmp_path, "a")
    st = load(tmp_path, '[cache]\nkv_bits = 8\nsnapshot_every = 1024\n[models.a]\npath = "a"\ncache = { kv_bits = 4 }\n')
    args = st.model_cache(st.models[0]).worker_args(st.state_dir)
    assert args[args.index("--cache-kv-bits") + 1] == "4" and args[args.index("--cache-snapshot-every") + 1] == "1024"
    for bad in ("kv_bits = 3", "kv_bits = true", "snapshot_every = -1"):
        with pytest.raises(ValueError, match="cache."):
            load(tmp_path, f"[cache]\n{bad}\n")


@pytest.mark.parametrize("text, match", [
    ('[cache]\nhot_budget = "lots"\n', "cache.hot_budget: expected a size"),
    ('[cache]\nssd = "yes"\n', "cache.ssd: must be true or false"),
    ('[cache]\nblock_tokens = 0\n', "cache.block_tokens"),
    ('[cache]\nsize = 1\n', "cache.size: unknown key"),
    ('[models.m]\npath = "m"\ncache = { ssd_cap = -1 }\n', "models.m.cache.ssd_cap: must not be negative"),
    ('[models.m]\npath = "m"\ncache = 3\n', "models.m.cache: must be a table"),
])
def test_bad_cache_settings_are_refused_with_the_key(tmp_path: Path, text: str, match: str) -> None:
    model(tmp_path, "m")
    with pytest.raises(ConfigError, match=match):
        load(tmp_path, text)


def test_kv_group_size_goes_with_kv_bits(tmp_path: Path) -> None:
    """issue 53: the running cache's quantization groups; passed only where kv_bits quantizes."""
    model(tmp_path, "a")
    st = load(tmp_path, '[cache]\nkv_bits = 4\nkv_group_size = 32\n[models.a]\npath = "a"\n')
    args = st.model_cache(st.models[0]).worker_args(st.state_dir)
    assert args[args.index("--cache-kv-group-size") + 1] == "32"
    st = load(tmp_path, '[cache]\nkv_group_size = 128\n[models.a]\npath = "a"\n')
    assert "--cache-kv-group-size" not in st.model_cache(st.models[0]).worker_args(st.state_dir)
    with pytest.raises(ValueError, match="kv_group_size"):
        load(tmp_path, "[cache]\nkv_group_size = 16\n")
