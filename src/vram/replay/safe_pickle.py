"""Decoding untrusted pickles and JSON to plain data, in bounded memory and stack.

Three rules, on top of "nothing in a file can run" (every global, persistent id and object-building
opcode is refused):

* **Memory in proportion to the file.** Every decoder runs under a temporary address-space cap
  (``RLIMIT_AS``) of the current address space + `MEMORY_FACTOR` x the file's size +
  `MEMORY_BASE` (or + the RAM still available, if less). Real snapshots decode to about 5x
  their size; a memo bomb or millions of empty containers fail with a `SnapshotError` that
  says so, not with the kernel's OOM killer.
* **Keys that hash in bounded time.** A dict key or set member must be a short str or bytes, an
  int below 2**61 - 1, a bool or None (`vram.replay.pickle_keys`: a tuple key can take minutes
  to hash from a 200-byte file, or overflow the C stack; ints can be made to share one hash).
  The pure-Python unpickler checks every key and member before hashing it (`check_key`). The C
  unpickler cannot be told to, so the file's opcodes are checked first (`pickle_keys.scan`, in
  C, in time linear in the file): a bad key is refused there, with its byte offset and opcode; a
  file the scan does not follow exactly, or any file where the C core is not built, goes to the
  pure-Python unpickler.
* **Messages that say what is wrong with the file**: the pure-Python unpickler, which decides
  whenever the C one fails, names the byte offset and opcode (``corrupt pickle at byte 40:
  0xef is not a pickle opcode``, ``truncated: the file ends inside the pickle``).
"""
from __future__ import annotations

import copyreg
import io
import json
import os
import pickle
import pickletools
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

from vram.devices.host import available_memory

from . import pickle_keys
from .gc_pause import gc_paused
from .messages import Invalid, brief, one_line
from .pickle_keys import check_key

__all__ = ["MEMORY_BASE", "MEMORY_FACTOR", "OPCODE_BYTES", "available_memory", "decode_json", "decode_pickle",
           "gc_paused", "memory_cap"]

MEMORY_FACTOR = 32  # decoded bytes per file byte allowed (real snapshots: ~5x, see the module doc)
MEMORY_BASE = 384 << 20  # plus this, for small files and the interpreter's own arenas
C_UNPICKLER = True  # False: every file goes to the pure-Python unpickler (tests)

_REFUSED_OPCODES = ("REDUCE", "BUILD", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "EXT1", "EXT2",
                    "EXT4", "PERSID", "BINPERSID", "NEXT_BUFFER", "READONLY_BUFFER")
_OPNAMES = {ord(op.code): op.name for op in pickletools.opcodes}
_NO_ARG = frozenset(ord(op.code) for op in pickletools.opcodes if op.arg is None)
OPCODE_BYTES = frozenset(_OPNAMES)


def _refuser(name: str) -> Any:
    def refuse(self: Any) -> None:
        raise pickle.UnpicklingError(f"refused opcode {name} (snapshots are plain data: no "
                                     "calls, objects, extensions, persistent ids or buffers)")
    return refuse


def _checked(items: list[Any], step: int) -> list[Any]:
    for k in range(0, len(items), step):
        check_key(items[k])
    return items


