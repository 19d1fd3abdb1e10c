"""Where numbers go.  A sink takes ``{tag: value}`` at a step; a failing sink warns once.

Writing to TensorBoard one scalar at a time costs ~50-100 us per scalar (the
writer's queue and protobuf per call), so every sink here writes all the scalars
of a step as one event with many values: :class:`EventFileSink` into an event
file of our own, :class:`SummaryWriterSink` into a user's ``SummaryWriter``.
:class:`BackgroundSink` runs either on a thread of its own: the training thread
only puts on a queue.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import itertools
import logging
import os
import queue
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from phase_timer._env import warn

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)


class Sink(Protocol):
    """Optionally also ``write_text(tag, text, step)`` (once, the verdict); sinks without it skip text."""

    def write(self, step: int, scalars: dict[str, float]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


@dataclass
class Outputs:
    """Where one run's values go (rank zero): its sinks, the directory they write in, the summary's."""

    sinks: list[Sink] = field(default_factory=list)
    #: The directory the TensorBoard values go to (None: none written).
    log_dir: str | None = None
    #: Where the run summary file goes at the end (None: nowhere).
    summary_dir: str | None = None
    #: Why there are no TensorBoard values, said once at the end (None: there are, or none were asked for).
    missing: str | None = None


def require_tensorboard() -> None:
    try:
        import tensorboard  # noqa: F401
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "phase-timer writes TensorBoard files with the `tensorboard` package, which is not installed: "
            "pip install 'phase-timer[tensorboard]'"
        ) from err


class SummaryWriterSink:
    """Scalars into a ``torch.utils.tensorboard.SummaryWriter``, one event per write."""

    def __init__(self, writer: SummaryWriter, *, owned: bool, layout: dict[str, Any] | None = None) -> None:
        require_tensorboard()
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._summary = Summary
        self._writer = writer
        self._owned = owned
        file_writer = getattr(writer, "_get_file_writer", None)
        self._file_writer = file_writer() if callable(file_writer) else None
        if layout is not None:
            writer.add_custom_scalars(layout)
        self._next_check = 0.0
        self._dir_warned = False

    def _check_dir(self) -> None:
        if not self._dir_warned and not os.path.isdir(self.log_dir):
            self._dir_warned = True
            warn(log, f"phase-timer: the TensorBoard directory {self.log_dir} was deleted during the run: the "
                      "values written there are lost (the SummaryWriter keeps writing to the deleted file)", 3)

    @property
    def log_dir(self) -> str:
        return self._writer.log_dir

    def write(self, step: int, scalars: dict[str, float]) -> None:
        now = time.monotonic()
        if now >= self._next_check:  # one stat every few seconds, off the training thread
            self._next_check = now + 2.0
            self._check_dir()
        if self._file_writer is None:  # a writer without the batch path: one call per scalar
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, value, step)
            return
        Value = self._summary.Value
        summary = self._summary(value=[Value(tag=tag, simple_value=value) for tag, value in scalars.items()])
        self._file_writer.add_summary(summary, step)

    def write_text(self, tag: str, text: str, step: int) -> None:
        self._writer.add_text(tag, text, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._check_dir()
        if self._owned:
            self._writer.close()
        else:
            self._writer.flush()


class GuardedSink:
    """Runs a sink's calls; the first failure warns, later ones are counted, training goes on."""

    def __init__(self, sink: Sink, name: str) -> None:
        self.sink = sink
        self.name = name
        self.failures = 0

    def _call(self, what: str, *args: Any) -> None:
        try:
            getattr(self.sink, what)(*args)
        except Exception as err:  # noqa: BLE001 - the timer must never break training
            self.failures += 1
            if self.failures == 1:
                msg = f"phase-timer: {what} to {self.name} failed ({type(err).__name__}: {err}); training goes on, further failures of this sink are silent"
                warn(log, msg, 2)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self._call("write", step, scalars)

    def write_text(self, tag: str, text: str, step: int) -> None:
        if callable(getattr(self.sink, "write_text", None)):
            self._call("write_text", tag, text, step)

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        self._call("close")


_STOP = object()


class _Text(tuple):
    """A text write on the background queue: (tag, text, step)."""

    def __new__(cls, tag: str, text: str, step: int) -> _Text:
        return super().__new__(cls, (tag, text, step))


