"""A new user's first hour: the OOM workflow (``vram run --snapshot`` -> ``vram explain`` -> ``vram
tune``), the command line's conventions (``--version``, torchrun's spellings, ``--json``, exit
codes, defaults) and the Python entry points a notebook uses.

Expected figures come from PyTorch's allocator rules (spec §4: requests over 1 MiB round up to
2 MiB multiples; §6: a request over 10 MiB gets a segment of its rounded size) and from the CUDA
context measured on an H200 (``shared/gpu-truth/h200-2026-11-27/context.txt``), never from what
vram printed.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from paths import RECORDINGS
from vram.cli import main

GiB = 1 << 30
MiB = 1 << 20
#: context.txt: device memory used after the first matmul 774,701,056 B, of which reserved 56,623,104 B
MEASURED_CONTEXT = 774_701_056 - 56_623_104

#: three 6 GiB tensors on a 16 GiB card with a 1 GiB context: the third cannot fit (12 GiB reserved,
#: 3 GiB left); each is its own 6 GiB segment (spec §6), so peaks are exactly 12 GiB
OOM_SCRIPT = """\
import torch
print("starting")
keep = [torch.empty(6 * 2**30, dtype=torch.uint8, device="cuda") for _ in range(3)]
"""


def _vram(*argv: str, cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vram", *argv], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


@pytest.fixture(scope="module")
def oom_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    pytest.importorskip("torch")
    work = tmp_path_factory.mktemp("oom")
    (work / "oom.py").write_text(OOM_SCRIPT)
    r = _vram("run", "--gpu", "16GiB", "--context", "1GiB", "--snapshot", "oom.pickle", "oom.py", cwd=work)
    return work, r


def test_run_snapshot_records_from_the_start_and_names_the_next_command(oom_run: Any) -> None:
    work, r = oom_run
    assert r.returncode == 1, r.stderr[-2000:]
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 6.00 GiB." in r.stderr
    snap = pickle.loads((work / "oom.pickle").read_bytes())
    trace = snap["device_traces"][0]
    allocs = [e for e in trace if e["action"] == "alloc"]
    assert [e["size"] for e in allocs] == [6 * GiB, 6 * GiB]  # from the first allocation on
    assert [e["action"] for e in trace if e["action"] == "oom"] == ["oom"]
    lines = r.stderr.strip().splitlines()  # sizes in PyTorch's format_size: up to 1 GiB in MiB
    assert lines[-2] == ("vram run: the GPU: peak allocated 12.00 GiB, peak reserved 12.00 GiB; nvidia-smi at "
                         "that peak: 13.00 GiB (reserved + 1024.00 MiB CUDA context, --context) of 16.00 GiB; 1 OOM")
    # the card goes with the file: a recording does not hold the GPU's size
    assert "run `vram explain oom.pickle --gpu 16GiB --context 1GiB`" in lines[-1]
    assert "`vram tune oom.pickle --gpu 16GiB --context 1GiB`" in lines[-1]


def test_explain_then_tune_answer_from_the_run_dump(oom_run: Any) -> None:
    work, _ = oom_run
    r = _vram("explain", "oom.pickle", "--jobs", "1", cwd=work)
    assert r.returncode == 0, r.stderr
    assert "device 0: the OOM at event" in r.stdout and "it does not fit" in r.stdout
    r = _vram("tune", "oom.pickle", "--jobs", "1", cwd=work)
    assert r.returncode == 1, r.stderr  # 18 GiB alive at once: every config runs out of memory
    # no config fits, so there is no best: how much more the least demanding one needs instead
    assert "no config fits" in r.stdout and "best:" not in r.stdout
    assert "the least demanding found, (default), needs" in r.stdout


def test_explain_on_the_card_of_the_run_counts_its_context(oom_run: Any) -> None:
    """Given the run's card (16 GiB with a 1 GiB context), the OOM replays with the run's own message,
    and the fixes count the context: three 6 GiB tensors need 18 GiB for PyTorch, so 19 GiB of card
    (3 GiB more); PyTorch could have 15 GiB, so it does not fit by 3 GiB whatever the settings."""
    work, r = oom_run
    ex = _vram("explain", "oom.pickle", "--gpu", "16GiB", "--context", "1GiB", "--jobs", "1", "--json", cwd=work)
    assert ex.returncode == 0, ex.stderr
    out = json.loads(ex.stdout)
    run_message = next(ln for ln in r.stderr.splitlines() if ln.startswith("torch.OutOfMemoryError: "))
    assert out["at"]["message"] == run_message.removeprefix("torch.OutOfMemoryError: ")
    gpu = [f for f in out["fixes"] if f["kind"] == "gpu"]
    assert gpu and gpu[0]["gpu"] == 19 * GiB and gpu[0]["more"] == 3 * GiB and gpu[0]["verified"]
    nofit = [f for f in out["fixes"] if f["kind"] == "does_not_fit"]
    assert nofit and nofit[0]["more"] == 3 * GiB


def test_an_oom_without_snapshot_says_how_to_record_one(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    (tmp_path / "oom.py").write_text(OOM_SCRIPT)
    r = _vram("run", "--gpu", "16GiB", "--context", "1GiB", "oom.py", "--bs", "8", cwd=tmp_path)
    assert r.returncode == 1
    assert ("`vram run --snapshot oom.pickle --gpu 16GiB --context 1GiB oom.py --bs 8`, then run `vram explain "
            "oom.pickle --gpu 16GiB --context 1GiB`" in r.stderr.splitlines()[-1])


def test_run_json_is_the_only_thing_on_stdout_and_counts_the_measured_context(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    (tmp_path / "fits.py").write_text("import torch\nprint('hello')\nx = torch.empty(3 * 2**20, device='cuda')\n")
    r = _vram("run", "--json", "fits.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "hello" in r.stderr and r.stdout.count("\n") == 1
    assert out["context"] == MEASURED_CONTEXT == 718_077_952
    (dev,) = out["devices"]
    assert dev["total_memory"] == 80 * GiB and dev["peak_allocated"] == dev["peak_reserved"] == 12 * MiB
    assert dev["nvidia_smi"] == 12 * MiB + MEASURED_CONTEXT and dev["num_ooms"] == 0


def test_run_takes_a_module_as_python_dash_m_does(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helper.py").write_text("SIZE = 2 * 2**20\n")
    (pkg / "train.py").write_text("import sys, torch\nfrom .helper import SIZE\n"
                                  "x = torch.empty(SIZE, dtype=torch.uint8, device='cuda')\n"
                                  "print(__name__, sys.argv[1:], torch.cuda.memory_allocated())\n")
    r = _vram("run", "--context", "0", "-m", "mypkg.train", "--lr", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"__main__ ['--lr', '1'] {2 * MiB}"
    r = _vram("run", "-m", "no_such_module_here", cwd=tmp_path)
    assert r.returncode == 2 and "no module named 'no_such_module_here'" in r.stderr


def test_torchrun_spellings_are_accepted() -> None:
    from vram.cli.commands import build_parser

    args = build_parser().parse_args(["run", "--nproc_per_node", "2", "--standalone", "--nnodes", "1", "t.py"])
    assert (args.nproc_per_node, args.standalone, args.nnodes, args.script) == (2, True, 1, "t.py")
    assert build_parser().parse_args(["run", "--nproc-per-node=4", "t.py"]).nproc_per_node == 4


def test_standalone_is_one_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "t.py"
    script.write_text("")
    assert main(["run", "--nproc_per_node", "2", "--standalone", "--nnodes", "2", str(script)]) == 2
    assert "--standalone is one node" in capsys.readouterr().err


def test_a_context_larger_than_the_gpu_is_refused_naming_the_flag(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "t.py"
    script.write_text("")
    assert main(["run", "--gpu", "100MiB", str(script)]) == 2
    assert "--context 0 to leave it out" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import vram

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"vram {vram.__version__}\n"


def test_help_documents_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "exit status:" in out and "does not fit" in out and "differ" in out


def test_conf_is_repeatable_where_one_config_runs() -> None:
    from vram.cli.commands import build_parser
    from vram.cli.defaults import joined_conf

    for command in (["run", "t.py"], ["estimate", "m:f"], ["demo"]):
        args = build_parser().parse_args([command[0], "--conf", "expandable_segments:True",
                                          "--conf", "max_split_size_mb:128", *command[1:]])
        assert joined_conf(args.conf) == "expandable_segments:True,max_split_size_mb:128"
    assert joined_conf(None) is None and joined_conf([""]) == ""


def test_one_gpu_default_for_programs_and_no_limit_printed_for_replays(capsys: pytest.CaptureFixture[str]) -> None:
    from vram.cli.commands import build_parser

    p = build_parser()
    assert {p.parse_args([c, *rest]).gpu for c, rest in (("run", ["t.py"]), ("estimate", ["m:f"]),
                                                         ("demo", []))} == {"80GiB"}
    assert main(["replay", str(RECORDINGS / "cs336-s-mem.pickle")]) == 0
    out = capsys.readouterr().out
    assert "GPU not limited" in out and "1024.00 GiB" not in out


def test_summary_and_gpus_print_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["summary", str(RECORDINGS / "cs336-s-mem.pickle"), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["num_ooms"] == 0 and "reserved_bytes.all.peak" in stats
    assert main(["gpus", "--json"]) == 0
    gpus = {g["gpu"]: g for g in json.loads(capsys.readouterr().out)["gpus"]}
    assert gpus["H100"]["major"] == 9


def test_diff_names_same_named_files_apart_and_exits_1_when_they_differ(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "run.pickle").write_bytes((RECORDINGS / "cs336-s-mem.pickle").read_bytes())
    (tmp_path / "b" / "run.pickle").write_bytes((RECORDINGS / "cs336-s-forward-bf16-128.pickle").read_bytes())
    assert main(["diff", str(tmp_path / "a" / "run.pickle"), str(tmp_path / "b" / "run.pickle")]) == 1
    out = capsys.readouterr().out
    assert "a/run.pickle" in out and "b/run.pickle" in out
    assert main(["diff", str(tmp_path / "a" / "run.pickle"), str(tmp_path / "a" / "run.pickle")]) == 0


def test_export_past_the_end_of_the_recording_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "piece.pickle"
    assert main(["export", str(RECORDINGS / "cs336-s-mem.pickle"), "-o", str(out), "--from", "100s",
                 "--to", "200s"]) == 2
    err = capsys.readouterr().err
    assert "holds no events" in err and "the recording has 97 events" in err and not out.exists()


def test_tune_of_a_script_leaves_no_temporary_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    script = tmp_path / "s.py"
    script.write_text("import torch\nx = torch.empty(30 * 2**20, dtype=torch.uint8, device='cuda')\n")
    assert main(["tune", "--gpu", "1GiB", "--jobs", "1", "--", str(script)]) == 0
    assert "best:" in capfd.readouterr().out
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("vram-tune-")]


def _self_contained(page: str) -> None:
    """One file: no script, nothing a browser would fetch, every SVG well-formed."""
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"<script|<link|<img|<iframe|\bsrc=|href=|url\(|@import", page, re.I)
    svgs = re.findall(r"<svg.*?</svg>", page, re.S)
    assert len(svgs) == 2
    for svg in svgs:
        ET.fromstring(svg)


def test_html_report_of_an_oom(oom_run: Any) -> None:
    work, _ = oom_run
    r = _vram("explain", "oom.pickle", "--jobs", "1", "--html", "report.html", cwd=work)
    assert r.returncode == 0, r.stderr
    page = (work / "report.html").read_text()
    _self_contained(page)
    assert ">OOM</text>" in page and "Tried to allocate 6.00 GiB" in page and "oom.py:3" in page


def test_plot_html_without_matplotlib_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.html"
    assert main(["plot", str(RECORDINGS / "cs336-s-mem.pickle"), "--html", str(out)]) == 0
    page = out.read_text()
    _self_contained(page)
    assert ">reserved peak</text>" in page
    assert main(["plot", str(RECORDINGS / "cs336-s-mem.pickle")]) == 2


def test_notebook_entry_points(oom_run: Any) -> None:
    import vram
    from vram.replay import replay

    work, _ = oom_run
    path = str(work / "oom.pickle")
    r = replay(path)
    assert vram.replay(path).peak_reserved == r.peak_reserved == 12 * GiB
    assert repr(r).startswith("<ReplayResult ") and "OOMs 1 (first at event" in repr(r)
    assert "<table>" in r._repr_html_()
    ex = vram.explain(path, workers=1)
    assert repr(ex).startswith("<Explanation of ") and "the OOM at event" in repr(ex)
    assert "device 0: the OOM at event" in str(ex) and "<table>" in ex._repr_html_()
    t = vram.tune(path, workers=1)
    # 18 GiB alive at once on a 16 GiB card: no config fits, so no best
    assert t.best is None and repr(t).startswith("<TuneResult: no config fits")
    assert "no config fits" in str(t) and "<table>" in t._repr_html_()


def test_needs_pytorch_error_says_how_to_get_the_cpu_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "vram.run.runtime", None)  # import fails as without torch
    script = tmp_path / "t.py"
    script.write_text("")
    assert main(["run", str(script)]) == 2
    err = capsys.readouterr().err
    assert "vram run needs PyTorch" in err
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in err


def test_a_rank_line_pytorch_already_prefixed_is_prefixed_once() -> None:
    import io
    import threading

    from vram.run.distributed.launcher import _forward

    out = io.StringIO()
    _forward(io.BytesIO(b"[rank0]:[W reducer.cpp] Warning: the script's own\nplain\n"), out, "[rank0]:",
             threading.Lock())
    assert out.getvalue() == "[rank0]:[W reducer.cpp] Warning: the script's own\n[rank0]:plain\n"


def test_the_reducer_timer_warning_of_the_simulated_device_is_not_shown() -> None:
    """reducer.cpp warns once that it has no timer for a device other than CPU and CUDA: on a GPU
    it never says so, so a simulated rank does not either."""
    import io
    import threading

    from vram.run.distributed.launcher import _forward

    out = io.StringIO()
    _forward(io.BytesIO(b"[rank0]:[W1127 reducer.cpp:1430] Warning: Time stats are currently only collected for "
                        b"CPU and CUDA devices. Please refer to CpuTimer or CudaTimer for how to register timer "
                        b"for other device type. (function operator())\nloss 0.0\n"), out, "[rank0]:",
             threading.Lock())
    assert out.getvalue() == "[rank0]:loss 0.0\n"


def test_the_nccl_note_is_short_unless_nccl_debug_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    from vram.run.distributed.launcher import outside_lines

    nccl = {"bytes": 508 * MiB, "lines": ["channels: 24 per communicator", "bookkeeping: 74 x 2 MiB",
                                          "communicator 0 (2 ranks): 508 MiB", "not counted: NVLS buffers"]}
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    short = outside_lines({0: (0, nccl), 1: (0, nccl)})
    assert len(short) == 4 and short[-1].strip() == "not counted: NVLS buffers"
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    assert len(outside_lines({0: (0, nccl), 1: (0, nccl)})) == 7


def test_the_placeholder_report_is_not_a_paragraph_about_generate() -> None:
    from vram.run.values.placeholders import ValueReport

    report = ValueReport()
    report.sites[("train.py", 3, "loss.item()")] = type("S", (), {"reads": 2, "derived": False, "assumed": "0.0",
                                                                   "file": "train.py", "line": 3,
                                                                   "expression": "loss.item()"})()
    text = report.render()
    assert "loss.item()" in text and "generate()" not in text and "Mamba" not in text


def test_long_work_off_a_terminal_prints_plain_lines(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Off a terminal (a log, CI, a notebook) progress is a plain line after 5 s, then at most one
    every 10 s, and the last; work that ends sooner prints nothing."""
    from vram.cli import progress

    clock = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    quick = progress.Progress("explaining", unit="replays")
    for done in range(1, 11):
        clock[0] += 0.4
        quick(done, 10)
    assert capsys.readouterr().err == ""
    clock[0] = 0.0
    slow = progress.Progress("explaining", unit="replays")
    for done in range(1, 31):
        clock[0] += 1.0
        slow(done, 30)
    assert capsys.readouterr().err.splitlines() == [
        "explaining: 16% (5/30 replays, 5 s)", "explaining: 50% (15/30 replays, 15 s)",
        "explaining: 83% (25/30 replays, 25 s)", "explaining: 100% (30/30 replays, 30 s)"]


