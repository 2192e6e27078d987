"""Request fields an API does not know: ignored and logged, or refused in strict mode.

The vendors' APIs grow fields faster than any local server follows them, and coding agents send what
their own vendor's API takes (Codex's `client_metadata`): refusing an unknown field breaks those
clients, so by default it is dropped with one warning per field name per process. `[server]
strict_fields = true` keeps the 400 that names it, for clients that want to know an option was lost.

Invariant: the log cannot be flooded by a client inventing names: at most WARNED_NAMES names are
logged (each cut to NAME_SHOWN characters), then one line says the rest are not.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from supervisor.errors import InvalidRequest

log = logging.getLogger(__name__)

WARNED_NAMES = 100
NAME_SHOWN = 64
_warned: set[str] = set()  # names already logged by this process


def check(body: dict, known: Iterable[str], strict: bool, api: str) -> None:
    """Refuse (strict) or log once per name the fields of `body` that are not in `known`."""
    unknown = sorted(set(body).difference(known))
    if not unknown:
        return
    if strict:
        raise InvalidRequest(f"unrecognized request argument(s): {', '.join(unknown)}", param=unknown[0])
    for name in unknown:
        if name in _warned or len(_warned) > WARNED_NAMES:
            continue
        _warned.add(name)
        if len(_warned) > WARNED_NAMES:
            log.warning("[request] more than %d unknown field names ignored; no more are logged", WARNED_NAMES)
        else:
            log.warning("[request] api=%s unknown field ignored: field=%r (logged once per name; "
                        "strict_fields refuses it)", api, name[:NAME_SHOWN])
