"""cuDNN workspace sizes measured on sm90 (layer 4; data only).

cuDNN sizes a convolution's workspace by the engine its heuristics pick (``Conv_v8.cpp``
``run_conv_plan``: ``plan.getWorkspaceSize()``, allocated through the caching allocator and freed
when the call returns) and batch norm's by ``cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize``
/ ``...BackwardExWorkspaceSize`` (``cudnn/BatchNorm.cpp``). Neither can be asked without cuDNN, so
these tables hold what a real GPU allocated.

Provenance: ``shared/gpu-truth/h200-2026-11-27`` (one NVIDIA H200, sm90, driver 580.159.04, CUDA 13.0,
torch 2.11.0+cu130; the cuDNN release was not recorded), program ``conv_caps.py`` (torchvision
resnet18, batch 64, channels_last, float16 autocast + GradScaler, two training steps), recording
``conv_caps_0.pickle``. Each workspace is the request of the ``alloc``/``free`` pair that follows
the op's outputs in that recording (matched to the program's convolution and batch-norm calls in
order); both steps asked the same sizes. 0 is a measured zero: no allocation (``allocate(0)``
records none). ``torch.backends.cudnn.benchmark`` and ``deterministic`` were off.

vram applies the tables to every sm90 card (H100 and H200 both have 132 SMs in their SXM form);
cuDNN's instant heuristics choose by the device's properties and cuDNN's own release, so another
card or release may choose another engine.
"""
from __future__ import annotations

