"""The command line as a new user meets it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from paths import RECORDINGS as TRACES  # noqa: E402
from vram.cli import main

MEM = TRACES / "cs336-s-mem.pickle"


def _help(*argv: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ["replay", "summary", "plot", "export", "diff", "demo", "run", "estimate",
                                     "gpus"])
def test_each_subcommand_has_a_description_and_only_its_own_examples(command, capsys) -> None:
    text = _help(command, capsys=capsys)
    usage, _, rest = text.partition("\n\n")
    assert rest.strip() and not rest.startswith("options")  # a description after the usage
    examples = text.split("examples:\n", 1)[1]
    lines = [ln for ln in examples.splitlines() if ln.startswith("  vram ")]
    assert lines and all(ln.startswith(f"  vram {command}") for ln in lines), lines


def test_demo_takes_a_card_and_lists_the_cards_when_it_does_not_know_one(capsys) -> None:
    assert main(["demo", "--gpu", "A100"]) == 2
    err = capsys.readouterr().err
    assert "A100-80GB" in err and "A100-40GB" in err and "H100" in err


def test_replay_of_a_device_the_snapshot_does_not_have_is_an_error(capsys) -> None:
    assert main(["replay", str(MEM), "--device", "3"]) == 2
    assert "device 3 is not in the snapshot: it records 1 device(s)" in capsys.readouterr().err


def test_run_of_a_directory(tmp_path, capsys) -> None:
    assert main(["run", str(tmp_path)]) == 2
    assert "can't find '__main__' module" in capsys.readouterr().err
    pytest.importorskip("torch")
    (tmp_path / "__main__.py").write_text("import torch\nprint(torch.cuda.is_available())\n")
    assert main(["run", str(tmp_path)]) == 0  # python DIR runs DIR/__main__.py, and so does vram run
    assert capsys.readouterr().out.strip() == "True"


def test_plot_reports_the_file_it_wrote(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    assert main(["plot", str(MEM), "-o", str(out)]) == 0
    assert (tmp_path / "out.png").exists() and f"wrote {out}.png" in capsys.readouterr().out


def test_output_into_a_closed_pipe_stops_quietly() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "vram", "export", str(MEM), "-o", "/dev/stdout"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before anything is written (`| head -0`)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and "Traceback" not in err and "Broken pipe" not in err, err


def test_diff_command(capsys) -> None:
    assert main(["diff", str(MEM), str(MEM)]) == 0
    out = capsys.readouterr().out
    assert "identical: every request and every new segment, in order" in out
    assert main(["diff", str(MEM), str(MEM), "--json"]) == 0
    assert '"identical": true' in capsys.readouterr().out
    assert os.path.basename(str(MEM)) in out
