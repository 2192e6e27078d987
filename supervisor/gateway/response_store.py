"""The daemon's store of Responses (`store: true`), for GET /v1/responses/{id} and `previous_response_id`.

Bounded: at most `max_count` responses and `max_bytes` of them (their JSON: the response object and
the conversation a follow-up continues), the least recently used going first. A response larger
than the whole budget is not kept. Pure state, owned by the gateway (one event loop, no locks); an id
no longer held is simply absent, and the route answers 404.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stored:
    response: dict
    conversation: list[dict]  # chat messages up to and including the response's own turn (no instructions)
    size: int


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict, conversation: list[dict]) -> bool:
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(conversation, ensure_ascii=False))
        rid = response["id"]
        self.delete(rid)
        if size > self.max_bytes or self.max_count < 1:
            log.warning("[responses] not stored id=%s bytes=%d limit=%d", rid, size, self.max_bytes)
            return False
        self._items[rid] = Stored(response, conversation, size)
        self.bytes += size
        while len(self._items) > self.max_count or self.bytes > self.max_bytes:
            old_id, old = self._items.popitem(last=False)
            self.bytes -= old.size
            log.info("[responses] dropped id=%s bytes=%d held=%d", old_id, old.size, len(self._items))
        return True

    def get(self, rid: str) -> Stored | None:
        stored = self._items.get(rid)
        if stored is not None:
            self._items.move_to_end(rid)
        return stored

    def delete(self, rid: str) -> bool:
        stored = self._items.pop(rid, None)
        if stored is None:
            return False
        self.bytes -= stored.size
        return True
