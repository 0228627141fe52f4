"""The text of ``torch.cuda.memory_summary`` rebuilt from a flat stats dict (spec §17).

PyTorch builds its summary from ``torch.cuda.memory_stats(device)``, the *flattened* stats
dictionary of spec §16.2 (keys such as ``"allocated_bytes.all.current"``). This module takes
such a dictionary, whoever produced it, and returns the same text, byte for byte:

>>> text = memory_summary_from_stats(stats)            # doctest: +SKIP
>>> text == torch.cuda.memory_summary()                # doctest: +SKIP
True

Layout (spec §17): every line is 75 characters wide and the result is
``"|" + "|\\n|".join(lines) + "|\\n"``. Sizes go through :func:`format_summary_size`, counts
through :func:`format_summary_count`; both scale every row of a metric by the ``all`` row's
value in the same column.

One quirk is reproduced on purpose. PyTorch writes the two header lines as ``str.format``
templates (``{_:16}``, ``{device:<17d}``, ``{num_ooms:<12d}``, ``{num_alloc_retries:<8d}``) and
fills them from a dictionary that starts as ``{"_": "", "device": device}`` and then receives
*every* stat, its key with ``.`` replaced by ``-``. A stat called ``"_"`` or ``"device"``
therefore overrides the padding string or the device index, and the two counters are read
through that same dictionary. The table rows never contain braces (fixed labels, digits,
unit names), so formatting only the header lines gives the same text as formatting the whole
joined text.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

__all__ = [
    "STAT_ARRAY_NAMES",
    "POOL_NAMES",
    "STAT_FIELDS",
    "OVERSIZE_STAT_NAMES",
    "LINE_WIDTH",
    "format_summary_size",
    "format_summary_count",
    "memory_summary_from_stats",
]

#: The nine per-pool ("array") stats, as spelled in ``memory_stats`` keys (spec §16.1).
STAT_ARRAY_NAMES: Final[tuple[str, ...]] = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
#: Pool kinds of every array stat (spec §16.1).
POOL_NAMES: Final[tuple[str, ...]] = ("all", "small_pool", "large_pool")
#: The four fields of every Stat (spec §16.1).
STAT_FIELDS: Final[tuple[str, ...]] = ("current", "peak", "allocated", "freed")
#: The two single (pool-less) Stats shown at the end of the summary (spec §16.1, §17 item 8).
OVERSIZE_STAT_NAMES: Final[tuple[str, ...]] = ("oversize_allocations", "oversize_segments")

#: Width of every summary line, not counting the enclosing ``|`` characters (spec §17).
LINE_WIDTH: Final = 75

_SIZE_UNITS: Final[tuple[str, ...]] = ("B  ", "KiB", "MiB", "GiB", "TiB", "PiB")
_SIZE_STEP: Final = 1024
_SIZE_PROMOTE_AT: Final = 768 * 1024
_COUNT_UNITS: Final[tuple[str, ...]] = (" ", "K", "M")
_COUNT_STEP: Final = 1000
_COUNT_PROMOTE_AT: Final = 750 * 1000

_Formatter = Callable[[int, int], str]


def _scale(value: int, ref: float, units: tuple[str, ...], step: int, promote_at: int) -> tuple[int, str]:
    """Shared unit promotion of both formatters (spec §17).

    While ``ref >= promote_at`` and a larger unit exists: take the next unit, floor-divide
    ``value`` by ``step`` and *true*-divide ``ref`` by ``step``. The true division matters only
    above 2**53, where ``ref`` becomes an inexactly rounded float exactly as in PyTorch, so a
    reference a hair below a promotion boundary can round up onto it and promote.
    """
    unit = units[0]
    for next_unit in units[1:]:
        if ref < promote_at:
            break
        unit = next_unit
        value //= step
        ref = ref / step
    return value, unit


def format_summary_size(value: int, ref: int) -> str:
    """Format a byte count for a summary cell: always 10 characters (spec §17).

    The unit is chosen from ``ref`` (the ``all`` row's value in the same column), promoting
    from ``B`` through ``KiB`` ... ``PiB`` only once ``ref`` reaches 768 of the next unit, so
    20 MiB prints as ``" 20480 KiB"`` and 1 GiB as ``"  1024 MiB"``. ``value`` is floored at
    each step: ``format_summary_size(1000, 2**20) == "     0 KiB"``.
    """
    scaled, unit = _scale(value, ref, _SIZE_UNITS, _SIZE_STEP, _SIZE_PROMOTE_AT)
    return f"{scaled:6d} {unit}"


def format_summary_count(value: int, ref: int) -> str:
    """Format a count for a summary cell: always 10 characters (spec §17).

    Units are ``" "``, ``K``, ``M`` (powers of 1000), promoted while ``ref`` is at least
    750,000 of the current unit; ``value`` is floored. The cell ends with a space:
    ``format_summary_count(4, 4) == "      4   "``.
    """
    scaled, unit = _scale(value, ref, _COUNT_UNITS, _COUNT_STEP, _COUNT_PROMOTE_AT)
    return f"{scaled:7d} {unit} "


# (stats key, row label, formatter), in summary order (spec §17 item 7).
_ARRAY_METRICS: Final[tuple[tuple[str, str, _Formatter], ...]] = (
    ("allocated_bytes", "Allocated memory", format_summary_size),
    ("active_bytes", "Active memory", format_summary_size),
    ("requested_bytes", "Requested memory", format_summary_size),
    ("reserved_bytes", "GPU reserved memory", format_summary_size),
    ("inactive_split_bytes", "Non-releasable memory", format_summary_size),
    ("allocation", "Allocations", format_summary_count),
    ("active", "Active allocs", format_summary_count),
    ("segment", "GPU reserved segments", format_summary_count),
    ("inactive_split", "Non-releasable allocs", format_summary_count),
)
# Sub-rows shown under each metric's "all" row unless abbreviated: large pool first.
_SUB_ROWS: Final[tuple[tuple[str, str], ...]] = (
    ("large_pool", "      from large pool"),
    ("small_pool", "      from small pool"),
)
# (stats key, row label) of the single Stats, count formatter (spec §17 item 8).
_OVERSIZE_METRICS: Final[tuple[tuple[str, str], ...]] = (
    ("oversize_allocations", "Oversize allocations"),
    ("oversize_segments", "Oversize GPU segments"),
)
_COLUMN_HEADINGS: Final = "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  "


def _row(label: str, cells: list[str]) -> str:
    """One table row: ``" {label:<21} | c1 | c2 | c3 | c4 "`` (spec §17 item 7)."""
    return f" {label:<21} | " + " | ".join(cells) + " "


def _stat_row(stats: Mapping[str, int], key_prefix: str, refs: list[int] | None, label: str,
              formatter: _Formatter) -> tuple[str, list[int]]:
    """Row for the Stat whose keys start with ``key_prefix``; returns it and its raw values.

    ``refs`` are the reference values per column (the ``all`` row's); ``None`` means this row
    is its own reference.
    """
    values = [stats[key_prefix + field] for field in STAT_FIELDS]
    refs = values if refs is None else refs
    return _row(label, [formatter(v, r) for v, r in zip(values, refs)]), values


def _header_fields(stats: Mapping[str, int], device: int) -> dict[str, Any]:
    """The mapping PyTorch formats the header templates with (spec §17, see module docstring)."""
    fields: dict[str, Any] = {"_": "", "device": device}
    for key, value in stats.items():
        fields[key.replace(".", "-")] = value
    return fields


def memory_summary_from_stats(stats: Mapping[str, int], device: int = 0, abbreviated: bool = False) -> str:
    """``torch.cuda.memory_summary(device, abbreviated)`` computed from a flat stats dict (spec §17).

    ``stats`` is what ``torch.cuda.memory_stats(device)`` returns (spec §16.2); extra keys are
    ignored except as described for the header quirk in the module docstring. ``device`` is
    the index printed in the title. With ``abbreviated`` only the ``all`` row of each pooled
    metric is printed.

    Raises KeyError for a missing stat, like PyTorch (pooled stats are looked up before the
    header counters ``num_ooms`` and ``num_alloc_retries``), and ValueError if the device or a
    header counter is not an integer.
    """
    rule_thin = "-" * LINE_WIDTH
    rule_thick = "=" * LINE_WIDTH

    table: list[str] = []
    for metric, label, formatter in _ARRAY_METRICS:
        table.append(rule_thin)
        all_row, refs = _stat_row(stats, f"{metric}.all.", None, label, formatter)
        table.append(all_row)
        if not abbreviated:
            for pool, pool_label in _SUB_ROWS:
                table.append(_stat_row(stats, f"{metric}.{pool}.", refs, pool_label, formatter)[0])
    for metric, label in _OVERSIZE_METRICS:
        table.append(rule_thin)
        table.append(_stat_row(stats, f"{metric}.", None, label, format_summary_count)[0])
    table.append(rule_thick)

    fields = _header_fields(stats, device)
    pad = fields["_"]
    title = f" {pad:16} PyTorch CUDA memory summary, device ID {fields['device']:<17d} "
    counters = (f"  {pad:9} CUDA OOMs: {fields['num_ooms']:<12d} | "
                f"{pad:6} cudaMalloc retries: {fields['num_alloc_retries']:<8d}  ")
    lines = [rule_thick, title, rule_thin, counters, rule_thick, _COLUMN_HEADINGS, *table]
    return "|" + "|\n|".join(lines) + "|\n"
