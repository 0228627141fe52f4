"""The largest batch that fits, found with real simulated runs (`search_largest`).

Each probe is a whole simulated run of the batch (`engine.fits`): whether it fits is never
extrapolated. What a fitting run leaves unused (`Probe.room`: the card less the smallest card on
which its recorded requests replay, `engine.smallest_card`) only *guides* which batch to run next:
memory grows about linearly with the
batch (activations, gradients of them), so the batch at which the room runs out is predicted from
the two largest fitting runs, tried, and the bracket around the answer closed from both sides.
Rounding (blocks, 2 and 20 MiB segments) and fragmentation make the guess optimistic, so it is
often off by a few batches or more; then the next one uses the new point. After `GUESSES` guesses
the search doubles and bisects, as it does without rooms (pipeline stages, where a probe is one
launch of every stage and says only whether all fit): at most `GUESSES` runs more than that
search, usually fewer in all.
Fitting is assumed monotonic in the batch size.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["GUESSES", "Probe", "search_largest"]

GUESSES = 4  # guided runs at most, then doubling and bisection
_MAX_LEAP = 64  # an extrapolated guess goes at most this many times beyond the largest fitting batch


@dataclass(frozen=True)
class Probe:
    """One simulated run of a batch: whether it `fits`, and for a fitting run the bytes of the card
    it left unused at its peak (`room`; None when unknown)."""

    fits: bool
    room: int | None = None
    #: the run's peak allocated bytes: their growth with the batch is the slope of the line (bytes
    #: per sample, smooth where the room moves in steps of segments); None: the rooms' own slope
    allocated: int | None = None

    def __bool__(self) -> bool:
        return self.fits


def _as_probe(result: Any) -> Probe:
    return result if isinstance(result, Probe) else Probe(bool(result))


def _predict(points: dict[int, Probe], lo: int) -> int | None:
    """The batch where the room left at `lo` runs out, at the bytes per sample of the two largest
    fitting batches (their peak allocated bytes' growth where known, else their rooms')."""
    if len(points) < 2 or lo not in points:
        return None
    a, b = sorted(points)[-2:]
    pa, pb = points[a], points[b]
    slope = (pa.room - pb.room) / (b - a)  # type: ignore[operator]
    if pa.allocated is not None and pb.allocated is not None:
        slope = max(slope, (pb.allocated - pa.allocated) / (b - a))
    if slope <= 0:
        return None
    return lo + int(points[lo].room // slope)  # type: ignore[operator]


def _next(points: dict[int, Probe], lo: int, hi: int | None, limit: int, guided: int) -> tuple[int, bool]:
    """The batch to run next and whether it is a guess (not a doubling or a bisection)."""
    guess = _predict(points, lo) if guided < GUESSES else None
    if hi is None:
        if guess is None:
            return min(lo * 2, limit), False
        return max(lo + 1, min(guess, lo * _MAX_LEAP, limit)), True
    if guess is None or not lo < guess < hi:  # the line says nothing new inside the bracket
        return (lo + hi) // 2, False
    return guess, True


def search_largest(ok: Callable[[int], Any], limit: int = 1 << 20, progress: Any = None) -> int:
    """The largest b in 1..`limit` with ``ok(b)`` (0 if none). `ok` returns a bool or a `Probe`;
    with rooms the search is guided (see the module doc), otherwise doubling, then bisection.
    With `progress` (a text stream, as ``sys.stderr``), one line per simulated run: its batch,
    whether it fits, and the time so far."""
    if progress is not None:
        ok = _reporting(ok, progress)
    first = _as_probe(ok(1))
    if not first:
        return 0
    lo, hi, guided = 1, None, 0
    points = {1: first} if first.room is not None else {}
    while lo < limit and (hi is None or hi - lo > 1):
        b, guess = _next(points, lo, hi, limit, guided)
        probe = _as_probe(ok(b))
        if probe:
            lo = b
            if probe.room is not None:
                points[b] = probe
        else:
            hi = b
        guided += guess
    return lo


def _reporting(ok: Callable[[int], Any], stream: Any) -> Callable[[int], Any]:
    start, runs = time.perf_counter(), [0]

    def probe(b: int) -> Any:
        fit = ok(b)
        runs[0] += 1
        print(f"max-batch: run {runs[0]}, batch {b} {'fits' if fit else 'does not fit'} "
              f"({time.perf_counter() - start:.1f} s)", file=stream, flush=True)
        return fit
    return probe
