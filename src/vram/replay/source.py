"""Reading a snapshot's bytes from a path, a pipe or bytes within a size limit, and telling its
format, for `vram.replay.loader`: nothing is read past the limit, and a pipe's bytes beyond
`_SPILL` wait on disk."""
from __future__ import annotations

import os
import stat
import tempfile

from .messages import Invalid, SnapshotError, printable
from .rmm import RMM_HEADER
from .safe_pickle import OPCODE_BYTES

DEFAULT_MAX_BYTES = 2 * 1024**3
_CHUNK = 16 << 20
#: a pipe's bytes beyond this wait in a temporary file until its end: one longer than the limit
#: is refused having held no more than this in memory
_SPILL = 64 << 20
# Bytes a supported file can start with: a pickle opcode, JSON's whitespace, BOM, '{' or '['
# (RMM's header starts with 'T', itself an opcode). /dev/zero is refused after one read.
_STARTS = OPCODE_BYTES | frozenset(b" \t\r\n{[\xef")


def detect(data: bytes) -> str:
    """Pickle protocol 2+ opens with PROTO (0x80); JSON with ``{``/``[``; RMM with its header;
    anything else ending in the STOP opcode ``.`` is tried as a protocol 0/1 pickle."""
    text = data.lstrip(b"\xef\xbb\xbf")
    if data[:1] == b"\x80":
        return "pickle"
    if text.lstrip()[:1] in (b"{", b"["):
        return "json"
    if text.split(b"\n", 1)[0].strip() == RMM_HEADER.encode():
        return "rmm-csv"
    if data.endswith(b"."):
        return "pickle"
    raise Invalid("unrecognised format (expected a pickle, JSON, or an RMM CSV log)")


def _too_large(name: str, size: int | str, max_bytes: int) -> SnapshotError:
    return SnapshotError(f"{name}: larger than the {max_bytes:,}-byte limit ({size} bytes); "
                         "pass max_bytes to raise it")


def read_source(source: str | os.PathLike[str] | bytes, max_bytes: int, sniff: bool) -> tuple[str, bytes]:
    """The file's bytes. A regular file's size is checked before anything is read; other files
    (pipes, devices) are read in `_CHUNK`-byte pieces, stopping at `max_bytes` + 1 (beyond
    `_SPILL` bytes they wait in a temporary file, so a pipe over the limit is refused without
    holding it in memory), and refused after the first piece when it cannot start any supported
    format (`sniff`; e.g. /dev/zero)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if len(data) > max_bytes:
            raise _too_large("<bytes>", f"{len(data):,}", max_bytes)
        return "<bytes>", data
    name = printable(os.fsdecode(source), 300)
    try:
        with open(source, "rb") as f:
            st = os.fstat(f.fileno())
            regular = stat.S_ISREG(st.st_mode)
            if regular and st.st_size > max_bytes:
                raise _too_large(name, f"{st.st_size:,}", max_bytes)
            chunks = [f.read(min(st.st_size + 1 if regular else _CHUNK, max_bytes + 1))]
            total = len(chunks[0])
            if sniff and total and chunks[0][0] not in _STARTS:
                raise SnapshotError(f"{name}: unrecognised format (byte 0 is {chunks[0][0]:#04x}: "
                                    "not a pickle, JSON, or an RMM CSV log)")
            with tempfile.TemporaryFile() as spill:
                spilled = 0
                while total <= max_bytes and (total > st.st_size or not regular):  # else: at its end
                    more = f.read(min(_CHUNK, max_bytes + 1 - total))
                    if not more:
                        break
                    chunks.append(more)
                    total += len(more)
                    if total - spilled > _SPILL:  # a pipe of unknown length: its bytes wait on disk
                        spill.writelines(chunks)
                        spilled, chunks = total, []
                if total > max_bytes:
                    raise _too_large(name, f"more than {max_bytes:,}", max_bytes)
                if spilled:
                    spill.seek(0)
                    chunks.insert(0, spill.read(spilled))
    except OSError as exc:
        raise SnapshotError(f"{name}: cannot read: {printable(exc.strerror or str(exc), 200)}") from None
    return name, chunks[0] if len(chunks) == 1 else b"".join(chunks)


