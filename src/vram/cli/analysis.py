"""``vram explain``, ``vram tune`` and ``vram replay`` over many snapshots (`vram.analysis`)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from vram.units import format_size, parse_size

from .defaults import DEFAULT_CONTEXT, DEFAULT_GPU, REPLAY_CONTEXT_HELP
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

    bar = Progress(label, unit="replays")  # explain, tune and fleets count whole replays

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
                jobs.append(ReplayJob(path, device, conf, args.gpu, args.context, args.verify,
                                      cap=None if args.cap is None else parse_size(args.cap, "--cap")))
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
    from vram.analysis.report import explanation_text

    ex = explain(args.snapshot, device=args.device, gpu=args.gpu, context=args.context, workers=args.jobs,
                 cluster=args.cluster, progress=_progress("trying fixes"))
    if args.html is not None:
        from .html import write_report

        write_report(args.html, args.snapshot, gpu=args.gpu, context=args.context, explanation=ex)
        print(f"wrote {args.html}", file=sys.stderr)
    print(json.dumps(ex.to_json()) if args.json else explanation_text(ex))
    return 0


def _record_script(argv: list[str], gpu: str | None, context: str, work: str) -> str:
    """Run ``script.py args`` once under ``vram run --snapshot`` (a subprocess), recording every
    allocation from its start into `work`; returns the dump's path. An OOM in the script still
    leaves the recording."""
    if not argv:
        raise ValueError("vram tune --: give the script to run, e.g. vram tune -- train.py --batch 8")
    if not os.path.isfile(argv[0]):
        raise OSError(f"can't open file {argv[0]!r}: no such file")
    dump = os.path.join(work, "recording.pickle")
    cmd = [sys.executable, "-m", "vram", "run", "--gpu", gpu or DEFAULT_GPU, "--context", context,
           "--snapshot", dump, "--no-next-step", *argv]
    proc = subprocess.run(cmd, stdout=sys.stderr)
    if not os.path.isfile(dump) or os.path.getsize(dump) == 0:
        raise RuntimeError(f"the script exited with status {proc.returncode} under vram run before "
                           "anything was recorded; nothing to tune")
    if proc.returncode != 0:
        print(f"vram: warning: the script exited with status {proc.returncode}; tuning what it recorded",
              file=sys.stderr)
    return dump


def cmd_tune(args: argparse.Namespace) -> int:
    paths = list(args.snapshot)
    if args.script is not None:
        if paths:
            raise ValueError("give snapshots or '-- script.py args', not both")
        work = tempfile.mkdtemp(prefix="vram-tune-")
        try:  # the recording is needed only while tuning: the folder goes when tune ends
            return _tune(args, [_record_script(args.script, args.gpu, args.context if args.gpu else DEFAULT_CONTEXT,
                                                    work)])
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return _tune(args, paths)


def _tune(args: argparse.Namespace, paths: list[str]) -> int:
    from vram.analysis.report import tune_text
    from vram.analysis.tune import tune

    if not paths:
        raise ValueError("nothing to tune: give snapshots, or '-- script.py args'")
    if args.html is not None and len(paths) > 1:
        raise ValueError("--html takes one snapshot")
    result = tune(paths, gpu=args.gpu, context=args.context,
                  devices=[args.device] * len(paths) if args.device is not None else None,
                  workers=args.jobs, cluster=args.cluster, progress=_progress("tuning"))
    if args.html is not None:
        from .html import tune_report

        tune_report(args.html, result, args.device, args.top)
        print(f"wrote {args.html}", file=sys.stderr)
    print(json.dumps(result.to_json()) if args.json else tune_text(result, args.top))
    return 1 if result.best is None else 0  # EXIT_CODES: 1 is "every config runs out of memory"


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
    p.add_argument("--context", default=None, help=REPLAY_CONTEXT_HELP)
    p.add_argument("--jobs", type=positive, default=None, help=JOBS_HELP)
    p.add_argument("--cluster", default=None, help=CLUSTER_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report: memory over time with "
                   "the OOM marked, the segments and top consumers there, the fixes")
    p.set_defaults(func=cmd_explain)

    help_ = "search allocator settings for the lowest peak reserved without an OOM, by replay"
    p = sub.add_parser("tune", help=help_, description=help_ + " (one recording, a fleet of them, or a "
                       "script recorded once under vram run)", epilog=epilog("tune"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("snapshot", nargs="*", help="snapshots to tune one config for (or '-- script.py args')")
    p.add_argument("--device", type=index, default=None, help="device index in every snapshot (default 0)")
    p.add_argument("--gpu", help=gpu_help + " (default: from a recorded OOM, else unlimited)")
    p.add_argument("--context", default=None, help=REPLAY_CONTEXT_HELP)
    p.add_argument("--top", type=positive, default=15, help="rows shown (default 15)")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report: the best config's "
                   "replay (memory over time, segments and live tensors at its peak) and the ranked configs")
    p.add_argument("--jobs", type=positive, default=None, help=JOBS_HELP)
    p.add_argument("--cluster", default=None, help=CLUSTER_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_tune, script=None)
