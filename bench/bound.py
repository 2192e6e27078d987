"""How close each side's decode is to the memory-bandwidth limit.

A decode step reads every weight once, whatever the batch, so no step can be shorter than
weight bytes / memory bandwidth. Per side and concurrency, the bench sets its per-token decode
time (the ITL p50 of a stream: one step of the batch) against that bound and prints the
fraction of it reached (bound / ITL: 1.0 is the limit). The bandwidth is the GPU's datasheet
figure, found by its name in BANDWIDTH_GB_S, or `--bandwidth-gbs` (e.g. for a CPU or a GPU not
in the table); without either there is no bound.
"""

from __future__ import annotations

from pathlib import Path

# Datasheet peak memory bandwidth, GB/s, by a substring of the name nvidia-smi (or the Apple chip) reports;
# the first match wins, so the more specific names come first.
BANDWIDTH_GB_S: list[tuple[str, float]] = [
    ("GH200", 4000.0),
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM (nvidia-smi: "NVIDIA H100 80GB HBM3")
    ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100-PCIE-80GB", 1935.0),
    ("A100", 1555.0),  # 40 GB
    ("L40S", 864.0),
    ("L40", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("RTX 4090", 1008.0),
    ("M3 Ultra", 819.0),
    ("M2 Ultra", 800.0),
    ("M4 Max", 546.0),
    ("M3 Max", 400.0),
]


def bandwidth_gb_s(gpus: list[str], override: float | None = None) -> tuple[float | None, str]:
    """(GB/s, where it came from): the option, else the first GPU's name in the table, else (None, why)."""
    if override:
        return override, "--bandwidth-gbs"
    for gpu in gpus:
        name = gpu.split(",")[0]
        for key, gbs in BANDWIDTH_GB_S:
            if key in name:
                return gbs, f"table: {key} (from {name.strip()!r})"
    return None, "no GPU in the table; pass --bandwidth-gbs"


def weight_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def decode_bound(summary: dict, weights: int, gbs: float | None, source: str) -> dict:
    """Per concurrency and side of a throughput summary: ITL p50 against the bandwidth bound."""
    out: dict = {"weight_bytes": weights, "bandwidth_gb_s": gbs, "bandwidth_source": source}
    if not gbs or not weights:
        return out
    bound_s = weights / (gbs * 1e9)
    out["bound_ms_per_step"] = round(bound_s * 1e3, 4)
    out["bound_tok_s_per_stream"] = round(1 / bound_s, 1)
    for c, cs in summary.items():
        for side, s in cs.items():
            if not isinstance(s, dict) or not s.get("itl_p50_s"):
                continue
            itl = s["itl_p50_s"]
            out.setdefault(c, {})[side] = {"itl_p50_ms": round(itl * 1e3, 3), "fraction_of_bound": round(bound_s / itl, 3)}
    return out


def bound_lines(bound: dict) -> list[str]:
    """Markdown for results.md: the bound and each side's fraction of it."""
    if not bound.get("bound_ms_per_step"):
        return [f"Bandwidth bound: none ({bound.get('bandwidth_source')})."]
    lines = [f"Bandwidth bound: {bound['weight_bytes'] / 1e9:.3f} GB of weights / {bound['bandwidth_gb_s']:.0f} GB/s "
             f"({bound['bandwidth_source']}) = {bound['bound_ms_per_step']:.3f} ms per decode step "
             f"({bound['bound_tok_s_per_stream']:.0f} tok/s for one stream). Fraction = bound / ITL p50 (1.0 is the limit).",
             "", "| clients | side | ITL p50 ms | fraction of bound |", "| --- | --- | --- | --- |"]
    for c, sides in bound.items():
        if not isinstance(sides, dict):
            continue
        for side, row in sides.items():
            lines.append(f"| {c} | {side} | {row['itl_p50_ms']:.3f} | {row['fraction_of_bound']:.3f} |")
    return lines