def test_python_api_counts_the_context_as_the_commands_do(oom_run: Any) -> None:
    """On a given GPU the commands count the measured CUDA context (context.txt) unless told
    otherwise; `vram.replay`, `vram.explain` and `vram.tune` answer the same."""
    import vram

    work, _ = oom_run
    path = str(work / "oom.pickle")
    cli = json.loads(_vram("replay", path, "--gpu", "32GiB", "--json").stdout)
    r = vram.replay(path, gpu="32GiB")
    assert r.peak_device_used - r.peak_reserved == MEASURED_CONTEXT
    assert cli["peak_device_used"] == r.peak_device_used
    own = vram.replay(path)  # on the recording's own GPU its recorded free memory already leaves the context out
    assert own.peak_device_used == own.peak_reserved == 12 * GiB
    # 18 GiB of live tensors: on a card of 18 GiB + the context they fit, on 18 GiB itself they do not
    fits = vram.tune(path, gpu=18 * GiB + MEASURED_CONTEXT, workers=1)
    assert fits.best is not None and fits.best["peak_reserved"] == 18 * GiB
    assert vram.tune(path, gpu=18 * GiB, workers=1).best is None
    assert vram.explain(path, gpu=18 * GiB, workers=1, fixes=False).at["kind"] == "oom"
