"""Reading one node's key of the exchange between ranks: frames in, in each sender's order; complete exchanges deleted.

Each child of a node (a rank, or the leader of a node one level down) appends one frame per exchange to
the node's key of that exchange, ``<ns>/<k>``, and bumps its counter ``<ns>/<k>/n``: two small requests.
The node's leader reads the counters of the exchanges not yet complete; when one has grown, it fetches
the key in one request and decodes the frames it has not read.  An exchange that holds a frame from
every child it expects, each counted, is deleted.

* A child appends to exchange k before k+1, but a read of k can come before that append and the read of
  k+1 after it: a frame that comes early waits for the ones before it.
* A child silent for ``STALE_EXCHANGES`` exchanges and ``STALE_S`` seconds is taken as gone: it no
  longer holds an exchange open.  Heard again, it counts again.
* A frame is ``<sender id, final flag, length>`` and its body; ``final``: the sender's last.
"""

from __future__ import annotations

import json
import struct
import time
from typing import Any

#: A child silent this many exchanges and ``STALE_S`` seconds is taken as gone (it died, or stopped).
STALE_EXCHANGES = 8
STALE_S = 30.0
#: A frame: the sender, whether it is its final one, and the body's length.
_FRAME = struct.Struct("<IBI")


def encode(sender: int, body: bytes, *, final: bool = False) -> bytes:
    """One frame: the sender, the final flag, then ``body`` (JSON)."""
    return _FRAME.pack(sender, int(final), len(body)) + body


def decode(buf: bytes, offset: int = 0, *, parse: bool = True) -> tuple[list[tuple[int, bool, Any]], int]:
    """The whole frames in ``buf`` from ``offset``: ``[(sender, final, payload)]`` and where they end.

    ``parse=False``: each payload as its bytes (the reader of a node parses what it needs of them)."""
    out = []
    while offset + _FRAME.size <= len(buf):
        sender, final, n = _FRAME.unpack_from(buf, offset)
        start = offset + _FRAME.size
        if start + n > len(buf):
            break  # a frame still being appended
        body = buf[start : start + n]
        out.append((sender, bool(final), json.loads(body) if parse else body))
        offset = start + n
    return out, offset


