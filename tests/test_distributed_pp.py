"""Pipeline parallel under ``vram run --nproc-per-node``: each stage is its own
program, simulated in its own process; point-to-point messages carry known values between the
rank processes (`vram.run.distributed.p2p`), so stages infer their shapes as on GPUs.

Expectations from ``torch/distributed/pipelining/schedules.py``: ``ScheduleGPipe`` runs every
microbatch's forward before any backward, so during the backward of microbatch k a stage still
holds the activations of microbatches k..M-1 (M - k of them); ``Schedule1F1B`` runs
``warmup_chunks = min(M, num_stages - stage_index)`` forwards, then alternates one backward and
one forward, so during the backward of microbatch k it holds ``min(warmup_chunks + k, M) - k``
microbatches. A stage's peak is during the backward of microbatch 1: the first whose weight
gradients are *accumulated* (``AccumulateGrad`` steals the first microbatch's gradient and adds
the next one's, a new H x D float32 tensor per weight, in place). The two schedules' peaks on a
stage therefore differ by exactly ``(M - 1) - (min(min(M, S - s) + 1, M) - 1)`` microbatches'
saved activations:
the ReLU output (saved by ``threshold_backward`` and by the second Linear's ``mm``) and, per
stage, the stage output kept for its backward (first stage: the output in ``fwd_cache``; last
stage: ``(y - t)``, saved by ``pow``'s backward). On a middle stage 1F1B also holds microbatch 0's
input gradient during microbatch 1's backward: ``Schedule1F1B._step_microbatches`` keeps it in
``bwd_sends`` until the next ``get_bwd_send_ops``, while under GPipe only the send's Work holds
it, and ``ProcessGroupNCCL`` unstashes a completed Work at the next enqueue on the group: the
receive of microbatch 1's gradient, before its backward (the last stage receives none, and the
first sends none).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from vram.run.distributed.p2p import Mailbox, P2PError, exited_marker  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ROOT / "tests" / "distributed_programs"
D, H, BATCH, MICRO = 256, 4096, 64, 4          # as in pp_schedules.py
MB = BATCH // MICRO


def _peaks(stdout: str) -> dict[tuple[int, str], int]:
    peaks = {}
    for line in stdout.splitlines():
        if line.startswith("[rank") and " peak " in line:
            rank = int(line[5:line.index("]")])
            name, _, value = line.split(":", 1)[1].split()
            peaks[rank, name] = int(value)
    return peaks


@pytest.mark.parametrize("how, stages", [pytest.param((), 2, marks=pytest.mark.slow), (("--tracer",), 2),
                                         pytest.param((), 4, marks=pytest.mark.slow)],
                         ids=["PipelineStage", "pipeline", "4-stages"])
def test_1f1b_holds_fewer_microbatches_than_gpipe_by_the_schedules_rules(how: tuple[str, ...], stages: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, "-m", "vram", "run", "--nproc-per-node", str(stages), "--gpu", "24GiB",
                        str(PROGRAMS / "pp_schedules.py"), *how], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    peaks = _peaks(r.stdout)
    saved = MB * H * 4 + MB * D * 4      # ReLU output + the stage's kept output (see the module doc)
    grad = MB * D * 4                    # one microbatch's input gradient, sent to the previous stage
    for s in range(stages):
        held_gpipe = MICRO - 1                       # during microbatch 1's backward: 1..M-1
        warmup = min(MICRO, stages - s)              # warmup_chunks
        held_1f1b = min(warmup + 1, MICRO) - 1       # forwards done before B1, less B0
        middle = 0 < s < stages - 1                  # 1F1B's bwd_sends still holds B0's gradient
        assert peaks[s, "ScheduleGPipe"] - peaks[s, "Schedule1F1B"] == (held_gpipe - held_1f1b) * saved - middle * grad
    # 1F1B saves the most on the last stage; on the first only when there are more microbatches
    # than stages (with M = S = 4 its warm-up runs every forward first, as GPipe does)
    assert peaks[stages - 1, "Schedule1F1B"] < peaks[stages - 1, "ScheduleGPipe"]
    assert (peaks[0, "Schedule1F1B"] < peaks[0, "ScheduleGPipe"]) == (MICRO > stages)


def test_mailbox_matches_messages_in_order_per_pair(tmp_path: Path) -> None:
    sender, receiver = Mailbox(str(tmp_path), 0, {0, 1}), Mailbox(str(tmp_path), 1, {0, 1})
    sender.post("g", 1, [torch.tensor(1.0)])         # a 0-d tensor, as pipelining's warm-up sends
    assert receiver.take("g", 0) == [torch.tensor(1.0)]
    sender.post("g", 1, [torch.tensor([1])])
    sender.post("g", 1, [None])
    assert receiver.take("g", 0) == [torch.tensor([1])]
    assert receiver.take("g", 0) == [None]                  # unknown values stay unknown
    assert Mailbox(str(tmp_path), 1, {1}).take("g", 0) is None   # rank 0 not simulated: unknown at once


def test_receiving_from_a_rank_that_ended_without_sending_is_an_error(tmp_path: Path) -> None:
    open(exited_marker(str(tmp_path), 0), "w").close()
    with pytest.raises(P2PError, match="rank 1 receives message 0 from rank 0 .* ended without sending it"):
        Mailbox(str(tmp_path), 1, {0, 1}).take("g", 0)


P2P_SCRIPT = """
import os, sys, torch, torch.distributed as dist
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl")
t = torch.zeros(1, device="cuda")
if "--deadlock" in sys.argv or rank == 0:
    dist.recv(t, src=1 - rank)
    print("got", t.item())
else:
    dist.send(torch.full((1,), 7.0, device="cuda"), dst=0)
"""


@pytest.mark.slow
def test_a_waiting_receiver_gets_its_sender_started_beyond_jobs(tmp_path: Path) -> None:
    script = tmp_path / "p2p.py"
    script.write_text(P2P_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, "-m", "vram", "run", "--nproc-per-node", "2", "--jobs", "1", str(script)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[rank0]:got 7.0" in r.stdout                      # the sender's value, not a placeholder
    r = subprocess.run([sys.executable, "-m", "vram", "run", "--nproc-per-node", "2", str(script), "--deadlock"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1
    assert "while every simulated rank waits: a deadlock" in r.stderr
