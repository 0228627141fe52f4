"""``vram run --nproc-per-node N [--nnodes M]``: ``torchrun`` on a machine of simulated GPUs.

Each rank is its own process running ``vram run`` on the script, as torchrun starts one Python
process per rank, with torchrun's environment (``torch/distributed/elastic/agent/server/
local_elastic_agent.py``, static rendezvous): ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_RANK``, ``ROLE_NAME``,
``ROLE_WORLD_SIZE``, ``MASTER_ADDR`` (127.0.0.1), ``MASTER_PORT`` (29500),
``TORCHELASTIC_*``, and ``OMP_NUM_THREADS=1`` when unset and N > 1 (``torch/distributed/run.py``).
A rank sees every GPU of its node (``device_count() == N``); ``cuda:LOCAL_RANK`` is its own.

Ranks run side by side, ``jobs`` at a time; a point-to-point receive waits for its sender
(`vram.run.distributed.p2p`: pipeline stages exchange metadata) and a collective for the other
ranks' known values its outputs need (`vram.run.distributed.exchange`: object collectives,
counts, barriers), and when every running rank waits, the next pending rank starts beyond
``jobs``. ``ranks`` picks which ranks to simulate: the
others are not run and the summary says so — for ranks whose programs are identical (plain data
parallel), one simulated rank stands for all; ranks that differ (pipeline stages, uneven shards)
must each be simulated.

Output lines are prefixed ``[rankR]:``. At the end a per-rank table gives each rank's own GPU:
peak allocated, peak reserved, peak reserved + CUDA context, OOMs and exit status. Snapshot dumps
(``torch.cuda.memory._dump_snapshot(path)``) are staged by each rank and moved when all are done:
to ``path`` when one rank wrote it, to ``path`` with ``.rankR`` before the extension for each
rank when several did (on a shared file system they would have overwritten each other).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from vram.devices.nccl import NcclEnv, with_nccl
from vram.units import format_size

from .p2p import MAILBOX_ENV, SIMULATED_ENV, deadlock_marker, exited_marker, waiting_marker
from .rank import RESULT_ENV, STAGING_ENV

__all__ = ["Launch", "parse_ranks", "launch", "outside_lines", "torchrun_env"]

MASTER_ADDR = "127.0.0.1"   # torchrun's --master-addr default
MASTER_PORT = 29500         # torchrun's --master-port default (static rendezvous)
DEADLOCK_S = 2.0            # every rank waiting for a message this long: a deadlock


@dataclass
class Launch:
    """What to launch: the machine's shape and which ranks to simulate."""

    nproc_per_node: int
    nnodes: int = 1
    ranks: list[int] | None = None      # None: all
    jobs: int | None = None             # processes at a time; None: the machine's cores
    master_addr: str = MASTER_ADDR
    master_port: int = MASTER_PORT

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


@dataclass
class RankResult:
    rank: int
    status: int
    context: int = 0
    nccl: dict[str, Any] | None = None     #: {"bytes": int | None, "lines": [...]} (`.nccl`)
    devices: list[dict[str, Any]] = field(default_factory=list)
    snapshots: list[tuple[str, str]] = field(default_factory=list)


def parse_ranks(spec: str, world_size: int) -> list[int]:
    """``"0"``, ``"0,3"``, ``"0-3,7"`` or ``"all"`` -> sorted ranks, each checked against the world."""
    if spec.strip().lower() == "all":
        return list(range(world_size))
    ranks: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"--ranks: {part!r} is not a rank or a range like 0-3") from None
        if not 0 <= first <= last < world_size:
            raise ValueError(f"--ranks: {part!r} is outside 0-{world_size - 1} (world size {world_size})")
        ranks.update(range(first, last + 1))
    return sorted(ranks)


