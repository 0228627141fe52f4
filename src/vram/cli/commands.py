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

from vram.units import format_size, parse_size

from .analysis import CLUSTER_HELP, JOBS_HELP
from .analysis import add_parsers as add_analysis_parsers
from .examples import epilog, overview
from .progress import Progress as _Progress

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


def _shown(text: Any, limit: int = 200) -> str:
    """Text from a file, safe to print: control characters escaped, at most `limit` chars."""
    from vram.replay.messages import printable

    return printable(str(text), limit)


def _label(conf: str) -> str:
    return conf if conf else "default config"


def cmd_replay(args: argparse.Namespace) -> int:
    """One snapshot: every device (or --device) under every --conf. Several: `cli.analysis`."""
    from vram.replay.engine import device_count

    if len(args.snapshot) > 1:
        if args.alloc:
            raise ValueError("--alloc takes one snapshot")
        from .analysis import cmd_replay_fleet
        return cmd_replay_fleet(args)
    path = args.snapshot[0]
    snap = _load(path)
    devices = [args.device] if args.device is not None else list(range(device_count(snap)))
    confs = args.conf if args.conf else [None]
    reports, objs = [], []
    for device in devices:
        results = []
        for conf in confs:
            label = _label(conf if conf is not None else "recorded config")
            results.append(_replay(path, snap, gpu=args.gpu, context=args.context, conf=conf,
                                   verify=args.verify, device=device,
                                   progress=_Progress(f"replaying ({_shown(label)})"),
                                   skip_cycles=not args.no_cycle_skip))
        trials = [_try_alloc(r, parse_size(args.alloc, "--alloc")) for r in results] if args.alloc else None
        for k, r in enumerate(results):
            objs.append(r.to_json())
            if trials:
                objs[-1]["alloc_trial"] = trials[k]
        header = f"device {device}: " if len(devices) > 1 else ""
        reports.append(header + _report(path, snap, results, trials))
    if args.json:
        print(json.dumps(objs[0] if len(objs) == 1 else {"runs": objs}))
        return 0
    print("\n\n".join(reports))
    return 0


def _try_alloc(result: Any, size: int) -> dict[str, Any]:
    from vram.allocator.errors import OutOfMemoryError

    alloc = result.allocator
    try:
        ptr = alloc.malloc(size)
    except OutOfMemoryError as e:
        return {"size": size, "ok": False, "message": str(e)}
    alloc.free(ptr)
    return {"size": size, "ok": True, "message": None}


