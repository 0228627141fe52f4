"""cuDNN RNNs (nn.LSTM / nn.GRU / nn.RNN) forward + backward over a grid of shapes, one config at a
time with the cache emptied between them, so the recording's segment frees separate the configs.
Prints one JSON line per config (its order in the recording) and cuDNN's version."""
import json

import torch

CONFIGS = [  # (module, input, hidden, layers, bidirectional, batch, seq, dtype, batch_first)
    ("LSTM", 64, 128, 1, False, 8, 32, "float32", False),
    ("LSTM", 64, 128, 2, False, 8, 32, "float32", False),
    ("LSTM", 64, 128, 2, True, 8, 32, "float32", True),
    ("LSTM", 256, 512, 2, False, 16, 100, "float32", True),
    ("LSTM", 256, 512, 2, False, 16, 100, "float16", True),
    ("LSTM", 256, 512, 3, True, 32, 50, "bfloat16", True),
    ("GRU", 128, 256, 2, False, 16, 64, "float32", True),
    ("GRU", 128, 256, 1, True, 4, 200, "float16", False),
    ("RNN", 32, 64, 1, False, 8, 16, "float32", False),
]
print(json.dumps({"cudnn": torch.backends.cudnn.version()}), flush=True)
for mod, inp, hid, layers, bidir, batch, seq, dt, bf in CONFIGS:
    dtype = getattr(torch, dt)
    rnn = getattr(torch.nn, mod)(inp, hid, layers, bidirectional=bidir, batch_first=bf).cuda().to(dtype)
    shape = (batch, seq, inp) if bf else (seq, batch, inp)
    x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, _ = rnn(x)
    out.float().sum().backward()
    torch.cuda.synchronize()
    print(json.dumps({"config": [mod, inp, hid, layers, bidir, batch, seq, dt, bf], "before": before,
                      "peak": torch.cuda.max_memory_allocated(), "after": torch.cuda.memory_allocated()}), flush=True)
    del rnn, x, out
    torch.cuda.empty_cache()
