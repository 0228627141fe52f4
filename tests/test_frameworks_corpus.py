"""Third-party frameworks' own training loops, unmodified, under ``vram run --gpu H100`` to their end
(tests/corpus/, README there): ultralytics YOLOv8n train/val/predict, torchvision Faster R-CNN and
RetinaNet training steps and inference, a Lightning Fabric bf16 loop with a checkpoint, and
accelerate's FSDP plugin (FSDP2) and Hugging Face ``Trainer`` with FSDP, each on 2 ranks. Each
runs when its library is installed (ultralytics and Lightning: the ``frameworks`` extra), else
skips; each takes a minute or more, so they are ``slow``. The mechanisms they needed have
plain-torch tests of their own (tests/test_lazy_host.py, tests/test_vision_ops.py).

Expectations, from the same models built here on the CPU without vram: the printed parameter
count; and a floor for the peak from PyTorch's rules — every trained parameter's weight, gradient
and optimizer state (SGD with momentum: one buffer; AdamW: two) live at once during the step, each
fp32 (ultralytics keeps an EMA copy of the model too), so the peak allocated is at least that many
bytes, and the peak reserved at least the peak allocated.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from corpus_output import CORPUS, load_program, printed_values  # noqa: E402
from vram.run.cuda.compat import define_torchvision_ops  # noqa: E402

define_torchvision_ops()

SRC = Path(__file__).resolve().parent.parent / "src"


def _yolo_params() -> int:
    from ultralytics.nn.tasks import DetectionModel

    return sum(p.numel() for p in DetectionModel("yolov8n.yaml", nc=2, verbose=False).parameters())


def _detection_params() -> int:
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_fpn, retinanet_resnet50_fpn

    return max(sum(p.numel() for p in build(weights=None, weights_backbone=None, num_classes=3).parameters())
               for build in (fasterrcnn_mobilenet_v3_large_fpn, retinanet_resnet50_fpn))


def _fabric_params() -> int:
    return sum(p.numel() for p in load_program("fabric_lm.py").LM().parameters())


def _fsdp_params() -> int:
    return sum(p.numel() for p in load_program("accelerate_fsdp.py").build().parameters())


def _trainer_fsdp_params() -> int:
    return sum(p.numel() for p in load_program("hf_trainer_fsdp.py").build().parameters())


# program -> (libraries, the CPU-built parameter count, fp32 copies per parameter alive in the
# step, ranks: each rank holds 1/ranks of them)
CASES = {
    # weights, gradients, the EMA model, and the optimizer's state (SGD momentum at the least)
    "yolo_ultralytics.py": (("ultralytics", "cv2"), _yolo_params, 4, 1),
    # weights, gradients, SGD momentum (the larger model: RetinaNet's)
    "tv_detection.py": (("torchvision",), _detection_params, 3, 1),
    # weights, gradients, AdamW's exp_avg and exp_avg_sq
    "fabric_lm.py": (("lightning",), _fabric_params, 4, 1),
    # FSDP2 full shard on 2 ranks: each rank's shard of the weights, gradients and AdamW's state
    "accelerate_fsdp.py": (("accelerate", "transformers"), _fsdp_params, 4, 2),
    # Trainer's FSDP (full shard, auto wrap) on 2 ranks: the same shards
    "hf_trainer_fsdp.py": (("accelerate", "transformers"), _trainer_fsdp_params, 4, 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("program", sorted(CASES))
def test_framework_program_runs_to_its_end(program: str, tmp_path: Path) -> None:
    libs, params_of, copies, ranks = CASES[program]
    for lib in libs:
        pytest.importorskip(lib)
    expected_params = params_of()
    env: dict[str, Any] = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    launch = ["--nproc-per-node", str(ranks)] if ranks > 1 else []
    proc = subprocess.run([sys.executable, "-m", "vram", "run", "--gpu", "H100", *launch, "--", str(CORPUS / program)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # a launched rank's lines come prefixed "[rankN]:"; rank 0's come first
    printed = printed_values("\n".join(re.sub(r"^\[rank\d+\]:", "", line) for line in proc.stdout.splitlines()))
    assert "done" in printed, proc.stdout[-2000:]
    assert int(printed["params"]) == expected_params
    peak, reserved = int(printed["peak_allocated"]), int(printed["peak_reserved"])
    assert peak >= copies * 4 * expected_params // ranks
    assert reserved >= peak
