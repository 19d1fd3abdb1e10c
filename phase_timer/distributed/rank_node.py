"""One node of the exchange's tree, on the exchange thread of the rank that reads it: frames in, windows out.

The node's children send one frame per exchange to its key (:mod:`phase_timer.distributed.rank_reader`).  A
level-1 node's children are ranks, and their frames hold their window reports and their run totals so
far; a higher node's children are nodes, and their frames hold :class:`~phase_timer.distributed.rank_summary.Summary`
objects, one per window complete below them, and notices (below).  The node merges what comes per
window, and a window is complete once every child has reported it or moved past it (a child that
finished, or is gone, holds nothing back): rank zero's own rule, applied at every node.

Notices, in every frame a node sends up (each a small, cumulative state, so that a frame lost with a
dead leader loses nothing of them): ``h``, the newest window it has moved past; ``next``, its oldest
exchange not fully read; ``f``, its children whose final frame came; ``g``, the ranks under it taken
as gone; ``a``, the children it reads itself (below), with their own notices.  Its final frame adds
``x``, the ranks under it whose final report never came, and ``ho`` when it hands them over.

A node whose leader stops reading it is read by its parent's reader from where it stood (adopted):
when the leader is taken as gone (dead), and when it finishes before its children (``ho``: they ran
more steps, or its wait ended).  The parent reads the node's key from the oldest exchange still there
since the ``next`` the node last said, drops reports of windows it had moved past (``h``), and marks the
key adopted: a leader that was only held up sees the mark and stops.  Windows a dead leader had read but
not sent up lack those reports; the ranks' run totals lose nothing (each report carries its rank's so far).

Each level-1 node also keeps its ranks' run totals (the newest each rank sent) under ``<ns>/t/<index>``:
rank zero reads those once, at the end, for the per-rank table.
"""

from __future__ import annotations

import json
from typing import Any

from phase_timer.distributed.rank_reader import KeyReader
from phase_timer.distributed.rank_summary import Summary
from phase_timer.distributed.rank_tree import Node, Tree


def table_key(ns: str, index: int) -> str:
    """Where level-1 node ``index`` keeps its ranks' run totals."""
    return f"{ns}/t/{index}"


def adopted_key(ns: str, node: Node) -> str:
    return f"{ns}/{node.name}/adopted"


def leaf_body(reports: list[bytes], totals: bytes | None) -> bytes:
    """A rank's frame body: its window reports (a JSON list), then, after a newline, its run totals' JSON.

    A leader parses the reports and keeps the totals as they came (compact JSON holds no newline)."""
    return b"[" + b",".join(reports) + b"]" + (b"\n" + totals if totals else b"")


def table_bytes(table: dict[int, tuple[int, bytes]]) -> bytes:
    """A group's run totals as one JSON object: ``{rank: [newest window, totals]}``."""
    return b"{" + b",".join(b'"%d":[%d,%s]' % (r, k, t) for r, (k, t) in sorted(table.items())) + b"}"


def parse_table(raw: bytes) -> dict[int, tuple[int, dict[str, Any]]]:
    return {int(r): (int(k), t) for r, (k, t) in json.loads(raw).items()}


