"""``vram explain``, ``vram tune`` and ``vram replay`` over many snapshots (`vram.analysis`)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from vram.units import format_size

from .examples import epilog


def positive(text: str) -> int:
    """An argparse type: a count of at least 1 (rows shown, parallel jobs)."""
    return _whole(text, 1, "a whole number >= 1")


def index(text: str) -> int:
    """An argparse type: an index, 0 or more (a device)."""
    return _whole(text, 0, "a whole number >= 0")


def _whole(text: str, low: int, what: str) -> int:
    t = text.strip()
    if not (t.isascii() and t.lstrip("+-").isdigit() and len(t) <= 20) or int(t) < low:
        raise argparse.ArgumentTypeError(f"expected {what}, not {_shown(text, 40)!r}")
    return int(t)


JOBS_HELP = "parallel replays (default: one per core; 1: serially)"
CLUSTER_HELP = ("run the replays on a Dask cluster: 'local' starts a LocalCluster, or a scheduler address "
                "such as tcp://host:8786 (pip install 'vram[cluster]'; workers must see the files)")


def _shown(text: Any, limit: int = 200) -> str:
    from vram.replay.messages import printable

    return printable(str(text), limit)


def _progress(label: str) -> Any:
    from .progress import Progress

    bar = Progress(label)

    def report(done: int, total: int) -> None:
        bar(done, total)
    return report


def cmd_replay_fleet(args: argparse.Namespace) -> int:
    """``vram replay A B C ...``: every snapshot (every device, every --conf) replayed in parallel."""
    from vram.analysis.fleet import ReplayJob, devices_of, run_jobs

    jobs = []
    for path in args.snapshot:
        devices = [args.device] if args.device is not None else devices_of(path)
        for device in devices:
            for conf in args.conf or [None]:
                jobs.append(ReplayJob(path, device, conf, args.gpu, args.context, args.verify))
    rows = run_jobs(jobs, workers=args.jobs, cluster=args.cluster, progress=_progress("replaying"))
    if args.json:
        print(json.dumps({"runs": rows}))
        return 0 if not any("error" in r for r in rows) else 2
    head = ("snapshot", "dev", "config", "peak allocated", "peak reserved", "OOMs", "first OOM", "verified")
    table = []
    for r in rows:
        job = r["job"]
        if "error" in r:
            table.append((_shown(job["path"], 60), str(job["device"]), "-", "error: " + _shown(r["error"], 120),
                          "", "", "", ""))
            continue
        verified = ""
        if job["verify"]:
            keys = ("segment_allocs", "segment_frees", "segment_maps", "segment_unmaps", "alloc_addresses",
                    "final_segments", "final_blocks", "recorded_ooms")
            exact = all(r[k]["matched"] == r[k]["total"] for k in keys) and not r["divergences"]
            verified = "exact" if exact else f"{len(r['divergences'])} divergences"
        table.append((_shown(job["path"], 60), str(job["device"]), _shown(r["conf"] or "default config", 60),
                      format_size(r["peak_allocated"]), format_size(r["peak_reserved"]), f"{r['ooms']:,}",
                      "-" if r["oom"] is None else f"event {r['oom']['event_index']:,}", verified))
    widths = [max(len(row[k]) for row in [head, *table]) for k in range(len(head))]
    for row in [head, *table]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0 if not any("error" in r for r in rows) else 2


def cmd_explain(args: argparse.Namespace) -> int:
    from vram.analysis.explain import explain

    ex = explain(args.snapshot, device=args.device, gpu=args.gpu, context=args.context, workers=args.jobs,
                 cluster=args.cluster, progress=_progress("trying fixes"))
    if args.json:
        print(json.dumps(ex.to_json()))
        return 0
    f = format_size
    at = ex.at
    where = (f"the OOM at event {at['event_index']:,}" if at["kind"] == "oom"
             else f"the reserved peak (event {at['event_index']:,})")
    lines = [f"{_shown(args.snapshot)}, device {ex.device}: {where}"]
    if at["kind"] == "oom":
        lines.append("  " + _shown(at["message"], 2000))
        if at.get("frame"):
            lines.append(f"  requested at {_shown(at['frame'], 300)}")
    gpu = _shown(ex.gpu_from) if ex.gpu is None else f"{ex.gpu:,} B for PyTorch ({_shown(ex.gpu_from)})"
    lines += ["", f"GPU: {gpu}",
              f"allocated {f(ex.allocated)}, reserved {f(ex.reserved)}, reserved but unallocated "
              f"{f(ex.reserved_unallocated)}, largest free block {f(ex.largest_free_block)}", "",
              "top consumers (live tensors by the user's stack frame):"]
    for c in ex.top_consumers:
        lines.append(f"  {f(c['bytes']):>12}  {c['blocks']:>6,} blocks  {_shown(c['frame'], 300)}")
    if ex.free_by_pool:
        lines += ["", "free blocks by pool and stream:"]
        lines += [f"  {r['pool']:<5} stream {r['stream']:<4} {f(r['free_bytes']):>12} in {r['blocks']:,} blocks, "
                  f"largest {f(r['largest'])}" for r in ex.free_by_pool]
    lines += ["", "why:"] + [f"  - {w}" for w in ex.why]
    lines += ["", "what would have avoided it (each replayed through the whole recording):" if at["kind"] == "oom"
              else "what lowers the peak (each replayed through the whole recording):"]
    if not ex.fixes:
        lines.append("  nothing found")
    for fix in ex.fixes:
        mark = "verified" if fix["verified"] else "fails   "
        extra = f"  (peak reserved {f(fix['peak_reserved'])})" if "peak_reserved" in fix else ""
        lines.append(f"  [{mark}] {_shown(fix['change'], 400)}{extra}")
    print("\n".join(lines))
    return 0


_WRAPPER = """\
import os, runpy, sys
import torch
dump, script = sys.argv[1], sys.argv[2]
sys.argv = sys.argv[2:]
sys.path[0] = os.path.dirname(os.path.abspath(script))
torch.cuda.memory._record_memory_history()
try:
    runpy.run_path(script, run_name="__main__")