def torchrun_env(spec: Launch, rank: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment torchrun (static rendezvous) gives `rank` (see the module doc)."""
    env = dict(os.environ if base is None else base)
    local, node = rank % spec.nproc_per_node, rank // spec.nproc_per_node
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(local), "GROUP_RANK": str(node), "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(spec.nproc_per_node),
        "WORLD_SIZE": str(spec.world_size), "GROUP_WORLD_SIZE": str(spec.nnodes),
        "ROLE_WORLD_SIZE": str(spec.world_size), "MASTER_ADDR": spec.master_addr,
        "MASTER_PORT": str(spec.master_port), "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    })
    if "OMP_NUM_THREADS" not in env and spec.nproc_per_node > 1:
        env["OMP_NUM_THREADS"] = "1"
    return env


#: PyTorch's warnings about the simulation itself, not the script: DDP's Reducer warns once that it
#: has no timer for the PrivateUse1 device (reducer.cpp, ``TORCH_WARN_ONCE`` where no Timer is
#: registered for the device type); on a GPU it has CudaTimer and says nothing
_SIMULATION_WARNINGS = ("Time stats are currently only collected for CPU and CUDA devices",)


def _forward(stream: IO[bytes], out: IO[str], prefix: str, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "backslashreplace")
        if any(w in line for w in _SIMULATION_WARNINGS):
            continue
        if line.startswith(prefix):  # PyTorch's own rank prefix on warnings (torch.distributed's): once is enough
            line = line[len(prefix):]
        with lock:
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()
    stream.close()


def launch(spec: Launch, vram_args: Sequence[str], script: str, script_args: Sequence[str],
           out: IO[str] | None = None, err: IO[str] | None = None, command: Sequence[str] | None = None) -> int:
    """Run `script` once per simulated rank (``python -m vram run VRAM_ARGS SCRIPT ARGS`` in each
    rank's environment; ``python COMMAND`` instead when given, e.g. ``vram estimate``'s ranks),
    print the per-rank summary; returns 0 when every simulated rank exited 0, else the first
    failing rank's status."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    NcclEnv.from_environ(os.environ)   # a bad NCCL_* variable: one line before any rank starts
    ranks = list(range(spec.world_size)) if spec.ranks is None else spec.ranks
    jobs = max(1, min(spec.jobs or os.cpu_count() or 1, len(ranks)))
    lock = threading.Lock()
    work = tempfile.mkdtemp(prefix="vram-ranks-")
    results: dict[int, RankResult] = {}
    try:
        pending = list(ranks)
        running: list[tuple[int, subprocess.Popen[bytes], list[threading.Thread]]] = []
        stuck_since: float | None = None
        while pending or running:
            # a rank waiting for a point-to-point message (`.p2p`) may need one not started yet
            while pending and (len(running) < jobs or _all_waiting(work, running)):
                rank = pending.pop(0)
                env = torchrun_env(spec, rank)
                env[RESULT_ENV] = os.path.join(work, f"rank{rank}.json")
                env[STAGING_ENV] = env[MAILBOX_ENV] = work
                env[SIMULATED_ENV] = ",".join(map(str, ranks))
                cmd = [sys.executable, *command] if command is not None else \
                    [sys.executable, "-m", "vram", "run", *vram_args, script, *script_args]
                proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                assert proc.stdout is not None and proc.stderr is not None
                threads = [threading.Thread(target=_forward, args=(s, o, f"[rank{rank}]:", lock), daemon=True)
                           for s, o in ((proc.stdout, out), (proc.stderr, err))]
                for t in threads:
                    t.start()
                running.append((rank, proc, threads))
            done = [job for job in running if job[1].poll() is not None]
            if not done:
                stuck = not pending and _all_waiting(work, running)
                stuck_since = (stuck_since or time.monotonic()) if stuck else None
                if stuck_since is not None and time.monotonic() - stuck_since > DEADLOCK_S:
                    open(deadlock_marker(work), "w").close()   # every waiting rank raises
                time.sleep(0.01)
                continue
            for job in done:
                running.remove(job)
                rank, proc, threads = job
                status = proc.wait()
                for t in threads:
                    t.join()
                open(exited_marker(work, rank), "w").close()
                results[rank] = _read_result(os.path.join(work, f"rank{rank}.json"), rank, status)
        moved = _place_snapshots(results)
        out.write(summary(spec, ranks, results, moved))
        out.flush()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    failed = [results[r].status for r in ranks if results[r].status != 0]
    return failed[0] if failed else 0


def _all_waiting(work: str, running: Sequence[tuple[int, Any, Any]]) -> bool:
    return bool(running) and all(os.path.exists(waiting_marker(work, r)) for r, _, _ in running)


def _read_result(path: str, rank: int, status: int) -> RankResult:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):  # the rank died before writing (killed, crashed in start-up)
        return RankResult(rank, status if status else 1)
    return RankResult(rank, status, int(data.get("context", 0)), data.get("nccl"), list(data.get("devices", [])),
                      [tuple(p) for p in data.get("snapshots", [])])


def _place_snapshots(results: dict[int, RankResult]) -> list[tuple[int, str]]:
    """Move staged dumps to the paths the script asked for (``.rankR`` added where ranks collide)."""
    writers: dict[str, set[int]] = {}
    for r in results.values():
        for wanted, _ in r.snapshots:
            writers.setdefault(wanted, set()).add(r.rank)
    moved: list[tuple[int, str]] = []
    for r in sorted(results.values(), key=lambda x: x.rank):
        last: dict[str, str] = {}
        for wanted, staged in r.snapshots:
            last[wanted] = staged  # a rank writing one path twice: the last dump stays, as on disk
        for wanted, staged in last.items():
            target = wanted
            if len(writers[wanted]) > 1:
                stem, ext = os.path.splitext(wanted)
                target = f"{stem}.rank{r.rank}{ext}"
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            shutil.move(staged, target)
            moved.append((r.rank, target))
    return moved


