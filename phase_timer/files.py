"""phase-timer's own files (the summary, the trace, the memory snapshot), written where the run's logger writes.

A logger's ``log_dir`` may be a local folder or an fsspec URL (``s3://``, ``gs://``, ``memory://``: Lightning's
loggers take them, and Lightning depends on fsspec).  A local file is written atomically (a temporary file in
the same folder, then a rename), made as ``open()`` makes one (mode 0666 less the umask, like the event files
beside it).  A URL is written through fsspec in one ``open``/``write``/``close``: an object store makes the
object whole at its close, and a failure there raises to the caller, which warns and goes on.
"""

from __future__ import annotations

import os
import secrets


def is_url(path: str | os.PathLike[str]) -> bool:
    """A path with a scheme (``s3://...``, ``memory://...``), for fsspec; ``file://`` too."""
    return "://" in os.fspath(path)


def join(directory: str | os.PathLike[str], name: str) -> str:
    """``name`` in ``directory`` (a URL's separator is ``/``)."""
    directory = os.fspath(directory)
    return directory.rstrip("/") + "/" + name if is_url(directory) else os.path.join(directory, name)


def write(path: str | os.PathLike[str], data: bytes) -> str:
    """``data`` as the whole of ``path`` (its folder made); returns the path written."""
    path = os.fspath(path)
    if is_url(path):
        import fsspec

        fs, inner = fsspec.core.url_to_fs(path)
        parent = inner.rsplit("/", 1)[0] if "/" in inner else ""
        if parent:
            fs.makedirs(parent, exist_ok=True)
        with fs.open(inner, "wb") as f:
            f.write(data)
        return path
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = _new_temp(directory, os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def _new_temp(directory: str, name: str) -> tuple[int, str]:
    """A new, uniquely named file in ``directory``, open for writing: ``O_EXCL``, never an existing file (nor a
    link planted there); mode 0666 less the umask (``mkstemp``'s 0600 would leave the file unreadable to another
    user or a CI step that can read the rest of the run)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = os.path.join(directory, f".{name}.{secrets.token_hex(8)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name for {name} in {directory}")
