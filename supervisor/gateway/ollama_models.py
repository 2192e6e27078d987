"""What Ollama's API says about a model: its Ollama name, details, model_info, capabilities and the
entries of /api/tags, /api/show and /api/ps, read from the model's folder. Pure file reads, no MLX.

Names: a model is listed as `ID:latest` (Ollama's clients split a name at its tag); a request may name it by its
id, an alias, its short name (registry.py's rules), any of those with `:latest`, or as Ollama names a Hugging
Face model, `hf.co/ORG/NAME[:TAG]` (also `huggingface.co/...`). Any other tag is not guessed at: `name:7b` is a
404, unless a model has that very id.

Capabilities are the model's own: every generating model takes tools (a template that writes none gets the
worker's own call format, worker/tool_fallback.py) and `completion`; `vision` a vision model; `thinking` a model
whose chat template thinks (think markers, `enable_thinking`, harmony's channels); `embedding` an embedder.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from protocol.modelconfig import ConfigError, read_config, text_config
from protocol.modelkind import CHAT, EMBEDDING, RERANK, VISION
from supervisor import errors
from supervisor.registry import ModelSpec, Registry

LATEST = "latest"
HF_PREFIXES = ("hf.co/", "huggingface.co/")
THINK_SIGNS = ("<think>", "enable_thinking", "<|channel|>", "reasoning_content")
NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:-]{0,199}")  # a name /api/copy may give (by fullmatch)
NEVER = timedelta(days=365 * 292)  # a model kept loaded (keep_alive < 0): Ollama's expires_at is as far off


def rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).isoformat().replace("+00:00", "Z")


def now() -> str:
    return rfc3339(datetime.now(UTC))


def ollama_name(model_id: str) -> str:
    return f"{model_id}:{LATEST}"


def candidates(name: str) -> list[str]:
    """The local names an Ollama-style name may be, in the order they are tried."""
    out = [name]
    bare = name
    for prefix in HF_PREFIXES:
        if bare.lower().startswith(prefix):
            bare = bare[len(prefix):]
    base, colon, tag = bare.rpartition(":")
    if colon and "/" not in tag and (tag == LATEST or bare != name):  # hf.co/ORG/NAME:REV serves what is pulled
        bare = base
    if bare != name:
        out.append(bare)
    return out


def resolve(registry: Registry, name: str) -> ModelSpec:
    """The model an Ollama name means; Ollama's own 404 (its clients raise ResponseError) when none."""
    if not isinstance(name, str) or not name:
        raise errors.InvalidRequest("model is required")
    last: errors.MlxsupError | None = None
    for candidate in candidates(name):
        try:
            return registry.resolve(candidate)
        except errors.ModelNotFound as exc:
            last = exc
    if last is not None and "ambiguous" in last.message:
        raise last
    raise errors.ModelNotFound(f"model '{name[:200]}' not found")


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def config_of(spec: ModelSpec) -> dict:
    try:
        return read_config(spec.path)
    except ConfigError:
        return {}


