"""What the doors know of a run beyond the timings: for the verdict's advice and the summary file.

Read once, at the start or the end of training, never per step.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch


def cpu_count() -> int | None:
    """The cores this process may run on (its affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


#: Where a wrapper keeps the loader it wraps: Fabric's ``_FabricDataLoader`` (``_dataloader``), and the like.
_WRAPPED = ("_dataloader", "dataloader", "base_dataloader")


def _attr(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name, None)
    except Exception:  # noqa: BLE001 - a property that fails: no wrapped loader there
        return None


def unwrap_loader(loader: Any) -> tuple[Any, list[str]]:
    """The DataLoader inside wrappers that hold it (a few levels at most), and the wrappers' type names, outermost
    first; a loader that is no DataLoader nor wraps one comes back as it is, with no wrappers."""
    wrappers: list[str] = []
    inner = loader
    for _ in range(4):
        if isinstance(inner, torch.utils.data.DataLoader):
            return inner, wrappers
        nxt = next((x for x in map(lambda a: _attr(inner, a), _WRAPPED) if x is not None), None)
        if nxt is None or nxt is inner:
            break
        wrappers.append(type(inner).__name__)
        inner = nxt
    return loader, []


def loader_info(loader: Any) -> dict[str, Any] | None:
    """A DataLoader's settings as the loader itself holds them (looked for inside a wrapper such as Fabric's);
    for another iterable, its type."""
    if loader is None:
        return None
    inner, wrappers = unwrap_loader(loader)
    if isinstance(inner, torch.utils.data.DataLoader):
        workers = inner.num_workers
        out = {
            "type": "DataLoader", "num_workers": workers, "pin_memory": bool(inner.pin_memory),
            "persistent_workers": bool(inner.persistent_workers),
            "prefetch_factor": inner.prefetch_factor if workers else None, "batch_size": inner.batch_size,
            # An iterable dataset is copied into every worker: more workers repeat its data unless it shards itself.
            "iterable": isinstance(inner.dataset, torch.utils.data.IterableDataset),
        }
        if wrappers:
            out["wrapper"] = " > ".join(wrappers)
        return out
    return {"type": type(loader).__name__}


def device_name(device: Any) -> str | None:
    try:
        dev = torch.device(device)
        if dev.type == "cuda" and torch.cuda.is_available():
            return torch.cuda.get_device_name(dev)
        return dev.type
    except Exception:  # noqa: BLE001 - a name is only a label
        return None


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype in effect now on ``device_type``, or None when autocast is off."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError, RuntimeError):  # an older torch
        return None


_NAMES = {torch.bfloat16: "bf16", torch.float16: "16", torch.float32: "32", torch.float64: "64"}


def precision_name(param_dtype: torch.dtype | None, autocast: torch.dtype | None) -> str | None:
    """Lightning's names: ``bf16-mixed`` (autocast), ``32-true`` (the weights' dtype, no autocast)."""
    if autocast is not None:
        return f"{_NAMES.get(autocast, str(autocast))}-mixed"
    if param_dtype is None:
        return None
    return f"{_NAMES.get(param_dtype, str(param_dtype))}-true"


def config_dict(config: Any) -> dict[str, Any]:
    """The timer's arguments as given (``window``: None means the framework's logging interval)."""
    out = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in ("owner", "window_arg")}
    return {k: (os.fspath(v) if isinstance(v, os.PathLike) else f"<function {getattr(v, '__qualname__', type(v).__name__)}>"
                if callable(v) else v) for k, v in out.items()}
