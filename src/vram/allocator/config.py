"""Allocator configuration: ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` (spec §3, §18.3).

Follows the newest sources (``c10/core/AllocatorConfig.{h,cpp}``, ``c10/cuda/CUDAAllocatorConfig.cpp``
with ``throw_on_cudamalloc_oom`` and ``expandable_segments_reserve*``), written from them, not copied.
Where PyTorch fails unhelpfully (internal assert "Index out of bounds in ConfigTokenizer", a bare
``stoull``/``stod``) or silently accepts a malformed separator, a ConfigError names the problem.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from typing import NamedTuple

MiB = 1024 * 1024
SIZE_MAX = 2**64 - 1  # size_t max: "unlimited" max_split_size
ROUNDUP_BUCKETS = 16  # roundup_power2_divisions entries: 1 MiB ... 32 GiB and up (§3.4)
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: default large_segment_size and max_non_split_rounding (§2)
MIN_LARGE_ALLOC_MB = 10  # kMinLargeAlloc in MiB: large_segment_size_mb must exceed it
MAX_REGISTER_THREADS = 128  # pinned_max_register_threads()
ASYNC_WARNING = ("backend:cudaMallocAsync ignores max_split_size_mb,"
                 "roundup_power2_divisions, and garbage_collect_threshold.")

_SEPARATORS = frozenset(",:[]")
_DROP_SPACES = str.maketrans("", "", " \t\n\v\f\r")  # C-locale isspace() (not Python's str.isspace)
_BOOL_KEYS = {  # key -> AllocatorConfig field that stores it (None: validated, then ignored)
    "expandable_segments": "expandable_segments",
    "release_lock_on_cudamalloc": "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc": "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register": "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register": "pinned_use_cuda_host_register",
    "throw_on_cudamalloc_oom": "throw_on_cudamalloc_oom",
    "graph_capture_record_stream_reuse": None, "pinned_free_catch_all": None,
    "pinned_use_background_threads": None,
}
# Keys of PyTorch's CUDA-specific parser. In the newest source only these, backend aside, make
# backend:cudaMallocAsync print ASYNC_WARNING; max_split_size_mb, roundup_power2_divisions,
# garbage_collection_threshold, ... belong to the generic parser and do not.
_CUDA_PARSER_KEYS = frozenset(
    {"backend", "pinned_num_register_threads", "pinned_reserve_segment_size_mb",
     "per_process_memory_fraction", "expandable_segments_reserve", "expandable_segments_reserve_by_class"}
    | set(_BOOL_KEYS) - {"expandable_segments", "pinned_use_background_threads"})
KNOWN_KEYS = _CUDA_PARSER_KEYS | set(_BOOL_KEYS) | {
    "large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
    "roundup_power2_divisions", "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"}


class ConfigError(ValueError):
    """A bad allocator-config string (PyTorch raises ValueError; older versions RuntimeError)."""


@dataclass(slots=True)
class AllocatorConfig:
    """Parsed allocator settings (spec §3.3); sizes in bytes. Beyond the core's fields,
    ``pinned_num_register_threads`` / ``pinned_use_cuda_host_register`` feed the snapshot's
    ``allocator_settings`` (§18.3) and ``throw_on_cudamalloc_oom`` is the 2.15 flag of §11.4."""

    max_split_size: int = SIZE_MAX
    max_non_split_rounding: int = LARGE_BUFFER
    roundup_power2_divisions: list[int] = field(default_factory=lambda: [0] * ROUNDUP_BUCKETS)
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    large_segment_size: int = LARGE_BUFFER
    release_lock_on_cudamalloc: bool = False
    per_process_memory_fraction: float = 1.0
    backend: str = "native"
    settings: str = ""
    """The raw last settings string (snapshot ``allocator_settings.PYTORCH_CUDA_ALLOC_CONF``)."""
    pinned_num_register_threads: int = 1
    pinned_use_cuda_host_register: bool = False
    throw_on_cudamalloc_oom: bool = False

    def copy(self) -> AllocatorConfig:
        """A deep copy (the roundup table is a fresh list)."""
        return dataclasses.replace(self, roundup_power2_divisions=list(self.roundup_power2_divisions))


# ---------------------------------------------------------------------------- tokenizer (§3.2)

def tokenize(text: str) -> list[str]:
    """Split on ``, : [ ]`` (each its own token), dropping C-locale whitespace (§3.2)."""
    return [t for part in re.split(r"([,:\[\]])", text) if (t := part.translate(_DROP_SPACES))]


def _shown(token: str, limit: int = 64) -> str:
    """A token as an error message shows it: whole up to `limit` characters (PyTorch's text),
    else its start and its length, so that a huge value cannot flood the message."""
    return token if len(token) <= limit else f"{token[:limit]}...({len(token):,} characters)"


def _expected(what: str, i: int, toks: list[str]) -> ConfigError:
    got = f"got '{_shown(toks[i])}'" if i < len(toks) else "reached end of config"
    return ConfigError(f"Expected {what} at index {i} in ConfigTokenizer but {got}")


_UNCLOSED = "Expected closing bracket ']' in ConfigTokenizer but reached end of config"  # PyTorch's text
_INT_RE = re.compile(r"[+-]?[0-9]+")
_HEX_RE = re.compile(r"[+-]?0[xX]([0-9a-fA-F]+(?:\.[0-9a-fA-F]*)?|\.[0-9a-fA-F]+)(?:[pP]([+-]?[0-9]+))?")
_DEC_RE = re.compile(r"[+-]?([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_SPECIAL_RE = re.compile(r"[+-]?(?:inf(?:inity)?|nan(?:\([0-9A-Za-z_]*\))?)", re.IGNORECASE)


def stoull(tok: str) -> int | None:
    """C++ ``std::stoull`` of a leading prefix (§3.2): ``"512MB"`` -> 512, ``"-1"`` -> 2**64-1.

    None when no digits lead (``std::invalid_argument``); OverflowError past 2**64-1 (``out_of_range``).
    """
    m = _INT_RE.match(tok)
    if m is None:
        return None
    digits = m.group().lstrip("+-").lstrip("0") or "0"
    if len(digits) > 20 or (value := int(digits)) > SIZE_MAX:
        raise OverflowError(tok)
    return (-value) % 2**64 if m.group()[0] == "-" else value


def stod(tok: str) -> float | None:
    """C++ ``std::stod`` (glibc ``strtod``) of a leading prefix (§3.2): ``"0.6x"`` -> 0.6.

    Decimal, hex (``0x1p-2``), ``inf``/``infinity``, ``nan``; None when nothing converts. OverflowError
    where strtod sets ERANGE: overflow, or underflow to zero or to an inexact subnormal.
    """
    if m := _HEX_RE.match(tok):
        try:
            value = float.fromhex(m.group())
        except OverflowError:
            raise OverflowError(tok) from None
        int_part, _, frac = m.group(1).partition(".")
        mant, exp = int_part + frac, int(m.group(2) or 0) - 4 * len(frac)

        def exact() -> bool:
            return Fraction(abs(value)) == Fraction(int(mant, 16)) * Fraction(2) ** exp
    elif m := _SPECIAL_RE.match(tok):
        return float(m.group().partition("(")[0])
    elif m := _DEC_RE.match(tok):
        value = float(m.group())
        mant = m.group(1).replace(".", "")

        def exact() -> bool:
            return Decimal(m.group()).copy_abs() == Decimal(abs(value))
    else:
        return None
    tiny = 0.0 < abs(value) < sys.float_info.min
    if math.isinf(value) or (value == 0.0 and mant.strip("0")) or (tiny and not exact()):
        raise OverflowError(tok)
    return value


# ---------------------------------------------------------------------------- structure

class _Item(NamedTuple):
    key: str
    value: int  # token index of the value ('[' for a list)
    pairs: list[tuple[int, int]] | None  # a list's items: token indexes (a, b) of each a:b


def _split(toks: list[str]) -> list[_Item]:
    """Check the grammar ``key:value(,key:value)*`` with ``[a:b,...]`` lists (§3.2).

    PyTorch is laxer: it ignores a missing ',' between pairs or items, and a missing ':' or value
    trips an internal assert; here each is a clear ConfigError. A trailing ',' is accepted, as in PyTorch.
    """
    items: list[_Item] = []
    n, i = len(toks), 0

    def at(k: int) -> str | None:
        return toks[k] if k < n else None

    while i < n:
        key = toks[i]
        if key in _SEPARATORS:
            raise _expected("a key", i, toks)
        if key not in KNOWN_KEYS:
            raise ConfigError(f"Unrecognized key '{_shown(key)}' in CUDA allocator config.")
        if at(i + 1) != ":":
            raise _expected(f"':' after key '{key}'", i + 1, toks)
        j = end = i + 2
        if at(j) in (None, ",", ":", "]"):
            raise _expected(f"a value for '{key}'", j, toks)
        pairs: list[tuple[int, int]] | None = None
        if toks[j] == "[":
            pairs, end = [], j + 1
            while at(end) != "]":
                if end >= n:
                    raise ConfigError(_UNCLOSED)
                if toks[end] in _SEPARATORS:
                    raise _expected(f"a list item for '{key}'", end, toks)
                if at(end + 1) != ":":
                    raise _expected("':'", end + 1, toks)
                if at(end + 2) in (None, *_SEPARATORS):
                    raise _expected(f"a value for '{key}' list item '{_shown(toks[end])}'", end + 2, toks)
                pairs.append((end, end + 2))
                end += 3
                if at(end) == ",":
                    end += 1
                elif at(end) not in (None, "]"):
                    raise _expected("',' or ']'", end, toks)
        items.append(_Item(key, j, pairs))
        i = end + 1
        if i < n and toks[i] != ",":
            raise _expected("','", i, toks)
        i += 1
    return items


# ---------------------------------------------------------------------------- values

def _number(toks: list[str], i: int, key: str, integer: bool = True) -> int | float:
    """The value at token `i` through std::stoull (or std::stod when not `integer`)."""
    kind, range_kind, func = (("an unsigned integer", "an unsigned 64-bit integer", "stoull") if integer
                              else ("a number", "a double", "stod"))
    try:
        value = stoull(toks[i]) if integer else stod(toks[i])
    except OverflowError:
        raise ConfigError(f"Value '{_shown(toks[i])}' for '{key}' at index {i} in ConfigTokenizer is out of "
                          f"range for {range_kind} (std::{func})") from None
    if value is None:
        raise ConfigError(f"Expected {kind} for '{key}' at index {i} in ConfigTokenizer "
                          f"but got '{_shown(toks[i])}' (std::{func})")
    return value


def _uint(toks: list[str], i: int, key: str) -> int:
    return int(_number(toks, i, key))


def _bool(toks: list[str], i: int) -> bool:
    if toks[i] not in ("True", "False"):
        raise ConfigError(f"Expected 'True' or 'False' at index {i} in ConfigTokenizer but got '{_shown(toks[i])}'")
    return toks[i] == "True"


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _mb(toks: list[str], i: int, key: str, minimum: int, message: str) -> int:
    """An ``*_mb`` size checked against `minimum` MiB, clamped to SIZE_MAX // MiB, in bytes."""
    value = _uint(toks, i, key)
    if value < minimum:
        raise ConfigError(message)
    return min(value, SIZE_MAX // MiB) * MiB


def _reserve_spec_ok(tok: str) -> bool:
    """2.15 ``expandable_segments_reserve`` value: fraction ``0.5`` or GiB ``40G``; warns if bad."""
    num = tok[:-1] if tok[-1:] in ("G", "g") else tok  # istream >> double must consume all of it
    ok = bool(_DEC_RE.fullmatch(num)) and 0.0 < float(num) < math.inf
    if not ok:
        warnings.warn(f"Ignoring invalid expandable-segment reserve value '{_shown(tok)}' in PYTORCH_CUDA_ALLOC_CONF "
                      "(expected a positive, finite fraction like 0.5 or an absolute size like 40G); "
                      "using default.", UserWarning, stacklevel=4)
    return ok


def _roundup(cfg: AllocatorConfig, toks: list[str], item: _Item, legacy: bool) -> None:
    """``roundup_power2_divisions``: scalar or ``[B:v,...,>:v]`` list (§3.4)."""
    key, table = item.key, cfg.roundup_power2_divisions
    if item.pairs is None:  # the scalar form: 0 is rejected here, even in the newest source
        if not _is_pow2(value := _uint(toks, item.value, key)):
            raise ConfigError("For roundups, the divisions has to be power of 2 ")
        table[:] = [value] * ROUNDUP_BUCKETS
        return
    first, last_index = True, 0
    for a, b in item.pairs:
        if (value := _uint(toks, b, key)) != 0 and not _is_pow2(value):
            raise ConfigError("For roundups, the divisions has to be power of 2 or 0 to disable roundup ")
        if toks[a] == ">":
            start = last_index if legacy else last_index + 1  # ≤2.8 overwrote the last bucket
            table[start:] = [value] * (ROUNDUP_BUCKETS - start)
            continue
        if not _is_pow2(boundary := _uint(toks, a, key)):
            raise ConfigError("For roundups, the intervals have to be power of 2 ")
        index = min(boundary.bit_length() - 1, ROUNDUP_BUCKETS - 1)
        if first:
            table[:index] = [value] * index
            first = False
        table[index] = value
        last_index = index


def _apply(cfg: AllocatorConfig, toks: list[str], item: _Item, legacy: bool) -> None:
    """Validate and apply one ``key:value`` (§3.3)."""
    key, i = item.key, item.value
    if key in _BOOL_KEYS:
        value = _bool(toks, i)
        if (name := _BOOL_KEYS[key]) is not None:
            setattr(cfg, name, value)
    elif key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        lo = cfg.large_segment_size // MiB  # newest: the minimum follows large_segment_size_mb
        size = _mb(toks, i, key, lo, f"CachingAllocator option {key} too small, must be >= {lo}")
        setattr(cfg, "max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding", size)
    elif key == "garbage_collection_threshold":
        if not 0.0 < (gc := _number(toks, i, key, integer=False)) < 1.0:
            raise ConfigError("garbage_collect_threshold is invalid, set it in (0.0, 1.0)")
        cfg.garbage_collection_threshold = gc
    elif key == "per_process_memory_fraction":
        if not 0.0 <= (fraction := _number(toks, i, key, integer=False)) <= 1.0:
            raise ConfigError("per_process_memory_fraction is invalid, set it in [0.0, 1.0]")
        cfg.per_process_memory_fraction = fraction
    elif key == "roundup_power2_divisions":
        _roundup(cfg, toks, item, legacy)
    elif key == "pinned_num_register_threads":
        if not _is_pow2(threads := _uint(toks, i, key)):
            raise ConfigError(f"Number of register threads has to be power of 2, got {threads}")
        if threads > MAX_REGISTER_THREADS:
            raise ConfigError("Number of register threads should be less than or equal to "
                              f"{MAX_REGISTER_THREADS}, got {threads}")
        cfg.pinned_num_register_threads = threads
    elif key == "pinned_reserve_segment_size_mb":
        if _uint(toks, i, key) == 0:
            raise ConfigError("Pinned reserve segment size has to be greater than 0")
    elif key in ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"):
        _uint(toks, i, key)  # host allocator only (torch 2.13 generic parser)
    elif key == "expandable_segments_reserve":
        if item.pairs is not None:  # PyTorch warns on '[' and then misreads the list as keys
            raise _expected(f"a single value for '{key}'", i, toks)
        _reserve_spec_ok(toks[i])
    elif key == "expandable_segments_reserve_by_class":
        if item.pairs is None:  # PyTorch ignores the failed '[' check and then asserts
            raise _expected("'['", i, toks)
        for _, b in item.pairs:
            _reserve_spec_ok(toks[b])
    # "backend" and "large_segment_size_mb" are handled by parse_alloc_conf itself.


def parse_alloc_conf(text: str | None, base: AllocatorConfig | None = None, *,
                     legacy_roundup: bool = False) -> AllocatorConfig:
    """Parse an allocator settings string into a new config (spec §3.1-§3.4).

    Starts from a copy of `base` (default: defaults) and resets ``max_split_size``, the roundup
    table and the GC threshold; ``max_non_split_rounding`` is reset to ``large_segment_size``
    (``large_segment_size_mb`` is applied first); other fields keep their values unless set.
    `text` None means "variable not set": the copy is returned unchanged. Every key is validated
    before anything is returned; `base` is never mutated, so a bad string leaves the caller's state
    intact. With `base` given, ``backend`` must name ``base.backend`` (PyTorch cannot switch
    backends after load). ``legacy_roundup=True`` selects the ≤2.8 ``>`` fill rule (§3.4).
    Raises ConfigError; warns (UserWarning) as PyTorch does.
    """
    if text is not None and not isinstance(text, str):
        raise TypeError("allocator settings must be a string such as 'expandable_segments:True' "
                        f"(PYTORCH_CUDA_ALLOC_CONF's syntax), got {type(text).__name__}")
    cfg = base.copy() if base is not None else AllocatorConfig()
    if text is None:
        return cfg
    cfg.max_split_size = SIZE_MAX
    cfg.roundup_power2_divisions = [0] * ROUNDUP_BUCKETS
    cfg.garbage_collection_threshold = 0.0
    cfg.settings = text
    toks = tokenize(text)
    items = _split(toks)
    for item in items:
        if item.key == "large_segment_size_mb":
            msg = f"CachingAllocator option large_segment_size_mb must be > {MIN_LARGE_ALLOC_MB} MB"
            cfg.large_segment_size = _mb(toks, item.value, item.key, MIN_LARGE_ALLOC_MB + 1, msg)
    cfg.max_non_split_rounding = cfg.large_segment_size
    loaded = base.backend if base is not None else None
    used_async = used_native = False
    for item in items:
        if item.key == "backend":
            name = toks[item.value]
            if name not in ("native", "cudaMallocAsync"):
                raise ConfigError("Unknown allocator backend, options are native and cudaMallocAsync")
            loaded = loaded or name
            if name != loaded:
                raise ConfigError("Allocator backend parsed at runtime != allocator backend parsed at "
                                  f"load time, {name} != {loaded}")
            cfg.backend, used_async = name, used_async or name == "cudaMallocAsync"
        else:
            _apply(cfg, toks, item, legacy_roundup)
            used_native = used_native or item.key in _CUDA_PARSER_KEYS  # (backend is handled above)
    if used_async and used_native:
        warnings.warn(ASYNC_WARNING, UserWarning, stacklevel=2)
    return cfg


# ---------------------------------------------------------------------------- environment

def alloc_conf_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The settings string PyTorch reads (§3.1, newest): the first *set* of
    ``PYTORCH_CUDA_ALLOC_CONF`` then ``PYTORCH_ALLOC_CONF`` (an empty value counts as set)."""
    env = os.environ if environ is None else environ
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if name in env:
            return env[name]
    return None


def caching_disabled_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """``PYTORCH_NO_CUDA_MEMORY_CACHING`` (or ``..._HIP_...``), newest semantics (§3.5).

    Only ``"1"`` disables caching; ``"0"`` is normal; any other value warns and is ignored.
    """
    env = os.environ if environ is None else environ
    disabled = False
    for name in ("PYTORCH_NO_CUDA_MEMORY_CACHING", "PYTORCH_NO_HIP_MEMORY_CACHING"):
        value = env.get(name)
        if value == "1":
            disabled = True
        elif value is not None and value != "0":
            warnings.warn(f"Ignoring invalid value for boolean flag {name}: {_shown(value)}valid values are 0 or 1.",
                          UserWarning, stacklevel=2)
    return disabled


# ---------------------------------------------------------------------------- snapshot form

def as_int64(value: int) -> int:
    """``int64_t(size_t)``: SIZE_MAX -> -1."""
    return value - 2**64 if value >= 2**63 else value


def roundup_divisions_dict(cfg: AllocatorConfig) -> dict[str, int]:
    """The table as snapshots show it: ``{"1": d0, "2": d1, ..., "32768": d15}`` (§3.4, §18.3)."""
    return {str(1 << k): as_int64(d) for k, d in enumerate(cfg.roundup_power2_divisions)}


def allocator_settings(cfg: AllocatorConfig) -> dict[str, object]:
    """The snapshot's ``allocator_settings`` dict, keys in PyTorch's order (§18.3)."""
    return {
        "PYTORCH_CUDA_ALLOC_CONF": cfg.settings,
        "max_split_size": as_int64(cfg.max_split_size),
        "garbage_collection_threshold": float(cfg.garbage_collection_threshold),
        "expandable_segments": cfg.expandable_segments,
        "pinned_num_register_threads": cfg.pinned_num_register_threads,
        "release_lock_on_cudamalloc": cfg.release_lock_on_cudamalloc,
        "pinned_use_cuda_host_register": cfg.pinned_use_cuda_host_register,
        "roundup_power2_divisions": roundup_divisions_dict(cfg),
    }


def roundup_bucket(size: int) -> int:
    """Index into the roundup table: ``clamp(floor(log2(size)) - 20, 0, 15)`` (§3.4); size > 0."""
    if size <= 0:
        raise ValueError(f"roundup_bucket needs a positive size, got {size}")
    return min(max(size.bit_length() - 1 - 20, 0), ROUNDUP_BUCKETS - 1)
