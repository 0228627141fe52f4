"""Writing output files so that a failure never destroys what was there: every writer writes a
temporary file beside the target and renames it over the target only once it is complete
(``os.replace`` is atomic on one file system). A failing write leaves the old file, and no
partial one; writing over the input file reads it whole before anything is replaced."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any


@contextmanager
def replaced(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary file in `path`'s folder for writing (`mode` "w" or "wb"); on success it
    replaces `path` (keeping an existing file's permissions, else those `open` would give), on
    any error it is removed and `path` is left as it was."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', not {mode!r}")
    target = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(target) + ".", suffix=".partial", dir=folder)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        try:
            keep = os.stat(target).st_mode & 0o7777
        except OSError:
            umask = os.umask(0)
            os.umask(umask)
            keep = 0o666 & ~umask
        os.chmod(tmp, keep)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
