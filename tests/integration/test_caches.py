"""Prompt caches through the whole path: the openai client -> gateway -> real worker -> MLX on CPU.

Greedy output must be token for token the same whether the prompt's prefix came from the hot
cache, from SSD after the worker was evicted and loaded again, or was computed; the SSD cache
must survive a worker SIGKILLed in the middle of its writes; the admin endpoints must give
back what they say; a broken disk must cost only the SSD cache.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path

import httpx
import openai

from tests.conftest import Daemon, assert_gone, wait_for

BLOCK = 64
Factory = Callable[..., Daemon]


def write_config(path: Path, model_dir: Path, cache: str = "", model: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'[models.tiny]\npath = "{model_dir / "tiny"}"\n{model}\n\n[cache]\n{cache}\n')
    return path


def long_prompt(seed: int, words: int = 90) -> str:
    return f"Story {seed}: " + " ".join(f"keeper{(seed * 7919 + i * 104729) % 9973} saw" for i in range(words))


def client(d: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.v1, api_key="unused", max_retries=0, timeout=120)


def complete(d: Daemon, prompt: str, max_tokens: int = 24, model: str = "tiny") -> tuple[str, int, int]:
    """(text, prompt_tokens, cached_tokens) of a greedy completion."""
    out = client(d).completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       extra_body={"ignore_eos": True})
    usage = out.usage
    return out.choices[0].text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def expected_hit(prompt_tokens: int, repeat: bool = False) -> int:
    """Whole blocks of the prompt, less the one token always left to compute; a `repeat` of a prompt
    whose earlier run left its blocks in the hot cache (its partial last one included) picks up all
    but the last token, when what lies past the whole blocks is worth a partial pick-up (8 tokens)."""
    whole = min(prompt_tokens // BLOCK * BLOCK, prompt_tokens - 1)
    return prompt_tokens - 1 if repeat and prompt_tokens - 1 - whole >= 8 else whole


def stored_blocks(fed: int) -> int:
    """The blocks a finished sequence of `fed` tokens leaves to each tier: its whole blocks, and its partial last
    block when that is worth a pick-up (8 tokens)."""
    return fed // BLOCK + (fed % BLOCK >= 8)


def cache(d: Daemon, model: str = "tiny") -> dict:
    return d.model(model)["cache"] or {}


def ssd_files(d: Daemon, model: str = "tiny") -> list[Path]:
    return sorted(Path(cache(d, model)["ssd"]["dir"]).glob("*.kvb"))


def post(d: Daemon, path: str, body: dict | None = None, status: int = 200) -> dict:
    r = httpx.post(d.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def reload(d: Daemon, model: str = "tiny") -> int:
    pid = d.model(model)["pid"]
    assert post(d, f"/api/models/{model}/evict", {"mode": "drain"})["evicted"]
    assert_gone([pid])
    return post(d, f"/api/models/{model}/load")["pid"]


def test_hot_hit_is_token_for_token_the_same(daemon_factory: Factory, model_dir: Path, tmp_path: Path) -> None:
    d = daemon_factory("--config", str(write_config(tmp_path / "c.toml", model_dir)))
    prompt = long_prompt(1)
    cold_text, n, cold_cached = complete(d, prompt)
    assert n >= 5 * BLOCK and cold_cached == 0
    hot_text, _, hot_cached = complete(d, prompt)
    assert hot_cached == expected_hit(n, repeat=True)
    assert hot_text == cold_text

    # a longer prompt sharing the prefix reuses it, and streaming reports it too
    chunks = list(client(d).completions.create(model="tiny", prompt=prompt + " and the storm came", max_tokens=4,
                                               temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= expected_hit(n) - BLOCK > 0

    # the next turn of a chat finds the previous turn, completion included
    chat = [{"role": "system", "content": long_prompt(2)}, {"role": "user", "content": "Go on."}]
    first = client(d).chat.completions.create(model="tiny", messages=chat, max_tokens=70, temperature=0)
    chat += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "More."}]
    second = client(d).chat.completions.create(model="tiny", messages=chat, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // BLOCK * BLOCK - BLOCK

    stats = wait_for(lambda: (c := cache(d))["hot"]["hits"] >= 3 and c, 10, what="cache stats")
    assert stats["hot"]["hit_tokens"] >= 2 * expected_hit(n) - BLOCK
    assert 0 < stats["hot"]["bytes"] <= stats["hot"]["budget_bytes"]


def test_a_shared_start_shorter_than_a_block_is_picked_up(daemon_factory: Factory, model_dir: Path,
                                                          tmp_path: Path) -> None:
    # Requests that share a system prompt shorter than one block (a chat template's head, an agent's
    # instructions) share its K/V: the next one picks up the common part of a cached block.
    d = daemon_factory("--config", str(write_config(tmp_path / "c.toml", model_dir)))
    system = "Be brief and kind."

    def chat(question: str, max_tokens: int) -> tuple[str, int, int]:
        out = client(d).chat.completions.create(
            model="tiny", messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
        return out.choices[0].message.content, out.usage.prompt_tokens, out.usage.prompt_tokens_details.cached_tokens

    cold_text, n, cached = chat("Where is the lighthouse?", 8)
    assert cached == 0 and n < BLOCK
    post(d, "/api/hot-cache/clear", {"model": "tiny"})  # the same question's answer, computed whole: both tiers
    post(d, "/api/ssd-cache/clear", {"model": "tiny"})  # held its partial block
    chat("How tall is the old mill by the river?", 8)  # less than a block: kept as a partial block
    hot_text, n2, cached = chat("Where is the lighthouse?", 8)
    assert n2 == n and 8 <= cached < n - 4  # the shared head, not the different question
    assert hot_text == cold_text
    again_text, _, again = chat("Where is the lighthouse?", 8)  # its own partial block: all but the last token
    assert again == n - 1 and again_text == cold_text


def test_hit_joining_a_running_batch_is_the_same(daemon_factory: Factory, model_dir: Path, tmp_path: Path) -> None:
    d = daemon_factory("--config", str(write_config(tmp_path / "c.toml", model_dir)))
    prompt = long_prompt(3)
    cold_text, n, _ = complete(d, prompt, max_tokens=40)
    aclient = openai.AsyncOpenAI(base_url=d.v1, api_key="unused", max_retries=0, timeout=120)

    async def main() -> tuple[str, int]:
        background = await aclient.completions.create(model="tiny", prompt=long_prompt(4, 40), max_tokens=400,
                                                      temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = background.__aiter__()
        await anext(chunks)  # generating: the hit joins a batch already under way
        hit = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                               extra_body={"ignore_eos": True})
        async for _ in chunks:
            pass
        return hit.choices[0].text, hit.usage.prompt_tokens_details.cached_tokens

    text, cached = asyncio.run(main())
    assert cached == expected_hit(n, repeat=True)
    assert text == cold_text
    assert wait_for(lambda: d.model("tiny")["peak_batch_size"] >= 2, 10, what="a heartbeat")


def test_ssd_hit_after_evict_and_reload_is_the_same(daemon_factory: Factory, model_dir: Path, tmp_path: Path) -> None:
    d = daemon_factory("--config", str(write_config(tmp_path / "c.toml", model_dir)))
    prompt = long_prompt(5)
    cold_text, n, _ = complete(d, prompt)
    wait_for(lambda: cache(d)["ssd"]["entries"] >= (n + 24) // BLOCK, 15, what="the SSD writes")
    reload(d)
    c = wait_for(lambda: cache(d), 10, what="cache stats of the new worker")
    assert c["hot"]["entries"] == 0 and c["ssd"]["entries"] >= n // BLOCK
    text, _, cached = complete(d, prompt)
    assert cached == expected_hit(n, repeat=True)  # the partial last block is on disk too
    assert text == cold_text
    c = wait_for(lambda: (c := cache(d))["ssd"]["hits"] and c, 10, what="cache stats")
    assert c["ssd"]["hit_tokens"] == expected_hit(n, repeat=True) and c["hot"]["hit_tokens"] == 0
    again, _, cached = complete(d, prompt)  # promoted: now from memory
    assert again == cold_text and cached == expected_hit(n, repeat=True)
    assert wait_for(lambda: cache(d)["hot"]["hits"] == 1, 10, what="a hot hit")


def test_clear_endpoints_reclaim_what_they_say(daemon_factory: Factory, model_dir: Path, tmp_path: Path) -> None:
    d = daemon_factory("--config", str(write_config(tmp_path / "c.toml", model_dir)), "--model-dir", str(model_dir))
    prompt = long_prompt(6)
    _, n, _ = complete(d, prompt)
    blocks = stored_blocks(n + 23)  # its last token is never fed back
    c = wait_for(lambda: (c := cache(d))["ssd"]["entries"] == blocks and c["hot"]["entries"] == blocks and c,
                 15, what="both tiers to hold the blocks")
    hot = post(d, "/api/hot-cache/clear", {"model": "tiny"})
    assert hot["reclaimed_bytes"] == c["hot"]["bytes"] > 0 and hot["entries"] == blocks
    assert complete(d, prompt)[2] == expected_hit(n, repeat=True)  # the SSD tier still has it
    assert wait_for(lambda: cache(d)["ssd"]["hits"] == 1, 10, what="an SSD hit")

    on_disk = sum(p.stat().st_size for p in ssd_files(d))
    ssd = post(d, "/api/ssd-cache/clear")  # no body: every model
    assert ssd["reclaimed_bytes"] == on_disk > 0
    assert {m["model"]: m["loaded"] for m in ssd["models"]} == {"tiny": True, "tiny2": False}
    assert not ssd_files(d)
    post(d, "/api/hot-cache/clear", {})
    assert complete(d, prompt)[2] == 0  # both tiers empty: computed again

    # a model that is not loaded: the supervisor empties the directory no worker owns now
    wait_for(lambda: cache(d)["ssd"]["entries"] == blocks, 15, what="the SSD writes")
    files = ssd_files(d)
    on_disk = sum(p.stat().st_size for p in files)
    pid = d.model("tiny")["pid"]
    post(d, "/api/models/tiny/evict", {"mode": "drain"})
    assert_gone([pid])
    out = post(d, "/api/ssd-cache/clear", {"model": "tiny"})
    assert out["models"] == [{"model": "tiny", "loaded": False, "entries": blocks, "reclaimed_bytes": on_disk}]
    assert not any(p.exists() for p in files)

    assert post(d, "/api/ssd-cache/clear", {"model": 3}, 400)["error"]["param"] == "model"
    post(d, "/api/hot-cache/clear", {"modle": "tiny"}, 400)
    assert post(d, "/api/hot-cache/clear", {"model": "nope"}, 404)["error"]["code"] == "model_not_found"


def _twins(model_dir: Path, root: Path) -> tuple[Path, Path]:
    """Two copies of `tiny` that differ in one bit of one tensor in the middle of the weights file, where none of
    the old fingerprint's 16 samples of 64 KiB reads: its header is padded (safetensors allows spaces after the
    JSON) to 4 MiB, so the samples are 320 KiB apart and most of the data lies between them."""
    import json
    import shutil
    import struct

    twins = []
    for name in ("alpha", "beta"):
        shutil.copytree(model_dir / "tiny", root / name)
        weights = root / name / "model.safetensors"
        raw = weights.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = raw[8:8 + n] + b" " * (4 * 2**20)
        padded = bytearray(struct.pack("<Q", len(header)) + header + raw[8 + n:])
        twins.append((weights, padded, 8 + len(header), json.loads(raw[8:8 + n])))
    (alpha, data, start, tensors), (beta, other, _, _) = twins
    size = len(data)
    samples = [(size * i // 16, size * i // 16 + 64 * 1024) for i in range(16)]
    tensor = tensors["model.layers.1.mlp.up_proj.weight"]["data_offsets"]  # 48 KiB of F32, mid-file
    at = next(start + o for o in range(tensor[0], tensor[1], 4) if not any(a <= start + o < b for a, b in samples))
    other[at] ^= 1  # the lowest mantissa bit of one weight
    alpha.write_bytes(bytes(data))
    beta.write_bytes(bytes(other))
    return alpha.parent, beta.parent


def test_models_that_differ_between_the_old_samples_never_share_k_v_and_clear_counts_each(
        daemon_factory: Factory, model_dir: Path, tmp_path: Path) -> None:
    """Catches: two models whose weights differ in one tensor between two of the old fingerprint's samples got one
    SSD directory: the second read the first's K/V (an SSD hit on its first request), and /api/ssd-cache/clear
    counted the shared directory to one model only."""
    alpha, beta = _twins(model_dir, tmp_path / "models")
    config = tmp_path / "c.toml"
    config.write_text(f'[models.alpha]\npath = "{alpha}"\n\n[models.beta]\npath = "{beta}"\n')
    d = daemon_factory("--config", str(config))
    prompt = long_prompt(7)
    dirs, files = {}, {}
    for model in ("alpha", "beta"):
        _, n, cached = complete(d, prompt, model=model)
        assert cached == 0, f"{model} was served K/V it did not compute"  # beta: not alpha's blocks
        blocks = stored_blocks(n + 23)
        wait_for(lambda m=model, b=blocks: cache(d, m)["ssd"]["entries"] == b, 15, what=f"{model}'s SSD writes")
        dirs[model] = Path(cache(d, model)["ssd"]["dir"])
        files[model] = ssd_files(d, model)
        pid = d.model(model)["pid"]
        post(d, f"/api/models/{model}/evict", {"mode": "drain"})
        assert_gone([pid])
    assert dirs["alpha"] != dirs["beta"] and dirs["alpha"].parent == dirs["beta"].parent
    assert {p.name for p in files["alpha"]} == {p.name for p in files["beta"]}  # the same prompt's blocks, twice
    on_disk = {m: (len(files[m]), sum(p.stat().st_size for p in files[m])) for m in files}
    out = post(d, "/api/ssd-cache/clear")  # no body: every model, neither loaded
    got = {m["model"]: (m["loaded"], m["entries"], m["reclaimed_bytes"]) for m in out["models"]}
    assert got == {m: (False, *on_disk[m]) for m in ("alpha", "beta")}  # each its own blocks, none twice
    assert out["entries"] == sum(n for n, _ in on_disk.values()) and on_disk["alpha"][0] > 0
    assert not any(p.exists() for m in files for p in files[m])


def test_ssd_cache_survives_a_worker_killed_mid_write(daemon_factory: Factory, model_dir: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared-cache"
    stall = write_config(tmp_path / "stall.toml", model_dir, f'ssd_dir = "{shared}"',
                         'worker_args = ["--fault", "ssd-stall"]')
    d1 = daemon_factory("--config", str(stall), name="d1")
    prompt = long_prompt(7, 120)
    text, n, _ = complete(d1, prompt)
    assert n >= 8 * BLOCK
    directory = Path(cache(d1)["ssd"]["dir"])
    wait_for(lambda: len(list(directory.glob("*.kvb"))) == 4 and list(directory.glob("*.tmp")), 15,
             what="four blocks written and the fifth half-way")
    os.kill(d1.model("tiny")["pid"], signal.SIGKILL)
    d1.stop()
    complete_blocks = sorted(directory.glob("*.kvb"))
    junk = [directory / f"{'ab' * 16}.kvb", directory / f"{'cd' * 16}.kvb", *directory.glob("*.tmp")]
    junk[0].write_bytes(complete_blocks[0].read_bytes()[:-100])  # a partial block
    junk[1].write_bytes(b"MLXSUPKV" + (99).to_bytes(4, "little") + complete_blocks[0].read_bytes()[12:])  # v99

    d2 = daemon_factory("--config", str(write_config(tmp_path / "ok.toml", model_dir, f'ssd_dir = "{shared}"')),
                        name="d2")
    post(d2, "/api/models/tiny/load")
    assert sorted(directory.glob("*.kvb")) == complete_blocks
    assert not any(p.exists() for p in junk)
    again, _, cached = complete(d2, prompt)
    assert cached == 4 * BLOCK
    assert again == text


def test_full_disk_turns_the_ssd_cache_off_and_serving_goes_on(daemon_factory: Factory, model_dir: Path,
                                                               tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.toml", model_dir, model='worker_args = ["--fault", "ssd-enospc"]')
    d = daemon_factory("--config", str(cfg))
    prompt = long_prompt(8)
    text, n, _ = complete(d, prompt)
    c = wait_for(lambda: (c := cache(d))["ssd"]["error"] and c, 10, what="the SSD cache to turn off")
    assert c["ssd"]["enabled"] is False and "No space left" in c["ssd"]["error"]
    again, _, cached = complete(d, prompt)
    assert cached == expected_hit(n, repeat=True) and again == text  # the hot cache still serves


def test_unwritable_cache_dir_turns_the_ssd_cache_off(daemon_factory: Factory, model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    d = daemon_factory("--config", str(write_config(tmp_path / "c.toml", model_dir,
                                                      f'ssd_dir = "{tmp_path / "a-file" / "cache"}"')))
    text, n, _ = complete(d, long_prompt(9))
    c = wait_for(lambda: cache(d), 10, what="cache stats")
    assert c["ssd"]["enabled"] is False and "not writable" in c["ssd"]["error"]
    assert complete(d, long_prompt(9)) == (text, n, expected_hit(n, repeat=True))


def test_evict_flushes_queued_ssd_writes(daemon_factory: Factory, model_dir: Path, tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.toml", model_dir, model='worker_args = ["--fault", "ssd-slow"]')
    d = daemon_factory("--config", str(cfg))
    _, n, _ = complete(d, long_prompt(10, 40))  # 0.25 s a block: most are still queued when the evict comes
    directory = Path(wait_for(lambda: cache(d), 10)["ssd"]["dir"])
    report = post(d, "/api/models/tiny/evict", {"mode": "now"})
    assert report["exit"] == 0 and report["phases_s"]["close_caches"] > 0.25
    assert len(list(directory.glob("*.kvb"))) == (n + 24) // BLOCK


def test_budget_and_footprint_hold_over_200_distinct_long_prompts(daemon_factory: Factory, model_dir: Path,
                                                                  tmp_path: Path) -> None:
    """200 prompts of ~650 tokens would pin ~80 MiB of KV in the tiny model's worker without the budget.

    One request at a time: with concurrent ones the footprint (RSS, as the supervisor measures
    it) jumps by tens of MiB whenever a new batch shape leaves larger transient buffers behind in
    the allocator, which would drown the signal. The test compares peaks, the highest reading
    over requests 41-100 and over 141-200: KV kept beyond the budget would show as a second peak
    higher by ~40 MiB.
    """
    budget, cap, batch = 4 * 2**20, 3 * 2**20, 1
    cfg = write_config(tmp_path / "c.toml", model_dir, 'hot_budget = "4MiB"\nssd_cap = "3MiB"')
    d = daemon_factory("--config", str(cfg))
    aclient = openai.AsyncOpenAI(base_url=d.v1, api_key="unused", max_retries=0, timeout=120)

    async def one(seed: int) -> int:
        out = await aclient.completions.create(model="tiny", prompt=long_prompt(1000 + seed, 80), max_tokens=8,
                                               temperature=0, extra_body={"ignore_eos": True})
        return out.usage.prompt_tokens

    footprints: dict[int, int] = {}
    tokens: list[int] = []

    async def main() -> None:
        for done in range(batch, 201, batch):
            tokens.extend(await asyncio.gather(*(one(s) for s in range(done - batch, done))))
            footprints[done] = d.model("tiny")["memory_bytes"]  # between requests: blocking stalls nothing
            if done % 40 == 0:
                c = wait_for(lambda: cache(d), 5)
                assert c["hot"]["bytes"] <= budget and c["ssd"]["bytes"] <= cap, c

    asyncio.run(main())
    assert min(tokens) >= 10 * BLOCK
    kv_per_request = 2 * 2 * 2 * 16 * 4 * min(tokens)  # layers * (K, V) * kv heads * head dim * float32
    early = max(f for n, f in footprints.items() if 40 < n <= 100)
    late = max(f for n, f in footprints.items() if 140 < n <= 200)
    print(f"footprint peaks (MiB): requests 41-100 {early / 2**20:.1f}, 141-200 {late / 2**20:.1f}")
    assert late - early < 20 * kv_per_request, f"the footprint grew by {(late - early) / 2**20:.1f} MiB"