class SafeUnpickler(pickle._Unpickler):
    """Plain-data unpickler, the canonical decoder. Built on the pure-Python unpickler, whose memo
    is a dict (the C one grows an array to any PUT index, so a 10-byte file can claim
    gigabytes). Opcodes that call or build objects are removed from its dispatch table, not just
    starved of globals (EXT1/2/4 skip `find_class` once copyreg's cache is warm); keys are
    checked before they are hashed; failures name the offset and opcode."""

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)
    dispatch.update({getattr(pickle, op)[0]: _refuser(op) for op in _REFUSED_OPCODES})

    stack: list[Any]
    metastack: list[Any]
    memo: dict[int, Any]

    def __init__(self, stream: io.BytesIO) -> None:
        super().__init__(stream)
        self._stream = stream
        self._size = len(stream.getbuffer())

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused pickled global {module}.{name} (snapshots are plain data)")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused persistent id (snapshots are plain data)")

    def _pop_mark(self, step: int) -> list[Any]:
        """The items since the last MARK (as ``pop_mark``), every `step`-th checked as a key."""
        items = self.stack
        self.stack = self.metastack.pop()
        self.append = self.stack.append
        return _checked(items, step)

    def load_dict(self) -> None:
        items = self._pop_mark(2)
        self.append({items[i]: items[i + 1] for i in range(0, len(items), 2)})

    def load_setitem(self) -> None:
        stack = self.stack
        value, key = stack.pop(), stack.pop()
        check_key(key)
        stack[-1][key] = value

    def load_setitems(self) -> None:
        items = self._pop_mark(2)
        target = self.stack[-1]
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def load_additems(self) -> None:
        items = self._pop_mark(1)
        add = self.stack[-1].add
        for x in items:
            add(x)

    def load_frozenset(self) -> None:
        items = self._pop_mark(1)  # first: it puts back the stack that `append` must push onto
        self.append(frozenset(items))

    def load_put(self) -> None:
        """PUT (protocol 0), its index in decimal: refused from 2**61 - 1 on, where ints can be
        chosen to share one hash in the memo dict (see `vram.replay.pickle_keys`)."""
        index = int(self.readline()[:-1])
        if index < 0:
            raise ValueError("negative PUT argument")
        if index >= pickle_keys.HASH_MODULUS:
            raise pickle.UnpicklingError("a PUT index of 2**61 - 1 or more (a memo index is a count of objects)")
        self.memo[index] = self.stack[-1]

    dispatch[pickle.PUT[0]] = load_put
    dispatch[pickle.DICT[0]] = load_dict
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.ADDITEMS[0]] = load_additems
    dispatch[pickle.FROZENSET[0]] = load_frozenset

    def _where(self, op: int) -> str:
        """Where the opcode `op` that just failed is: exact for opcodes without an argument."""
        end = self._offset()
        if end >= self._size:
            raise Invalid("truncated: the file ends inside the pickle") from None
        if op in _NO_ARG:
            return f"at byte {end - 1:,} ({_OPNAMES[op]})"
        return f"near byte {end:,} ({_OPNAMES.get(op, op)})"

    def _offset(self) -> int:
        frame = self._unframer.current_frame
        pos = self._stream.tell()
        if frame is not None:
            with frame.getbuffer() as buf:
                pos -= buf.nbytes - frame.tell()
        return pos

    def load(self) -> Any:
        self._unframer = pickle._Unframer(self._file_read, self._file_readline)  # type: ignore[attr-defined]
        self.read = self._unframer.read
        self.readinto = self._unframer.readinto
        self.readline = self._unframer.readline
        self.metastack = []
        self.stack = []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch = self.read, self.dispatch
        op = -1
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                op = key[0]
                handler = dispatch.get(op)
                if handler is None:
                    raise Invalid(f"corrupt pickle at byte {self._offset() - 1:,}: {op:#04x} is not "
                                  "a pickle opcode")
                handler(self)
        except pickle._Stop as stop:  # type: ignore[attr-defined]
            return stop.value
        except EOFError:
            raise Invalid("truncated: the file ends inside the pickle (no STOP opcode)") from None
        except pickle.UnpicklingError as exc:
            text = one_line(exc)
            if "exhausted" in text:
                raise Invalid("truncated: the file ends inside a pickle frame") from None
            if text.startswith("refused"):
                raise Invalid(f"unreadable pickle: {text}") from None
            raise Invalid(f"corrupt pickle {self._where(op)}: {text}") from None
        except (IndexError, KeyError) as exc:
            raise Invalid(f"corrupt pickle {self._where(op)}: it needs a value or a MARK that is not on "
                          f"the stack ({one_line(exc, 60)})") from None
        except (ValueError, TypeError, AttributeError, struct.error, OverflowError) as exc:
            raise Invalid(f"corrupt pickle {self._where(op)}: {one_line(exc)}") from None