#: cuDNN convolution workspaces, bytes: (operation, dtype, layout, input shape, weight shape, stride,
#: padding, dilation, groups) -> the workspace the heuristics' first engine asked. ``operation``:
#: ``forward`` / ``backward_data`` / ``backward_filter`` (CUDNN_BACKEND_OPERATION_CONVOLUTION_*);
#: ``layout``: ``cudnn_conv_suggest_memory_format``'s answer
CONV_WORKSPACE: dict[tuple[object, ...], int] = {
    ("forward", "float16", "channels_last", (64, 3, 224, 224), (64, 3, 7, 7), (2, 2), (3, 3), (1, 1), 1): 25715216,
    ("forward", "float16", "channels_last", (64, 64, 56, 56), (64, 64, 3, 3), (1, 1), (1, 1), (1, 1), 1): 131,
    ("forward", "float16", "channels_last", (64, 64, 56, 56), (128, 64, 3, 3), (2, 2), (1, 1), (1, 1), 1): 131,
    ("forward", "float16", "channels_last", (64, 128, 28, 28), (128, 128, 3, 3), (1, 1), (1, 1), (1, 1), 1): 131,
    ("forward", "float16", "channels_last", (64, 64, 56, 56), (128, 64, 1, 1), (2, 2), (0, 0), (1, 1), 1): 38535440,
    ("forward", "float16", "channels_last", (64, 128, 28, 28), (256, 128, 3, 3), (2, 2), (1, 1), (1, 1), 1): 0,
    ("forward", "float16", "channels_last", (64, 256, 14, 14), (256, 256, 3, 3), (1, 1), (1, 1), (1, 1), 1): 0,
    ("forward", "float16", "channels_last", (64, 128, 28, 28), (256, 128, 1, 1), (2, 2), (0, 0), (1, 1), 1): 0,
    ("forward", "float16", "channels_last", (64, 256, 14, 14), (512, 256, 3, 3), (2, 2), (1, 1), (1, 1), 1): 131,
    ("forward", "float16", "channels_last", (64, 512, 7, 7), (512, 512, 3, 3), (1, 1), (1, 1), (1, 1), 1): 0,
    ("forward", "float16", "channels_last", (64, 256, 14, 14), (512, 256, 1, 1), (2, 2), (0, 0), (1, 1), 1): 0,
    ("backward_data", "float16", "channels_last", (64, 512, 7, 7), (512, 512, 3, 3), (1, 1), (1, 1), (1, 1), 1): 0,
    ("backward_filter", "float16", "channels_last", (64, 512, 7, 7), (512, 512, 3, 3), (1, 1), (1, 1), (1, 1), 1):
        131,
    ("backward_data", "float16", "channels_last", (64, 256, 14, 14), (512, 256, 1, 1), (2, 2), (0, 0), (1, 1), 1):
        131,
    ("backward_filter", "float16", "channels_last", (64, 256, 14, 14), (512, 256, 1, 1), (2, 2), (0, 0), (1, 1), 1):
        0,
    ("backward_data", "float16", "channels_last", (64, 256, 14, 14), (512, 256, 3, 3), (2, 2), (1, 1), (1, 1), 1):
        131,
    ("backward_filter", "float16", "channels_last", (64, 256, 14, 14), (512, 256, 3, 3), (2, 2), (1, 1), (1, 1), 1):
        3277159,
    ("backward_data", "float16", "channels_last", (64, 256, 14, 14), (256, 256, 3, 3), (1, 1), (1, 1), (1, 1), 1):
        0,
    ("backward_filter", "float16", "channels_last", (64, 256, 14, 14), (256, 256, 3, 3), (1, 1), (1, 1), (1, 1), 1):
        0,
    ("backward_data", "float16", "channels_last", (64, 128, 28, 28), (256, 128, 1, 1), (2, 2), (0, 0), (1, 1), 1):
        131,
    ("backward_filter", "float16", "channels_last", (64, 128, 28, 28), (256, 128, 1, 1), (2, 2), (0, 0), (1, 1), 1):
        3801216,
    ("backward_data", "float16", "channels_last", (64, 128, 28, 28), (256, 128, 3, 3), (2, 2), (1, 1), (1, 1), 1):
        131,
    ("backward_filter", "float16", "channels_last", (64, 128, 28, 28), (256, 128, 3, 3), (2, 2), (1, 1), (1, 1), 1):
        0,
    ("backward_data", "float16", "channels_last", (64, 128, 28, 28), (128, 128, 3, 3), (1, 1), (1, 1), (1, 1), 1):
        131,
    ("backward_filter", "float16", "channels_last", (64, 128, 28, 28), (128, 128, 3, 3), (1, 1), (1, 1), (1, 1), 1):
        3539535,
    ("backward_data", "float16", "channels_last", (64, 64, 56, 56), (128, 64, 1, 1), (2, 2), (0, 0), (1, 1), 1):
        131,
    ("backward_filter", "float16", "channels_last", (64, 64, 56, 56), (128, 64, 1, 1), (2, 2), (0, 0), (1, 1), 1):
        3866752,
    ("backward_data", "float16", "channels_last", (64, 64, 56, 56), (128, 64, 3, 3), (2, 2), (1, 1), (1, 1), 1):
        131,
    ("backward_filter", "float16", "channels_last", (64, 64, 56, 56), (128, 64, 3, 3), (2, 2), (1, 1), (1, 1), 1):
        3834519,
    ("backward_data", "float16", "channels_last", (64, 64, 56, 56), (64, 64, 3, 3), (1, 1), (1, 1), (1, 1), 1): 131,
    ("backward_filter", "float16", "channels_last", (64, 64, 56, 56), (64, 64, 3, 3), (1, 1), (1, 1), (1, 1), 1):
        1917591,
    ("backward_filter", "float16", "channels_last", (64, 3, 224, 224), (64, 3, 7, 7), (2, 2), (3, 3), (1, 1), 1):
        26117231,
}

#: cuDNN batch-norm workspaces in training, bytes: (``forward`` / ``backward``, input dtype, weight
#: dtype, layout, input shape) -> the workspace; the reserve space of these calls was empty (no
#: allocation between the statistics and the workspace)
BN_WORKSPACE: dict[tuple[object, ...], int] = {
    ("forward", "float16", "float32", "channels_last", (64, 64, 112, 112)): 2590364,
    ("forward", "float16", "float32", "channels_last", (64, 64, 56, 56)): 648656,
    ("forward", "float16", "float32", "channels_last", (64, 128, 28, 28)): 325128,
    ("forward", "float16", "float32", "channels_last", (64, 256, 14, 14)): 164144,
    ("forward", "float16", "float32", "channels_last", (64, 512, 7, 7)): 83664,
    ("backward", "float16", "float32", "channels_last", (64, 512, 7, 7)): 136256,
    ("backward", "float16", "float32", "channels_last", (64, 256, 14, 14)): 269360,
    ("backward", "float16", "float32", "channels_last", (64, 128, 28, 28)): 536616,
    ("backward", "float16", "float32", "channels_last", (64, 64, 56, 56)): 1071652,
    ("backward", "float16", "float32", "channels_last", (64, 64, 112, 112)): 4282916,
}

#: the compute capabilities these tables were measured on
MEASURED_ON = ((9, 0),)