class KeyReader:
    """One node's key, read on its leader's exchange thread (see the module's text)."""

    def __init__(self, store: Any, namespace: str, children: list[int], *, start: int = 0) -> None:
        self.store = store
        self.ns = namespace
        self.children = children
        self.gone: set[int] = set()  # children taken as gone (a new set at each change: other threads read it)
        self.retired: set[int] = set()  # children read elsewhere from now on: their frames are dropped
        self.final_at: dict[int, int] = {}  # child -> the exchange of its final frame
        self._next = start  # the oldest exchange not fully read
        self._touched = start - 1  # the newest exchange read
        self._read: dict[int, int] = {}  # exchange -> bytes of it already read
        self._counted: dict[int, int] = {}  # exchange -> frames its counter says it holds
        self._frames: dict[int, int] = {}  # exchange -> frames read from it (one may be in before its count)
        self._heard: dict[int, tuple[int, float]] = {}  # child -> (newest exchange it was heard in, when)
        self._in: dict[int, set[int]] = {}  # exchange -> the children read in it
        self._want: dict[int, int] = dict.fromkeys(children, start)  # child -> exchange of its next frame
        self._held: dict[int, dict[int, tuple[bool, Any]]] = {}  # child -> frames that came early
        self._gone_from: dict[int, int] = {}  # gone child -> the first exchange closed without it
        self._retired_at: dict[int, int] = {}  # retired child -> the first exchange closed without it
        self._start = start
        self._started = time.monotonic()

    def read_up_to(self, last: int, *, beyond: bool = False) -> list[tuple[int, bool, Any]]:
        """Every exchange from the oldest not complete to ``last``: the frames passed on, in each child's order.

        ``beyond`` (at the end): also the exchanges after ``last`` that exist, those of children that
        ran more steps than the leader.
        """
        ns, store = self.ns, self.store
        out: list[tuple[int, bool, Any]] = []
        k = self._next - 1
        while True:
            k += 1
            if k > last and not (beyond and store.check([f"{ns}/{k}/n"])):
                break
            self._touched = max(self._touched, k)
            count = int(store.add(f"{ns}/{k}/n", 0))
            if count > self._counted.get(k, 0):
                buf = store.get(f"{ns}/{k}")
                frames, self._read[k] = decode(buf, self._read.get(k, 0), parse=False)
                self._counted[k] = count
                self._frames[k] = self._frames.get(k, 0) + len(frames)
                for frame in frames:
                    self._take(k, *frame, out)
            if k == self._next and self._in.get(k, set()) >= self._expected(k) and self._counted_all(k, last):
                self._close(k)
        self._mark_gone(last)
        return out

    def retire(self, child: int) -> None:
        """From now on ``child`` is read elsewhere (its node was adopted): it holds no exchange open."""
        self.retired = self.retired | {child}
        self._retired_at[child] = self._gone_from.pop(child, self._next)
        self.gone = self.gone - {child}
        self._held.pop(child, None)

    def _take(self, k: int, child: int, final: bool, payload: Any, out: list[tuple[int, bool, Any]]) -> None:
        if child not in self._want:
            return  # not a child of this node (a stray frame)
        if child in self.retired:  # read elsewhere now; a leader that was only held up sends until it sees so
            for old in range(self._retired_at.pop(child, self._next), self._next):  # its late appends made these again
                self._forget(old)
            return
        self._in.setdefault(k, set()).add(child)
        if child in self.gone:  # it was only slow: it counts again
            self.gone = self.gone - {child}
            for old in range(self._gone_from.pop(child, k), self._next):  # its late appends made these again
                self._forget(old)
        held = self._held.setdefault(child, {})
        held[k] = (final, payload)
        while self._want[child] in held:
            j = self._want[child]
            is_final, body = held.pop(j)
            self._want[child] = j + 1
            self._heard[child] = (j, time.monotonic())
            if is_final:
                self.final_at[child] = j
            out.append((child, is_final, body))

    def _close(self, k: int) -> None:
        """Exchange ``k`` holds every frame it will get: delete it; gone children's frames of it are given up."""
        for c in self.gone:
            if c not in self._in[k]:
                self._want[c] = max(self._want[c], k + 1)
                self._gone_from.setdefault(c, k)
                for j in [j for j in self._held.get(c, {}) if j <= k]:
                    del self._held[c][j]
        self._forget(k)
        self._frames.pop(k, None)
        self._read.pop(k, None)
        self._counted.pop(k, None)
        self._in.pop(k, None)
        self._next = k + 1

    def _forget(self, k: int) -> None:
        self.store.delete_key(f"{self.ns}/{k}")
        self.store.delete_key(f"{self.ns}/{k}/n")

    def forget_all(self, sent: int) -> None:
        """At the end: delete the keys of exchanges never completed (up to ``sent``, and those read)."""
        for k in range(self._next, max(sent, self._touched + 1)):
            self._forget(k)

    def _expected(self, k: int) -> set[int]:
        """The children whose frame exchange ``k`` will hold: not finished before it, not gone, not read elsewhere."""
        return {c for c in self.children if self.final_at.get(c, k) >= k and c not in self.gone and c not in self.retired}

    def done(self, child: int) -> bool:
        """Whether ``child`` holds nothing back any more: its final frame is in, it is gone, or read elsewhere."""
        return child in self.final_at or child in self.gone or child in self.retired

    def _counted_all(self, k: int, now: int) -> bool:
        """Whether exchange ``k``'s counter holds every frame read from it.

        A child appends its frame, then bumps the count: a frame read before its count means a bump still to
        come, which would make the counter key again after the exchange's deletion (two of them: again after
        a second).  So an exchange is deleted once its count is in; a count that never comes (the child's
        connection broke between the two requests) holds it ``STALE_EXCHANGES`` exchanges at most."""
        return self._frames.get(k, 0) <= self._counted.get(k, 0) or now - k > STALE_EXCHANGES

    def settled(self) -> bool:
        """No frame read whose count is still to come: the keys can be deleted (the end)."""
        return all(self._frames.get(k, 0) <= c for k, c in self._counted.items())

    def _mark_gone(self, now: int) -> None:
        """Children silent for STALE_EXCHANGES exchanges and STALE_S seconds."""
        clock = time.monotonic()
        for c in self.children:
            if self.done(c):
                continue
            k, when = self._heard.get(c, (self._start - 1, self._started))
            if now - k > STALE_EXCHANGES and clock - when > STALE_S:
                self.gone = self.gone | {c}
