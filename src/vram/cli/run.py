"""``vram run``: an unmodified PyTorch script on a simulated GPU, as ``python`` or ``torchrun``
would run it (`vram.run.runtime.run_script`; several ranks: `vram.run.distributed.launcher`).

Around the script: ``--snapshot FILE`` records the allocation history from the first line and
dumps it (``torch.cuda.memory._dump_snapshot``'s format) when the script ends, an uncaught OOM
included; one line at the end gives each GPU's whole-run peaks and what nvidia-smi would show;
after an OOM, the next command to run is named.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any

from vram.units import format_size, parse_size

from .analysis import positive
from .defaults import CONTEXT_HELP, DEFAULT_CONTEXT, DEFAULT_GPU, TORCH_HINT, check_context, joined_conf
from .examples import epilog


def _needs_torch(command: str, e: ImportError) -> RuntimeError:
    return RuntimeError(f"{command} needs PyTorch ({e}); {TORCH_HINT}")


def _snapshot_path(path: str) -> str:
    """A launched rank writes ``FILE.rankR.pickle``, as ranks dumping to one path do."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        stem, ext = os.path.splitext(path)
        return f"{stem}.rank{os.environ['RANK']}{ext or '.pickle'}"
    return path


def _check_script(args: argparse.Namespace) -> None:
    if args.module:
        import importlib.util

        try:
            found = importlib.util.find_spec(args.script)
        except (ImportError, ValueError) as e:
            raise OSError(f"no module named {args.script!r} ({e})") from None
        if found is None:
            raise OSError(f"no module named {args.script!r}")
    elif os.path.isdir(args.script):  # as python does: a directory runs its __main__.py
        if not os.path.isfile(os.path.join(args.script, "__main__.py")):
            raise OSError(f"can't find '__main__' module in {args.script!r} (a directory, not a script)")
    elif not os.path.isfile(args.script):
        raise OSError(f"can't open file {args.script!r}: no such file")


def device_figures(context: int) -> list[dict[str, Any]]:
    """Each simulated GPU's whole-run figures once the script is over: peaks (what the script's
    ``reset_peak_memory_stats`` does not lower), OOMs, and nvidia-smi's figure at the reserved
    peak: peak reserved + the CUDA context."""
    from vram.frontend import memory as _memory

    out = []
    for i in range(_memory.device_count()):
        run = _memory.get_allocator(i).stats
        stats = _memory.memory_stats(i)
        peak_reserved = run.run_peak("reserved_bytes")
        out.append({"index": i, "total_memory": _memory.get_device(i).total_memory,
                    "peak_allocated": run.run_peak("allocated_bytes"), "peak_reserved": peak_reserved,
                    "nvidia_smi": peak_reserved + context, "num_ooms": stats.get("num_ooms", 0)})
    return out


def end_of_run_lines(figures: list[dict[str, Any]], context: int, snapshot: str | None,
                     argv: list[str], card: list[str], flags: list[str]) -> list[str]:
    """The lines `vram run` ends with on stderr: peaks per GPU, then, after an OOM, what to run next
    (`card`: the ``--gpu``/``--context`` that make explain's replay the run's card, whose size a
    recording does not hold; `flags`: the run's other options, for the command that records it)."""
    f = format_size
    lines = []
    for d in figures:
        name = f"cuda:{d['index']}" if len(figures) > 1 else "the GPU"
        lines.append(f"vram run: {name}: peak allocated {f(d['peak_allocated'])}, peak reserved "
                     f"{f(d['peak_reserved'])}; nvidia-smi at that peak: {f(d['nvidia_smi'])} (reserved + "
                     f"{f(context)} CUDA context, --context) of {f(d['total_memory'])}"
                     + (f"; {d['num_ooms']} OOM{'s' if d['num_ooms'] > 1 else ''}" if d["num_ooms"] else ""))
    if any(d["num_ooms"] for d in figures):
        if snapshot is not None:
            q = " ".join(shlex.quote(a) for a in [snapshot, *card])
            lines.append(f"vram run: out of memory; the allocation history is in {snapshot}: run `vram explain {q}` "
                         f"(why, and fixes checked by replay), then `vram tune {q}` (allocator settings)")
        else:
            again = " ".join(shlex.quote(a) for a in ["vram", "run", "--snapshot", "oom.pickle", *card, *flags, *argv])
            lines.append(f"vram run: out of memory; to see why, record it: `{again}`, "
                         f"then run `vram explain {' '.join(shlex.quote(a) for a in ['oom.pickle', *card])}`")
    return lines