class BackgroundSink:
    """Hands writes to a daemon thread; ``flush`` and ``close`` wait for it to catch up.

    Only for sinks that are safe to call from another thread (a SummaryWriter is:
    its event writer takes a lock).  Lightning loggers in general are not, and are
    written from the training thread.
    """

    def __init__(self, sink: Sink, name: str, *, timeout_s: float = 60.0) -> None:
        self.sink = sink if isinstance(sink, GuardedSink) else GuardedSink(sink, name)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._timeout_s = timeout_s
        self._thread = threading.Thread(target=self._run, name=f"phase-timer-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if isinstance(item, threading.Event):
                self.sink.flush()
                item.set()
            elif isinstance(item, _Text):
                self.sink.write_text(*item)
            else:
                self.sink.write(*item)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self._queue.put((step, scalars))

    def write_text(self, tag: str, text: str, step: int) -> None:
        self._queue.put(_Text(tag, text, step))

    def flush(self) -> None:
        done = threading.Event()
        self._queue.put(done)
        done.wait(self._timeout_s)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(self._timeout_s)
        self.sink.close()


def next_version_dir(root: str | os.PathLike[str]) -> str:
    """``root/version_N`` for the first N not taken (as Lightning names its runs)."""
    n = 0
    while os.path.exists(os.path.join(root, f"version_{n}")):
        n += 1
    return os.path.join(root, f"version_{n}")


class EventFileSink:
    """A TensorBoard event file of our own, written directly: one record per write.

    The same records a ``SummaryWriter`` writes (TFRecord framing around ``Event``
    protos, read by TensorBoard and its ``EventAccumulator``), without its queue and
    second thread, and with the record checksum from ``_native`` in C (~1 us)
    instead of tensorboard's pure-Python CRC (~80 us per 1 KB record), so a window
    costs ~10x less host time.  Buffered; flushed at most every ``flush_s`` and on
    close.  Not thread-safe: one writer (the core's, through a BackgroundSink).
    """

    def __init__(self, log_dir: str, *, layout: dict[str, Any] | None = None, flush_s: float = 2.0) -> None:
        require_tensorboard()
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._event, self._summary, self._value = Event, Summary, Summary.Value
        self._crc = _record_crc()
        self._scalars_record = _scalars_record()
        self.log_dir = log_dir
        self._layout = layout
        self._flush_s = flush_s
        self._open()

    def _open(self) -> None:
        """A new event file in ``log_dir`` (made if missing): its header, the layout."""
        os.makedirs(self.log_dir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILE_IDS)}"
        self.path = os.path.join(self.log_dir, name)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        self._record(self._event(wall_time=time.time(), file_version="brain.Event:2"))
        if self._layout is not None:
            from torch.utils.tensorboard.summary import custom_scalars

            self._record(self._event(wall_time=time.time(), summary=custom_scalars(self._layout)))
        self._file.flush()
        self._next_flush = time.monotonic() + self._flush_s

    def _record(self, event: Any) -> None:
        data = event.SerializeToString()
        header = _U64.pack(len(data))
        crc = self._crc
        self._file.write(header + _U32.pack(crc(header)) + data + _U32.pack(crc(data)))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if not os.path.exists(self.path):  # one stat a window, off the training thread
            self._reopen()
        if self._scalars_record is not None:  # the same bytes, in one C call
            self._file.write(self._scalars_record(time.time(), step, scalars))
        else:
            value = self._value
            summary = self._summary(value=[value(tag=tag, simple_value=v) for tag, v in scalars.items()])
            self._record(self._event(wall_time=time.time(), step=step, summary=summary))
        if time.monotonic() >= self._next_flush:
            self.flush()

    def write_text(self, tag: str, text: str, step: int) -> None:
        """Text for TensorBoard's text dashboard (the verdict, once)."""
        from torch.utils.tensorboard.summary import text as text_summary

        self._record(self._event(wall_time=time.time(), step=step, summary=text_summary(tag, text)))
        self.flush()

    def flush(self) -> None:
        self._file.flush()
        self._next_flush = time.monotonic() + self._flush_s

    def _reopen(self) -> None:
        """The file (or its directory) was deleted under us: say so once, and go on in a new file there."""
        lost = self.path
        self._file.close()
        self._open()
        warn(log, f"phase-timer: the TensorBoard file {lost} was deleted during the run (its directory removed?): "
                  f"the values it held are lost; the next ones go to {self.path}", 2)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
            if not os.path.exists(self.path):
                warn(log, f"phase-timer: the TensorBoard file {self.path} was deleted during the run "
                          "(its directory removed?): the values it held are lost", 2)


_FILE_IDS = itertools.count()
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


def _record_crc() -> Any:
    """The record checksum: ours in C when built, else tensorboard's (pure Python)."""
    try:
        from phase_timer._native import masked_crc32c as crc
    except ImportError:  # pragma: no cover - depends on the build
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as crc
    return crc


def _scalars_record() -> Any:
    """A scalars event's whole record in C (``_native.event_record``: protobuf's own bytes, ~10x less time with
    the GIL held), or None: built with protobuf."""
    try:
        from phase_timer._native import event_record
    except ImportError:  # pragma: no cover - depends on the build
        return None
    return event_record


def open_event_file(log_dir: str, *, per_step: bool, ranks: bool = False) -> Sink:
    """An event file of our own under ``log_dir``, with the custom-scalars layout.

    Written on a thread of its own, so that a slow file system (a network mount)
    never holds a training step: the training thread only puts on a queue.
    """
    from phase_timer.outputs.tags import custom_scalars_layout

    return BackgroundSink(EventFileSink(log_dir, layout=custom_scalars_layout(per_step, ranks)), "tensorboard")
