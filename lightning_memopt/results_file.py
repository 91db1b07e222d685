"""Append rows to a results CSV safely while other processes append to it too (a Hydra sweep's jobs).

A plain ``open(path, "a")`` loses rows when several processes append at once (each writes from the
end it saw), and two jobs that both find the file empty both write the header. :func:`append_row` takes
an exclusive lock on the file around the whole "read the header, write it if the file is empty,
write the row, flush and fsync", so every row lands whole and the header once. The lock is
``fcntl.flock`` on POSIX and ``msvcrt.locking`` of the first byte on Windows; both are released by the
operating system if the process dies, so a killed job never leaves the file locked.
"""

from __future__ import annotations

import csv
import io
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]
    import msvcrt

LOCK_TIMEOUT_SECONDS = 60.0  # Windows only: how long to wait for the lock before giving up


def _lock(fd: int, path: Path) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    deadline = time.monotonic() + LOCK_TIMEOUT_SECONDS
    while True:
        os.lseek(fd, 0, os.SEEK_SET)
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not lock {str(path)!r} within {LOCK_TIMEOUT_SECONDS:g} s") from None
            time.sleep(0.01)


def _unlock(fd: int) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return
    os.lseek(fd, 0, os.SEEK_SET)
    msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)


def _first_line(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    line = b""
    while b"\n" not in line:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        line += chunk
    return line.split(b"\n", 1)[0].rstrip(b"\r")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def append_row(path: str | os.PathLike[str], row: Mapping[str, Any]) -> None:
    """Append ``row`` to the CSV at ``path`` (its keys are the columns), with a header if the file is new or empty.

    Safe under concurrent writers, threads or processes: the check of the header and the write of the
    row happen under an exclusive lock, and the row is flushed to disk (fsync) before the lock is
    released. Missing folders are created.

    Raises:
        ValueError: the file's header has other columns than ``row``, naming the file and both lists.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     file = os.path.join(folder, "runs", "grid.csv")
        ...     append_row(file, {"label": "lr=0.1", "loss": 0.5})
        ...     append_row(file, {"label": "lr=0.2", "loss": 0.4})
        ...     print(open(file, newline="").read().replace("\\r\\n", "|"))
        label,loss|lr=0.1,0.5|lr=0.2,0.4|
    """
    path = Path(path)
    columns = [str(column) for column in row]
    path.parent.mkdir(parents=True, exist_ok=True)
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writerow(row)
    line = text.getvalue()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | getattr(os, "O_BINARY", 0), 0o666)
    try:
        _lock(fd, path)
        try:
            if os.fstat(fd).st_size == 0:
                header = io.StringIO()
                csv.writer(header).writerow(columns)
                line = header.getvalue() + line
            else:
                found = next(csv.reader([_first_line(fd).decode("utf-8", errors="replace")]), [])
                if found != columns:
                    raise ValueError(
                        f"cannot append to {str(path)!r}: it has the columns {found}, but the row has the columns"
                        f" {columns}; append to another file, or move this one away"
                    )
            _write_all(fd, line.encode("utf-8"))
            os.fsync(fd)
        finally:
            _unlock(fd)
    finally:
        os.close(fd)
