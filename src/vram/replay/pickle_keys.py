"""Which objects an untrusted pickle may use as dict keys and set members, checked before anything
hashes them: on the objects (`check_key`, the pure-Python unpickler) and, for the C unpickler,
which cannot be told to check, on the file's opcodes before it runs (`scan`).

A key is hashed when it goes in, and compared with every key of the same hash it meets. For a
tuple both walk all of its leaves, without caching and with no depth check (CPython 3.11
``tuplehash``): a tuple built from memo fetches, each level twice the one before, has 2**30
leaves in 200 bytes, and one nested 200,000 deep overflows the C stack. An int's hash is its
value modulo 2**61 - 1, so a file can give thousands of distinct keys the same hash and make each
insertion compare with all the keys before it (quadratic); tuples and floats can be made to
collide the same way, and an equal but distinct long str is compared byte by byte at every use.
So a key or member must be one of the kinds whose hash is cached or trivially distinct and whose
comparison is short: a str or bytes of at most `MAX_KEY_CHARS` characters, an int whose hash is
itself (below 2**61 - 1 in size), a bool or None. Snapshot keys are strings (PyTorch's
``_cuda_memorySnapshot`` in torch/csrc/cuda/Module.cpp writes nothing else), so nothing real is
refused; anything else is refused where it would be hashed, with the byte offset and opcode.

`scan` follows the C unpickler (Modules/_pickle.c) opcode by opcode, keeping for every stack item
and memo entry only the kind of object it is (`Kind`). Objects are never changed into another
kind and the memo holds references, so the kind an item has when it is pushed, fetched (GET,
BINGET, LONG_BINGET, DUP) or stored (PUT, BINPUT, LONG_BINPUT, MEMOIZE, numbered as the C memo
numbers) is the kind it has when it is hashed. Every opcode that hashes is checked: DICT and
SETITEM / SETITEMS (each key), ADDITEMS and FROZENSET (each member), in the order the unpickler
hashes them. Whatever it does not follow exactly (the text opcodes of protocols 0 and 1, anything
that calls or builds an object, a stack or memo misuse the C unpickler fails on, items added to
a container of another kind than list / dict / set, a str that is not valid UTF-8, a memo index
larger than the file, a file without STOP) gives `UNMODELLED`: the file then goes to the
pure-Python unpickler, which checks each key object itself. Its work and memory are linear in
the file. ``_ccore.pickle_keys`` is the same walk in C (compared in tests/test_pickle_keys.py).
"""
from __future__ import annotations

import pickle
from enum import IntEnum
from typing import Any

from . import ccore

__all__ = ["MAX_KEY_CHARS", "OK", "REFUSED", "UNMODELLED", "Kind", "check_key", "refusal", "scan",
           "scan_python"]

MAX_KEY_CHARS = 256  # the longest str / bytes key or member read (snapshot keys: at most 28)
HASH_MODULUS = (1 << 61) - 1  # an int's hash is itself below this (sys.hash_info.modulus)

OK, REFUSED, UNMODELLED = 0, 1, 2  # what `scan` says about a file


class Kind(IntEnum):
    """What a stack item or memo entry is, as far as keys go (the same numbers in ``_ccore.c``)."""

    KEY = 0  # a str / bytes of at most MAX_KEY_CHARS characters, an int below 2**61 - 1, bool, None
    TUPLE = 1
    FLOAT = 2
    BIG_INT = 3
    LONG_STR = 4
    LONG_BYTES = 5
    FROZENSET = 6
    LIST = 7
    DICT = 8
    SET = 9
    BYTEARRAY = 10


_UNHASHABLE = {Kind.LIST: "list", Kind.DICT: "dict", Kind.SET: "set", Kind.BYTEARRAY: "bytearray"}
_WHY = "(snapshot keys are strings; other kinds can take time out of proportion to the file to hash)"


def refusal(kind: Kind) -> str:
    """The message for a key or member of `kind` (one text for both unpicklers)."""
    if kind in _UNHASHABLE:
        return f"unhashable dict key or set member (a {_UNHASHABLE[kind]})"
    what = {Kind.TUPLE: "a tuple", Kind.FLOAT: "a float", Kind.FROZENSET: "a frozenset",
            Kind.BIG_INT: "an int of 2**61 - 1 or more in size",
            Kind.LONG_STR: f"a str longer than {MAX_KEY_CHARS} characters",
            Kind.LONG_BYTES: f"a bytes longer than {MAX_KEY_CHARS}"}[kind]
    return f"a dict key or set member is {what} {_WHY}"