def _report(path: str, snap: dict[str, Any], results: list[Any], trials: list[dict[str, Any]] | None) -> str:
    r0 = results[0]
    lines = [f"{_shown(path)}: {r0.events:,} events replayed ({snap['format']}"
             f"{', legacy format' if snap.get('legacy') else ''}), GPU "
             f"{format_size(r0.gpu)}, context {format_size(r0.context)}"]
    rows = [
        ("config", lambda r: _label(r.conf)),
        ("peak allocated", lambda r: format_size(r.peak_allocated)),
        ("peak reserved", lambda r: format_size(r.peak_reserved)),
        ("peak nvidia-smi (reserved + context)", lambda r: format_size(r.peak_device_used)),
        ("reserved - allocated at reserved peak", lambda r: format_size(r.fragmentation_at_reserved_peak)),
        ("largest free block at reserved peak", lambda r: format_size(r.largest_free_block_at_reserved_peak)),
        ("segment allocations (cudaMalloc/map)", lambda r: f"{r.segment_allocs:,}"),
        ("segment frees (cudaFree/unmap)", lambda r: f"{r.segment_frees:,}"),
        ("cudaMalloc retries", lambda r: f"{r.alloc_retries:,}"),
        ("OOMs", lambda r: f"{r.ooms:,}" if r.oom is None else f"{r.ooms:,} (first: event {r.oom['event_index']:,})"),
        ("replay time", lambda r: f"{r.seconds_replay:.2f} s" + (
            f" ({r.skipped_events:,} events in repeated periods)" if r.skipped_events else "")),
    ]
    width = max(len(name) for name, _ in rows) + 2
    cells = [[fn(r) for r in results] for _, fn in rows]
    if trials:
        rows.append(("then allocate " + format_size(trials[0]["size"]), _label))
        cells.append(["succeeds" if t["ok"] else "OOM" for t in trials])
    colw = [max(len(c[k]) for c in cells) + 2 for k in range(len(results))]
    lines.append("")
    for (name, _), vals in zip(rows, cells):
        lines.append(name.ljust(width) + "".join(v.rjust(w) for v, w in zip(vals, colw)))
    for r in results:
        if r.oom is not None:
            lines += ["", f"[{_shown(_label(r.conf))}] OOM at event {r.oom['event_index']:,}:", r.oom["message"]]
            frames = [f for f in r.oom["frames"] if f.get("line")][:6]
            if frames:
                lines.append("recorded stack (innermost first):")
                lines += [f"  {_shown(f['filename'])}:{f['line']} in {_shown(f['name'])}" for f in frames]
    if trials:
        for r, t in zip(results, trials):
            if not t["ok"]:
                lines += ["", f"[{_shown(_label(r.conf))}] allocating {format_size(t['size'])} now fails:",
                          t["message"]]
    for r in results:
        if r.verification is not None:
            lines += ["", "verification against the recording:"]
            for key, name in (("segment_allocs", "segment_alloc (size, order, address)"),
                              ("segment_frees", "segment_free (address, size, order)"),
                              ("segment_maps", "segment_map (address, size, order)"),
                              ("segment_unmaps", "segment_unmap (address, size, order)"),
                              ("alloc_addresses", "alloc addresses"),
                              ("recorded_ooms", "OOMs (same event, recorded free memory)"),
                              ("final_segments", "final segments"), ("final_blocks", "final blocks")):
                m, t = r.verification[key]["matched"], r.verification[key]["total"]
                if key in ("segment_maps", "segment_unmaps") and not t:
                    continue  # no expandable segments: nothing to say
                pct = 100.0 * m / t if t else 100.0
                lines.append(f"  {name:<40} {m:>8,} / {t:<8,} {pct:6.2f}%")
            unknown = r.verification.get("unknown_actions") or {}
            if unknown:
                names = ", ".join(f"'{_shown(a, 24)}' x{c:,}" for a, c in sorted(unknown.items())[:5])
                lines.append(f"  not replayed: {sum(unknown.values()):,} events with unknown actions ({names})")
            others = r.verification.get("segments_on_other_devices", 0)
            if others:
                lines.append(f"  not verified: {others:,} segments on other devices (see --device)")
            lines += [f"  note: {note}" for note in r.verification.get("notes", ())]
            for d in r.verification["divergences"][:5]:
                lines += [f"  divergence ({d['kind']}) at event {d['event_index']}: expected "
                          f"{d['expected']}, got {d['actual']}"] + [f"      {c}" for c in d["context"]]
    return "\n".join(lines)


def cmd_summary(args: argparse.Namespace) -> int:
    from vram.views.summary import memory_summary_from_stats

    snap = _load(args.snapshot)
    result = _replay(args.snapshot, snap, device=args.device, stop_at=args.at, progress=_Progress("replaying"))
    stats = result.allocator.memory_stats()
    print(memory_summary_from_stats(stats, args.device, args.abbreviated), end="")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from vram.views.plot import plot_replays
    from vram.views.snapshot import segments

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

    snap = _load(args.snapshot)
    if args.start is not None or args.end is not None:
        from vram.replay.cut import cut, event_index

        traces = snap.get("device_traces") or []
        trace = traces[args.device] if args.device < len(traces) else []
        start = 0 if args.start is None else event_index(trace, args.start, "--from")
        end = len(trace) if args.end is None else event_index(trace, args.end, "--to")
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
        with open(args.output, "w") as f:
            json.dump(out, f)
    else:
        with open(args.output, "wb") as f:
            pickle.dump(out, f)
    print(f"wrote {args.output}: {len(out['segments'])} segments, "
          f"{sum(len(t) for t in out['device_traces']):,} trace events")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    """``vram diff A B``: where two snapshots of one program part ways (`vram.replay.diff`)."""
    from vram.replay.diff import compare, render, side

    a = side(_shown(os.path.basename(args.a)), _load(args.a), args.device)
    b = side(_shown(os.path.basename(args.b)), _load(args.b), args.device)
    result = compare(a, b)
    print(json.dumps(result.to_json(), indent=1) if args.json else render(result, args.top))
    return 0


