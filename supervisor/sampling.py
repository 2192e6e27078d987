"""Which sampling a request gets: each field it sets, else its model's default, else the server's.

For each of temperature, top_p, top_k, min_p and repetition_penalty (protocol/sampling.py FIELDS), the first of:

- `request`: the request set it (the gateway knows which fields its body named; 0 is a value, so a request at
  temperature 0 stays greedy);
- `config`: the model's `[models.ID]` table (`temperature = 0.7`, checked at start: a bad value is a config error);
- `model`: the model folder's generation_config.json (read once, on first use; `do_sample: false` is greedy);
- `server`: SERVER, the APIs' own defaults (OpenAI's temperature and top_p of 1, no top_k or min_p, no penalty),
  what every request got before models had defaults.

`applied(spec, given)` is that resolution with where each value comes from, as `GET /v1/models/{id}` and
`mlxsup status --json` show it (`sampling`: {field: {"value", "source"}}). The wire is unchanged: the gateway
writes the values into the Submit (gateway/sampling.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from protocol.sampling import FIELDS, Sampling

if TYPE_CHECKING:
    from supervisor.registry import ModelSpec

SERVER = Sampling(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
SOURCES = ("request", "config", "model", "server")


def applied(spec: ModelSpec, given: Mapping[str, float | int] | None = None) -> dict[str, dict[str, float | int | str]]:
    """Each field's value and its source (SOURCES) for a request on `spec` that set `given`."""
    layers = (given or {}, spec.sampling.items(), spec.model_sampling.items(), SERVER.items())
    out: dict[str, dict[str, float | int | str]] = {}
    for key in FIELDS:
        source, values = next((s, v) for s, v in zip(SOURCES, layers, strict=True) if key in v)
        out[key] = {"value": values[key], "source": source}
    return out
