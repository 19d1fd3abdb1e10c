"""Which module the verdict names: the module that holds the most of a GPU-bound run's slow phase, with what usually
helps for its kind, and the modules that hold the activations (MEMORY_HEADROOM, MEMORY_PRESSURE, OUT_OF_MEMORY).

Read from the summary file's ``modules`` block (``measures/modules/``): its leaves (the rows no other row is
under), so that a block and its own ``attn`` are never both named."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from phase_timer.diagnosis.finding import Diagnosis, _pct

#: What usually helps a module of each kind that holds a slow phase.
ADVICE = {
    "vocab_head": "a fused or chunked cross-entropy over the vocabulary head (e.g. Liger's fused linear "
                  "cross-entropy, or the loss computed in chunks of the sequence) never makes the full logits",
    "attention": "scaled_dot_product_attention (flash or memory-efficient kernels) where the attention is written out "
                 "by hand, and a mask/dtype that keeps it off the math fallback",
    "conv": "channels_last (model.to(memory_format=torch.channels_last)) with torch.backends.cudnn.benchmark=True",
    "embedding": "the embedding's backward is a scatter-add over the table: keep the table in fp32 (its backward in "
                 "bf16/fp16 is slow and lossy), or sparse=True with a sparse optimizer for a very large vocabulary",
    "mlp": "its matmuls in bf16 (or fp8 on Hopper), and a fused activation (torch.compile fuses the GELU)",
    "norm": "a fused norm kernel (torch.compile, or apex's FusedLayerNorm / RMSNorm)",
}
#: Modules named for their activations.
TOP = 3
#: Named only when it holds at least this share of the phase.
MIN_SHARE = 0.15


def _leaves(modules: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    if not modules:
        return {}
    rows = modules.get("rows") or {}
    return {k: rows[k] for k in modules.get("leaves") or () if k in rows}


def slowest(modules: dict[str, Any] | None, phase: str) -> tuple[str, dict[str, Any]] | None:
    """The leaf module that holds the most of ``phase`` (forward or backward), or None."""
    rows = [(r.get(f"{phase}_ms") or 0.0, k) for k, r in _leaves(modules).items()]
    if not rows or phase not in ("forward", "backward"):
        return None
    ms, key = max(rows)
    return (key, _leaves(modules)[key]) if ms > 0 else None


def holders(modules: dict[str, Any] | None) -> list[tuple[str, float]]:
    """The leaf modules that keep the most activations (MB), largest first."""
    rows = [(k, r["activation_mb"]) for k, r in _leaves(modules).items() if (r.get("activation_mb") or 0) > 0]
    return sorted(rows, key=lambda kv: -kv[1])[:TOP]


def with_modules(d: Diagnosis, modules: dict[str, Any] | None) -> Diagnosis:
    """``d`` (and its other findings) with the modules named where they say something: only from a full table (every
    group of rows read, ``complete``), since a part of it would name the largest of what was read."""
    if not modules or not modules.get("rows") or modules.get("complete") is False:
        return d
    return replace(_one(d, modules), secondary=tuple(_one(s, modules) for s in d.secondary))


def _one(d: Diagnosis, modules: dict[str, Any]) -> Diagnosis:
    if d.kind == "GPU_BOUND":
        phase = d.evidence.get("largest_phase")
        found = slowest(modules, phase) if isinstance(phase, str) else None
        if found is None:
            return d
        key, row = found
        share = row.get(f"share_of_{phase}")
        if share is not None and share < MIN_SHARE:
            return d
        said = f" ({_pct(share)} of {phase})" if share is not None else ""
        why = d.why + f"; in {phase}, {key} ({row['kind']}) takes {row[f'{phase}_ms']:.2f} ms{said}"
        tips = list(d.next)
        tip = ADVICE.get(row["kind"])
        tips.insert(1, f"{key}: {tip}" if tip else f"make {key} cheaper: it holds the most of {phase}")
        ev = {**d.evidence, "module": key, "module_kind": row["kind"], "module_share": share}
        return replace(d, why=why, next=tuple(tips), evidence=ev)
    if d.kind in ("MEMORY_HEADROOM", "MEMORY_PRESSURE", "OUT_OF_MEMORY"):
        held = holders(modules)
        if not held:
            return d
        names = ", ".join(f"{k} {mb:.0f} MB" for k, mb in held)
        why = d.why + f"; the activations kept from forward to backward are held most by {names} (sampled steps)"
        tips = list(d.next)
        if d.kind != "MEMORY_HEADROOM":
            tips.append(f"activation checkpointing on {held[0][0]} trades its recompute for its activations")
        return replace(d, why=why, next=tuple(tips), evidence={**d.evidence, "activation_holders_mb": dict(held)})
    return d
