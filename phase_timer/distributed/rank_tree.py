"""Who reads whom in the exchange between ranks: a tree of groups over the ranks, the same on every rank.

Ranks are cut into groups of ``fan_in`` (level 1), those groups into groups of ``fan_in`` (level 2), and
so on up to one group of everything (level ``depth``, the root).  A node is one group; its children are
the ranks (level 1) or the groups one level down.  Each node has a leader, the rank whose exchange
thread reads the node's key and sends one summary up: the root's is rank zero; below it, the rank
``L`` places into the group (``start + L``), so that rank zero reads only the root, and no rank leads
two nodes (for ``depth < fan_in``) except in a tail group too short to hold ``L + 1`` ranks (a node of
few ranks: little to read).  Whatever the number of ranks, a leader reads at most ``fan_in`` reports
a window.

Computed, never sent: every rank derives the same tree from ``(world_size, fan_in)``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Children per node.  A leader's work per window is about ``fan_in`` reports (~1-3 ms at 64 on a busy
#: core); the root is reached in ``depth`` exchanges (3 for up to 262,144 ranks).
FAN_IN = 64


@dataclass(frozen=True)
class Node:
    """One group: ``level`` >= 1, its ``index`` at that level, the ranks ``[start, end)`` under it."""

    level: int
    index: int
    start: int
    end: int

    @property
    def name(self) -> str:
        """The node's part of its store keys."""
        return f"{self.level}.{self.index}"


class Tree:
    """The groups over ``world_size`` ranks, ``fan_in`` children a node."""

    def __init__(self, world_size: int, fan_in: int = FAN_IN) -> None:
        if fan_in < 2:
            raise ValueError(f"fan_in must be >= 2, got {fan_in!r}")
        self.world_size = world_size
        self.fan_in = fan_in
        depth, span = 1, fan_in
        while span < world_size:
            depth, span = depth + 1, span * fan_in
        self.depth = depth

    def node(self, level: int, index: int) -> Node:
        span = self.fan_in**level
        return Node(level, index, index * span, min((index + 1) * span, self.world_size))

    @property
    def root(self) -> Node:
        return self.node(self.depth, 0)

    def children(self, node: Node) -> list[int]:
        """The ids of the node's children: ranks (level 1), else node indices one level down."""
        if node.level == 1:
            return list(range(node.start, node.end))
        span = self.fan_in ** (node.level - 1)
        first = node.index * self.fan_in
        return [first + i for i in range(self.fan_in) if (first + i) * span < self.world_size]

    def child(self, node: Node, child: int) -> Node:
        """A child of a node above level 1, as a node."""
        return self.node(node.level - 1, child)

    def leader(self, node: Node) -> int:
        if node.level == self.depth:
            return 0
        return node.start + node.level % (node.end - node.start)

    def parent(self, node: Node) -> Node | None:
        return None if node.level == self.depth else self.node(node.level + 1, node.index // self.fan_in)

    def leaf_node(self, rank: int) -> Node:
        """The level-1 node a rank reports to."""
        return self.node(1, rank // self.fan_in)

    def led_by(self, rank: int) -> list[Node]:
        """The nodes ``rank`` leads, lowest level first (what it reads feeds what it reads next)."""
        out = []
        for level in range(1, self.depth + 1):
            node = self.node(level, rank // self.fan_in**level)
            if self.leader(node) == rank:
                out.append(node)
        return out