def chat_template(spec: ModelSpec) -> str:
    template = _json(spec.path / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if not isinstance(template, str):
        try:
            template = (spec.path / "chat_template.jinja").read_text()
        except OSError:
            template = ""
    return template


def capabilities(spec: ModelSpec) -> list[str]:
    if spec.kind == EMBEDDING:
        return ["embedding"]
    if spec.kind == RERANK:
        return []
    caps = ["completion", "tools"]
    if spec.kind == VISION:
        caps.append("vision")
    if any(sign in chat_template(spec) for sign in THINK_SIGNS):
        caps.append("thinking")
    return caps


def _bits(config: dict) -> int:
    quant = config.get("quantization") or config.get("quantization_config")
    if isinstance(quant, dict) and isinstance(quant.get("bits"), int) and quant["bits"] > 0:
        return quant["bits"]
    return 32 if text_config(config).get("torch_dtype", config.get("torch_dtype")) == "float32" else 16


def quantization_level(config: dict) -> str:
    quant = config.get("quantization") or config.get("quantization_config")
    if isinstance(quant, dict) and isinstance(quant.get("bits"), int):
        return f"Q{quant['bits']}"
    dtype = text_config(config).get("torch_dtype", config.get("torch_dtype")) or "bfloat16"
    return {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(str(dtype), str(dtype).upper())


def parameter_count(spec: ModelSpec, config: dict) -> int:
    """From the weights' bytes and their bits per weight (the scales of a quantized model counted in: close)."""
    return spec.weights_bytes * 8 // _bits(config)


def parameter_size(count: int) -> str:
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def architecture(config: dict) -> str:
    return str(text_config(config).get("model_type") or config.get("model_type") or "unknown")


def details(spec: ModelSpec, config: dict | None = None) -> dict:
    config = config_of(spec) if config is None else config
    arch = architecture(config)
    return {"parent_model": "", "format": "safetensors", "family": arch, "families": [arch],
            "parameter_size": parameter_size(parameter_count(spec, config)),
            "quantization_level": quantization_level(config)}


def modified_at(spec: ModelSpec) -> str:
    try:
        return rfc3339(datetime.fromtimestamp((spec.path / "config.json").stat().st_mtime, UTC))
    except OSError:
        return now()


def digest(spec: ModelSpec) -> str:
    """A stable name for the model's files as they are (Ollama's is its manifest's sha256)."""
    try:
        stamp = str((spec.path / "config.json").stat().st_mtime_ns)
    except OSError:
        stamp = ""
    return hashlib.sha256(f"{spec.id}\0{spec.path}\0{stamp}".encode()).hexdigest()


def tag(spec: ModelSpec) -> dict:
    """An /api/tags entry."""
    name = ollama_name(spec.id)
    return {"name": name, "model": name, "modified_at": modified_at(spec), "size": spec.weights_bytes,
            "digest": digest(spec), "details": details(spec)}


def model_info(spec: ModelSpec, config: dict, context: int | None) -> dict[str, Any]:
    arch = architecture(config)
    text = text_config(config)
    info: dict[str, Any] = {"general.architecture": arch, "general.basename": spec.id.rpartition("/")[2],
                            "general.parameter_count": parameter_count(spec, config)}
    keys = {"embedding_length": "hidden_size", "block_count": "num_hidden_layers",
            "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads",
            "attention.head_count_kv": "num_key_value_heads", "vocab_size": "vocab_size",
            "rope.freq_base": "rope_theta"}
    for key, field in keys.items():
        if isinstance(text.get(field), (int, float)) and not isinstance(text.get(field), bool):
            info[f"{arch}.{key}"] = text[field]
    if context is not None:
        info[f"{arch}.context_length"] = context
    return info


def parameters(sampling: dict | None) -> str:
    """Ollama's `parameters` text (a Modelfile's PARAMETER lines) from the sampling a request that sets none gets."""
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repeat_penalty"}
    lines = [f"{names[k]:<16}{v['value']}" for k, v in (sampling or {}).items() if k in names]
    return "\n".join(lines)


def show(spec: ModelSpec, context: int | None, sampling: dict | None) -> dict:
    config = config_of(spec)
    template = chat_template(spec) if spec.kind in (CHAT, VISION) else ""
    params = parameters(sampling)
    modelfile = f"# mlxsup serves {spec.id}\nFROM {spec.path}\n" + \
        "".join(f"PARAMETER {line}\n" for line in params.splitlines())
    return {"modelfile": modelfile, "parameters": params, "template": template, "details": details(spec, config),
            "model_info": model_info(spec, config, context), "capabilities": capabilities(spec),
            "modified_at": modified_at(spec), "license": ""}


def expires_at(ttl_remaining_s: float | None, ttl_s: float | None, pinned: bool) -> str:
    """When an idle model is unloaded: now plus what is left of its TTL (all of it while it works), or never."""
    left = ttl_remaining_s if ttl_remaining_s is not None else ttl_s
    if pinned or left is None:
        return rfc3339(datetime.now(UTC) + NEVER)
    return rfc3339(datetime.now(UTC) + timedelta(seconds=left))


def running(spec: ModelSpec, status: dict) -> dict:
    """An /api/ps entry from the model's status (router.status)."""
    name = ollama_name(spec.id)
    size = status.get("memory_bytes") or spec.weights_bytes
    return {"name": name, "model": name, "size": size, "digest": digest(spec), "details": details(spec),
            "expires_at": expires_at(status.get("ttl_remaining_s"), status.get("ttl_s"), bool(status.get("pinned"))),
            "size_vram": size, "context_length": status.get("context_length")}
