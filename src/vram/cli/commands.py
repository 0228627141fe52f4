"""The ``vram`` command line: replay, summary, plot, export, demo.

Every subcommand reads any supported snapshot (PyTorch pickle, current or legacy; JSON; RMM's
allocation-log CSV) through the safe loader, exits non-zero with a one-line error on bad input,
and has ``--help`` with examples.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from vram.units import parse_size

from .analysis import CLUSTER_HELP, JOBS_HELP, index, positive
from .analysis import add_parsers as add_analysis_parsers
from .defaults import (
    ARCH_HELP,
    CONTEXT_HELP,
    DEFAULT_CONTEXT,
    DEFAULT_GPU,
    EXIT_CODES,
    GPU_HELP,
    REPLAY_CONTEXT_HELP,
    TORCH_HINT,
    joined_conf,
    replay_context,
)
from .examples import epilog, overview
from .html import replay_html
from .progress import Progress as _Progress
from .reports import label as _label
from .reports import replay_report, side_names, trace_extent, try_alloc
from .reports import shown as _shown
from .run import add_parser as add_run_parser

MiB = 1024 * 1024

def _load(path: str) -> dict[str, Any]:
    """Load a snapshot; what it holds but vram will not replay is said on stderr."""
    from vram.replay.loader import load_snapshot
    from vram.replay.messages import printable

    snap = load_snapshot(path)
    for warning in snap.get("warnings", ()):
        print(f"vram: warning: {printable(path)}: {warning}", file=sys.stderr)
    return snap


def _replay(path: str, snap: dict[str, Any], **kw: Any) -> Any:
    """`vram.replay.engine.replay`; a recording it cannot replay is named in the error."""
    from vram.replay.engine import replay
    from vram.replay.messages import SnapshotError, printable
    from vram.replay.state import StateError

    try:
        return replay(snap, **kw)
    except (SnapshotError, StateError) as exc:
        raise SnapshotError(f"{printable(path)}: {exc}") from None
    except MemoryError:
        raise SnapshotError(f"{printable(path)}: ran out of memory replaying it") from None


def cmd_replay(args: argparse.Namespace) -> int:
    """One snapshot: every device (or --device) under every --conf. Several: `cli.analysis`."""
    from vram.replay.engine import device_count, recorded_devices

    if len(args.snapshot) > 1:
        if args.alloc or args.html:
            raise ValueError(f"{'--alloc' if args.alloc else '--html'} takes one snapshot")
        from .analysis import cmd_replay_fleet
        return cmd_replay_fleet(args)
    path = args.snapshot[0]
    snap = _load(path)
    devices = [args.device] if args.device is not None else recorded_devices(snap)
    if args.device is None and len(devices) < device_count(snap):
        print(f"vram: note: {_shown(path)}: {device_count(snap) - len(devices):,} device(s) record no events and "
              "no segments: not replayed (--device replays one)", file=sys.stderr)
    confs = args.conf if args.conf else [None]
    cap = None if args.cap is None else parse_size(args.cap, "--cap")
    reports, objs = [], []
    for device in devices:
        results = []
        for conf in confs:
            label = _label(conf if conf is not None else "recorded config")
            results.append(_replay(path, snap, gpu=args.gpu, context=args.context, conf=conf,
                                   verify=args.verify, device=device, cap=cap,
                                   progress=_Progress(f"replaying ({_shown(label)})"),
                                   skip_cycles=not args.no_cycle_skip))
        trials = [try_alloc(r, parse_size(args.alloc, "--alloc")) for r in results] if args.alloc else None
        for k, r in enumerate(results):
            objs.append(r.to_json())
            if trials:
                objs[-1]["alloc_trial"] = trials[k]
        header = f"device {device}: " if len(devices) > 1 else ""
        reports.append(header + replay_report(path, snap, results, trials))
    if args.html is not None:
        replay_html(args, path, cap)
    if args.json:  # one shape for one run and for several: every run in "runs", the first also on top
        print(json.dumps({**objs[0], "runs": objs}))
        return 0
    print("\n\n".join(reports))
    return 0


def cmd_summary(args: argparse.Namespace) -> int:
    from vram.views.summary import memory_summary_from_stats

    snap = _load(args.snapshot)
    result = _replay(args.snapshot, snap, device=args.device, stop_at=args.at, progress=_Progress("replaying"))
    stats = result.allocator.memory_stats()
    if args.json:
        print(json.dumps(dict(stats)))
        return 0
    print(memory_summary_from_stats(stats, args.device, args.abbreviated), end="")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from vram.views.plot import plot_replays
    from vram.views.snapshot import segments

    if args.output is None and args.html is None:
        raise ValueError("give -o FILE.png, --html FILE.html, or both")
    if args.html is not None:
        from .html import write_report

        write_report(args.html, args.snapshot, device=args.device, gpu=args.gpu, context=args.context)
        print(f"wrote {args.html}")
        if args.output is None:
            return 0
    snap = _load(args.snapshot)
    confs = [None] + list(args.conf or [])
    runs = []
    for conf in confs:
        label = "recorded config" if conf is None else _label(conf)
        gpu = None if conf is None else args.gpu
        runs.append((label, _replay(args.snapshot, snap, gpu=gpu, context=args.context, conf=conf,
                                    device=args.device, timeline=True,
                                    progress=_Progress(f"replaying ({_shown(label)})"))))
    ref = runs[0][1]
    at = ref.reserved_peak_event + 1 if ref.reserved_peak_event >= 0 else 0
    peak = _replay(args.snapshot, snap, device=args.device, stop_at=at)
    output = args.output if os.path.splitext(args.output)[1] else args.output + ".png"  # as savefig does
    plot_replays(runs, segments(peak.allocator), output, title=_shown(os.path.basename(args.snapshot)))
    print(f"wrote {output}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import pickle

    from vram.replay.loader import to_pytorch_snapshot
    from vram.views.output import replaced

    snap = _load(args.snapshot)
    if args.start is not None or args.end is not None:
        from vram.replay.cut import cut, event_index

        traces = snap.get("device_traces") or []
        trace = traces[args.device] if args.device < len(traces) else []
        start = 0 if args.start is None else event_index(trace, args.start, "--from")
        end = len(trace) if args.end is None else event_index(trace, args.end, "--to")
        if start == end:
            raise ValueError(f"--from {_shown(args.start)} --to {_shown(args.end)} holds no events: "
                             + trace_extent(trace))
        out = cut(snap, start, end, args.device)
    else:
        out = to_pytorch_snapshot(snap)
    if args.output.endswith(".json"):
        # JSON has no references: frames shared by reference are written out at every use
        frames = sum(len(x["frames"]) for t in out["device_traces"] for x in t if "frames" in x)
        frames += sum(len(s["frames"]) + sum(len(b["frames"]) for b in s["blocks"]) for s in out["segments"])
        limit = max(10_000_000, os.path.getsize(args.snapshot) // 8)
        if frames > limit:
            raise ValueError(f"{_shown(args.snapshot)}: its JSON form would spell out {frames:,} stack "
                             f"frames (shared by reference in the file), over the {limit:,} limit: "
                             "export to .pickle instead")
        with replaced(args.output, "w") as f:
            json.dump(out, f)
    else:
        with replaced(args.output, "wb") as f:
            pickle.dump(out, f)
    print(f"wrote {args.output}: {len(out['segments'])} segments, "
          f"{sum(len(t) for t in out['device_traces']):,} trace events")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    """``vram diff A B``: where two snapshots of one program part ways (`vram.replay.diff`)."""
    from vram.replay.diff import compare, render, side

    name_a, name_b = side_names(args.a, args.b)
    a = side(_shown(name_a), _load(args.a), args.device)
    b = side(_shown(name_b), _load(args.b), args.device)
    result = compare(a, b)
    print(json.dumps(result.to_json(), indent=1) if args.json else render(result, args.top))
    return 0 if result.identical else 1  # EXIT_CODES: 1 is "differs"


def demo(gpu: str, context: str, conf: str | None) -> int:
    from .demo import run_demo

    return run_demo(gpu, context, conf)


def cmd_gpus(args: argparse.Namespace) -> int:
    """``vram gpus``: the presets, with CUDA's total memory for each and where it was printed."""
    from vram.devices.gpus import GPU_PRESETS

    if args.json:
        print(json.dumps({"gpus": [{"gpu": p.key, "name": p.name, "total_memory": p.total_memory,
                                    "major": p.major, "minor": p.minor,
                                    "multi_processor_count": p.multi_processor_count}
                                   for p in GPU_PRESETS.values()]}))
        return 0
    rows = [(p.key, p.name, f"{p.total_memory:,}", f"{p.total_memory / 2**30:.2f} GiB",
             f"{p.major}.{p.minor}", str(p.multi_processor_count)) for p in GPU_PRESETS.values()]
    head = ("--gpu", "name (CUDA)", "total_memory (B)", "", "arch", "SMs")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    print("\ntotal_memory is cudaDeviceProp.totalGlobalMem (torch.cuda.get_device_properties(0).total_memory) as "
          "printed on a real card;\nit varies by a few tens of MiB with the driver: pass --gpu <bytes> for yours. "
          "Sources: docs/gpus.md")
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    """``vram estimate``: a training step's memory on a simulated GPU (see `vram.estimate`)."""
    try:
        from .estimate import run_estimate
    except ImportError as e:  # pragma: no cover - torch missing
        raise RuntimeError(f"vram estimate needs PyTorch ({e}); {TORCH_HINT}") from None
    args.conf = joined_conf(args.conf)
    return run_estimate(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vram", description="PyTorch's CUDA caching allocator, byte-faithful, on a simulated GPU: "
                                 "replay memory snapshots, ask what-if questions, explain OOMs.",
        epilog=overview() + "\n" + EXIT_CODES + "\n", formatter_class=argparse.RawDescriptionHelpFormatter)
    from vram import __version__

    parser.add_argument("--version", action="version", version=f"vram {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    _add_replay_parser(sub)
    _add_file_parsers(sub)
    add_analysis_parsers(sub, GPU_HELP)
    _add_demo_parser(sub)
    add_run_parser(sub, GPU_HELP, ARCH_HELP)
    _add_estimate_parser(sub)
    _add_gpus_parser(sub)
    return parser


def _snapshot_parser(sub: Any, name: str, help_: str, many: bool = False) -> argparse.ArgumentParser:
    """A subcommand whose first argument is a snapshot file (several with `many`)."""
    p = sub.add_parser(name, help=help_, description=help_, epilog=epilog(name),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    what = "a torch.cuda.memory._dump_snapshot pickle, a JSON snapshot or an RMM allocation-log CSV"
    if many:
        p.add_argument("snapshot", nargs="+", help=what + " (several: replayed in parallel)")
        p.add_argument("--device", type=index, default=None, help="device index (default: every device)")
        p.add_argument("--jobs", type=positive, default=None, help=JOBS_HELP)
        p.add_argument("--cluster", default=None, help=CLUSTER_HELP)
    else:
        p.add_argument("snapshot", help=what)
        p.add_argument("--device", type=index, default=0, help="device index in the snapshot (default 0)")
    return p


def _add_replay_parser(sub: Any) -> None:
    """``vram replay``."""
    p = _snapshot_parser(sub, "replay", "replay recorded snapshots through the allocator (what-if, verification)",
                         many=True)
    p.add_argument("--gpu", help=GPU_HELP + " (default: no limit, the recording's own run)")
    p.add_argument("--context", default=None, help=REPLAY_CONTEXT_HELP)
    p.add_argument("--conf", action="append", metavar="CONF",
                   help="PYTORCH_CUDA_ALLOC_CONF to replay under (repeat to compare; default: the recorded one)")
    p.add_argument("--cap", metavar="SIZE",
                   help="a per-process cap (torch.cuda.set_per_process_memory_fraction) of SIZE bytes for PyTorch "
                        "on a GPU with room: each new segment is checked whole against it (not the same as a "
                        "smaller GPU with expandable segments)")
    p.add_argument("--verify", action="store_true", help="compare event by event with the recording")
    p.add_argument("--alloc", metavar="SIZE", help="after the replay, try allocating SIZE (e.g. 2GiB)")
    p.add_argument("--html", metavar="FILE", help="also write an HTML report of the replay (one snapshot, one --conf)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--no-cycle-skip", action="store_true",
                   help="replay every event even where a period provably repeats (same results; "
                        "the C core, where it is built, replays every event anyway)")
    p.set_defaults(func=cmd_replay)


def _add_file_parsers(sub: Any) -> None:
    """``vram summary``, ``plot``, ``diff`` and ``export``: one snapshot file in, a view of it out."""
    p = _snapshot_parser(sub, "summary", "print torch.cuda.memory_summary() for the recorded state")
    p.add_argument("--at", type=int, metavar="EVENT", help="the state before this event index (default: the end)")
    p.add_argument("--abbreviated", action="store_true", help="only the 'all' rows")
    p.add_argument("--json", action="store_true", help="print torch.cuda.memory_stats() there as one JSON object")
    p.set_defaults(func=cmd_summary)

    p = _snapshot_parser(sub, "plot", "plot memory over the trace and a segment map at the reserved peak")
    p.add_argument("-o", "--output", help="output image, e.g. out.png (needs matplotlib)")
    p.add_argument("--html", metavar="FILE", help="a self-contained HTML report instead (or as well): memory over "
                   "time with the OOM marked, segments and top consumers at the OOM or reserved peak")
    p.add_argument("--gpu", help=GPU_HELP + " for the what-if runs (default: no limit)")
    p.add_argument("--context", default=None, help=REPLAY_CONTEXT_HELP)
    p.add_argument("--conf", action="append", metavar="CONF", help="what-if config to overlay (repeatable)")
    p.set_defaults(func=cmd_plot)

    help_ = "compare two snapshots of one program: requests aligned, what differs by stack frame, peaks"
    p = sub.add_parser("diff", help=help_, description=help_ + " (e.g. a GPU's recording and a vram run "
                       "dump of the same program)", epilog=epilog("diff"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", metavar="A", help="a snapshot (PyTorch pickle, legacy pickle, JSON, RMM CSV)")
    p.add_argument("b", metavar="B", help="the snapshot to compare it with")
    p.add_argument("--device", type=index, default=0, help="device index (default 0)")
    p.add_argument("--top", type=positive, default=10, help="frames listed per side (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_diff)

    p = _snapshot_parser(sub, "export", "convert any supported input to a PyTorch snapshot pickle (or .json)")
    p.add_argument("-o", "--output", required=True, help="output path (.pickle, or .json for JSON)")
    p.add_argument("--from", dest="start", metavar="EVENT|TIME",
                   help="the piece starts at this event index, or time from the first event (2.5s, 300ms)")
    p.add_argument("--to", dest="end", metavar="EVENT|TIME",
                   help="the piece ends before this event (or time); its segments are the state there")
    p.set_defaults(func=cmd_export)


def _add_estimate_parser(sub: Any) -> None:
    """``vram estimate``."""
    help_ = "predict a training step's GPU memory before running it (needs torch)"
    p = sub.add_parser("estimate", help=help_, description=help_ + ": the model trains for a few "
                       "steps on a simulated GPU; peaks per phase, what the memory is at the peak, "
                       "which modules' activations.", epilog=epilog("estimate"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODULE:FACTORY", help="e.g. mymodels:gpt2_small (FACTORY() -> nn.Module)")
    p.add_argument("--input", action="append", metavar="[NAME=]SHAPE[:DTYPE]",
                   help="an input tensor, first dimension the batch, e.g. 8x512:int64 (repeat for more, "
                        "in forward's order; or name them all: input_ids=8x512:int64 labels=8x512:int64; "
                        "a 'loss' the model returns is what backward runs from)")
    p.add_argument("--dtype", help="the model's parameter dtype, and float inputs' default: "
                                   "float32, bf16, fp16")
    p.add_argument("--optimizer", default="adam", choices=["adam", "adamw", "sgd", "none"],
                   help="optimizer (default adam; sgd has no momentum)")
    p.add_argument("--amp", choices=["bf16", "fp16"],
                   help="autocast forward and loss (fp16 adds a GradScaler)")
    p.add_argument("--checkpoint", action="store_true",
                   help="activation checkpointing of each block of the model's ModuleLists (else each child)")
    p.add_argument("--compile", nargs="?", const="default", metavar="MODE",
                   choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                   help="run the model under torch.compile (MODE: default, reduce-overhead, max-autotune, "
                        "max-autotune-no-cudagraphs; needs the 'compile' extra); activations are then the "
                        "compiled graphs'; with --ddp, --fsdp and --pp (each rank's stage), not --tp")
    p.add_argument("--grad-accum", type=int, default=1, metavar="N", help="micro-steps per optimizer step")
    p.add_argument("--iterations", type=int, default=3, metavar="N", help="training steps to run (default 3)")
    p.add_argument("--gpu", default=DEFAULT_GPU, help=GPU_HELP + f" (default {DEFAULT_GPU}, an H100's size)")
    p.add_argument("--context", default=DEFAULT_CONTEXT, help=CONTEXT_HELP)
    p.add_argument("--conf", action="append", metavar="CONF",
                   help="PYTORCH_CUDA_ALLOC_CONF (repeatable: joined with commas; default: the environment's)")
    p.add_argument("--arch", default=None, help=ARCH_HELP)
    p.add_argument("--max-batch", action="store_true",
                   help="search the largest batch (first dimension of every --input) that fits")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    g = p.add_argument_group("many GPUs (the world size is the product of the degrees; the batch in --input "
                             "is each rank's micro-batch)")
    g.add_argument("--ddp", type=int, default=1, metavar="N",
                   help="data parallel replicas (DDP; with --fsdp: HSDP)")
    g.add_argument("--fsdp", type=int, default=1, metavar="N",
                   help="FSDP2 fully_shard over N GPUs (each block, then the root)")
    g.add_argument("--tp", type=int, default=1, metavar="N", help="tensor parallel degree (needs --tp-plan)")
    g.add_argument("--tp-plan", metavar="MODULE:FUNC", help="FUNC(model, tp_mesh) calls parallelize_module")
    g.add_argument("--pp", type=int, default=1, metavar="N", help="pipeline stages (top-level ModuleList split)")
    g.add_argument("--microbatches", type=int, default=None, metavar="M",
                   help="pipeline micro-batches the --input batch is split into (default: --pp)")
    g.add_argument("--schedule", default="1F1B", choices=["1F1B", "GPipe"], help="pipeline schedule (default 1F1B)")
    p.set_defaults(func=cmd_estimate)


def _add_demo_parser(sub: Any) -> None:
    """``vram demo``."""
    help_ = "walk through reserved vs allocated, the summary table and an OOM on a simulated GPU"
    p = sub.add_parser("demo", help=help_, description=help_ + ": the classic experiments (a tensor, its "
                       "cached block after del, fragmentation empty_cache cannot return, PyTorch's OOM "
                       "message)", epilog=epilog("demo"), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", default=DEFAULT_GPU, help=GPU_HELP + f" (default {DEFAULT_GPU})")
    p.add_argument("--context", default=DEFAULT_CONTEXT, help=CONTEXT_HELP)
    p.add_argument("--conf", action="append", metavar="CONF",
                   help="PYTORCH_CUDA_ALLOC_CONF (repeatable: joined with commas)")
    p.set_defaults(func=lambda a: demo(a.gpu, a.context, joined_conf(a.conf)))


def _add_gpus_parser(sub: Any) -> None:
    """``vram gpus``."""
    help_ = "list the cards --gpu accepts, with what CUDA reports for each"
    p = sub.add_parser("gpus", help=help_, description=help_ + " (total memory in bytes, compute "
                       "capability, SMs); sources in docs/gpus.md", epilog=epilog("gpus"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_gpus)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    script = None
    if argv[:1] == ["tune"] and "--" in argv:  # vram tune [options] -- script.py args
        k = argv.index("--")
        argv, script = argv[:k], argv[k + 1:]
    args = parser.parse_args(argv)
    if script is not None:
        args.script = script
    if getattr(args, "context", "") is None:  # a replayed recording: the context counts with --gpu
        args.context = replay_context(args.gpu, None)
    if args.command is None:
        parser.print_help()
        return 0
    from vram.allocator.config import ConfigError
    from vram.allocator.errors import OutOfMemoryError

    for stream in (sys.stdout, sys.stderr):  # text from a file may not encode: never a traceback
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
    try:
        return int(args.func(args))
    except BrokenPipeError:  # `vram ... | head`: the reader left; stop quietly, as a pipe-killed tool
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # nothing more to flush at exit
        return 141
    except (OSError, ValueError, TypeError, RuntimeError, OutOfMemoryError, ConfigError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"vram: error: {_shown(msg, 1000)}", file=sys.stderr)
        return 2
    except MemoryError:
        print("vram: error: out of memory", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # pragma: no cover
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