def cmd_run(args: argparse.Namespace) -> int:
    """``vram run``: execute a PyTorch script as if on a CUDA GPU (see `vram.run.runtime`)."""
    try:
        from vram.run.runtime import run_script
    except ImportError as e:  # torch missing
        raise _needs_torch("vram run", e) from None
    _check_script(args)
    if args.standalone and args.nnodes != 1:
        raise ValueError("--standalone is one node: it cannot go with --nnodes > 1")
    context = parse_size(args.context, "--context")  # bad input stops here, before the script starts
    check_context(args.gpu, context)
    conf = joined_conf(args.conf)
    if args.backend is not None:  # the environment carries it to a launcher's ranks too
        os.environ["VRAM_RUN_BACKEND"] = args.backend
    if args.nproc_per_node is not None:
        return _launch(args, conf)
    from vram.frontend import memory as _memory
    from vram.run.values import rerun

    printed = _values_rerun(args)
    snapshot = None if args.snapshot is None else _snapshot_path(args.snapshot)
    record = snapshot is not None or args.html is not None

    def start() -> None:
        if record:
            _memory._record_memory_history(max_entries=sys.maxsize)

    def dump() -> None:
        if snapshot is not None:
            _memory._dump_snapshot(snapshot)

    real_stdout = sys.stdout
    if args.json:  # stdout is the one JSON object; the script's prints go to stderr
        sys.stdout = sys.stderr
    try:
        status = run_script(args.script, args.args, summary=args.summary, gpu=args.gpu,
                            context=context, conf=conf, device_count=args.devices, arch=args.arch,
                            strict_values=args.strict_values, value_report=args.value_report, values=args.values,
                            values_fallback=printed is not None, on_start=start,
                            on_exit=dump, module=args.module)
    except rerun.ValuesNeeded as e:  # a data-dependent shape: the whole run again with real values
        print(f"{e}\nvram run: running the script again with --values real (every value computed on the "
              "CPU); its output so far is not printed again", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "vram", *sys.argv[1:]],
                  dict(os.environ, **{rerun.PRINTED_ENV: printed or ""}))
    finally:
        sys.stdout = real_stdout
    rerun.forget(printed)
    from vram.devices.gpus import resolve_gpu
    from vram.run.distributed.rank import write_result

    # for a launcher, when one started us
    write_result(status, context, resolve_gpu(args.gpu, args.arch))
    return _report(args, status, context, snapshot)


def _values_rerun(args: argparse.Namespace) -> str | None:
    """Where this run records what it prints, in case a data-dependent shape makes it run again
    with real values (`vram.run.values.rerun`); None when it would not (real values already,
    strict values, a launched rank: its messages to the other ranks are already sent). In that
    second run, what the first printed is held back."""
    import tempfile

    from vram.run.distributed.p2p import MAILBOX_ENV
    from vram.run.values import rerun

    printed = os.environ.pop(rerun.PRINTED_ENV, None)  # the second attempt, with real values
    if printed is not None:
        args.values = "real"
        rerun.skip_printed(printed)
    if args.values != "known" or args.strict_values or os.environ.get(MAILBOX_ENV):
        return None
    fd, path = tempfile.mkstemp(prefix="vram-printed-", suffix=".txt")
    os.close(fd)
    rerun.record(path)
    return path


def _report(args: argparse.Namespace, status: int, context: int, snapshot: str | None) -> int:
    """The end-of-run lines (a launched rank leaves them to the launcher's table), --json, --html."""
    from vram.run.distributed.rank import RESULT_ENV

    figures = device_figures(context)
    if not os.environ.get(RESULT_ENV) and not args.no_next_step:
        argv = [*(["-m"] if args.module else []), args.script, *args.args]
        card = ["--gpu", args.gpu] + (["--context", args.context] if args.context != DEFAULT_CONTEXT else [])
        sys.stdout.flush()
        lines = end_of_run_lines(figures, context, snapshot, argv, card, _rerun_flags(args))
        print("\n".join(lines), file=sys.stderr, flush=True)
    if args.html is not None:
        _html(args, snapshot, context)
    if args.json:
        print(json.dumps({"status": status, "script": args.script, "context": context, "snapshot": snapshot,
                          "devices": figures}))
    return status


def _rerun_flags(args: argparse.Namespace) -> list[str]:
    """The options besides --gpu/--context that running the script again needs to do the same."""
    flags = []
    for conf in args.conf or []:
        flags += ["--conf", conf]
    if args.devices != 1:
        flags += ["--devices", str(args.devices)]
    if args.arch:
        flags += ["--arch", args.arch]
    if args.values == "real":
        flags += ["--values", "real"]
    return flags


