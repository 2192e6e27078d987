"""The engine's one output stage: every row's tokens made into text, whichever lane made them (the solo, the batch,
its drafting step), after the step that made them.

`rows` takes one step's responses: each token goes to its request's output (worker/request_output.py: text, stop
strings, the reply's parser, logprobs) and a chunk [rid, text, n, ids, ...] comes out where the text grew; a request
ends (the engine's `end`) at its EOS, its max_tokens, or a stop string in its text. With a text thread
(text_thread.py), a batch row's text is made a step later, on that thread while the next step's kernels launch:
`launch` hands it the last step's rows, `rows` collects their chunks (before this step's tokens, so each row's
text stays in order) and keeps this step's rows for the next launch. A reply's first token, an ending row and a row
with logprobs are never lagged: their client waits for them, or their text reads MLX arrays.

Invariants: a request's tokens reach its output once each, in order; an EOS that ends a request is not counted or
shown; a row its stop string ended is ended once, and what its lagged tokens said after the stop is dropped; a
request ended or aborted between a launch and its collect is skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from protocol.messages import Failed, Finished
from worker.mlx_engine.request_state import Request
from worker.text_thread import TextThread

# (the request, its response that ended it or None, its finish reason, the list its Finished goes to)
End = Callable[[Request, Any, str, list[Finished | Failed]], None]


class OutputStage:
    def __init__(self, text: TextThread | None) -> None:
        self.text = text
        self.lagged: list[tuple[Request, list[int]]] = []  # rows' tokens for the text thread, at the next launch
        self.making: list[tuple[Request, list[int]]] = []  # ... and those it is making text of now
        self.counted = 0  # completion tokens the last `rows` counted (the engine adds them to generated_tokens)

    def launch(self) -> None:
        """Before a step: the last step's rows' text is made while this step's kernels launch."""
        if self.lagged:
            assert self.text is not None
            self.text.start([(req.out, tokens) for req, tokens in self.lagged])
            self.making, self.lagged = self.lagged, []

    def rows(self, responses: list, live: dict[int, Request], eos: set[int], lag: bool, end: End,
             failures: Callable[[], list[Failed | Finished]]) -> tuple[list[list], list[Finished | Failed]]:
        """One step's chunks and the requests that ended: the text thread's rows first, then `failures` (the engine's
        grammar failures of this step), then this step's rows (`lag`: the batch's may wait for the text thread)."""
        chunks: list[list] = []
        finished: list[Finished | Failed] = []
        self.counted = 0
        ending = {r.uid: r for r in responses if r.finish_reason is not None} if lag or self.making else {}
        if self.making:  # before this step's tokens and any grammar failure: each row's text in order
            self._collect(ending, live, end, chunks, finished)
        finished += failures()
        lagged: dict[str, tuple[Request, list[int]]] = {}
        for r in responses:
            req = live.get(r.uid)
            if req is None:
                continue
            # its text on the text thread, out a step later; a reply's first token not (its client waits for it)
            if lag and r.uid not in ending and req.completion_tokens and req.out.threadable:
                row = lagged.get(req.rid)
                if row is None:
                    lagged[req.rid] = (req, [r.token])
                else:
                    row[1].append(r.token)
                continue
            reason = r.finish_reason
            if not (reason == "stop" and r.token in eos):
                req.completion_tokens += 1
                self.counted += 1
                req.unsent.append(r.token)
                req.out.push(r.token, r.logprobs)
                if req.out.stopped:
                    reason = "stop"
            if reason is None:
                if (chunk := req.out.take()) is not None:  # the ids of the tokens behind what it says go with it
                    chunks.append([req.rid, chunk[0], chunk[1], req.unsent, *chunk[2:]])
                    req.unsent = []
                continue
            end(req, r, reason, finished)
        self.lagged = list(lagged.values())
        return chunks, finished

    def _collect(self, ending: dict, live: dict[int, Request], end: End, chunks: list[list],
                 finished: list[Finished | Failed]) -> None:
        """The text thread's chunks for the rows of the last step; a row its stop string ended finishes now (the
        token this step made for it is dropped, uncounted, and the generator lets it go)."""
        assert self.text is not None
        rows, self.making = self.making, []
        for (req, tokens), (chunk, pushed, stopped) in zip(rows, self.text.collect(), strict=True):
            if live.get(req.uid) is not req:
                continue  # aborted meanwhile
            req.completion_tokens += pushed
            self.counted += pushed
            req.unsent += tokens[:pushed]
            if stopped:
                end(req, ending.get(req.uid), "stop", finished)
            elif chunk is not None:
                chunks.append([req.rid, chunk[0], chunk[1], req.unsent, *chunk[2:]])
                req.unsent = []

    def clear(self) -> None:
        self.lagged, self.making = [], []

    def close(self) -> None:
        if self.text is not None:
            self.text.close()
