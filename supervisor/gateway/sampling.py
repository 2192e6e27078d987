"""A request's unset sampling fields, filled with its model's defaults once the model is known.

The Submit on the wire cannot tell an unset temperature from 1.0, so the parsers keep which sampling fields the
body set (`Parsed.sampling_given`); `fill` gives every other field the value supervisor/sampling.py resolves
(the model's `[models.ID]` config, its generation_config.json, the server's default) in every choice, and keeps
the whole resolution, with sources, in `Parsed.sampling`. A field the request set is never touched: a request at
temperature 0 stays greedy, whatever the model's defaults. Each generation route fills its request once the model
is known (beside images.attach), before its Calls start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from supervisor import errors
from supervisor.sampling import applied

if TYPE_CHECKING:
    from supervisor.gateway.openai_api import Parsed
    from supervisor.registry import Registry


def fill(parsed: Parsed, registry: Registry) -> None:
    """Every choice's unset sampling fields from `parsed.model`'s defaults (once: a filled request is left as it is;
    a model that does not resolve is left to the request's start to refuse)."""
    if parsed.sampling is not None:
        return
    try:
        spec = registry.resolve(parsed.model)
    except errors.MlxsupError:
        return
    given = {key: getattr(parsed.submit, key) for key in parsed.sampling_given}
    parsed.sampling = applied(spec, given)
    defaults = {key: entry["value"] for key, entry in parsed.sampling.items() if entry["source"] != "request"}
    for submit in {id(s): s for s in (parsed.submit, *parsed.choices)}.values():
        for key, value in defaults.items():
            setattr(submit, key, value)
