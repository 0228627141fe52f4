"""Inductor's ``pad_mm`` (torch/_inductor/fx_passes/pad_mm.py) in the compile process: each rule
that needs no GPU decides as it does on the simulated card; what only a benchmark decides is said
once per graph, with what padding allocates.

On a GPU, a matmul (``mm``, ``addmm``, ``bmm``) with a size not a multiple of 8 (fp16/bf16) or
4 (fp32) is padded, in this order (``should_pad``): never if ``can_pad`` refuses (shape padding
off, all sizes symbolic, a zero size, ``deterministic`` without ``force_shape_pad`` or the
learned heuristic); always under ``force_shape_pad``; always for the bf16 large-K rule
(``post_grad_fusion_options["pad_aten_mm_pass"]``, compute capability below 9.0); never if
``is_mm_compute_bound`` says memory bound (see `vram.devices.clocks`: under torch 2.11–2.13 a
card outside Inductor's datasheet table finds every matmul compute bound); then Inductor's pad
cache (a first run: empty here); then the learned AutoHeuristic, when
``use_autoheuristic("pad_mm")`` (``TORCHINDUCTOR_AUTOHEURISTIC_USE=pad_mm``, or
``deterministic``; models for sm80 with 163 KB and sm90 with 227 KB of shared memory); then, under
``deterministic``, never; else both matmuls are timed and the padded one is taken when the
unpadded one takes over 1.1 times as long (``is_padded_faster``; no rule decides that case
without the times: ``should_exclude_padding_time`` only leaves an operand's padding out of the
timed padded call and adds to the cache key, and the replacement pads it all the same). The
compile process answers Triton's driver and ``nvidia-smi`` with the simulated card's figures
while this runs (`card_answers`), so all but the timing is Inductor's own code.

Padding adds ``constant_pad_nd`` copies of the operands (and ``cat`` copies of ``addmm``'s bias)
and a larger output, sliced back: `padding_bytes` is what that allocates beyond the unpadded
matmul (a copy Inductor fuses into its producer costs only its padding; the sliced output is a
strided view, which a consumer needing it dense would copy).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

from vram.devices.clocks import card_clocks, max_shared_memory_per_block_optin

PAD_MM = ("Inductor's pad_mm times a padded and an unpadded matmul on the GPU while compiling (padded when "
          "the unpadded one takes over 1.1 times as long), which is not modelled")
#: the matmuls of this compile left to that timing: (bytes padding would add, what the matmul is)
UNDECIDED: list[tuple[int, str]] = []


class _Benchmark(Exception):
    """A compile-time benchmark was asked for (no GPU to time it)."""


def padding_bytes(batch: int, sizes: Sequence[int], pads: Sequence[int], itemsizes: Sequence[int],
                  bias: Sequence[int] | None = None) -> int:
    """What ``pad_mm``'s replacement allocates beyond the unpadded matmul of `sizes` (m, k, n)
    padded by `pads` (torch/_inductor/fx_passes/pad_mm.py ``pad_mm``/``pad_bmm``/``pad_addmm``):
    mat1 ``(m+mp, k+kp)`` when mp or kp, mat2 ``(k+kp, n+np)`` when kp or np (each ``batch``
    times for ``bmm``), the output's growth ``(m+mp)(n+np) - mn``, and addmm's `bias` (its shape)
    padded along n, then m (2-D), where it is not broadcast (``pad_dim``: one ``cat`` each);
    `itemsizes`: mat1's, mat2's."""
    (m, k, n), (mp, kp, np_), (size1, size2) = sizes, pads, itemsizes
    total = batch * ((m + mp) * (n + np_) - m * n) * size1
    if mp or kp:
        total += batch * (m + mp) * (k + kp) * size1
    if kp or np_:
        total += batch * (k + kp) * (n + np_) * size2
    if bias is not None:
        shape = list(bias)
        for dim, pad in ((len(shape) - 1, np_), (0 if len(shape) == 2 else -1, mp)):
            if pad and dim >= 0 and shape[dim] != 1:
                shape[dim] += pad
                count = 1
                for d in shape:
                    count *= d
                total += count * size1
    return total


def notice() -> str | None:
    """The line said for this compile's matmuls left to the benchmark (None: there were none)."""
    if not UNDECIDED:
        return None
    total = sum(cost for cost, _ in UNDECIDED)
    cost, what = max(UNDECIDED)
    many, them = (f"{len(UNDECIDED)} matmuls", "them") if len(UNDECIDED) > 1 else ("1 matmul", "it")
    return (f"{PAD_MM}: {many} with unaligned sizes compiled unpadded; padding {them} allocates {total:,} "
            f"bytes more (padded copies of the operands, larger outputs; the largest: {what}, {cost:,} bytes)")