def demo(gpu: str, context: str, conf: str | None) -> int:
    from .demo import run_demo

    return run_demo(gpu, context, conf)


def cmd_run(args: argparse.Namespace) -> int:
    """``vram run``: execute a PyTorch script as if on a CUDA GPU (see `vram.run.runtime`)."""
    try:
        from vram.run.runtime import run_script
    except ImportError as e:  # pragma: no cover - torch missing
        raise RuntimeError(f"vram run needs PyTorch ({e})") from None
    if os.path.isdir(args.script):  # as python does: a directory runs its __main__.py
        if not os.path.isfile(os.path.join(args.script, "__main__.py")):
            raise OSError(f"can't find '__main__' module in {args.script!r} (a directory, not a script)")
    elif not os.path.isfile(args.script):
        raise OSError(f"can't open file {args.script!r}: no such file")
    if args.backend is not None:  # the environment carries it to a launcher's ranks too
        os.environ["VRAM_RUN_BACKEND"] = args.backend
    if args.nproc_per_node is not None:
        return _launch(args)
    status = run_script(args.script, args.args, summary=args.summary, gpu=args.gpu,
                        context=args.context, conf=args.conf, device_count=args.devices, arch=args.arch,
                        strict_values=args.strict_values, value_report=args.value_report, values=args.values)
    from vram.devices.gpus import resolve_gpu
    from vram.run.distributed.rank import write_result

    # for a launcher, when one started us
    write_result(status, parse_size(args.context, "--context"), resolve_gpu(args.gpu, args.arch))
    return status


def _launch(args: argparse.Namespace) -> int:
    """``vram run --nproc-per-node N``: one ``vram run`` process per rank (`vram.run.distributed.launcher`)."""
    from vram.run.distributed.launcher import Launch, launch, parse_ranks

    if args.nproc_per_node < 1 or args.nnodes < 1:
        raise ValueError(f"--nproc-per-node and --nnodes must be >= 1, got {args.nproc_per_node} and {args.nnodes}")
    if args.devices != 1:
        raise ValueError("--devices is the GPUs of one process; with --nproc-per-node each node has that many")
    if args.value_report is not None:
        raise ValueError("--value-report is per process; it is not supported with --nproc-per-node yet")
    spec = Launch(args.nproc_per_node, args.nnodes, jobs=args.jobs)
    spec.ranks = parse_ranks(args.ranks, spec.world_size)
    parse_size(args.context, "--context")  # bad input stops here, before any rank starts
    child = ["--gpu", args.gpu, "--context", args.context, "--devices", str(args.nproc_per_node)]
    if args.conf is not None:
        child += ["--conf", args.conf]
    if args.arch is not None:
        child += ["--arch", args.arch]
    child += ["--summary"] * args.summary + ["--strict-values"] * args.strict_values + ["--values", args.values]
    return launch(spec, child, args.script, args.args)


def cmd_gpus(args: argparse.Namespace) -> int:
    """``vram gpus``: the presets, with CUDA's total memory for each and where it was printed."""
    from vram.devices.gpus import GPU_PRESETS

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
        raise RuntimeError(f"vram estimate needs PyTorch ({e})") from None
    return run_estimate(args)


GPU_HELP = ("GPU: a size (24GiB, 80000000000) or a card (A100-80GB, H100, RTX4090, ...; "
            "'vram gpus' lists them with CUDA's byte counts)")
