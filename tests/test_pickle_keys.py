"""The scan of a pickle's dict keys and set members (`vram.replay.pickle_keys`): ``_ccore.pickle_keys``
(C) against `scan_python` (the reference), verdict for verdict, offset for offset; and the scan
against the pure-Python unpickler, which checks every key object itself (`check_key`): where the
scan refuses a key, the unpickler refuses the same key at the same byte with the same message,
and where the scan lets a file through, the unpickler refuses no key of it.

Files: every real recording, pickles of varied plain data in every protocol, the hostile keys
(tuples built from memo fetches, ints that share one hash, long strs), real pickles cut and
changed byte by byte, and random opcode programs built to keep the stack and the memo mostly
consistent, so that most of them reach their STOP.
"""
from __future__ import annotations

import io
import pickle
import random
import re
from typing import Any

import pytest

from paths import RECORDINGS
from test_ccore import built  # noqa: F401  (the fixture builds the C core)
from vram.replay import ccore, pickle_keys, safe_pickle
from vram.replay.loader import SnapshotError, load_snapshot
from vram.replay.messages import Invalid
from vram.replay.pickle_keys import OK, REFUSED, UNMODELLED, Kind

P = (1 << 61) - 1


def _c(data: bytes) -> tuple[int, int, int]:
    module = ccore.loaded()
    if module is None:
        pytest.skip(f"the C core is not used here: {ccore.available()}")
    return tuple(module.pickle_keys(data))  # type: ignore[no-any-return]


def _pure(data: bytes) -> str:
    """What the pure-Python unpickler makes of `data`: "ok" or its one-line error."""
    try:
        safe_pickle._capped(len(data), safe_pickle.SafeUnpickler(io.BytesIO(data)).load)
    except Invalid as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - any other failure: not about keys
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _agree(data: bytes) -> tuple[int, int, int]:
    """Both scans give the same answer, and the pure-Python unpickler agrees with it on keys."""
    want = pickle_keys.scan_python(data)
    assert _c(data) == want, data[:200]
    verdict, offset, kind = want
    pure = _pure(data)
    if verdict == REFUSED:
        name = safe_pickle._OPNAMES[data[offset]]
        assert pure == f"corrupt pickle at byte {offset:,} ({name}): {pickle_keys.refusal(Kind(kind))}", data[:200]
    elif verdict == OK:
        assert "dict key or set member" not in pure, (pure, data[:200])
    return want


def _bin(text: str) -> bytes:
    raw = text.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def _snapshot(settings: bytes) -> bytes:
    """``{"segments": [], "device_traces": [], "allocator_settings": {...}}`` with raw settings opcodes."""
    return (b"\x80\x04}(" + _bin("segments") + b"]" + _bin("device_traces") + b"]"
            + _bin("allocator_settings") + b"}" + settings + b"u.")


def tuple_dag(levels: int) -> bytes:
    """t0 = ("x",), t(k+1) = (t(k), t(k)), each level put in the memo and fetched back: 2**levels leaves."""
    out = _bin("x") + b"\x85q\x00"
    for k in range(levels):
        out += b"h" + bytes([k]) + b"\x86q" + bytes([k + 1])
    return out


def int_flood(n: int) -> bytes:
    """n distinct int keys that all hash to 0: k * (2**61 - 1)."""
    return b"(" + b"".join(pickle.dumps(k * P, protocol=4)[2:-1] + b"N" for k in range(1, n + 1)) + b"u"


HOSTILE = {
    "tuple-dag": _snapshot(tuple_dag(30) + b"K\x01s"),
    "tuple-dag-dict": _snapshot(b"(" + tuple_dag(30) + b"K\x01" + b"u"),
    "tuple-dag-frozenset": _snapshot(_bin("x") + b"(" + tuple_dag(30) + b"\x91s"),
    "tuple-dag-set": _snapshot(_bin("x") + b"\x8f(" + tuple_dag(30) + b"\x90s"),
    "tuple-dag-memoize": _snapshot(_bin("x") + b"\x85\x94" + b"h\x00\x86\x94" * 3 + b"K\x01s"),
    "tuple-dag-dup": _snapshot(_bin("x") + b"\x852\x86" * 3 + b"K\x01s"),
    "int-flood": _snapshot(int_flood(2000)),
    "long-equal-strs": _snapshot(_bin("s" * 100_000) + b"q\x00Ns" + _bin("s" * 100_000) + b"q\x01Ns"
                                 + b"h\x01Ns" * 1000),
    "float-key": _snapshot(b"G" + bytes(8) + b"K\x01s"),
    "list-key": _snapshot(b"]K\x01s"),
}