class _FastSafeUnpickler(pickle.Unpickler):
    """The C unpickler with every global and persistent id refused. Without a global nothing
    callable can reach the stack, so REDUCE/BUILD/NEWOBJ fail on plain data; EXT opcodes are
    only safe while copyreg's extension registry is empty (checked before use)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused pickled global {module}.{name} (snapshots are plain data)")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused persistent id (snapshots are plain data)")


class _MemoryCapped(Exception):
    """Internal: a decoder ran out of the memory `memory_cap` allows (`args[0]`: the limit, in words)."""


@contextmanager
def memory_cap(nbytes: int) -> Iterator[str | None]:
    """Cap the address space, while the block runs, at the current one + `MEMORY_FACTOR` x
    `nbytes` + `MEMORY_BASE`, or + the RAM still available if that is less (a proportional cap
    larger than the machine would end in the kernel's OOM killer, not in an error). Yields the
    limit in words, for the error; None where RLIMIT_AS or /proc is unavailable."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError, AttributeError, IndexError):
        yield None
        return
    extra = MEMORY_FACTOR * nbytes + MEMORY_BASE
    why = f"{MEMORY_FACTOR}x the file's size + {MEMORY_BASE >> 20} MiB"
    free = available_memory()
    if free is not None and free < extra:
        extra, why = free, f"the {free >> 20:,} MiB of memory available"
    cap = vm + extra
    for limit in (soft, hard):
        if limit != resource.RLIM_INFINITY and limit < cap:
            cap, why = limit, f"this process's address-space limit ({limit >> 20:,} MiB)"
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield why
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _capped(nbytes: int, fn: Callable[[], Any]) -> Any:
    with memory_cap(nbytes) as why:
        try:
            return fn()
        except MemoryError:
            raise _MemoryCapped(why) from None


def _too_big(nbytes: int, exc: _MemoryCapped) -> Invalid:
    return Invalid(f"decoding needs more memory than {exc.args[0] or 'there is'} ({nbytes:,} bytes in "
                   "the file; real snapshots decode to about 5x their size)")


def _c_load(data: bytes) -> tuple[Any, int] | None:
    """The C unpickler (its keys checked by `pickle_keys.scan` first); None if it fails in any way."""
    stream = io.BytesIO(data)
    try:
        return _capped(len(data), _FastSafeUnpickler(stream).load), stream.tell()
    except Exception:  # noqa: BLE001 - any failure: the canonical pure-Python path decides
        return None


def decode_pickle(data: bytes) -> Any:
    """A pickle to plain data (see the module doc); nothing may follow its STOP opcode."""
    got = None
    if C_UNPICKLER and not (copyreg._extension_registry  # type: ignore[attr-defined]
                            or copyreg._extension_cache):  # type: ignore[attr-defined]
        verdict, offset, kind = pickle_keys.scan(data) or (pickle_keys.UNMODELLED, 0, 0)
        if verdict == pickle_keys.REFUSED:
            raise Invalid(f"corrupt pickle at byte {offset:,} ({_OPNAMES[data[offset]]}): "
                          f"{pickle_keys.refusal(pickle_keys.Kind(kind))}")
        if verdict == pickle_keys.OK:
            got = _c_load(data)
    if got is None:  # a refused opcode, a corrupt file, a memo index too large for the C
        stream = io.BytesIO(data)  # unpickler's array, opcodes the scan does not follow: the pure-Python path decides
        try:
            got = _capped(len(data), SafeUnpickler(stream).load), stream.tell()
        except _MemoryCapped as exc:
            raise _too_big(len(data), exc) from None
        except RecursionError:
            raise Invalid("corrupt pickle: nested too deeply") from None
    obj, end = got
    if end != len(data):
        raise Invalid(f"{len(data) - end:,} trailing bytes after the pickle's STOP opcode")
    return obj


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's dict, refused when a key repeats: a parser keeps only the last value (RFC 8259
    §4: names "SHOULD be unique"; json.dump never repeats one), so a repeated
    ``"device_traces"`` would silently drop every event before it."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise Invalid(f"unreadable JSON: the key {brief(key, 60)} appears twice in one object")
            seen.add(key)
    return out


def decode_json(data: bytes) -> Any:
    """JSON to plain data under the same memory cap (NaN/Infinity are refused later, by the walk;
    a key repeated in an object here: `_unique_keys`)."""
    try:
        return _capped(len(data), lambda: json.loads(data.decode("utf-8-sig"), object_pairs_hook=_unique_keys))
    except _MemoryCapped as exc:
        raise _too_big(len(data), exc) from None
    except RecursionError:
        raise Invalid("unreadable JSON: nested deeper than Python's recursion limit") from None
    except UnicodeDecodeError as exc:
        raise Invalid(f"unreadable JSON: byte {exc.start:,} is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise Invalid(f"unreadable JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    except ValueError as exc:  # e.g. an integer with more digits than int() accepts
        raise Invalid(f"unreadable JSON: {one_line(exc)}") from None
