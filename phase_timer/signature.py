"""A batch's signature: the shapes of its tensors and where they sit, read from host metadata alone (no sync).

Equal signatures mean equal FLOPs and equal counts: the boundaries read a step's first batch's signature every step
(``run/batch_counts.py``), and the FLOP count (``measures/flops.py``, ``measures/step_flops.py``) keeps a count per
signature.  A pure function of the batch, imported by both layers: it knows no measure.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from typing import Any

import torch

#: A batch's signature names at most this many tensors; a larger batch's signature ends with "...".
_MAX_LEAVES = 64
_MAX_DEPTH = 6

_SHAPE = operator.attrgetter("shape")


def signature(batch: Any) -> tuple[Any, ...]:
    """The shapes of the tensors in ``batch`` (nested dicts, lists, tuples, dataclasses), and where they sit:
    equal signatures mean equal FLOPs.  Reads only host metadata (no sync); other leaves give their type."""
    kind = type(batch)
    if kind is torch.Tensor:
        return (batch.shape,)
    # The usual batches, a dict or a tuple of tensors, in one pass of C-level calls: a door calls this every
    # step.  (An item without .shape, a nested one: the walk below.  An array's .shape is a shape too.)
    try:
        if kind is dict:
            return (*batch, *map(_SHAPE, batch.values()))
        if kind is tuple or kind is list:
            return (len(batch), *map(_SHAPE, batch))
    except AttributeError:
        pass
    out: list[Any] = []
    _walk(batch, out, 0)
    return tuple(out)


def _walk(obj: Any, out: list[Any], depth: int) -> None:
    if len(out) >= _MAX_LEAVES:
        if out[-1] != "...":
            out.append("...")
        return
    if isinstance(obj, torch.Tensor):
        out.append(obj.shape)
    elif depth >= _MAX_DEPTH:
        out.append(type(obj).__name__)
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            out.append(key if isinstance(key, (str, int)) else type(key).__name__)
            _walk(value, out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        out.append(len(obj))
        for value in obj:
            _walk(value, out, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            out.append(f.name)
            _walk(getattr(obj, f.name), out, depth + 1)
    else:
        out.append(type(obj).__name__)
