"""DDP's copies into ``.grad`` on a sampled end-of-backward: a dispatch mode that counts them a bucket, and marks
the compute stream before each bucket's first copy and after its last (:mod:`phase_timer.measures.comm.ddp` says why)."""

from __future__ import annotations

from typing import Any


def _push_mode(mode: Any) -> None:
    import torch

    torch._C._push_on_torch_dispatch_stack(mode)


def _pop_mode(mode: Any) -> None:
    """Pop ``mode`` if it is on top of the dispatch stack (DDP's end-of-backward pushed nothing of its own above
    it); else leave the stack alone and let ``mode`` pass everything through from now on."""
    import torch

    n = torch._C._len_torch_dispatch_stack()
    if n and torch._C._get_dispatch_stack_at(n - 1) is mode:
        torch._C._pop_torch_dispatch_stack(None)
    else:
        mode.passthrough = True


#: The copies marked in this process's backward (one module at a time: two DDP modules sampled in the same
#: backward would stack two modes; the second waits for its next backward).
_ACTIVE: list[Any] = [None]


_MARKER: Any = None


def _copy_marker(params: Any, counts: list[int] | None, clock: Any) -> Any:
    """A dispatch mode that watches each ``copy_`` into the ``.grad`` of one of ``params`` (DDP's copies out of its
    buckets) and makes it where DDP does.  A bucket's copies read one storage (the bucket's, or its comm hook's
    result); the mode counts them a bucket (``counts``, in DDP's order).  Given the ``counts`` an earlier backward
    made and a ``clock``, it also marks the stream before each bucket's first copy and after its last (counted), so
    the copies' time is read where they run: after their bucket's wait, beside the collectives still running, at
    the pace they are launched, with no mark between two copies.  Every other op passes through, other copies
    too: DDP reads some of its own at once (the used-parameter map it copies to the host and reads with
    ``.item()`` under ``find_unused_parameters``)."""
    global _MARKER
    if _MARKER is None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        copy_ = torch.ops.aten.copy_.default

        class CopyMarker(TorchDispatchMode):
            def __init__(self, params: Any, counts: list[int] | None, clock: Any) -> None:
                super().__init__()
                self.passthrough = False
                # the gradients' memory (their tensors may reach the mode as other Python objects)
                self.grads = {(g.data_ptr(), g.numel()) for p in params
                              if (g := p.grad) is not None and g.layout == torch.strided}
                self.expect = counts if clock is not None else None
                self.clock = clock
                self.counts: list[int] = []
                self.marks: list[Any] = []  # before a bucket's first copy, after its last: two a bucket
                self._source: Any = None

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
                kwargs = kwargs or {}
                if func is not copy_ or self.passthrough:
                    return func(*args, **kwargs)
                dst, src = args[0], args[1]
                if dst.layout != torch.strided or (dst.data_ptr(), dst.numel()) not in self.grads:
                    return func(*args, **kwargs)
                try:
                    counts, expect = self.counts, self.expect
                    source = src.untyped_storage().data_ptr() if src.layout == torch.strided else id(src)
                    if source != self._source or not counts:  # a bucket's first copy: its wait is enqueued before it
                        self._source = source
                        counts.append(0)
                        if expect is not None and len(self.marks) % 2 == 0 and len(counts) <= len(expect):
                            self.marks.append(self.clock.mark())
                except Exception:  # noqa: BLE001 - the timing's, never DDP's: this backward reads nothing
                    self.expect, self.counts = None, []
                out = func(*args, **kwargs)
                if not self.counts:
                    return out
                counts, expect = self.counts, self.expect
                counts[-1] += 1
                k = len(counts) - 1
                if expect is not None and k < len(expect) and counts[k] == expect[k] and len(self.marks) == 2 * k + 1:
                    try:
                        self.marks.append(self.clock.mark())  # the bucket's last copy, as counted before
                    except Exception:  # noqa: BLE001 - as above
                        self.expect = None
                return out

            def pairs(self) -> list[tuple[Any, Any]] | None:
                """Each bucket's (first mark, last mark), or None where the copies were counted only, or not as
                expected (a bucket's copies split, or a bucket more or less)."""
                self.passthrough = True
                marks = self.marks
                if self.expect is None or self.counts != self.expect or len(marks) != 2 * len(self.counts):
                    return None
                return list(zip(marks[::2], marks[1::2]))

        _MARKER = CopyMarker
    return _MARKER(params, counts, clock)
