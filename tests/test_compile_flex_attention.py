"""Compiled FlexAttention under ``vram run``: Dynamo's graph holds ``flex_attention``, a
higher-order operator whose ``score_mod`` and ``mask_mod`` are subgraphs (``get_attr`` nodes),
sent to the compile process with the graph (`vram.run.compile.graph_transport`); Inductor lowers
it to its Triton template (torch/_inductor/kernel/flex/flex_attention.py), which never makes the
[B, H, S, S] scores the eager path makes. Compiles in the compile process: marked slow."""
from __future__ import annotations

import pickle
from importlib.util import find_spec
from pathlib import Path

import pytest

from compiled_runs import vram_run

B, H, S, D = 4, 8, 1024, 64
_SCRIPT = f'''
import torch
from torch.nn.attention.flex_attention import flex_attention, create_block_mask
def causal(b, h, q, kv):
    return q >= kv
mask = create_block_mask(causal, B=None, H=None, Q_LEN={S}, KV_LEN={S}, device="cuda")
flex = torch.compile(flex_attention)
q, k, v = (torch.randn({B}, {H}, {S}, {D}, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
for i in range(2):
    flex(q, k, v, block_mask=mask).sum().backward()
'''


@pytest.mark.slow  # compiles in the compile process: about a minute
def test_compiled_flex_attention_runs_its_template(tmp_path: Path) -> None:
    """The forward wrapper allocates what the template's lowering makes: the logsumexp and the
    row maxima, float32 [B, H, S], then the output like the query (bf16 [B, H, S, D]); the
    backward one gradient like each of q, k, v; nothing the size of the scores (B x H x S x S
    float32) is ever allocated."""
    if find_spec("triton") is None:
        pytest.skip("needs triton (the 'compile' extra)")
    script, snapshot = tmp_path / "flex.py", tmp_path / "flex.pickle"
    script.write_text(_SCRIPT, encoding="utf-8")
    done = vram_run(script, snapshot)
    assert "not modelled" not in done.stderr and "runs eagerly" not in done.stderr, done.stderr[-2000:]
    with open(snapshot, "rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    allocs = [e for e in trace if e["action"] == "alloc"]
    lse, out = B * H * S * 4, B * H * S * D * 2
    first = next(i for i, e in enumerate(allocs) if e["size"] == lse)
    assert [e["size"] for e in allocs[first:first + 3]] == [lse, lse, out]
    assert sum(1 for e in allocs if e["size"] == out) >= 3 + 2 * (1 + 3)  # q, k, v; per step out, dq, dk, dv
    assert max(e["size"] for e in allocs) < B * H * S * S * 4
