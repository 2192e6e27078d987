"""`python -m worker.mlx_engine.make_model DIR ...`: the command line of `mlxsup make-model`.

`--draft-for TARGET` makes a draft model for speculative decoding: the preset's shape with TARGET's
tokenizer files and vocabulary size, so the two share every token id (presets differ in vocabulary, so no preset
can draft for another). The family is TARGET's own unless `--arch` names it.

Refuses a folder that already holds a model (exit 2) rather than mixing two models' files, and a TARGET whose
family it cannot make (exit 2).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from worker.mlx_engine.make_model import FAMILIES, PRESET_NAMES, QUANTIZE_BITS, make_model
from worker.mlx_engine.make_model.family import Family, dtype_of

# what a tokenizer is made of on disk: copied whole, so the draft's tokenizer is the target's byte for byte
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxsup make-model",
                                     description="Write a random-weight model that mlx_lm.load(DIR) loads.")
    parser.add_argument("dir", type=Path)
    parser.add_argument("--arch", choices=list(FAMILIES), default=None,
                        help="(default llama, or --draft-for's family) "
                             + "; ".join(f"{f.arch}: {f.description}" for f in FAMILIES.values()))
    parser.add_argument("--preset", choices=PRESET_NAMES, default="tiny",
                        help="tiny: a few MB, for tests; small: ~100M parameters; 1b: ~1B parameters in bf16")
    parser.add_argument("--quantize", type=int, choices=QUANTIZE_BITS, default=None,
                        help="bits per weight, affine, group size 64, as mlx-lm converts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draft-for", type=Path, default=None, metavar="TARGET",
                        help="a draft model for the model in TARGET: this preset's shape, TARGET's tokenizer")
    parser.add_argument("--dflash-for", type=Path, default=None, metavar="TARGET",
                        help="a DFlash drafter for the model in TARGET (speculative dflash): random weights, its layout")
    parser.add_argument("--mtp", action="store_true",
                        help="qwen3_5: an MTP head too (mtp.* weights of Qwen3.5's layout), for speculative mtp")
    return parser


def _configs(family: Family, target: Path, preset: str) -> tuple[dict, dict]:
    """(TARGET's config.json, the draft's): the draft's built from the preset and TARGET's tokenizer and vocab."""
    from tokenizers import Tokenizer

    from worker.mlx_engine.make_model.tokenizer import token_ids

    wanted = json.loads((target / "config.json").read_text())
    ids = token_ids(Tokenizer.from_file(str(target / "tokenizer.json")), family.tokens)
    return wanted, family.configure(family.presets[preset], ids, int(wanted["vocab_size"]))


def family_of(target: Path, preset: str) -> Family:
    """The family whose config for TARGET's tokenizer names TARGET's model type."""
    wanted = json.loads((target / "config.json").read_text())
    for family in FAMILIES.values():
        if family.make is None:
            try:
                if _configs(family, target, preset)[1]["model_type"] == wanted.get("model_type"):
                    return family
            except (ValueError, KeyError):  # another family's tokens, or a config without vocab_size
                continue
    raise ValueError(f"no family makes a draft for {target} (model_type {wanted.get('model_type')!r})")


def make_draft(out: Path, target: Path, preset: str, seed: int, family: Family, quantize: int | None) -> dict:
    """Write a draft model for `target` into `out`; return what was written, as make_model does."""
    from worker.mlx_engine.make_model.weights import write_weights

    if family.make is not None:
        raise ValueError(f"--draft-for makes decoders of a chat family, not {family.arch}")
    wanted, config = _configs(family, target, preset)
    if config["model_type"] != wanted.get("model_type"):
        raise ValueError(f"{target} is a {wanted.get('model_type')} model, not {family.arch}'s {config['model_type']}")
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (target / name).is_file():
            shutil.copyfile(target / name, out / name)
    written = write_weights(out, config, dtype_of(family.presets[preset]), seed, quantize)
    return {"path": str(out), "arch": family.arch, "preset": preset, "quantize": quantize,
            "vocab_size": config["vocab_size"], **written}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (args.dir / "config.json").exists():
        print(f"error: {args.dir} already holds a model (config.json exists)", file=sys.stderr)
        return 2
    if args.dflash_for is not None:
        from worker.mlx_engine.make_model.weights import write_dflash_drafter

        try:
            info = write_dflash_drafter(args.dir, args.dflash_for, args.seed)
        except (OSError, ValueError, KeyError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote a DFlash drafter for {args.dflash_for} to {info['path']}: {info['parameters'] / 1e6:.1f}M "
              f"parameters, {info['weights_bytes'] / 2**20:.1f} MiB of weights")
        return 0
    if args.draft_for is not None:
        try:
            family = FAMILIES[args.arch] if args.arch else family_of(args.draft_for, args.preset)
            info = make_draft(args.dir, args.draft_for, args.preset, args.seed, family, args.quantize)
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    else:
        if args.mtp and (args.arch != "qwen3_5" or args.quantize):
            print("error: --mtp makes Qwen3.5's MTP head: --arch qwen3_5, unquantized", file=sys.stderr)
            return 2
        info = make_model(args.dir, args.preset, args.seed, arch=args.arch or "llama", quantize=args.quantize)
        if args.mtp:
            from worker.mlx_engine.make_model.weights import write_mtp_head

            info["weights_bytes"] += write_mtp_head(args.dir, args.seed)
    quantized = f", {info['quantize']}-bit ({info['bits_per_weight']:.2f} bits per weight)" if info["quantize"] else ""
    drafts = f", a draft for {args.draft_for}" if args.draft_for is not None else ""
    print(f"wrote {info['arch']} {info['preset']} model to {info['path']}: {info['parameters'] / 1e6:.1f}M parameters"
          f"{quantized}, {info['weights_bytes'] / 2**20:.1f} MiB of weights, vocab {info['vocab_size']}{drafts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