def test_the_hostile_keys_are_refused_where_they_would_be_hashed() -> None:
    expected = {"tuple-dag": Kind.TUPLE, "tuple-dag-dict": Kind.TUPLE, "tuple-dag-frozenset": Kind.TUPLE,
                "tuple-dag-set": Kind.TUPLE, "tuple-dag-memoize": Kind.TUPLE, "tuple-dag-dup": Kind.TUPLE,
                "int-flood": Kind.BIG_INT, "long-equal-strs": Kind.LONG_STR, "float-key": Kind.FLOAT,
                "list-key": Kind.LIST}
    for name, data in HOSTILE.items():
        verdict, offset, kind = _agree(data)
        assert (verdict, kind) == (REFUSED, expected[name]), name
        assert safe_pickle._OPNAMES[data[offset]] in ("SETITEM", "SETITEMS", "DICT", "FROZENSET", "ADDITEMS"), name


@pytest.mark.parametrize("name", sorted(p.name for p in RECORDINGS.glob("*.pickle")))
def test_every_recording_passes_in_both_scans(name: str) -> None:
    data = (RECORDINGS / name).read_bytes()
    assert _agree(data) == (OK, len(data) - 1, Kind.KEY)


VALUES: list[Any] = [
    {"a": 1, "b": [1, 2.5, None, True, False, b"xy", "é" * 300, 2**64, -(2**70), (1, (2, 3))]},
    {"k": {"x": frozenset({1, "a"}), "y": {1, 2}, "z": bytearray(b"q")}},
    {1: "a", -1: "b", P - 1: "c", -(P - 1): "d", False: 0, None: 1, b"b" * 256: 2, "s" * 256: 3},
    {P: 1}, {-P: 1}, {2**63: 1}, {(1, 2): 3}, {1.0: 2}, {frozenset(): 1}, {"s" * 257: 1}, {b"b" * 257: 1},
    {"\ud800" * 3: 1}, frozenset({(1,)}), {(): 1}, [{"a": 1}] * 3, {"ünïcode": "ç" * 40},
]


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_plain_data_in_every_protocol(protocol: int) -> None:
    seen = set()
    for value in VALUES:
        seen.add(_agree(pickle.dumps(value, protocol=protocol))[0])
    if protocol == 0:  # text opcodes only: the pure-Python unpickler decides
        assert seen == {UNMODELLED}
    else:
        assert {OK, REFUSED} <= seen, seen


def _mutants(data: bytes, rng: random.Random, count: int) -> list[bytes]:
    out = []
    for _ in range(count):
        b = bytearray(data)
        how = rng.random()
        if how < 0.2:
            b = b[:rng.randrange(len(b))]
        else:
            for _ in range(rng.randint(1, 4)):
                k = rng.randrange(len(b))
                if how < 0.6:
                    b[k] = rng.randrange(256)
                elif how < 0.8:
                    b[k:k] = bytes([rng.choice(b"()tlduse\x85\x86\x87\x90\x91\x94hjqr20\x8c\x8a")])
                else:
                    del b[k]
        out.append(bytes(b))
    return out


def test_changed_and_cut_recordings() -> None:
    rng = random.Random(7)
    small = pickle.dumps(load_snapshot(RECORDINGS / "cs336-s-mem.pickle")["segments"][:3], protocol=4)
    seen = set()
    for data in _mutants(small, rng, 600):
        seen.add(_agree(data)[0])
    assert seen == {OK, REFUSED, UNMODELLED}, seen


_LEAVES = [b"N", b"\x88", b"K\x07", b"M\x07\x01", b"J\x01\x00\x00\x80", b"G" + bytes(8),
           b"\x8a\x09" + bytes(8) + b"\x01", b"\x8a\x08" + b"\xff" * 8, b"\x8a\x08" + (P - 1).to_bytes(8, "little"),
           b"\x8a\x08" + P.to_bytes(8, "little"),
           b"\x8c\x01a", b"\x8c\x02\xc3\xa9", b"\x8c\x02\xc3(", b"U\x01b", b"U\x01\xff", b"C\x01b", b"]", b"}", b")",
           b"\x8f", b"\x96" + (1).to_bytes(8, "little") + b"z"]


