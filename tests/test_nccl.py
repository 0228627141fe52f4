"""NCCL's memory outside the caching allocator (`vram.devices.nccl`).

Every expected figure is computed here by hand from NCCL's source (NVIDIA/nccl 2.30.7, commit
5067397c): ``src/init.cc`` lines 810-813 (``DEFAULT_LL_BUFFSIZE`` = NCCL_LL_LINES_PER_THREAD 8 x
NCCL_LL_MAX_NTHREADS 512 x NCCL_STEPS 8 x sizeof(ncclLLFifoLine) 16; ``DEFAULT_LL128_BUFFSIZE`` =
120 x 640 x 8 x sizeof(uint64_t); ``DEFAULT_BUFFSIZE`` = 1 << 22), ``src/transport/p2p.cc``
lines 407-410 (send: ``sizeof(ncclSendMem)`` + Simple when reading, aligned to CUDA_IPC_MIN) and
486-491 (receive: ``sizeof(ncclRecvMem)`` + every protocol but Simple when reading), and
``src/include/comm.h`` (CUDA_IPC_MIN 2097152; both structs are a union padded to MEM_ALIGN 4096).
The channel search is checked against what NCCL printed on an H800 node (8 NVLinks):
"16 coll channels, 0 nvls channels, 16 p2p channels, 16 p2p channels per peer"
(github.com/NVIDIA/nccl/issues/892).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vram.devices.nccl import (
    Communicator,
    NcclEnv,
    Node,
    connector_bytes,
    nccl_memory,
    node_for,
    nvswitch_ring_channels,
)

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
LL, LL128, SIMPLE = 8 * 512 * 8 * 16, 120 * 640 * 8 * 8, 1 << 22


def align2m(n: int) -> int:
    return -(-n // (2 * MiB)) * (2 * MiB)


def test_protocol_defaults_and_connector_sizes_follow_p2p_cc() -> None:
    env = NcclEnv()
    assert (env.ll, env.ll128, env.simple) == (524_288, 4_915_200, 4_194_304)
    # P2P write (sm_90 NVLink): the receiver holds all three protocols
    write = connector_bytes(env, read=False)
    assert write == (align2m(4096), align2m(4096 + LL + LL128 + SIMPLE)) == (2 * MiB, 10 * MiB)
    # P2P read (two sm_80 GPUs over NVLink): Simple moves to the sender
    read = connector_bytes(env, read=True)
    assert read == (align2m(4096 + SIMPLE), align2m(4096 + LL + LL128)) == (6 * MiB, 6 * MiB)
    big = NcclEnv.from_environ({"NCCL_BUFFSIZE": str(8 * MiB)})
    assert connector_bytes(big, read=False)[1] == align2m(4096 + LL + LL128 + 8 * MiB) == 14 * MiB


def test_ring_search_matches_the_h800_log_and_gives_h100_and_a100() -> None:
    assert nvswitch_ring_channels(8, 90) == 16      # H800: NCCL printed 16 coll channels
    assert nvswitch_ring_channels(18, 90) == 24     # H100 SXM: 6 at 60 GB/s, duplicated, then doubled
    assert nvswitch_ring_channels(12, 80) == 24     # A100 SXM4: 6 at 40 GB/s, duplicated, then doubled


def test_channel_environment_clamps_as_ncclTopoPostset() -> None:
    h100 = node_for("NVIDIA H100 80GB HBM3", 9, 0)
    one = [Communicator("g", 8, ring=True)]
    book = lambda ch: (2 + 3 * ch) * 2 * MiB   # noqa: E731 - devComm, rankToLocalRank, 3 per channel
    # NCCL_MAX_NCHANNELS=8: ring 8 channels; p2p channels pow2Up(8) = 8 initialised, so 8 in all
    m = nccl_memory(one, h100, NcclEnv.from_environ({"NCCL_MAX_NCHANNELS": "8"}))
    assert m.bytes == 8 * 12 * MiB + book(8)
    # NCCL_MIN_NCHANNELS=32 raises the 24 found; pow2Up(32) = 32 channels initialised
    m = nccl_memory(one, h100, NcclEnv.from_environ({"NCCL_MIN_NCHANNELS": "32"}))
    assert m.bytes == 32 * 12 * MiB + book(32)


def test_h100_communicator_figure_and_p2p_channels_per_peer() -> None:
    h100 = node_for("NVIDIA H100 80GB HBM3", 9, 0)
    env = NcclEnv()
    # 24 ring channels x (2 + 10) MiB; channels initialised max(24, pow2Up(24) = 32) = 32
    ring = nccl_memory([Communicator("g", 2, ring=True)], h100, env)
    assert ring.bytes == 24 * 12 * MiB + (2 + 3 * 32) * 2 * MiB == 484 * MiB
    # p2p per peer: min(p2pnChannels 32, pow2Up(2 x 18 links) = 64) = 32 channels
    p2p = nccl_memory([Communicator("g", 2, sends={1}, recvs={1})], h100, env)
    assert p2p.bytes == 32 * (2 + 10) * MiB + (2 + 3 * 32) * 2 * MiB
    assert any("NVLS" in ln for ln in ring.lines)                        # said, not counted
    assert not any("NVLS" in ln for ln in nccl_memory([Communicator("g", 2, ring=True)], h100,
                                                      NcclEnv.from_environ({"NCCL_NVLS_ENABLE": "0"})).lines)


def test_what_is_not_derived_is_said() -> None:
    a10 = node_for("NVIDIA A10", 8, 6)
    comm = [Communicator("g", 4, ring=True)]
    m = nccl_memory(comm, a10, NcclEnv())
    assert m.bytes is None and m.lines[0].startswith("not derived") and "NCCL_MIN_NCHANNELS" in m.lines[0]
    pinned = nccl_memory(comm, a10, NcclEnv.from_environ({"NCCL_MIN_NCHANNELS": "4", "NCCL_MAX_NCHANNELS": "4"}))
    assert pinned.bytes == 4 * 12 * MiB + (2 + 3 * 4) * 2 * MiB
    spread = nccl_memory([Communicator("g", 16, one_node=False, ring=True)], Node("nvswitch", 90, 18), NcclEnv())
    assert spread.bytes is None and "span nodes" in spread.lines[0]
    assert nccl_memory([Communicator("g", 1, ring=True)], a10, NcclEnv()).bytes == 0
    with pytest.raises(ValueError, match="NCCL_BUFFSIZE='4M' is not an integer"):
        NcclEnv.from_environ({"NCCL_BUFFSIZE": "4M"})


SCRIPT = """
import os, torch, torch.distributed as dist
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
x = torch.empty(1024 * 1024, device="cuda")
dist.all_reduce(x)
"""


def _launch(tmp_path: Path, **env_extra: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "ar.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), **env_extra)
    return subprocess.run([sys.executable, "-m", "vram", "run", "--gpu", "H100", "--context", "500MiB",
                           "--nproc-per-node", "2", str(script)], capture_output=True, text=True, env=env,
                          timeout=300)


def test_launcher_summary_adds_context_and_nccl(tmp_path: Path) -> None:
    r = _launch(tmp_path, NCCL_BUFFSIZE=str(8 * MiB))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.strip()[:1].isdigit()}
    reserved = int(rows["0"].split()[6].replace(",", ""))
    nccl = 24 * (2 + 14) * MiB + (2 + 3 * 32) * 2 * MiB        # NCCL_BUFFSIZE=8 MiB: 14 MiB receivers
    assert f"{reserved + 500 * MiB + nccl:,}" in rows["0"] and f"{reserved + 500 * MiB + nccl:,}" in rows["1"]
    assert "outside the caching allocator" in r.stdout and f"NCCL {nccl:,}" in r.stdout
    bad = _launch(tmp_path, NCCL_MAX_NCHANNELS="many")
    assert bad.returncode != 0 and "NCCL_MAX_NCHANNELS='many' is not an integer" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_estimate_layout_reports_nvidia_smi_per_rank() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, "-m", "vram", "estimate", "tiny_stack:stack", "--input", "64x256",
                        "--fsdp", "2", "--gpu", "H100", "--context", "300MiB", "--json"], capture_output=True,
                       text=True, env=env, timeout=300, cwd=str(ROOT / "tests" / "distributed_programs"))
    assert r.returncode == 0, r.stdout + r.stderr
    import json

    out = json.loads(r.stdout)
    peak = out["estimates"]["0"]["peak_reserved"]
    one_comm = 24 * 12 * MiB + (2 + 3 * 32) * 2 * MiB     # FSDP2's collectives on the world group
    assert out["nccl"]["0"]["bytes"] == one_comm
    assert out["nvidia_smi"]["0"] == out["nvidia_smi"]["1"] == peak + 300 * MiB + one_comm