class NodeReader:
    """One node, read by its leader (or its adopter): see the module's text."""

    def __init__(self, tree: Tree, node: Node, store: Any, ns: str, *, seed: dict[str, Any] | None = None,
                 now: int = 0) -> None:
        """``seed``: an adopted node's notices as its leader last sent them (``{}``: none came), ``now`` the
        exchange at which it is adopted."""
        self.tree, self.node, self.store, self.ns = tree, node, store, ns
        self.children = tree.children(node)
        adopted = seed is not None
        start = self._first_kept(int(seed.get("next", 0)), now) if seed is not None else 0
        seed = seed or {}
        self.reader = KeyReader(store, f"{ns}/{node.name}", self.children, start=start)
        self.pending: dict[int, Summary] = {}
        self.latest: dict[int, int] = {}  # child -> the newest window it reported or moved past
        self.written = int(seed.get("h", -1))  # windows up to this one are sent on: later reports of them are late
        self.state: dict[int, dict[str, Any]] = {}  # node child -> the notices of its newest frame
        self.adopted: dict[int, NodeReader] = {}  # node child -> its reader here
        self.table: dict[int, tuple[int, bytes]] = {}  # level 1: rank -> (newest window, its run totals' JSON)
        self._table_dirty = False
        self._now = now  # the exchange read up to last
        for c in seed.get("f", ()):
            self.reader.final_at[int(c)] = start - 1
        if node.level == 1:
            self.reader.gone = {int(c) for c in seed.get("g", ())} & set(self.children)
            if adopted:  # its ranks' totals so far, as its leader last kept them
                self._load_table()
        for c, notices in seed.get("a", {}).items():
            self.adopt(int(c), notices)

    def _first_kept(self, since: int, now: int) -> int:
        """The oldest exchange of this node's key still in the store, from ``since`` (where its leader said it
        stood): those before were read and deleted by its leader (one more, if it died between the two), and
        their frames are gone; reading from a deleted one would wait for them for ever."""
        for k in range(since, now + 1):
            if self.store.check([f"{self.ns}/{self.node.name}/{k}/n"]):
                return k
        return since

    # -- each exchange ---------------------------------------------------------------
    def step(self, upto: int, *, beyond: bool = False) -> list[Summary]:
        """Read up to exchange ``upto``; the windows complete now, oldest first."""
        self._now = upto
        for c, child in list(self.adopted.items()):
            for s in child.step(upto, beyond=beyond):
                self._merge(s)
            self.latest[c] = max(self.latest.get(c, -1), child.written)
        for c, final, payload in self.reader.read_up_to(upto, beyond=beyond):
            self._take(c, final, payload)
        if self.node.level > 1:
            for c in self.reader.gone - set(self.adopted):  # a leader silent too long: read its node here
                self.adopt(c, self.state.get(c))
        return self._complete(final=False)

    def flush(self) -> list[Summary]:
        """Every window still pending, complete or not (the end)."""
        for child in self.adopted.values():
            for s in child.flush():
                self._merge(s)
        return self._complete(final=True)

    def _take(self, child: int, final: bool, body: bytes) -> None:
        if self.node.level == 1:
            reports, _, totals = body.partition(b"\n")
            newest = -1
            for report in json.loads(reports):
                key = int(report[0])
                newest = max(newest, key)
                if key > self.written:
                    s = self.pending.get(key)
                    if s is None:
                        s = self.pending[key] = Summary(key)
                    s.add_report(child, report)
            self.latest[child] = max(self.latest.get(child, -1), newest)
            if totals and newest >= self.table.get(child, (-1, b""))[0]:
                self.table[child] = (newest, totals)  # kept as sent: rank zero alone reads it, at the end
                self._table_dirty = True
            return
        payload = json.loads(body)
        for w in payload.get("w", ()):
            self._merge_wire(w)
        self.latest[child] = max(self.latest.get(child, -1), int(payload.get("h", -1)))
        self.state[child] = {k: v for k, v in payload.items() if k != "w"}
        if final and payload.get("ho"):  # its leader finished before its children: read them here
            self.adopt(child, self.state[child])

    def _merge_wire(self, w: list[Any]) -> None:
        if w[0] <= self.written:
            return  # too late: that window went on without these ranks
        mine = self.pending.get(w[0])
        if mine is None:
            self.pending[w[0]] = Summary.from_wire(w)
        else:
            mine.merge_wire(w)

    def _merge(self, s: Summary) -> None:
        if s.key <= self.written:
            return  # too late: that window went on without these ranks
        mine = self.pending.get(s.key)
        if mine is None:
            self.pending[s.key] = s
        else:
            mine.merge(s)

    def _complete(self, *, final: bool) -> list[Summary]:
        if final:
            horizon = max(self.pending, default=self.written)
        else:
            waiting = [c for c in self.children if not self.child_done(c)]
            horizon = min((self.latest.get(c, -1) for c in waiting), default=max(self.pending, default=self.written))
        out = [self.pending.pop(k) for k in sorted(self.pending) if k <= horizon]
        self.written = max(self.written, horizon)
        return out

    # -- children's state ------------------------------------------------------------
    def adopt(self, child: int, notices: dict[str, Any] | None) -> None:
        """Read ``child``'s node here from now on, from where it said it stood (see the module's text)."""
        if child in self.adopted:
            return
        node = self.tree.child(self.node, child)
        self.store.set(adopted_key(self.ns, node), b"1")  # its leader, if only held up, stops reading it
        self.reader.retire(child)
        self.adopted[child] = NodeReader(self.tree, node, self.store, self.ns, seed=dict(notices or {}), now=self._now)

    def child_done(self, child: int) -> bool:
        """Whether ``child`` holds nothing back any more."""
        if child in self.adopted:
            return self.adopted[child].all_done()
        return self.reader.done(child)

    def all_done(self) -> bool:
        return all(self.child_done(c) for c in self.children)

    def settled(self) -> bool:
        """Whether its keys can be deleted: no count still to come (:meth:`KeyReader.settled`), its adoptees' too."""
        return self.reader.settled() and all(child.settled() for child in self.adopted.values())

    def gone_ranks(self) -> set[int]:
        """The ranks under this node taken as gone."""
        if self.node.level == 1:
            return set(self.reader.gone)
        out: set[int] = set()
        for c in self.children:
            out |= self.adopted[c].gone_ranks() if c in self.adopted else set(self.state.get(c, {}).get("g", ()))
        return out

    def missing(self) -> set[int]:
        """The ranks under this node whose final report never came (and not gone): at the end."""
        if self.node.level == 1:
            return {c for c in self.children if c not in self.reader.final_at and c not in self.reader.gone}
        out: set[int] = set()
        for c in self.children:
            if c in self.adopted:
                out |= self.adopted[c].missing()
            elif c in self.reader.final_at:
                out |= set(self.state.get(c, {}).get("x", ()))
            else:  # no final frame from its leader: every rank under it, but those known gone
                node = self.tree.child(self.node, c)
                out |= set(range(node.start, node.end)) - set(self.state.get(c, {}).get("g", ()))
        return out

    def notices(self) -> dict[str, Any]:
        return {
            "h": self.written, "next": self.reader._next,
            "f": sorted(c for c in self.reader.final_at if c not in self.adopted),
            "g": sorted(self.gone_ranks()),
            "a": {str(c): child.notices() for c, child in self.adopted.items()},
        }

    # -- the run totals (level 1), and the end ----------------------------------------------
    def publish_table(self, *, own: bool = True) -> None:
        """Keep this node's ranks' run totals in the store (level 1, when they changed), and its adoptees'.

        ``own=False``: the adoptees' only (rank zero's root of one level keeps its table in memory)."""
        for child in self.adopted.values():
            child.publish_table()
        if own and self._table_dirty:
            self.store.set(table_key(self.ns, self.node.index), table_bytes(self.table))
            self._table_dirty = False

    def _load_table(self) -> None:
        key = table_key(self.ns, self.node.index)
        if self.store.check([key]):
            self.table = {r: (k, json.dumps(t, separators=(",", ":")).encode())
                          for r, (k, t) in parse_table(self.store.get(key)).items()}

    def forget(self, sent: int) -> None:
        """Delete this node's keys left (and its adoptees'): its reading is over."""
        for child in self.adopted.values():
            child.forget(sent)
            self.store.delete_key(adopted_key(self.ns, child.node))
        self.reader.forget_all(sent)
