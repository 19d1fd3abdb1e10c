"""DDP's copies into ``.grad`` on a sampled end-of-backward: a dispatch mode that counts them a bucket, and marks
the compute stream before each bucket's first copy and after its last (:mod:`phase_timer.measures.comm.ddp` says why)."""

from __future__ import annotations

import time
from typing import Any, NamedTuple


class Copies(NamedTuple):
    """One bucket's copies on a sampled end-of-backward: the compute stream's marks before the first and after the
    last; the host's time between the two marks, and inside the copies' own calls (ns); and whether the device had
    reached the first mark when the host came to the last."""

    start: Any
    end: Any
    host_ns: int
    launch_ns: int
    caught: bool

    def own(self, clock: Any) -> bool:
        """Whether :meth:`ms` is the copies' own time: every copy was queued before it ran (the device had not reached
        the first mark when the last copy was launched), or the marks are further apart on the device than on the
        host (by more than ``PACE_SLACK_MS`` and ``PACE_SLACK`` of it: the copies took longer than their launches)."""
        return (not self.caught
                or clock.elapsed_ms(self.start, self.end) > self.host_ns / 1e6 * (1 + PACE_SLACK) + PACE_SLACK_MS)

    def ms(self, clock: Any) -> float:
        """The copies' time as DDP runs them, with no mode in its end-of-backward (both marks done).

        Where the device had not reached the first mark when the last copy was launched, every copy was queued
        before it ran: the marks hold the copies' own time, back to back, as DDP's are on a device behind its
        host.  So too where the marks are further apart on the device than on the host (by more than
        ``PACE_SLACK_MS`` and ``PACE_SLACK`` of it): the copies took longer than the host took to launch them.
        Otherwise the device caught up with the host and the copies ran at the pace it launched them, the mode's
        Python included: that Python (the host time between the marks, less the copies' own calls) is taken off,
        never below the calls' own time, never above the marks'.  A device that catches up with DDP's own
        launches runs the copies at about that pace; where the copies' own time lies between that pace and the
        mode's, the estimate reads low by the difference (``backward.comm_wait`` high by as much)."""
        span = clock.elapsed_ms(self.start, self.end)
        if self.own(clock):
            return span
        host, launch = self.host_ns / 1e6, self.launch_ns / 1e6
        return min(span, max(launch, span - (host - launch)))


#: The device's marks further apart than the host's by more than this share and these ms: the copies' own time,
#: not the host's pace (a paced bucket's device span is the host's within a launch's latency at each end).
PACE_SLACK, PACE_SLACK_MS = 0.02, 0.01


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
    the pace they are launched, with no mark between two copies.  It also keeps, a bucket, what tells that pace
    from the copies' own (:meth:`pairs`): the host time between the two marks, the host time of the copies'
    own calls (DDP's launches, without the mode's Python around them), and whether the device had already
    reached the first mark when the host came to mark the last (one ``query()``, never a wait).  Every other op
    passes through, other copies too: DDP reads some of its own at once.  One of them it notes (``synced``): the
    used-parameter map's copy over the host's map (int32: the tensor DDP reads each parameter's flag from, by
    ``select``, before its copy), which DDP makes under ``find_unused_parameters`` where a
    parameter got no gradient on this rank, after waiting for the map's all-reduce: that wait falls among a
    bucket's copies, and a sample that holds it is not read (:meth:`pairs`).  (A static graph reads its map in its
    first backward, outside the span.)"""
    global _MARKER
    if _MARKER is None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        copy_ = torch.ops.aten.copy_.default
        select = torch.ops.aten.select.int

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
                self.host: list[int] = []  # perf_counter_ns at each mark
                self.launch: list[int] = []  # a bucket's copies' own calls, ns (the mode's Python left out)
                self.caught: list[bool] = []  # a bucket: the device had reached its first mark at its last
                self.synced = False  # DDP read its used-parameter map (waiting for its all-reduce) in this span
                self._map: int | None = None  # the host's map: the int32 tensor DDP reads a parameter's flag from
                self._source: Any = None

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
                kwargs = kwargs or {}
                if func is select and not self.passthrough and args[0].dtype == torch.int32:
                    self._map = args[0].data_ptr()  # local_used_map_[i]: the flag read before each copy
                if func is not copy_ or self.passthrough:
                    return func(*args, **kwargs)
                dst, src = args[0], args[1]
                if dst.layout != torch.strided or (dst.data_ptr(), dst.numel()) not in self.grads:
                    if dst.dtype == torch.int32 and self._map is not None and dst.data_ptr() == self._map:
                        self.synced = True  # the reduced map copied over the host's (its all-reduce waited for)
                    return func(*args, **kwargs)
                try:
                    counts, expect = self.counts, self.expect
                    source = src.untyped_storage().data_ptr() if src.layout == torch.strided else id(src)
                    if source != self._source or not counts:  # a bucket's first copy: its wait is enqueued before it
                        self._source = source
                        counts.append(0)
                        if expect is not None and len(self.marks) % 2 == 0 and len(counts) <= len(expect):
                            self.host.append(time.perf_counter_ns())
                            self.marks.append(self.clock.mark())
                            self.launch.append(0)
                except Exception:  # noqa: BLE001 - the timing's, never DDP's: this backward reads nothing
                    self.expect, self.counts = None, []
                t0 = time.perf_counter_ns()
                out = func(*args, **kwargs)
                if not self.counts:
                    return out
                counts, expect, marks = self.counts, self.expect, self.marks
                counts[-1] += 1
                k = len(counts) - 1
                if expect is not None and len(marks) == 2 * k + 1:
                    self.launch[k] += time.perf_counter_ns() - t0
                    if k < len(expect) and counts[k] == expect[k]:
                        try:  # the bucket's last copy, as counted before
                            self.caught.append(self.clock.done(marks[-1]))  # a query: never a wait
                            marks.append(self.clock.mark())
                            self.host.append(time.perf_counter_ns())
                        except Exception:  # noqa: BLE001 - as above
                            self.expect = None
                return out

            def pairs(self) -> list[Copies] | None:
                """Each bucket's :class:`Copies`, or None where the copies were counted only, or not as expected
                (a bucket's copies split, or a bucket more or less), or DDP read its used-parameter map among them."""
                self.passthrough = True
                marks, host = self.marks, self.host
                if (self.synced or self.expect is None or self.counts != self.expect
                        or len(marks) != 2 * len(self.counts)):
                    return None
                return [Copies(marks[2 * k], marks[2 * k + 1], host[2 * k + 1] - host[2 * k], self.launch[k],
                               self.caught[k]) for k in range(len(self.counts))]

        _MARKER = CopyMarker
    return _MARKER(params, counts, clock)