def outside_lines(results: dict[int, tuple[int, dict[str, Any] | None]]) -> list[str]:
    """The "outside the caching allocator" note for ranks' (CUDA context, NCCL figure): nvidia-smi
    estimate = peak reserved + CUDA context + NCCL, each figure with its source; ranks with the
    same NCCL explanation share one."""
    if not results:
        return []
    ctx = {c for c, _ in results.values()}
    detail = bool(os.environ.get("NCCL_DEBUG"))  # NCCL's own switch for its details: every figure's derivation
    out = ["outside the caching allocator, per rank (nvidia-smi estimate = peak reserved + CUDA context + NCCL):",
           f"  CUDA context: {', '.join(_size(c) for c in sorted(ctx))} (--context)"]
    groups: dict[str, list[int]] = {}
    for r, (_, nccl) in sorted(results.items()):
        n = nccl or {"bytes": None, "lines": ["not derived: the rank gave no NCCL figure"]}
        head = f"NCCL {_size(n['bytes']) if n['bytes'] is not None else 'not derived'}"
        groups.setdefault("\n".join([head, *n["lines"]]), []).append(r)
    for text, rs in groups.items():
        head, *rest = text.split("\n")
        out.append(f"  {head} (rank{'s' if len(rs) > 1 else ''} {_ranges(rs)}; vram.devices.nccl"
                   + ("):" if detail else "; NCCL_DEBUG=INFO for how it is derived)"))
        out.extend(f"    {ln}" for ln in rest if detail or ln.startswith(("not derived", "not counted")))
    return out


def _ranges(ranks: Sequence[int]) -> str:
    parts: list[str] = []
    for r in sorted(ranks):
        if parts and r == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{r}"
        else:
            parts.append(str(r))
    return ",".join(parts)


def _size(n: int) -> str:
    return f"{n:,} ({format_size(n).strip()})"


def summary(spec: Launch, ranks: Sequence[int], results: dict[int, RankResult],
            moved: Sequence[tuple[int, str]] = ()) -> str:
    """The per-rank table printed when every simulated rank has finished."""
    skipped = [r for r in range(spec.world_size) if r not in ranks]
    head = (f"vram run: {spec.world_size} rank(s) = {spec.nnodes} node(s) x {spec.nproc_per_node} GPU(s); "
            f"simulated: {_ranges(ranks) if skipped else 'all'}")
    if skipped:
        head += f"; not simulated (--ranks): {_ranges(skipped)}"
    lines = [head, f"{'rank':>4} {'node':>4} {'gpu':>6}  {'peak allocated':>24}  {'peak reserved':>24}  "
                   f"{'nvidia-smi estimate':>24}  {'OOMs':>4}  status"]
    notes: list[str] = []
    for r in ranks:
        res = results[r]
        local, node = r % spec.nproc_per_node, r // spec.nproc_per_node
        own = next((d for d in res.devices if d["index"] == local), None)
        if own is None:
            lines.append(f"{r:>4} {node:>4} {'cuda:' + str(local):>6}  {'(no result)':>24}  {'':>24}  {'':>24}  "
                         f"{'':>4}  {res.status}")
            continue
        nccl = (res.nccl or {}).get("bytes")
        smi = with_nccl(own["peak_reserved"] + res.context, nccl)
        used = _size(smi) if smi is not None else "not derived"
        lines.append(f"{r:>4} {node:>4} {'cuda:' + str(local):>6}  {_size(own['peak_allocated']):>24}  "
                     f"{_size(own['peak_reserved']):>24}  {used:>24}  {own['num_ooms']:>4}  "
                     f"{'ok' if res.status == 0 else 'exit ' + str(res.status)}")
        for d in res.devices:
            if d["index"] != local and d["peak_reserved"]:
                notes.append(f"  rank {r} also used cuda:{d['index']} (peak reserved {_size(d['peak_reserved'])}), "
                             f"the GPU of local rank {d['index']}: on a real node they would share it, which is "
                             "not simulated")
    lines.extend(notes)
    lines.extend(outside_lines({r: (results[r].context, results[r].nccl) for r in ranks if results[r].devices}))
    for rank, path in moved:
        lines.append(f"  rank {rank}'s snapshot: {path}")
    return "\n".join(lines) + "\n"
