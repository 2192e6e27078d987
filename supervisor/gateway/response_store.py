"""The daemon's store of Responses (`store: true`), for GET /v1/responses/{id} and `previous_response_id`.

Bounded by what it really holds: each response is kept as encoded JSON bytes (the response object,
and its own turn: this request's input and the model's answer), and `bytes` is the sum of their
lengths plus a fixed ENTRY_OVERHEAD per entry for the id, the link and the bookkeeping. Python objects
of a decoded body can be many times its JSON (a dict per `{}`), so nothing decoded is kept. At most
`max_count` responses and `max_bytes` of them, the least recently used going first; a response larger
than the whole budget is not kept.

A chain of turns (`previous_response_id`) is stored as links, not copies: each entry keeps its own
turn and the id of its predecessor, and `conversation(id)` rebuilds the history by walking back. So
N turns hold O(N) messages, not O(N^2). Walking touches every link (most recent: the one asked for),
so a conversation in use keeps its whole chain. A chain with a link no longer held (dropped or
deleted) has no conversation: the route answers 404, as for an id never stored.

Pure state, owned by the gateway (one event loop, no locks).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass

log = logging.getLogger(__name__)

ENTRY_OVERHEAD = 512  # an entry's objects beside its bytes: the key, the tuple, the OrderedDict's node


@dataclass(frozen=True)
class Stored:
    response: bytes  # the response object as JSON (what GET answers)
    turn: bytes  # JSON list: the chat messages this response added (its input, then its answer)
    previous: str | None  # the response it continues, or None

    @property
    def size(self) -> int:
        return len(self.response) + len(self.turn) + ENTRY_OVERHEAD


def _encode(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict, turn: list[dict], previous: str | None = None) -> bool:
        """Keep `response`, whose own new messages are `turn`, continuing `previous`."""
        rid = response["id"]
        stored = Stored(_encode(response), _encode(turn), previous)
        self.delete(rid)
        if stored.size > self.max_bytes or self.max_count < 1:
            log.warning("[responses] not stored id=%s bytes=%d limit=%d", rid, stored.size, self.max_bytes)
            return False
        self._items[rid] = stored
        self.bytes += stored.size
        while len(self._items) > self.max_count or self.bytes > self.max_bytes:
            old_id, old = self._items.popitem(last=False)
            self.bytes -= old.size
            log.info("[responses] dropped id=%s bytes=%d held=%d", old_id, old.size, len(self._items))
        return True

    def get(self, rid: str) -> bytes | None:
        """The stored response object's JSON, or None."""
        stored = self._items.get(rid)
        if stored is None:
            return None
        self._items.move_to_end(rid)
        return stored.response

    def conversation(self, rid: str) -> list[dict] | None:
        """The chat messages of the chain ending at `rid`, oldest first; None when a link is not held."""
        chain: list[str] = []
        seen: set[str] = set()
        link: str | None = rid
        while link is not None:
            stored = self._items.get(link)
            if stored is None or link in seen:  # dropped, deleted, or (by a re-stored id) a cycle
                return None
            seen.add(link)
            chain.append(link)
            link = stored.previous
        messages: list[dict] = []
        for link in reversed(chain):
            messages += json.loads(self._items[link].turn)
            self._items.move_to_end(link)
        return messages

    def delete(self, rid: str) -> bool:
        stored = self._items.pop(rid, None)
        if stored is None:
            return False
        self.bytes -= stored.size
        return True
