"""A model's speculative decoding options in the config: `speculative`, `draft`, `num_draft_tokens`.

    [models.coder]
    path = "..."
    speculative = "prompt-lookup"   # or "draft" / "dflash" (the default when `draft` is given), "mtp", "off", "auto"
    draft = "../coder-0.5b"         # a smaller model with the same tokenizer, or a DFlash drafter, in the same worker
    num_draft_tokens = 4

They become the worker's `--speculative`, `--draft` and `--num-draft-tokens` (worker/__main__.py), placed before
the model's own `worker_args`, which win. A model without them drafts as `[server] speculative` (`serve
--speculative`) says: "auto" by default, the worker's choice (prompt lookup where MLX runs on a GPU, off on a CPU). Invariant: a draft's weights are counted in the model's weights, so
admission sees them before the worker loads; a draft that is no model folder is a config error, not a failed load.
"""

from __future__ import annotations

from pathlib import Path

from protocol.modelkind import is_dflash

MODES = ("auto", "off", "prompt-lookup", "draft", "mtp", "dflash")  # worker/mlx_engine/speculative.py's
SERVER_MODES = MODES[:3]  # every model's: "draft" needs a model's own draft, "mtp" a checkpoint's MTP head
KEYS = frozenset({"speculative", "draft", "num_draft_tokens"})


def speculative_args(entry: dict, where: str, base: Path) -> tuple[tuple[str, ...], int]:
    """(the worker's arguments, the draft's weights in bytes) of a model entry; ValueError naming the key."""
    draft = entry.get("draft")
    path = None
    if draft is not None:
        if not isinstance(draft, str):
            raise ValueError(f"{where}.draft: expected a model folder's path, got {draft!r}")
        path = Path(draft).expanduser()
        path = (base / path).resolve() if not path.is_absolute() else path
    # a draft's kind by default: a DFlash drafter's folder (protocol.modelkind.is_dflash), else a draft model
    mode = entry.get("speculative", "auto" if path is None else "dflash" if is_dflash(path) else "draft")
    if mode not in MODES:
        raise ValueError(f"{where}.speculative: expected one of {', '.join(MODES)}, got {mode!r}")
    args: list[str] = ["--speculative", mode] if set(entry) & KEYS else []
    weights = 0
    if (mode in ("draft", "dflash")) != (path is not None):
        raise ValueError(f"{where}: speculative = \"{mode}\" goes with a `draft` path (a model, or a DFlash "
                         "drafter), and a `draft` with \"draft\" or \"dflash\"")
    if path is not None:
        shards = list(path.glob("*.safetensors"))
        if not (path / "config.json").is_file() or not shards:
            raise ValueError(f"{where}.draft: {path} holds no config.json and *.safetensors")
        args += ["--draft", str(path)]
        weights = sum(p.stat().st_size for p in shards)
    if "num_draft_tokens" in entry:
        n = entry["num_draft_tokens"]
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 64:
            raise ValueError(f"{where}.num_draft_tokens: expected an integer from 1 to 64, got {n!r}")
        args += ["--num-draft-tokens", str(n)]
    return tuple(args), weights
