"""Writing files so that a reader never sees half of one: the one atomic-write helper every module uses."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, mode: str = "w", *, encoding: str | None = "utf-8") -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path`` and, when the block ends without an exception, move it into place
    with :func:`os.replace` (atomic on POSIX and Windows). On an exception the temporary file is removed and ``path``
    keeps its old content, if it had one.

    Example::

        with atomic_writer("report.json") as f:
            json.dump(data, f)
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_writer mode must be 'w' or 'wb', not {mode!r}")
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
        # mkstemp makes the file owner-only; the result gets the permissions open() would give it.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` (bytes, or text as UTF-8) to ``path`` atomically; returns the path."""
    with atomic_writer(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    return Path(path)
