"""``torch.compile`` under ``vram run``. The compiled program is not modelled
yet: ``torch.compile`` returns the model unchanged and says once that memory is eager PyTorch's
(docs/estimate-accuracy.md, "torch.compile": what blocks inductor's CUDA wrapper on a CPU build)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vram.run.runtime import simulated_cuda  # noqa: E402


def test_compile_runs_eagerly_and_says_so_once(capsys: pytest.CaptureFixture[str]) -> None:
    with simulated_cuda("24GiB"):
        m = torch.nn.Linear(8, 8).cuda()
        assert torch.compile(m) is m
        assert torch.compile(mode="max-autotune")(m) is m  # the decorator form
        m(torch.zeros(2, 8, device="cuda"))
    err = capsys.readouterr().err
    assert err.count("torch.compile runs eagerly") == 1


def test_dynamo_handler_table_builds_under_the_simulation() -> None:
    """Dynamo keys its torch-function handlers by function and refuses one registered twice
    (torch/_dynamo/variables/torch.py ``TorchInGraphFunctionVariable._get_handlers``, which
    registers ``torch.cuda._exchange_device`` and ``torch.cuda._maybe_exchange_device``): the
    simulated ``torch.cuda`` must give them distinct functions, else any Dynamo trace under
    ``vram run`` fails with "Handler already registered"."""
    from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

    get = TorchInGraphFunctionVariable._get_handlers
    with simulated_cuda("24GiB"):
        assert torch.cuda._exchange_device is not torch.cuda._maybe_exchange_device
        get.cache_clear()
        try:
            handlers = get()
        finally:
            get.cache_clear()  # built again, outside the simulation, by the next trace
        assert torch.cuda._maybe_exchange_device in handlers
        assert torch.cuda._exchange_device(-1) == 0 and torch.cuda._maybe_exchange_device(-1) == 0


def test_a_library_compiling_its_helpers_says_nothing(tmp_path, monkeypatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """DeepSpeed and litgpt decorate helper functions with ``torch.compile`` when imported; the
    script never compiles its model, so the notice (about a compiled model's memory) is not said."""
    lib = tmp_path / "site-packages" / "helperlib"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("import torch\n\n@torch.compile\ndef gelu(x):\n    return x * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
    with simulated_cuda("24GiB"):
        import helperlib

        assert helperlib.gelu(torch.ones(2, device="cuda")).is_cuda
    assert "torch.compile runs eagerly" not in capsys.readouterr().err
    with simulated_cuda("24GiB"):
        torch.compile(torch.nn.Linear(2, 2).cuda())   # a model, whoever compiles it
    assert capsys.readouterr().err.count("torch.compile runs eagerly") == 1
