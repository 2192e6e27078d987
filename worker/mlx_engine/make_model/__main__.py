"""`python -m worker.mlx_engine.make_model DIR ...`: the command line of `mlxsup make-model`.

Refuses a folder that already holds a model (exit 2) rather than mixing two models' files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from worker.mlx_engine.make_model import FAMILIES, PRESET_NAMES, QUANTIZE_BITS, make_model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxsup make-model",
                                     description="Write a random-weight model that mlx_lm.load(DIR) loads.")
    parser.add_argument("dir", type=Path)
    parser.add_argument("--arch", choices=list(FAMILIES), default="llama",
                        help="; ".join(f"{f.arch}: {f.description}" for f in FAMILIES.values()))
    parser.add_argument("--preset", choices=PRESET_NAMES, default="tiny",
                        help="tiny: a few MB, for tests; small: ~100M parameters; 1b: ~1B parameters in bf16")
    parser.add_argument("--quantize", type=int, choices=QUANTIZE_BITS, default=None,
                        help="bits per weight, affine, group size 64, as mlx-lm converts")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (args.dir / "config.json").exists():
        print(f"error: {args.dir} already holds a model (config.json exists)", file=sys.stderr)
        return 2
    info = make_model(args.dir, args.preset, args.seed, arch=args.arch, quantize=args.quantize)
    quantized = f", {info['quantize']}-bit ({info['bits_per_weight']:.2f} bits per weight)" if info["quantize"] else ""
    print(f"wrote {info['arch']} {info['preset']} model to {info['path']}: {info['parameters'] / 1e6:.1f}M parameters"
          f"{quantized}, {info['weights_bytes'] / 2**20:.1f} MiB of weights, vocab {info['vocab_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
