"""``--html`` on replay and tune, and every report opened in a real headless browser.

Expected figures come from the allocator's rules (spec §6: a request over 10 MiB gets a segment of
its own rounded size; §4: sizes over 1 MiB round up to 2 MiB), never from what vram printed.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from test_first_hour import OOM_SCRIPT, _self_contained, _vram

GiB = 1 << 30


@pytest.fixture(scope="module")
def oom_recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OOM_SCRIPT recorded on a 16 GiB card: two 6 GiB tensors live, the third fails."""
    pytest.importorskip("torch")
    work = tmp_path_factory.mktemp("html")
    (work / "oom.py").write_text(OOM_SCRIPT)
    r = _vram("run", "--gpu", "16GiB", "--context", "1GiB", "--snapshot", "oom.pickle", "oom.py", cwd=work)
    assert r.returncode == 1 and (work / "oom.pickle").is_file(), r.stderr[-2000:]
    return work


def _report(work: Path, *argv: str, rc: int = 0) -> str:
    """``vram ARGV --html report.html`` in `work`: its exit status checked, the page read and
    checked to be self-contained."""
    r = _vram(*argv, "--html", "report.html", cwd=work)
    assert r.returncode == rc, r.stderr
    page = (work / "report.html").read_text()
    _self_contained(page)
    return page


def test_replay_html_on_a_larger_gpu_shows_the_peak(oom_recording: Path) -> None:
    # on 32 GiB the third 6 GiB request succeeds (then is freed at once: the program never got it),
    # so the peak is three 6 GiB segments and there is no OOM to mark
    work = oom_recording
    page = _report(work, "replay", "oom.pickle", "--gpu", "32GiB", "--context", "0")
    assert ">reserved peak</text>" in page and ">OOM</text>" not in page
    assert "<th>peak reserved</th><td>18.00 GiB</td>" in page
    assert "oom.py:3" in page  # the live tensors there, by the line that made them


def test_replay_html_under_a_cap_marks_the_oom(oom_recording: Path) -> None:
    # a 13 GiB per-process cap on a 32 GiB card: 12 GiB fit, the third 6 GiB segment does not
    work = oom_recording
    page = _report(work, "replay", "oom.pickle", "--gpu", "32GiB", "--context", "0", "--cap", "13GiB")
    assert ">OOM</text>" in page and "<th>per-process cap</th><td>13,958,643,712 B</td>" in page
    assert "<th>peak reserved</th><td>12.00 GiB</td>" in page


def test_replay_html_takes_one_run(oom_recording: Path) -> None:
    work = oom_recording
    r = _vram("replay", "oom.pickle", "--conf", "max_split_size_mb:64", "--conf", "garbage_collection_threshold:0.5",
              "--html", "x.html", cwd=work)
    assert r.returncode == 2 and "give at most one --conf" in r.stderr and not (work / "x.html").exists()
    r = _vram("replay", "oom.pickle", "oom.pickle", "--html", "x.html", cwd=work)
    assert r.returncode == 2 and "--html takes one snapshot" in r.stderr


def test_tune_html_reports_the_best_config(oom_recording: Path) -> None:
    work = oom_recording
    page = _report(work, "tune", "oom.pickle", "--gpu", "32GiB", "--context", "0", "--jobs", "1")
    assert "the best config" in page and "rank 1: peak reserved 18.00 GiB" in page
    assert ": (default)</li>" in page  # the default config is always a row


def test_tune_html_when_nothing_fits(oom_recording: Path) -> None:
    # 18 GiB are requested alive at once; a 16 GiB card holds no config's run
    work = oom_recording
    page = _report(work, "tune", "oom.pickle", "--gpu", "16GiB", "--context", "0", "--jobs", "1", rc=1)
    assert "no config fits" in page and ">OOM</text>" in page


def _browser() -> str | None:
    return next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


@pytest.mark.skipif(_browser() is None, reason="no headless browser installed (Debian: apt-get install chromium)")
def test_reports_render_in_a_headless_browser(oom_recording: Path, tmp_path: Path) -> None:
    """The browser parses the page as written (its DOM keeps both pictures, their marks and the
    tables) and draws it: the screenshot is a PNG of the window's size."""
    work = oom_recording
    _report(work, "replay", "oom.pickle", "--gpu", "16GiB", "--context", "0", rc=0)
    browser: Any = _browser()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", f"--user-data-dir={tmp_path}"]
    url = (work / "report.html").as_uri()
    dom = subprocess.run([browser, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    assert dom.count("<svg") == 2 and ">OOM</text>" in dom and "<th>peak reserved</th>" in dom
    shot = tmp_path / "shot.png"
    subprocess.run([browser, *flags, f"--screenshot={shot}", "--window-size=1200,2000", url],
                   capture_output=True, timeout=120)
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1200, 2000) and len(png) > 20_000
