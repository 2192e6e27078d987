"""Write a random-weight Llama-architecture model that `mlx_lm.load(DIR)` loads offline.

There is no model hub here: tests, the demo and the benchmarks run on these. The tokenizer is
a byte-level BPE trained locally with `tokenizers` on a deterministic synthetic corpus, so any
UTF-8 input encodes and the same preset always yields the same tokenizer. Random weights speak
gibberish but cost what trained ones of the same shape cost.

    python -m worker.mlx_engine.make_model DIR [--preset tiny|small|1b] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

PRESETS: dict[str, dict] = {
    # A few MB: loads in well under a second, for tests and the demo.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=192, vocab=1024, max_position_embeddings=8192, dtype="float32"),
    # ~100M parameters: compute dominates on a CPU.
    "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=2048, vocab=4096, max_position_embeddings=8192, dtype="float32"),
    # ~1B parameters in bf16: the GPU benchmark preset.
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab=8192, max_position_embeddings=8192, dtype="bfloat16"),
}

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
EOS = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def synthetic_corpus(seed: int, n_lines: int = 6000) -> list[str]:
    """Deterministic pseudo-text: syllable words, numbers, punctuation, some non-ASCII."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
              "st", "tr", "ch", "sh", "th", "pl", "gr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng"]
    words = ["".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                     for _ in range(rng.randint(1, 3))) for _ in range(3000)]
    words += ["é", "ü", "ß", "日本", "語", "😀", "def", "return", "{", "}", "(", ")", "=", "+", "\n"]
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 16)
        line = " ".join(rng.choice(words) for _ in range(n))
        if rng.random() < 0.3:
            line += f" {rng.randint(0, 99999)}"
        lines.append(line.capitalize() + rng.choice([".", "!", "?", ",", ":"]))
    return lines


def train_tokenizer(vocab: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
    return tok


def write_tokenizer(out: Path, tok) -> None:
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": EOS,
        "pad_token": "<|pad|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {"bos_token": "<|bos|>", "eos_token": EOS, "pad_token": "<|pad|>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def model_config(preset: dict, tok) -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": preset["hidden_size"],
        "num_hidden_layers": preset["num_hidden_layers"],
        "num_attention_heads": preset["num_attention_heads"],
        "num_key_value_heads": preset["num_key_value_heads"],
        "intermediate_size": preset["intermediate_size"],
        "vocab_size": tok.get_vocab_size(),
        "max_position_embeddings": preset["max_position_embeddings"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": tok.token_to_id("<|bos|>"),
        "eos_token_id": tok.token_to_id(EOS),
        "torch_dtype": preset["dtype"],
    }


def write_weights(out: Path, config: dict, dtype_name: str, seed: int) -> int:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    dtype = getattr(mx, dtype_name)
    weights = {k: v.astype(dtype) for k, v in tree_flatten(model.parameters())}
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return sum(v.size for v in weights.values())


def make_model(out: Path, preset_name: str = "tiny", seed: int = 0) -> dict:
    preset = PRESETS[preset_name]
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(preset["vocab"], seed)
    write_tokenizer(out, tok)
    config = model_config(preset, tok)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    n_params = write_weights(out, config, preset["dtype"], seed)
    return {"path": str(out), "preset": preset_name, "parameters": n_params, "vocab_size": config["vocab_size"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mlxsup make-model", description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if (args.dir / "config.json").exists():
        print(f"error: {args.dir} already holds a model (config.json exists)", file=sys.stderr)
        return 2
    info = make_model(args.dir, args.preset, args.seed)
    print(f"wrote {info['preset']} model to {info['path']}: "
          f"{info['parameters'] / 1e6:.1f}M parameters, vocab {info['vocab_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