def _kind_of(obj: Any) -> Kind | None:
    """The `Kind` of an object a plain-data pickle can make; None for any other."""
    t = type(obj)
    if t is str:
        return Kind.KEY if len(obj) <= MAX_KEY_CHARS else Kind.LONG_STR
    if t is bytes:
        return Kind.KEY if len(obj) <= MAX_KEY_CHARS else Kind.LONG_BYTES
    if t is int:
        return Kind.KEY if -HASH_MODULUS < obj < HASH_MODULUS else Kind.BIG_INT
    if t is bool or obj is None:
        return Kind.KEY
    kinds = {tuple: Kind.TUPLE, float: Kind.FLOAT, frozenset: Kind.FROZENSET, list: Kind.LIST, dict: Kind.DICT,
             set: Kind.SET, bytearray: Kind.BYTEARRAY}
    return kinds.get(t)


def check_key(obj: Any) -> None:
    """Refuse a dict key or set member that is not of a kind `scan` lets through (O(1) work)."""
    kind = _kind_of(obj)
    if kind is None:
        raise pickle.UnpicklingError(f"a dict key or set member is a {type(obj).__name__} {_WHY}")
    if kind is not Kind.KEY:
        raise pickle.UnpicklingError(refusal(kind))


def scan(data: bytes) -> tuple[int, int, int] | None:
    """(`OK` | `REFUSED` | `UNMODELLED`, byte offset, `Kind`) for a pickle (see the module doc), in
    C; None where the C core is not used (`scan_python` takes as long as the pure-Python
    unpickler, which then decodes the file instead)."""
    module = ccore.loaded()
    return None if module is None else module.pickle_keys(data)


_LEN = {0x8C: 1, 0x58: 4, 0x8D: 8, 0x55: 1, 0x54: -4, 0x43: 1, 0x42: 4, 0x8E: 8, 0x96: 8, 0x8A: 1, 0x8B: -4}
_FIXED = {0x4B: 1, 0x4D: 2, 0x4A: 4, 0x47: 8}  # BININT1, BININT2, BININT, BINFLOAT
#: the kind of target each opcode that adds to a container is followed on (APPEND, APPENDS,
#: SETITEM, SETITEMS, ADDITEMS); another (a bytearray's append, a list's setitem) is not followed
_TARGET = {0x61: Kind.LIST, 0x65: Kind.LIST, 0x73: Kind.DICT, 0x75: Kind.DICT, 0x90: Kind.SET}
_PUSH = {0x4E: Kind.KEY, 0x88: Kind.KEY, 0x89: Kind.KEY, 0x5D: Kind.LIST, 0x7D: Kind.DICT, 0x29: Kind.TUPLE,
         0x8F: Kind.SET}  # NONE, NEWTRUE, NEWFALSE, EMPTY_LIST, EMPTY_DICT, EMPTY_TUPLE, EMPTY_SET


def _sized(op: int, arg: bytes) -> Kind | None:
    """The kind a length-prefixed opcode pushes; None where the C unpickler would fail."""
    n = len(arg)
    if op in (0x8C, 0x58, 0x8D):  # SHORT_BINUNICODE, BINUNICODE, BINUNICODE8: UTF-8, surrogatepass
        try:
            chars = len(arg.decode("utf-8", "surrogatepass"))
        except UnicodeDecodeError:
            return None
        return Kind.KEY if chars <= MAX_KEY_CHARS else Kind.LONG_STR
    if op in (0x55, 0x54):  # SHORT_BINSTRING, BINSTRING: decoded as ASCII (the default encoding)
        if not arg.isascii():
            return None
        return Kind.KEY if n <= MAX_KEY_CHARS else Kind.LONG_STR
    if op in (0x43, 0x42, 0x8E):
        return Kind.KEY if n <= MAX_KEY_CHARS else Kind.LONG_BYTES
    if op == 0x96:
        return Kind.BYTEARRAY
    value = int.from_bytes(arg, "little", signed=True)  # LONG1, LONG4
    return Kind.KEY if -HASH_MODULUS < value < HASH_MODULUS else Kind.BIG_INT


_STOP_HERE = -1  # `_marked` / `_memo`: the C unpickler fails at this opcode (unmodelled from here)
_MARKED_PUSH = {0x74: Kind.TUPLE, 0x6C: Kind.LIST, 0x64: Kind.DICT, 0x91: Kind.FROZENSET}


