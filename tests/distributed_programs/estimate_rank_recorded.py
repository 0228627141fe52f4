"""One rank of a multi-GPU ``vram estimate`` (`vram.estimate.ranks`) that also writes what the
tests compare: the allocation history of the rank's own GPU from the first request (``action``,
``addr``, ``size`` of each event) and the buckets of each graph Dynamo's DDPOptimizer split, as
JSON to ``$ESTIMATE_EVENTS.rankR.json``. Run as ``python estimate_rank_recorded.py CONFIG.json``
in place of ``python -m vram.estimate.ranks CONFIG.json``."""
import json
import os
import sys

from torch._dynamo.backends.distributed import DDPOptimizer

from vram.estimate import engine, ranks

real_run, real_compile_fn = engine._run, DDPOptimizer.compile_fn
found = {"events": [], "ddp_buckets": []}


def recorded(*args, **kwargs):
    run = real_run(*args, **{**kwargs, "record": True})
    parallel = kwargs.get("parallel")
    trace = run.snapshot["device_traces"][parallel.device if parallel is not None else 0]
    found["events"] = [(e["action"], e["addr"], e["size"]) for e in trace]
    return run


def compile_fn(self, gm, example_inputs, **configs):
    compiled = real_compile_fn(self, gm, example_inputs, **configs)
    found["ddp_buckets"].append([b.size for b in self.buckets])
    return compiled


engine._run = recorded
DDPOptimizer.compile_fn = compile_fn
status = ranks.main()
with open(f"{os.environ['ESTIMATE_EVENTS']}.rank{os.environ['RANK']}.json", "w") as f:
    json.dump(found, f)
sys.exit(status)