def _html(args: argparse.Namespace, snapshot: str | None, context: int) -> None:
    """``--html``: the report of the recording (`vram.cli.html`), from --snapshot's file or a
    temporary dump of the run's history."""
    import tempfile

    from vram.frontend import memory as _memory

    from .html import write_report

    with tempfile.TemporaryDirectory(prefix="vram-run-") as work:
        path = snapshot
        if path is None:
            path = os.path.join(work, "run.pickle")
            _memory._dump_snapshot(path)
        write_report(args.html, path, gpu=_memory.get_device(0).total_memory, context=context,
                     title=f"vram run {' '.join([args.script, *args.args])}")
    print(f"vram run: wrote {args.html}", file=sys.stderr)


def _launch(args: argparse.Namespace, conf: str | None) -> int:
    """``vram run --nproc-per-node N``: one ``vram run`` process per rank (`vram.run.distributed.launcher`)."""
    from vram.run.distributed.launcher import Launch, launch, parse_ranks

    if args.nproc_per_node < 1 or args.nnodes < 1:
        raise ValueError(f"--nproc-per-node and --nnodes must be >= 1, got {args.nproc_per_node} and {args.nnodes}")
    if args.devices != 1:
        raise ValueError("--devices is the GPUs of one process; with --nproc-per-node each node has that many")
    for flag, value in (("--value-report", args.value_report), ("--json", args.json or None),
                        ("--html", args.html)):
        if value is not None:
            raise ValueError(f"{flag} is per process; it is not supported with --nproc-per-node yet")
    spec = Launch(args.nproc_per_node, args.nnodes, jobs=args.jobs)
    spec.ranks = parse_ranks(args.ranks, spec.world_size)
    child = ["--gpu", args.gpu, "--context", args.context, "--devices", str(args.nproc_per_node)]
    if conf is not None:
        child += ["--conf", conf]
    if args.arch is not None:
        child += ["--arch", args.arch]
    if args.snapshot is not None:
        child += ["--snapshot", args.snapshot]
    child += ["--summary"] * args.summary + ["--strict-values"] * args.strict_values + ["--values", args.values]
    child += ["-m"] * args.module
    return launch(spec, child, args.script, args.args)


def add_parser(sub: Any, gpu_help: str, arch_help: str) -> None:
    """Register ``vram run`` (python's and torchrun's spellings)."""
    help_ = "run an unmodified PyTorch script as if on a CUDA GPU (needs torch)"
    p = sub.add_parser("run", help=help_, description=help_ + ": tensors live on the meta device, "
                       "every allocation goes through the simulated caching allocator, and an OOM is "
                       "PyTorch's torch.OutOfMemoryError. Exit status: the script's (1 for an uncaught "
                       "exception, an OOM included), 2 for vram's own errors.", epilog=epilog("run"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", default=DEFAULT_GPU, help=gpu_help + f" (default {DEFAULT_GPU}, an H100's size)")
    p.add_argument("--context", default=DEFAULT_CONTEXT, help=CONTEXT_HELP)
    p.add_argument("--conf", action="append", metavar="CONF",
                   help="PYTORCH_CUDA_ALLOC_CONF (repeatable: the options are joined with commas; "
                        "default: the environment's)")
    p.add_argument("--snapshot", metavar="FILE",
                   help="record the allocation history from the script's first line and dump it to FILE "
                        "(torch.cuda.memory._dump_snapshot's format) when the script ends, an uncaught OOM "
                        "included; then `vram explain FILE`")
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML report (memory over time, "
                   "the OOM marked, segments at the peak, top consumers)")
    p.add_argument("--no-next-step", action="store_true", help=argparse.SUPPRESS)  # vram tune's own recording
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout at the end (the script's own output goes to stderr)")
    p.add_argument("--devices", type=int, default=1, help="number of simulated GPUs (default 1)")
    p.add_argument("--arch", default=None, help=arch_help)
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
    g = p.add_argument_group("as torchrun (its spellings too: --nproc_per_node, --standalone, -m)")
    g.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=int, default=None,
                   metavar="N", help="N processes (ranks) per node, one simulated GPU each")
    g.add_argument("--nnodes", type=int, default=1, metavar="M", help="nodes, with --nproc-per-node (default 1)")
    g.add_argument("--standalone", action="store_true", help="one node, local rendezvous (torchrun's; the default)")
    g.add_argument("-m", "--module", action="store_true",
                   help="the script is a module name, run as python -m runs it")
    g.add_argument("--ranks", default="all", metavar="LIST",
                   help="ranks to simulate, e.g. 0 or 0,3 or 0-3 (default all); ranks running identical "
                        "programs need only one")
    g.add_argument("--jobs", type=positive, default=None, metavar="J",
                   help="ranks simulated at once (default: the machine's cores)")
    p.add_argument("script", help="the Python script to run (with -m: a module name)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=cmd_run)
