"""Collectives whose values the program reads carry every launched rank's values, as NCCL and
Gloo do (`vram.run.distributed.exchange`): the object collectives of ``distributed_c10d.py``
(a size, then the pickled bytes: ``broadcast_object_list``, ``all_gather_object``,
``gather_object``, ``scatter_object_list``, ``send_object_list``) and the tensor collectives.

Expectations are the collectives' definitions (``torch.distributed`` documentation) applied to
what each rank of ``distributed_programs/object_collectives.py`` puts in.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from vram.run.distributed.exchange import Exchange  # noqa: E402
from vram.run.distributed.p2p import P2PError, exited_marker  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORLD = 3


def _expected(rank: int) -> dict[str, str]:
    """What each rank prints, from the program's inputs and the collectives' definitions."""
    out: dict[str, str] = {}
    for name in ("default", "nccl", "gloo", "pair"):
        members = [1, 2] if name == "pair" else list(range(WORLD))
        if rank not in members:
            continue
        root, last = members[0], members[-1]
        out[f"{name} broadcast_object_list"] = repr([{"lr": 0.1, "from": root}, "x" * (root + 1)])
        out[f"{name} all_gather_object"] = repr([{"rank": r, "name": "r" * (r + 2)} for r in members])
        out[f"{name} gather_object"] = repr([("obj", r, list(range(r + 1))) for r in members] if rank == last else None)
        out[f"{name} scatter_object_list"] = repr([f"for {rank}" * (rank + 1)])
        if rank in members[:2]:
            out[f"{name} send_object_list"] = repr([{"step": 7, "who": root}])
    ranks = range(WORLD)
    out["all_reduce"] = f"{[sum(r + 1 for r in ranks), sum(10 * (r + 1) for r in ranks)]} {float(WORLD - 1)}"
    out["all_to_all_single"] = repr([r * WORLD + rank for r in ranks])          # rank r sends r*W + j to j
    out["all_gather_into_tensor"] = repr([v for r in ranks for v in (r, -r)])
    out["reduce_scatter_tensor"] = repr([float(sum(rank * (r + 1) for r in ranks))])
    return out


def test_launched_ranks_get_each_others_values_in_every_collective() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, "-m", "vram", "run", "--nproc-per-node", str(WORLD),
                        str(ROOT / "tests" / "distributed_programs" / "object_collectives.py")],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got: dict[int, dict[str, str]] = {}
    for line in r.stdout.splitlines():
        if line.startswith("[rank") and ": " in line:
            rank = int(line[5:line.index("]")])
            key, _, value = line[line.index(":") + 1:].partition(": ")
            got.setdefault(rank, {})[key] = value
    for rank in range(WORLD):
        expected = _expected(rank)
        assert {k: got[rank].get(k) for k in expected} == expected, rank
    assert ast.literal_eval(got[2]["pair gather_object"])[0][1] == 1   # group ranks map to global ones
    assert "placeholder" not in r.stdout + r.stderr


def test_exchange_posts_then_takes_in_order_and_checks_the_kind(tmp_path: Path) -> None:
    a, b = Exchange(str(tmp_path), 0, {0, 1}), Exchange(str(tmp_path), 1, {0, 1})
    for ex, value in ((a, torch.tensor([1, 2])), (b, torch.tensor([3, 4]))):
        seq = ex.begin("nccl-0")
        ex.post("nccl-0", seq, "allreduce", [value], False)
    rec = b.take("nccl-0", 0, "allreduce", 0)
    assert rec is not None and rec[1] is not None and rec[1][0].tolist() == [1, 2]
    seq = b.begin("nccl-0")
    b.post("nccl-0", seq, "broadcast", None, False)        # unknown values: a record all the same
    rec = a.take("nccl-0", 0, "allreduce", 1)
    assert rec is not None and rec[1] is not None and rec[1][0].tolist() == [3, 4]
    a.begin("nccl-0")
    with pytest.raises(P2PError, match="is allgather, rank 1's is broadcast: the ranks call their collectives"):
        a.take("nccl-0", 1, "allgather", 1)
    assert Exchange(str(tmp_path), 0, {0}).take("nccl-0", 0, "allreduce", 1) is None   # not simulated


def test_waiting_for_a_rank_that_ended_without_the_collective_is_an_error(tmp_path: Path) -> None:
    open(exited_marker(str(tmp_path), 1), "w").close()
    ex = Exchange(str(tmp_path), 0, {0, 1})
    with pytest.raises(P2PError, match=r"rank 0 waits for rank 1 in collective 0 \(allreduce\) .* ended without "
                                       "reaching it"):
        ex.take("nccl-0", ex.begin("nccl-0"), "allreduce", 1)