def _describe(op: Any, mat1: Any, mat2: Any) -> str:
    shape = "x".join
    return (f"{op} {shape(str(d) for d in mat1.shape)} @ {shape(str(d) for d in mat2.shape)} "
            f"{str(mat1.dtype).removeprefix('torch.')}")


def _cost(pad_mm: Any, op: Any, mat1: Any, mat2: Any, bias: Any) -> int:
    """`padding_bytes` of one matmul as ``pad_mm`` would pad it (sizes at their hints)."""
    def hint(d: Any) -> int:
        return int(d.node.hint) if hasattr(d, "node") else int(d)

    bmm = len(mat1.shape) == 3
    batch = hint(mat1.shape[0]) if bmm else 1
    m, k, n = hint(mat1.shape[-2]), hint(mat1.shape[-1]), hint(mat2.shape[-1])
    pads = [pad_mm.get_padded_length(mat1.shape[-2], pad_mm.get_alignment_size(mat1)),
            pad_mm.get_padded_length(mat1.shape[-1], pad_mm.get_alignment_size(mat1)),
            pad_mm.get_padded_length(mat2.shape[-1], pad_mm.get_alignment_size(mat2))]
    bias_shape = [hint(d) for d in bias.shape] if bias is not None else None
    return padding_bytes(batch, (m, k, n), pads, (mat1.dtype.itemsize, mat2.dtype.itemsize), bias_shape)


class _PadCache:
    """Inductor's pad cache (``get_pad_cache()``, a file under its cache directory) on a first
    run: empty, and what this process sets."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def lookup(self, *keys: str) -> Any:
        return self.values.get(keys[-1])

    def set_value(self, *keys: str, value: Any) -> None:
        self.values[keys[-1]] = value


def _triton_properties(card: dict[str, Any]) -> dict[str, int]:
    """``driver.active.utils.get_device_properties(0)`` (triton's driver.c) for the card; the
    clock keys only where `vram.devices.clocks` has the card."""
    props = {"max_num_regs": 65536, "multiprocessor_count": card["multi_processor_count"], "warpSize": 32}
    shared = max_shared_memory_per_block_optin(card["major"], card["minor"])
    if shared is not None:
        props["max_shared_mem"] = shared
    clocks = card_clocks(card["name"])
    if clocks is not None:
        props.update(sm_clock_rate=clocks.sm_clock_khz, mem_clock_rate=clocks.memory_clock_khz,
                     mem_bus_width=clocks.memory_bus_width)
    return props


@contextlib.contextmanager
def card_answers(card: dict[str, Any]) -> Iterator[None]:
    """Triton's active driver and ``triton.testing.nvsmi`` answering for the simulated card (what
    ``get_device_tflops``, ``get_gpu_dram_gbps`` and ``get_gpu_shared_memory`` read), then put back.
    A figure the card has no print of raises, as on a machine without it."""
    import torch
    import triton.testing
    from triton.runtime import driver

    props = _triton_properties(card)
    clocks = card_clocks(card["name"])
    utils = SimpleNamespace(get_device_properties=lambda device=0: dict(props))
    stand_in = SimpleNamespace(utils=utils, get_device_interface=lambda: torch.cuda,
                               get_current_device=lambda: 0)

    def nvsmi(attrs: Sequence[str]) -> list[int]:
        if list(attrs) == ["clocks.max.sm"] and clocks is not None and clocks.max_sm_clock_mhz is not None:
            return [clocks.max_sm_clock_mhz]
        raise RuntimeError(f"nvidia-smi --query-gpu={','.join(attrs)}: not known for {card['name']}")

    saved_driver, saved_nvsmi = driver._active, triton.testing.nvsmi
    driver._active, triton.testing.nvsmi = stand_in, nvsmi
    try:
        yield
    finally:
        driver._active, triton.testing.nvsmi = saved_driver, saved_nvsmi


def patch_pad_mm(card: dict[str, Any]) -> None:
    """``pad_mm._should_pad`` runs as on the card (`card_answers`, a first run's pad cache);
    where it asks for a benchmark the matmul stays unpadded and is counted in `UNDECIDED`."""
    from torch._inductor.fx_passes import pad_mm

    original, get_do_bench = pad_mm._should_pad, pad_mm.get_do_bench
    cache = _PadCache()
    pad_mm.get_pad_cache = lambda: cache

    def refuse(*args: Any, **kwargs: Any) -> float:
        raise _Benchmark

    def should_pad(match: Any, mat1: Any, mat2: Any, op: Any, input: Any = None) -> bool:  # noqa: A002
        pad_mm.get_do_bench = lambda: refuse
        try:
            with card_answers(card):
                return bool(original(match, mat1, mat2, op, input))
        except _Benchmark:
            UNDECIDED.append((_cost(pad_mm, op, mat1, mat2, input), _describe(op, mat1, mat2)))
            return False
        finally:
            pad_mm.get_do_bench = get_do_bench

    pad_mm._should_pad = should_pad
