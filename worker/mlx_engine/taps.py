"""The target model's hidden states, for the drafters that read them (an MTP head: mtp.py; a DFlash drafter:
dflash.py).

A tap changes no parameter and no graph: the modules it reads keep their names and weights, their class swapped for
a subclass that also leaves its output in the model's `Tap` while the tap is `on` (a solo's own forward passes, a trace
of the decode graph; never the batch's). Two kinds: the final norm's output (`install_tap(model)`: the hidden state
an MTP head reads), or the outputs of some decoder layers, concatenated in their order (`install_tap(model, layers)`:
a DFlash drafter's context). The decode graph (decode_graph.py) returns what its trace tapped as one more output and
hands it back (`Tap.ready`), so the solo reads a compiled step's hidden states the same way (`take`).

Invariants: at most one tap per model; `take` gives the hidden states of the last forward pass run while `on` (or of
the graph's last step), once.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn


class Tap:
    """What the tapped modules left of the last forward pass (lazy arrays), kept while `on`."""

    __slots__ = ("parts", "on", "ready")

    def __init__(self, n: int) -> None:
        self.parts: list[mx.array | None] = [None] * n
        self.on = False
        self.ready: mx.array | None = None  # the decode graph's step's, handed back

    def take(self) -> mx.array | None:
        """The hidden states, shape (1, L, width), once (None: nothing tapped since)."""
        if self.ready is not None:
            out, self.ready = self.ready, None
            return out
        return self.collect()

    def clear(self) -> None:
        """Forget what is left (before a forward pass of the solo's own: a decode graph's step another request ran
        left its output in `ready`)."""
        self.parts, self.ready = [None] * len(self.parts), None

    def collect(self) -> mx.array | None:
        """What the tapped modules left, concatenated, once (a trace's own: never `ready`)."""
        if any(p is None for p in self.parts):
            return None
        parts = cast(list[mx.array], self.parts)
        self.parts = [None] * len(parts)
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


_TAPPED: dict[type, type] = {}


def _tapped(cls: type) -> type:
    """`cls` whose call also leaves its output in its tap, at its slot (one subclass per class)."""
    if cls not in _TAPPED:
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = cls.__call__(self, *args, **kwargs)
            tap = self._mlxsup_tap
            if tap.on:
                tap.parts[self._mlxsup_slot] = out
            return out
        _TAPPED[cls] = type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__})
    return _TAPPED[cls]


def text_model(model: nn.Module) -> nn.Module | None:
    """The decoder stack whose final norm's and layers' outputs a drafter reads (None: none we know)."""
    lm = getattr(model, "language_model", model)
    inner = getattr(lm, "model", None)
    return inner if isinstance(getattr(inner, "norm", None), nn.RMSNorm) and hasattr(inner, "layers") else None


def install_tap(model: nn.Module, layers: list[int] | None = None) -> Tap:
    """Tap the final norm (`layers` None) or those decoder layers' outputs."""
    inner = text_model(model)
    assert inner is not None and tap_of(model) is None
    modules = [inner.norm] if layers is None else [inner.layers[i] for i in layers]
    tap = Tap(len(modules))
    for slot, m in enumerate(modules):
        m.__class__ = _tapped(type(m))  # the same parameters under the same names
        object.__setattr__(m, "_mlxsup_tap", tap)  # plain attributes: not parameters
        object.__setattr__(m, "_mlxsup_slot", slot)
    object.__setattr__(inner, "_mlxsup_tap", tap)
    return tap


def tap_of(model: nn.Module) -> Tap | None:
    inner = text_model(model)
    return getattr(inner, "_mlxsup_tap", None) if inner is not None else None


class Seen:
    """A tapped drafter's record of the target's hidden states by position (MTPDrafter's and DFlashDrafter's base):
    its cache holds what it made of positions [base, base + fed) of the request's history, all verified; `rows` are
    the hidden states from position base + fed on, not used yet. A forward pass's states replace any from its start on
    (a verification's rejected drafts, a re-feed's); `keep` drops those past the tokens kept."""

    taps = True  # the solo hands it each forward pass's hidden states (`see`)

    def __init__(self) -> None:
        self.cache = self.fresh()
        self.base: int | None = None  # the first position seen (None: nothing yet)
        self.fed = 0
        self.rows: mx.array | None = None

    def fresh(self) -> list:
        """An empty cache of the drafter's own."""
        raise NotImplementedError

    @property
    def next(self) -> int:
        """The first position whose hidden state is not in the cache yet."""
        return (self.base or 0) + self.fed

    def seen(self, start: int, hidden: mx.array) -> None:
        """The target's hidden states at positions start, start + 1, ... (one forward pass)."""
        if self.base is None:
            self.base = start
        n = 0 if self.rows is None else self.rows.shape[1]
        if start < self.next or start > self.next + n:  # a position already in the cache, or one missed: afresh
            self.cache, self.base, self.fed, self.rows = self.fresh(), start, 0, None
        kept = start - self.next
        self.rows = hidden if self.rows is None or kept == 0 else mx.concatenate([self.rows[:, :kept], hidden], axis=1)

    def pending(self, tokens: Sequence[int]) -> int:
        """Rows up to position len(tokens) - 1 (the ones a proposal after `tokens` reads); 0: they do not reach
        there (a batch row: its hidden states stopped at the hand-over)."""
        n = len(tokens) - self.next
        return n if self.rows is not None and 1 <= n <= self.rows.shape[1] else 0

    def used(self, n: int) -> mx.array:
        """The first n rows, now in the cache."""
        rows = cast(mx.array, self.rows)
        self.rows = rows[:, n:] if n < rows.shape[1] else None
        self.fed += n
        return rows[:, :n]

    def keep(self, valid: int) -> None:
        """Only the first `valid` tokens of the history hold: the hidden states past them go."""
        if self.rows is not None:
            n = valid - self.next
            self.rows = self.rows[:, :n] if n > 0 else None

    def room(self) -> int:
        return sys.maxsize
