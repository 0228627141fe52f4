"""ultralytics YOLOv8n from its yaml (randomly initialised): train one epoch, validate and predict on
a tiny synthetic dataset written to a temporary folder (no download)."""
import os
import tempfile
from pathlib import Path

import numpy as np

root = Path(tempfile.mkdtemp(prefix="yolo_data_"))
os.environ.setdefault("YOLO_CONFIG_DIR", str(root / "settings"))
os.environ.setdefault("YOLO_OFFLINE", "1")
import cv2  # noqa: E402
import torch  # noqa: E402
from ultralytics import YOLO  # noqa: E402

rng = np.random.default_rng(0)
for split in ("train", "val"):
    (root / "images" / split).mkdir(parents=True)
    (root / "labels" / split).mkdir(parents=True)
    for i in range(4):
        cv2.imwrite(str(root / "images" / split / f"{i}.jpg"), rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))
        (root / "labels" / split / f"{i}.txt").write_text(f"{i % 2} 0.5 0.5 0.3 0.4\n")
data = root / "data.yaml"
data.write_text(f"path: {root}\ntrain: images/train\nval: images/val\nnames:\n  0: a\n  1: b\n")

model = YOLO("yolov8n.yaml")
model.train(data=str(data), epochs=1, imgsz=64, batch=4, device=0, workers=0, plots=False, amp=False,
            project=str(root / "runs"), name="train", exist_ok=True, verbose=False)
print("params", sum(p.numel() for p in model.model.parameters()))
metrics = model.val(data=str(data), imgsz=64, batch=4, device=0, workers=0, plots=False,
                    project=str(root / "runs"), name="val", exist_ok=True)
print("map50", metrics.box.map50)
results = model.predict(str(root / "images" / "val"), imgsz=64, device=0, verbose=False)
print("predicted", len(results), "images")
print("peak_allocated", torch.cuda.max_memory_allocated())
print("peak_reserved", torch.cuda.max_memory_reserved())
print("done")