ARCH_HELP = ("compute capability, e.g. 8.0 or sm_86 (default: the card's; 9.0, an H100, for a "
             "size); it sets the cuBLAS workspace: 32 MiB on sm90, 8,519,680 B elsewhere")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vram", description="PyTorch's CUDA caching allocator, byte-faithful, on a simulated GPU: "
                                 "replay memory snapshots, ask what-if questions, explain OOMs.",
        epilog=overview(), formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def snapshot_cmd(name: str, help_: str, many: bool = False) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_, epilog=epilog(name),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        what = "a torch.cuda.memory._dump_snapshot pickle, a JSON snapshot or an RMM allocation-log CSV"
        if many:
            p.add_argument("snapshot", nargs="+", help=what + " (several: replayed in parallel)")
            p.add_argument("--device", type=int, default=None, help="device index (default: every device)")
            p.add_argument("--jobs", type=int, default=None, help=JOBS_HELP)
            p.add_argument("--cluster", default=None, help=CLUSTER_HELP)
        else:
            p.add_argument("snapshot", help=what)
            p.add_argument("--device", type=int, default=0, help="device index in the snapshot (default 0)")
        return p

    p = snapshot_cmd("replay", "replay recorded snapshots through the allocator (what-if, verification)",
                     many=True)
    p.add_argument("--gpu", help=GPU_HELP + " (default: large enough for anything)")
    p.add_argument("--context", default="0", help="CUDA context bytes nvidia-smi shows on top (e.g. 500MiB)")
    p.add_argument("--conf", action="append", metavar="CONF",
                   help="PYTORCH_CUDA_ALLOC_CONF to replay under (repeat to compare; default: the recorded one)")
    p.add_argument("--verify", action="store_true", help="compare event by event with the recording")
    p.add_argument("--alloc", metavar="SIZE", help="after the replay, try allocating SIZE (e.g. 2GiB)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--no-cycle-skip", action="store_true",
                   help="replay every event even where a period provably repeats (same results; "
                        "the C core, where it is built, replays every event anyway)")
    p.set_defaults(func=cmd_replay)

    p = snapshot_cmd("summary", "print torch.cuda.memory_summary() for the recorded state")
    p.add_argument("--at", type=int, metavar="EVENT", help="the state before this event index (default: the end)")
    p.add_argument("--abbreviated", action="store_true", help="only the 'all' rows")
    p.set_defaults(func=cmd_summary)

    p = snapshot_cmd("plot", "plot memory over the trace and a segment map at the reserved peak")
    p.add_argument("-o", "--output", required=True, help="output image, e.g. out.png")
    p.add_argument("--gpu", help=GPU_HELP + " for the what-if runs")
    p.add_argument("--context", default="0", help="CUDA context bytes")
    p.add_argument("--conf", action="append", metavar="CONF", help="what-if config to overlay (repeatable)")
    p.set_defaults(func=cmd_plot)

    help_ = "compare two snapshots of one program: requests aligned, what differs by stack frame, peaks"
    p = sub.add_parser("diff", help=help_, description=help_ + " (e.g. a GPU's recording and a vram run "
                       "dump of the same program)", epilog=epilog("diff"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", metavar="A", help="a snapshot (PyTorch pickle, legacy pickle, JSON, RMM CSV)")
    p.add_argument("b", metavar="B", help="the snapshot to compare it with")
    p.add_argument("--device", type=int, default=0, help="device index (default 0)")
    p.add_argument("--top", type=int, default=10, help="frames listed per side (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_diff)

    p = snapshot_cmd("export", "convert any supported input to a PyTorch snapshot pickle (or .json)")
    p.add_argument("-o", "--output", required=True, help="output path (.pickle, or .json for JSON)")
    p.add_argument("--from", dest="start", metavar="EVENT|TIME",
                   help="the piece starts at this event index, or time from the first event (2.5s, 300ms)")
    p.add_argument("--to", dest="end", metavar="EVENT|TIME",
                   help="the piece ends before this event (or time); its segments are the state there")
    p.set_defaults(func=cmd_export)
    add_analysis_parsers(sub, GPU_HELP)

    help_ = "walk through reserved vs allocated, the summary table and an OOM on a simulated GPU"
    p = sub.add_parser("demo", help=help_, description=help_ + ": the classic experiments (a tensor, its "
                       "cached block after del, fragmentation empty_cache cannot return, PyTorch's OOM "
                       "message)", epilog=epilog("demo"), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", default="8GiB", help=GPU_HELP + " (default 8GiB)")
    p.add_argument("--context", default="500MiB", help="CUDA context size (default 500MiB)")
    p.add_argument("--conf", default=None, help="PYTORCH_CUDA_ALLOC_CONF string")
    p.set_defaults(func=lambda a: demo(a.gpu, a.context, a.conf))

    help_ = "run an unmodified PyTorch script as if on a CUDA GPU (needs torch)"
    p = sub.add_parser("run", help=help_, description=help_ + ": tensors live on the meta device, "
                       "every allocation goes through the simulated caching allocator, and an OOM is "
                       "PyTorch's torch.OutOfMemoryError.", epilog=epilog("run"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", default="80GiB", help=GPU_HELP + " (default 80GiB)")
    p.add_argument("--context", default="0", help="CUDA context bytes nvidia-smi shows on top (e.g. 500MiB)")
    p.add_argument("--conf", default=None, help="PYTORCH_CUDA_ALLOC_CONF (default: the environment's)")
    p.add_argument("--devices", type=int, default=1, help="number of simulated GPUs (default 1)")
    p.add_argument("--arch", default=None, help=ARCH_HELP)
    p.add_argument("--summary", action="store_true", help="print torch.cuda.memory_summary() at the end")
    p.add_argument("--strict-values", action="store_true",
                   help="stop at the first read of a tensor value the simulation does not know (default: "
                        "answer it with zeros and list every such read on stderr at the end)")
    p.add_argument("--values", choices=["known", "real"], default="known",
                   help="known (default): values that need no model arithmetic (masks, ids, factories) are exact, "
                        "others are placeholders; real: every value is computed on the CPU (losses, logits, "
                        "weights after optimizer steps), so data-dependent control flow follows the data, at the "
                        "cost of the model's arithmetic on the CPU and a host copy of every simulated storage "
                        "(refused when host memory cannot hold it). Memory figures are the same in both")
    p.add_argument("--value-report", metavar="FILE.json",
                   help="write the reads answered with placeholder values as JSON")
    p.add_argument("--backend", choices=["privateuse1", "meta"], default=None,
                   help="the simulation engine (default: $VRAM_RUN_BACKEND, else privateuse1). privateuse1: tensors "
                        "on a PrivateUse1 device, no dispatch mode while the model trains, so autograd takes "
                        "the GPU's formulas; meta, a debugging aid: meta tensors under a dispatch mode, whose "
                        "backward formulas are PyTorch's out-of-place subclass ones (extra allocations; "
                        "docs/design.md)")
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="as torchrun: N processes (ranks) per node, one simulated GPU each")
    p.add_argument("--nnodes", type=int, default=1, metavar="M", help="nodes, with --nproc-per-node (default 1)")
    p.add_argument("--ranks", default="all", metavar="LIST",
                   help="ranks to simulate, e.g. 0 or 0,3 or 0-3 (default all); ranks running identical "
                        "programs need only one")
    p.add_argument("--jobs", type=int, default=None, metavar="J",
                   help="ranks simulated at once (default: the machine's cores)")
    p.add_argument("script", help="the Python script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=cmd_run)

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
    p.add_argument("--grad-accum", type=int, default=1, metavar="N", help="micro-steps per optimizer step")
    p.add_argument("--iterations", type=int, default=3, metavar="N", help="training steps to run (default 3)")
    p.add_argument("--gpu", default="80GiB", help=GPU_HELP + " (default 80GiB)")
    p.add_argument("--context", default="0", help="CUDA context bytes nvidia-smi shows on top (e.g. 500MiB)")
    p.add_argument("--conf", default=None, help="PYTORCH_CUDA_ALLOC_CONF (default: the environment's)")
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

    help_ = "list the cards --gpu accepts, with what CUDA reports for each"
    p = sub.add_parser("gpus", help=help_, description=help_ + " (total memory in bytes, compute "
                       "capability, SMs); sources in docs/gpus.md", epilog=epilog("gpus"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=cmd_gpus)
    return parser


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