def _marked(op: int, stack: list[int], marks: list[int]) -> int | None:
    """POP_MARK, TUPLE, LIST, DICT, FROZENSET, APPENDS, SETITEMS, ADDITEMS (``marker`` pops the
    mark first): None when done, the `Kind` of a refused key, or `_STOP_HERE`."""
    if not marks:
        return _STOP_HERE
    mark = marks.pop()
    items = stack[mark:]
    fence = marks[-1] if marks else 0
    if op in (0x65, 0x75, 0x90):  # APPENDS, SETITEMS, ADDITEMS: the target below the mark
        if mark <= fence or items and (stack[mark - 1] != _TARGET[op] or op == 0x75 and len(items) % 2):
            return _STOP_HERE
    elif op == 0x64 and len(items) % 2:  # DICT
        return _STOP_HERE
    if op in (0x64, 0x75, 0x91, 0x90):
        bad = next((k for k in items[::2 if op in (0x64, 0x75) else 1] if k != Kind.KEY), None)
        if bad is not None:
            return bad
    del stack[mark:]
    if op in _MARKED_PUSH:
        stack.append(_MARKED_PUSH[op])
    return None


def _memo(op: int, idx: int, stack: list[int], memo: dict[int, int], fence: int, n: int) -> bool:
    """BINGET, LONG_BINGET, BINPUT, LONG_BINPUT, MEMOIZE (`idx` its count of entries, as the C
    memo_len); False where the C unpickler fails (or the index is larger than the file)."""
    if op in (0x68, 0x6A):
        if idx not in memo:
            return False
        stack.append(memo[idx])
        return True
    if len(stack) <= fence or idx > n:
        return False
    memo[idx] = stack[-1]
    return True


def scan_python(data: bytes) -> tuple[int, int, int]:  # noqa: C901 - one opcode per branch, as _pickle.c's load
    """`scan` in Python: the reference for ``_ccore.pickle_keys``. Rules per opcode:
    Modules/_pickle.c (3.11), ``load`` and the ``load_*`` it dispatches to; ``fence`` is the
    stack length at the last MARK, below which nothing pops."""
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[int, int] = {}
    pos, n = 0, len(data)
    while pos < n:
        at, op = pos, data[pos]
        pos += 1
        fence = marks[-1] if marks else 0
        if op in _PUSH:
            stack.append(_PUSH[op])
        elif op in _FIXED:
            pos += _FIXED[op]
            stack.append(Kind.FLOAT if op == 0x47 else Kind.KEY)
        elif op in _LEN:
            width = abs(_LEN[op])
            if pos + width > n:
                break
            size = int.from_bytes(data[pos:pos + width], "little", signed=_LEN[op] < 0)
            pos += width
            kind = _sized(op, data[pos:pos + size]) if 0 <= size <= n - pos else None
            if kind is None:
                break
            pos += size
            stack.append(kind)
        elif op == 0x28:  # MARK
            marks.append(len(stack))
        elif op == 0x2E:  # STOP
            return OK, at, Kind.KEY
        elif op in (0x68, 0x6A, 0x71, 0x72, 0x94):  # BINGET, LONG_BINGET, BINPUT, LONG_BINPUT, MEMOIZE
            width = 0 if op == 0x94 else 1 if op in (0x68, 0x71) else 4
            if pos + width > n:
                break
            idx = len(memo) if op == 0x94 else int.from_bytes(data[pos:pos + width], "little")
            pos += width
            if not _memo(op, idx, stack, memo, fence, n):
                break
        elif op == 0x32:  # DUP
            if len(stack) <= fence:
                break
            stack.append(stack[-1])
        elif op == 0x30:  # POP: the mark, if nothing was pushed since it
            if marks and marks[-1] == len(stack):
                marks.pop()
            elif len(stack) <= fence:
                break
            else:
                stack.pop()
        elif op in (0x85, 0x86, 0x87):  # TUPLE1, TUPLE2, TUPLE3
            count = op - 0x84
            if len(stack) - count < fence:
                break
            del stack[len(stack) - count:]
            stack.append(Kind.TUPLE)
        elif op in (0x61, 0x73):  # APPEND, SETITEM: do_append / do_setitems from the top
            x = len(stack) - (1 if op == 0x61 else 2)
            if x <= fence or stack[x - 1] != _TARGET[op]:
                break
            if op == 0x73 and stack[x] != Kind.KEY:
                return REFUSED, at, stack[x]
            del stack[x:]
        elif op in (0x31, 0x74, 0x6C, 0x64, 0x91, 0x65, 0x75, 0x90):  # the ops that pop a MARK
            got = _marked(op, stack, marks)
            if got == _STOP_HERE:
                break
            if got is not None:
                return REFUSED, at, got
        elif op == 0x80:  # PROTO
            if pos >= n or data[pos] > pickle.HIGHEST_PROTOCOL:
                break
            pos += 1
        elif op == 0x95:  # FRAME: its bytes are the opcodes that follow
            pos += 8
        else:  # text opcodes, calls and objects, buffers, extensions, persistent ids, unknown
            break
    return UNMODELLED, min(pos, n), Kind.KEY
