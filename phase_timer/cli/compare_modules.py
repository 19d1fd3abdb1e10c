"""``phase-timer compare``: which module got slower between two runs, from their summary files' ``modules`` blocks.

Per module both runs measured (the leaves: the rows no other row is under), each side's forward and backward
(ms a step, the mean over its sampled steps), and the change; the module whose time grew the most is named.
Sampled steps are few (one in ~256 after the first few), so a change of a few percent is within their noise: the
table says how many samples each side has, and a module is named only past :data:`NAMED_PCT` and
:data:`NAMED_MS`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: A module is named as slower only past both of these.
NAMED_PCT = 5.0
NAMED_MS = 0.05


@dataclass(frozen=True)
class ModuleRow:
    module: str
    kind: str | None
    base_forward_ms: float | None
    cand_forward_ms: float | None
    base_backward_ms: float | None
    cand_backward_ms: float | None

    @property
    def base_ms(self) -> float:
        return (self.base_forward_ms or 0.0) + (self.base_backward_ms or 0.0)

    @property
    def cand_ms(self) -> float:
        return (self.cand_forward_ms or 0.0) + (self.cand_backward_ms or 0.0)

    @property
    def delta_ms(self) -> float:
        return self.cand_ms - self.base_ms

    @property
    def delta_pct(self) -> float | None:
        return 100 * self.delta_ms / self.base_ms if self.base_ms > 0 else None


def module_rows(base: dict[str, Any] | None, cand: dict[str, Any] | None) -> list[ModuleRow] | None:
    """The modules both runs measured, the largest change first; None: a side has no module rows."""
    if not base or not cand or not base.get("rows") or not cand.get("rows"):
        return None
    b_rows, c_rows = base["rows"], cand["rows"]
    keys = [k for k in (base.get("leaves") or b_rows) if k in c_rows]
    rows = [ModuleRow(k, b_rows[k].get("kind"), b_rows[k].get("forward_ms"), c_rows[k].get("forward_ms"),
                      b_rows[k].get("backward_ms"), c_rows[k].get("backward_ms")) for k in keys]
    return sorted(rows, key=lambda r: -abs(r.delta_ms))


def module_verdict(rows: list[ModuleRow] | None, base_samples: int, cand_samples: int) -> str | None:
    """"modules: X got slower ..." (or faster), or None where no module changed past the thresholds."""
    if not rows:
        return None
    worst = max(rows, key=lambda r: r.delta_ms)
    best = min(rows, key=lambda r: r.delta_ms)
    for r, word in ((worst, "slower"), (best, "faster")):
        pct = r.delta_pct
        if pct is not None and abs(pct) >= NAMED_PCT and abs(r.delta_ms) >= NAMED_MS and (r.delta_ms > 0) == (word == "slower"):
            parts = []
            for phase, b, c in (("forward", r.base_forward_ms, r.cand_forward_ms),
                                ("backward", r.base_backward_ms, r.cand_backward_ms)):
                if b is not None and c is not None:
                    parts.append(f"{phase} {b:.3f} -> {c:.3f} ms")
            return (f"modules: {r.module} got {word}: {r.base_ms:.3f} -> {r.cand_ms:.3f} ms a step ({pct:+.1f}%; "
                    f"{', '.join(parts)}; {base_samples} vs {cand_samples} sampled steps)")
    return f"modules: no module changed by {NAMED_PCT:g}% and {NAMED_MS:g} ms or more ({base_samples} vs {cand_samples} sampled steps)"


def format_module_table(rows: list[ModuleRow]) -> str:
    from tabulate import tabulate

    def n(v: float | None) -> str:
        return "" if v is None else f"{v:.3f}"

    table = [(r.module, n(r.base_forward_ms), n(r.cand_forward_ms), n(r.base_backward_ms), n(r.cand_backward_ms),
              f"{r.delta_ms:+.3f}", "" if r.delta_pct is None else f"{r.delta_pct:+.1f}") for r in rows]
    heads = ("module", "base fwd ms", "cand fwd ms", "base bwd ms", "cand bwd ms", "delta ms", "delta %")
    return tabulate(table, headers=heads, disable_numparse=True, colalign=("left",) + ("right",) * 6)


def modules_json(rows: list[ModuleRow] | None) -> dict[str, Any] | None:
    if rows is None:
        return None
    return {r.module: {"kind": r.kind, "baseline_forward_ms": r.base_forward_ms, "candidate_forward_ms": r.cand_forward_ms,
                       "baseline_backward_ms": r.base_backward_ms, "candidate_backward_ms": r.cand_backward_ms,
                       "delta_ms": r.delta_ms, "delta_pct": r.delta_pct} for r in rows}
