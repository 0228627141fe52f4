"""Reads of values that need the model's arithmetic: by default a placeholder
(zeros), so the script goes on, and every such read is reported by script line, how often and
what was assumed; ``--strict-values`` stops at the first one."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from vram.cli import main  # noqa: E402
from vram.run.runtime import run_script, simulated_cuda  # noqa: E402

TRAIN = """\
import torch, torch.nn as nn
model = nn.Sequential(nn.Embedding(1000, 512), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1000)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for it in range(3):
    x = torch.randint(0, 1000, (8, 256), device="cuda")
    loss = nn.functional.cross_entropy(model(x).view(-1, 1000), x.view(-1))
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if torch.isfinite(norm):
        opt.step()
    opt.zero_grad(set_to_none=True)
    {log}
print("peak", torch.cuda.max_memory_allocated())
"""


def _script(tmp_path: Path, text: str, name: str = "train.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_training_loop_logging_loss_runs_to_the_end_with_a_report(tmp_path, capsys) -> None:
    path = _script(tmp_path, TRAIN.format(log='print(f"iter {it}: loss {loss.item():.4f}")'))
    report = tmp_path / "values.json"
    assert main(["run", "--gpu", "24GiB", "--value-report", str(report), path]) == 0
    out, err = capsys.readouterr()
    assert out.count("loss 0.0000") == 3 and "peak" in out  # the placeholder, every iteration
    assert "train.py:12: loss.item()  x3  -> 0.0 (placeholder)" in err
    sites = json.loads(report.read_text())["placeholder_reads"]
    by_expr = {s["expression"]: s for s in sites}
    item = by_expr["loss.item()"]
    assert (item["line"], item["reads"], item["assumed"], item["derived"]) == (12, 3, "0.0", False)
    assert item["file"] == path
    # `if torch.isfinite(norm)`: the norm of unknown gradients is a placeholder (0), so finite
    finite = by_expr["torch.isfinite(norm)"]
    assert (finite["line"], finite["reads"], finite["assumed"], finite["derived"]) == (9, 3, "True", True)


def test_placeholders_do_not_change_the_memory_figures(tmp_path, capsys) -> None:
    """The same loop with and without reads of the loss: the same peak (a read costs no GPU memory)."""
    with_reads = _script(tmp_path, TRAIN.format(log='print(f"loss {loss.item():.4f}")'), "a.py")
    without = _script(tmp_path, TRAIN.format(log="pass"), "b.py")
    assert run_script(with_reads, []) == 0
    peak_with = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("peak")]
    assert run_script(without, []) == 0
    peak_without = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("peak")]
    assert peak_with == peak_without and peak_with


def test_strict_values_stops_at_the_first_read(tmp_path, capsys) -> None:
    path = _script(tmp_path, TRAIN.format(log='print(f"iter {it}: loss {loss.item():.4f}")'))
    assert main(["run", "--strict-values", path]) == 1
    err = capsys.readouterr().err
    # the expression that produced the tested value, not the whole `if` statement
    assert "train.py:9: torch.isfinite(norm) needs tensor values, which a simulated GPU does not have" in err


def test_generation_without_eos_runs_to_the_step_limit() -> None:
    """A greedy decoding loop stops at EOS or after max_new_tokens. The logits need the model's
    arithmetic, so the next token is a placeholder (0), never EOS: the loop runs every step, the
    memory worst case, and the report says the stop test was assumed."""
    eos, max_new = 50256, 6
    with simulated_cuda(gpu="24GiB"):
        from vram.run.runtime import active_sim

        lm = torch.nn.Linear(64, 50257).cuda()
        tokens = torch.zeros(1, 1, dtype=torch.long, device="cuda")
        finished = torch.zeros(1, dtype=torch.bool, device="cuda")
        steps = 0
        while steps < max_new and not bool(finished.all()):
            hidden = torch.randn(1, tokens.shape[1], 64, device="cuda")
            logits = lm(hidden)[:, -1, :]
            next_token = logits.argmax(-1)
            finished |= next_token == eos
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
            steps += 1
        assert steps == max_new and tokens.shape == (1, 1 + max_new)
        sites = active_sim().report.sites.values()
        assert any("finished.all()" in s.expression and s.derived and s.assumed == "False" for s in sites)


def test_torch_save_writes_a_cuda_checkpoint_with_known_values_and_zeros(tmp_path) -> None:
    """torch.save copies each storage to the host: known contents are copied, unknown ones are
    zeros (reported), and the checkpoint records cuda:0, as one saved on a GPU does."""
    path = tmp_path / "ckpt.pt"
    with simulated_cuda():
        from vram.run.runtime import active_sim

        lin = torch.nn.Linear(512, 512)       # built on the host: 262,144 weights, 512 biases
        bias = lin.bias.detach().clone()
        lin.cuda()                            # the bias (512 elements) is small enough to keep
        torch.save(lin.state_dict(), path)
        (site,) = active_sim().report.sites.values()
        assert site.reads == 1 and site.assumed == "1,048,576 zero bytes"  # the weight's storage
    sd = torch.load(path, map_location="cpu")
    assert torch.equal(sd["bias"], bias) and not sd["weight"].any()
    with pytest.raises(RuntimeError, match="CUDA"):  # recorded as cuda:0: a CPU-only torch refuses it
        torch.load(path)
    with simulated_cuda():
        loaded = torch.load(path)             # no map_location: back onto the simulated GPU
        assert loaded["weight"].is_cuda and torch.cuda.memory_allocated() == 1_048_576 + 2048


def test_torch_save_stops_when_strict(tmp_path) -> None:
    from vram.run.runtime import DataDependentError

    with simulated_cuda(strict_values=True):
        w = torch.randn(512, 512, device="cuda")
        with pytest.raises(DataDependentError, match="needs tensor values"):
            torch.save(w, tmp_path / "w.pt")


def test_a_failure_on_a_placeholder_read_is_blamed_on_the_simulation(tmp_path, capsys) -> None:
    """pytorch/examples ``super_resolution``: ``10 * log10(1 / mse.item())`` divides by the 0.0
    placeholder. The traceback stays (the script did fail), and one line says the failing line read
    a placeholder; a failure elsewhere gets no such line."""
    path = _script(tmp_path, """\
        import math, sys, torch
        net = torch.nn.Linear(300, 300).cuda()
        x = torch.ones(300, 300, device="cuda")
        mse = torch.nn.functional.mse_loss(net(x), torch.zeros_like(x))
        if sys.argv[1] == "psnr":
            print(10 * math.log10(1 / mse.item()))
        raise KeyError("the script's own")
        """)
    assert run_script(path, ["psnr"]) == 1
    err = capsys.readouterr().err
    assert "ZeroDivisionError" in err
    assert (f"vram run: the script failed at {path}:6 after `mse.item()` was answered with a placeholder "
            "(0.0); on a GPU it has the model's value there") in err
    assert run_script(path, ["other"]) == 1
    err = capsys.readouterr().err
    assert "KeyError" in err and "the script failed at" not in err


def test_sizes_computed_from_placeholders_are_said_and_a_later_failure_is_blamed(tmp_path, capsys) -> None:
    """Whisper's ``generate`` strips padding with ``seek_sequence[:-num_paddings]`` and then reads
    ``seek_sequence[-1]``; a mixture-of-experts layer's eager loop sizes each expert's batch with
    ``torch.where(mask)``. Sizes that come from the model's arithmetic are assumed (here nonzero of a
    placeholder: empty), the report says so, and a failure a few lines on names that assumption."""
    path = _script(tmp_path, """\
        import torch
        net = torch.nn.Linear(300, 300).cuda()
        y = net(torch.ones(300, 300, device="cuda")).sum(dim=1)  # the model's arithmetic (too big to compute)
        hits = torch.nonzero(y > 0)
        print("hits", len(hits))
        last = hits[-1]
        """)
    report = tmp_path / "values.json"
    assert run_script(path, [], value_report=str(report)) == 1
    out, err = capsys.readouterr()
    assert "hits 0" in out and "IndexError" in err
    assert f"{path}:4: torch.nonzero(y > 0)  x1  -> output shape [0, 1] (computed from placeholders)" in err
    assert "Sizes assumed: 1 data-dependent output shape(s)" in err and "tokens per expert are assumed" in err
    assert (f"vram run: the script failed at {path}:6 after `torch.nonzero(y > 0)` at line 4 was answered with "
            "a placeholder (output shape [0, 1]); this failure may be the simulation's") in err
    assert json.loads(report.read_text())["notes"][0].startswith("Sizes assumed: 1 data-dependent")
