"""`vram plot`'s segment map: a row per segment up to MAX_ROWS, else segments laid end to end and
wrapped into at most MAX_ROWS equal rows, with every byte of every block drawn once."""
from __future__ import annotations

from collections import Counter

from vram.views.plot import segment_rows

MiB = 1 << 20


def _seg(address: int, *blocks: tuple[str, int]) -> dict:
    return {"address": address, "blocks": [{"state": s, "size": n} for s, n in blocks]}


def test_a_row_per_segment_in_address_order() -> None:
    segs = [_seg(3 * MiB, ("inactive", 2 * MiB)), _seg(0, ("active_allocated", MiB), ("inactive", MiB))]
    rows = segment_rows(segs, max_rows=2)
    assert rows == [[("active_allocated", 0, MiB), ("inactive", MiB, MiB)], [("inactive", 0, 2 * MiB)]]


def test_many_segments_wrap_into_equal_rows_keeping_every_byte() -> None:
    segs = [_seg(k * 64 * MiB, ("active_allocated", 3 * MiB), ("inactive", 17 * MiB)) for k in range(250)]
    rows = segment_rows(segs, max_rows=100)
    assert len(rows) <= 100
    total = Counter()
    for row in rows:
        assert sum(size for state, _, size in row if state != "boundary") <= 50 * MiB  # 5,000 MiB / 100
        for state, _, size in row:
            total[state] += size
    assert total["active_allocated"] == 250 * 3 * MiB and total["inactive"] == 250 * 17 * MiB
    boundaries = sum(1 for row in rows for state, _, _ in row if state == "boundary")
    # segment k starts at k x 20 MiB; one falling exactly at a row's start (a multiple of 50 MiB,
    # every 5th) is not drawn
    assert boundaries == sum(1 for k in range(1, 250) if (k * 20) % 50)
