"""The CPU generator's stream when host tensors are lazy (see `vram.run.memory.lazy_host`).

A lazy host tensor's random initialisation (``nn.Linear``'s ``kaiming_uniform_``, HF's
``normal_``) is not computed, but a GPU run's program draws those numbers from the default CPU
generator, and whatever it draws next (a batch from ``torch.randint``, a ``DataLoader``'s seed)
depends on how far the stream moved. So every deferred draw is written in a `Ledger`: the
generator's state when the deferral began and the deferred ops in order. The debt is *settled* —
the default generator advanced exactly as the ops would have advanced it — the moment anything
observes the generator: a random op that really runs on the CPU, ``torch.get_rng_state()``.
``torch.manual_seed`` / ``seed`` / ``set_rng_state`` replace the state, so the debt is dropped
(the draws keep their tickets: a lazy tensor's values can still be computed later).

How many 32-bit words an op takes from the Mersenne Twister is the kernel's business
(``aten/src/ATen/native/cpu/DistributionTemplates.h``, torch 2.13, checked against the kernels in
``tests/test_lazy_host.py``): ``uniform_`` takes one per element (two for float64, via
``random64``); a contiguous ``normal_`` of n ≥ 16 elements fills n uniforms and, when n is not a
multiple of 16, 16 more for its last block (float32, float64 twice over), while float16/bfloat16
take a whole block of 16 for the tail (16·⌈n/16⌉). Those draws are made as raw words
(``random_`` on int32 scratch, one word each, in chunks); every other random op is replayed on
a scratch tensor of the same geometry, which draws exactly what it draws.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

_CHUNK = 1 << 22  # raw words per scratch fill (16 MiB of int32)
_WORDS_PER_ELEMENT = {torch.float32: 1, torch.float16: 1, torch.bfloat16: 1, torch.float64: 2}


def advance(gen: torch.Generator, words: int) -> None:
    """Draw `words` 32-bit words from `gen` (``random_`` on int32 takes one per element)."""
    if words <= 0:
        return
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        scratch = torch.empty(min(words, _CHUNK), dtype=torch.int32)
        while words > 0:
            n = min(words, _CHUNK)
            (scratch if n == scratch.numel() else scratch[:n]).random_(generator=gen)
            words -= n


def word_count(name: str, t: torch.Tensor) -> int | None:
    """Words an in-place ``uniform_``/``normal_`` on `t` draws (None: not modelled, replay it)."""
    per = _WORDS_PER_ELEMENT.get(t.dtype)
    if per is None:
        return None
    n = t.numel()
    if name == "uniform_":
        return per * n
    if name == "normal_" and n >= 16 and t.is_contiguous():
        if t.dtype in (torch.float16, torch.bfloat16):
            return -(-n // 16) * 16
        return per * (n + (16 if n % 16 else 0))
    return None


class Draw:
    """One deferred random op: `words` raw words, or `replay` (a callable drawing from a given
    generator exactly what the op would)."""

    __slots__ = ("words", "replay")

    def __init__(self, words: int | None = None, replay: Callable[[torch.Generator], Any] | None = None) -> None:
        self.words, self.replay = words, replay

    def apply(self, gen: torch.Generator) -> None:
        if self.words is not None:
            advance(gen, self.words)
        elif self.replay is not None:
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                self.replay(gen)


class Segment:
    """Deferred draws from one starting state of the default generator."""

    __slots__ = ("base", "draws", "states")

    def __init__(self, base: torch.Tensor) -> None:
        self.base = base
        self.draws: list[Draw] = []
        self.states: dict[int, torch.Tensor] = {0: base}  # checkpoints: state before draw i

    def state_before(self, i: int) -> torch.Tensor:
        """The generator state before draw `i` (from the nearest checkpoint)."""
        hit = self.states.get(i)
        if hit is not None:
            return hit
        start = max(j for j in self.states if j <= i)
        gen = torch.Generator()
        gen.set_state(self.states[start])
        for d in self.draws[start:i]:
            d.apply(gen)
        state = gen.get_state()
        self.states[i] = state
        return state


class Ledger:
    """The default CPU generator's deferred draws (see the module docstring)."""

    def __init__(self) -> None:
        self.current: Segment | None = None

    def ticket(self, draw: Draw) -> tuple[Segment, int]:
        """Defer `draw`; returns where it sits, to know the state it starts from later."""
        if self.current is None:
            self.current = Segment(torch.default_generator.get_state())
        seg = self.current
        seg.draws.append(draw)
        return seg, len(seg.draws) - 1

    @property
    def owing(self) -> bool:
        return self.current is not None

    def settle(self) -> None:
        """Advance the default generator by every deferred draw (it is about to be observed).
        A state that no longer is the segment's base was replaced behind our back (a direct
        ``torch.default_generator.manual_seed``): the debt went with it."""
        seg, self.current = self.current, None
        if seg is None or not seg.draws:
            return
        if torch.equal(torch.default_generator.get_state(), seg.base):
            torch.default_generator.set_state(seg.state_before(len(seg.draws)))

    def drop(self) -> None:
        """The state is being replaced (``manual_seed``): what was owed no longer matters."""
        self.current = None


def patch_rng(ledger: Ledger) -> Callable[[], None]:
    """``torch.get_rng_state`` settles first; ``manual_seed``/``seed``/``set_rng_state`` drop the
    debt (in ``torch`` and ``torch.random``). Returns the restore function."""
    import torch.random as random_module

    saved: list[tuple[Any, str, Any]] = []

    def wrap(name: str, before: Callable[[], None]) -> None:
        original = getattr(random_module, name)

        def patched(*args: Any, **kwargs: Any) -> Any:
            before()
            return original(*args, **kwargs)
        patched.__doc__ = original.__doc__
        for module in (torch, random_module):
            if getattr(module, name, None) is original:
                saved.append((module, name, original))
                setattr(module, name, patched)

    wrap("get_rng_state", ledger.settle)
    for name in ("manual_seed", "seed", "set_rng_state"):
        wrap(name, ledger.drop)

    def restore() -> None:
        for module, name, original in reversed(saved):
            setattr(module, name, original)
        saved.clear()

    return restore