def random_program(rng: random.Random) -> bytes:
    """Opcodes that mostly keep the stack and memo consistent, ending in STOP."""
    out, depth, marks, memo = [b"\x80\x04"], 0, [], 0
    for _ in range(rng.randint(1, 40)):
        r = rng.random()
        fence = marks[-1] if marks else 0
        if r < 0.3 or depth <= fence:
            out.append(rng.choice(_LEAVES))
            depth += 1
        elif r < 0.4:
            out.append(b"(")
            marks.append(depth)
        elif r < 0.5 and memo:
            out.append(b"h" + bytes([rng.randrange(memo + 1)]))
            depth += 1
        elif r < 0.58:
            out.append(rng.choice([b"\x94", b"q" + bytes([memo])]))
            memo += 1
        elif r < 0.66:
            op = rng.choice([b"\x85", b"\x86", b"\x87", b"2", b"0"])
            need = {b"\x85": 1, b"\x86": 2, b"\x87": 3, b"2": 1, b"0": 1}[op]
            if depth - need >= fence:
                out.append(op)
                depth += {b"\x85": 0, b"\x86": -1, b"\x87": -2, b"2": 1, b"0": -1}[op]
        elif r < 0.74 and depth - fence >= 3:
            out.append(rng.choice([b"s", b"a"]))
            depth -= 2 if out[-1] == b"s" else 1
        elif marks:
            op = rng.choice([b"t", b"l", b"d", b"\x91", b"e", b"u", b"\x90", b"1"])
            mark = marks.pop()
            out.append(op)
            depth = mark + (1 if op in (b"t", b"l", b"d", b"\x91") else 0)
    out.append(b".")
    return b"".join(out)


def test_random_programs() -> None:
    rng = random.Random(11)
    seen: dict[int, int] = {}
    for _ in range(4000):
        verdict = _agree(random_program(rng))[0]
        seen[verdict] = seen.get(verdict, 0) + 1
    assert min(seen.get(v, 0) for v in (OK, REFUSED, UNMODELLED)) > 100, seen


def test_the_c_unpickler_never_runs_on_a_refused_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal comes from the scan, before anything is unpickled (a 2**30-leaf tuple key took
    the C unpickler about 60 s to hash); the pure-Python unpickler refuses it at the same byte."""
    def never(data: bytes) -> None:
        raise AssertionError("the C unpickler ran")

    monkeypatch.setattr(safe_pickle, "_c_load", never)
    messages = []
    for c_unpickler in (True, False):
        monkeypatch.setattr(safe_pickle, "C_UNPICKLER", c_unpickler)
        with pytest.raises(SnapshotError) as info:
            load_snapshot(HOSTILE["tuple-dag"])
        messages.append(str(info.value))
    assert messages[0] == messages[1] == ("<bytes>: corrupt pickle at byte 222 (SETITEM): a dict key or set member "
                                          "is a tuple (snapshot keys are strings; other kinds can take time out of "
                                          "proportion to the file to hash)")


def test_key_checks_take_no_walk() -> None:
    """`check_key` looks at the key's type and size only: a tuple of 2**60 leaves (60 levels, each
    twice the one before) is refused at once (walking its levels never ended)."""
    t: Any = ("x",)
    for _ in range(60):
        t = (t, t)
    for key, kind in ((t, "a tuple"), (P, "an int of 2**61 - 1"), ("s" * 257, "a str longer than 256"),
                      (1.5, "a float"), ([], "unhashable dict key or set member (a list)")):
        with pytest.raises(pickle.UnpicklingError, match=re.escape(kind)):
            pickle_keys.check_key(key)
    for key in ("s" * 256, b"b" * 256, P - 1, -(P - 1), 0, True, None):
        pickle_keys.check_key(key)


def test_put_indices_that_could_share_a_hash_are_refused() -> None:
    """Protocol 0's PUT takes its memo index in decimal: 2**61 - 1 and its multiples all hash to
    0 in the pure-Python unpickler's memo dict."""
    data = b"(l" + b"".join(b"p%d\n" % (k * P) for k in range(1, 4)) + b"."
    with pytest.raises(SnapshotError, match=r"a PUT index of 2\*\*61 - 1 or more"):
        load_snapshot(data)
    assert load_snapshot(b"(lp99999999999\n.")["segments"] == []