finally:
    torch.cuda.memory._dump_snapshot(dump)
"""


def _record_script(argv: list[str], gpu: str | None, context: str) -> str:
    """Run ``script.py args`` once under ``vram run`` (a subprocess), recording every allocation
    from its start; returns the dump's path. An OOM in the script still leaves the recording."""
    if not argv:
        raise ValueError("vram tune --: give the script to run, e.g. vram tune -- train.py --batch 8")
    if not os.path.isfile(argv[0]):
        raise OSError(f"can't open file {argv[0]!r}: no such file")
    work = tempfile.mkdtemp(prefix="vram-tune-")
    wrapper, dump = os.path.join(work, "record.py"), os.path.join(work, "recording.pickle")
    with open(wrapper, "w") as fh:
        fh.write(_WRAPPER)
    cmd = [sys.executable, "-m", "vram", "run", "--gpu", gpu or "80GiB", "--context", context, wrapper, dump, *argv]
    proc = subprocess.run(cmd, stdout=sys.stderr)
    if not os.path.isfile(dump) or os.path.getsize(dump) == 0:
        raise RuntimeError(f"the script exited with status {proc.returncode} under vram run before "
                           "anything was recorded; nothing to tune")
    if proc.returncode != 0:
        print(f"vram: warning: the script exited with status {proc.returncode}; tuning what it recorded",
              file=sys.stderr)
    return dump


def cmd_tune(args: argparse.Namespace) -> int:
    from vram.analysis.tune import paste_line, tune

    paths = list(args.snapshot)
    if args.script is not None:
        if paths:
            raise ValueError("give snapshots or '-- script.py args', not both")
        paths = [_record_script(args.script, args.gpu, args.context)]
    if not paths:
        raise ValueError("nothing to tune: give snapshots, or '-- script.py args'")
    result = tune(paths, gpu=args.gpu, context=args.context,
                  devices=[args.device] * len(paths) if args.device is not None else None,
                  workers=args.jobs, cluster=args.cluster, progress=_progress("tuning"))
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    f = format_size
    base = next((r for r in result.results if r["conf"] == ""), result.best)
    for p, b in zip(result.snapshots, result.budgets):
        gpu = "unlimited" if b.gpu is None else f"{b.gpu:,} B" if isinstance(b.gpu, int) else b.gpu
        print(f"{_shown(p)}: GPU {gpu} ({_shown(b.why)})")
    print(f"\n{'rank':>4}  {'peak reserved':>14}  {'vs default':>11}  {'OOM':<4} {'cudaMalloc':>10}  config")
    for k, r in enumerate(result.results[:args.top], 1):
        delta = r["peak_reserved"] - base["peak_reserved"]
        sign = "-" if delta < 0 else "+"
        print(f"{k:>4}  {f(r['peak_reserved']):>14}  {sign + f(abs(delta)):>11}  {'yes' if r['oom'] else 'no':<4} "
              f"{r['segment_allocs']:>10,}  {_shown(r['conf'] or '(default)', 200)}")
    for note in result.notes:
        print(f"note: {_shown(note, 400)}")
    best = result.best
    print(f"\nbest: {paste_line(best['conf'])}" + ("   (still runs out of memory)" if best["oom"] else ""))
    if "per_process_memory_fraction" in best["conf"]:
        print("(per_process_memory_fraction in PYTORCH_CUDA_ALLOC_CONF needs a recent PyTorch; else call "
              "torch.cuda.set_per_process_memory_fraction)")
    return 0


def add_parsers(sub: Any, gpu_help: str) -> None:
    """Register explain and tune."""
    help_ = "why a recording ran out of memory (or what its reserved peak is), and fixes checked by replay"
    desc = (help_ + ". empty_cache() is tried before each event where the cache (reserved - allocated) is at "
            "a local maximum, the 32 largest: at most 32 replays, each through the whole recording")
    p = sub.add_parser("explain", help=help_, description=desc, epilog=epilog("explain"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("snapshot", help="a torch.cuda.memory._dump_snapshot pickle (or a vram run dump), JSON, RMM CSV")
    p.add_argument("--device", type=index, default=None,
                   help="device index (default: the first with a recorded OOM, else 0)")
    p.add_argument("--gpu", help=gpu_help + " (default: at a recorded OOM, what PyTorch could have had there)")
    p.add_argument("--context", default="0", help="CUDA context bytes with --gpu")
    p.add_argument("--jobs", type=positive, default=None, help=JOBS_HELP)
    p.add_argument("--cluster", default=None, help=CLUSTER_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_explain)

    help_ = "search allocator settings for the lowest peak reserved without an OOM, by replay"
    p = sub.add_parser("tune", help=help_, description=help_ + " (one recording, a fleet of them, or a "
                       "script recorded once under vram run)", epilog=epilog("tune"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("snapshot", nargs="*", help="snapshots to tune one config for (or '-- script.py args')")
    p.add_argument("--device", type=index, default=None, help="device index in every snapshot (default 0)")
    p.add_argument("--gpu", help=gpu_help + " (default: from a recorded OOM, else unlimited)")
    p.add_argument("--context", default="0", help="CUDA context bytes with --gpu")
    p.add_argument("--top", type=positive, default=15, help="rows shown (default 15)")
    p.add_argument("--jobs", type=positive, default=None, help=JOBS_HELP)
    p.add_argument("--cluster", default=None, help=CLUSTER_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_tune, script=None)
