"""The examples each ``vram`` subcommand's ``--help`` ends with (``vram --help`` shows them all)."""
from __future__ import annotations

EXAMPLES = {
    "replay": """\
  vram replay run.pickle                          replay under the recorded config, report peaks
  vram replay run.pickle --gpu 24GiB --context 500MiB
                                                  would this run have fit on a 24 GiB card?
  vram replay run.pickle --conf '' --conf expandable_segments:True --conf max_split_size_mb:128
                                                  compare allocator configs side by side
  vram replay run.pickle --verify                 check vram reproduces the recording exactly
  vram replay run.pickle --json                   one JSON object on stdout, for scripts
  vram replay state.pickle --alloc 2GiB           would a 2 GiB allocation succeed now?
  vram replay dumps/*.pickle --verify             a fleet: every file and device, in parallel on all cores
  vram replay dumps/*.pickle --cluster local      ... on a Dask LocalCluster (or --cluster tcp://host:8786)""",
    "summary": """\
  vram summary run.pickle                         torch.cuda.memory_summary() at the end of the trace
  vram summary run.pickle --at 1200               ... before event 1200""",
    "plot": """\
  vram plot run.pickle -o out.png                 memory over the trace, segment map at the peak
  vram plot run.pickle -o out.png --conf expandable_segments:True
                                                  overlay a what-if config's reserved memory""",
    "export": """\
  vram export rmm_log.csv -o run.pickle           any input -> a snapshot PyTorch's memory_viz opens
  vram export run.pickle -o run.json              the same data as JSON
  vram export big.pickle -o piece.pickle --from 200000 --to 500000
                                                  events [200000, 500000) with the state at 500000
  vram export big.pickle -o piece.pickle --from 30s --to 45s
                                                  the same by time from the first event (s, ms, us)""",
    "diff": """\
  vram diff real.pickle sim.pickle                a GPU's recording vs a `vram run` dump of the program
  vram diff a.pickle b.pickle --json              one JSON object on stdout""",
    "demo": """\
  vram demo                                       a tour on an 8 GiB simulated GPU
  vram demo --gpu T4 --conf expandable_segments:True""",
    "run": """\
  vram run --snapshot oom.pickle train.py        record the allocation history; after an OOM:
                                                  vram explain oom.pickle
  vram run --gpu 24GiB --context 500MiB train.py --epochs 1
                                                  script arguments follow the script
  vram run --nproc_per_node 8 --standalone train.py
                                                  as torchrun: 8 ranks, one simulated GPU each
  vram run --json -m mypackage.train             a module, as python -m; one JSON object on stdout
  vram run --html report.html train.py            a self-contained HTML report of the run
  vram run --gpu A100-80GB --summary train.py     a card; torch.cuda.memory_summary() at the end
  vram run --strict-values train.py               stop at the first read of an unknown value
  vram run --values real train.py                 compute every value on the CPU (data-dependent scripts)
  vram run --value-report values.json train.py    the placeholder reads as JSON""",
    "explain": """\
  vram explain oom.pickle                         the OOM: who allocated what, why it failed, fixes
  vram explain run.pickle --gpu 24GiB             ... on a 24 GiB card (else: the reserved peak)
  vram explain oom.pickle --json                  top_consumers, reserved_unallocated, fixes, ...""",
    "tune": """\
  vram tune run.pickle --gpu 24GiB                the allocator settings with the lowest peak reserved
  vram tune dumps/*.pickle --cluster local        one config for a fleet of OOM dumps, on Dask
  vram tune --gpu 24GiB -- train.py --batch 8     record the script once under vram run, then tune
  vram tune oom.pickle --json                     {"best": {"conf", "peak_reserved", "oom"}, "results"}""",
    "gpus": """\
  vram gpus                                       the cards --gpu accepts, CUDA's bytes for each""",
}
ESTIMATE = """\
  vram estimate mymodels:gpt2_small --input 8x512:int64
                        mymodels.gpt2_small() -> nn.Module, called with one int64 [8, 512] tensor
  vram estimate mymodels:gpt2_small --input 8x512:int64 --amp bf16 --optimizer adamw --gpu 24GiB
  vram estimate mymodels:Net --input 64x3x224x224 --dtype bf16 --checkpoint --grad-accum 4
  vram estimate mymodels:gpt2_small --input 8x512:int64 --gpu 24GiB --context 500MiB --max-batch
                        the largest first dimension (batch) that trains without OOM
  vram estimate models.py:build --input 32x128 --input 32x128:int64 --json
                        a file path works too; several --input: model(x1, x2)
  (mymodels.py ships in the repository's examples/ folder: run these from there)

MODULE:FACTORY is imported from the current directory or sys.path; FACTORY() (no arguments) returns
an nn.Module. It is called under torch.device("meta"), so building costs no memory. The step is
forward, loss = sum of the outputs, backward, optimizer.step(), zero_grad(set_to_none=True), run 3
times; figures are for the steady state (iterations 2-3). Exit status 0 when it fits, 1 when it
does not ("fits" in --json), 2 on errors."""
EXIT = {
    "diff": "exit status: 0 identical, 1 the snapshots differ, 2 error",
    "tune": "exit status: 0 a config runs without OOM, 1 every config runs out of memory, 2 error",
    "run": "exit status: the script's (1 for an uncaught exception, an OOM included), 2 vram's own errors",
}


def epilog(command: str) -> str:
    """The examples block of one subcommand's ``--help``."""
    text = "examples:\n" + (ESTIMATE if command == "estimate" else EXAMPLES[command]) + "\n"
    return text + ("\n" + EXIT[command] + "\n" if command in EXIT else "")


def _first(text: str) -> str:
    """The first example of a block: its line and the description lines that follow it."""
    lines = text.splitlines()
    end = 1
    while end < len(lines) and lines[end].startswith("   "):
        end += 1
    return "\n".join(lines[:end])


def overview() -> str:
    """``vram --help``'s examples: the first of each subcommand."""
    firsts = [_first(text) for text in EXAMPLES.values()]
    firsts.insert(5, ESTIMATE.splitlines()[0] + "\n" + " " * 50 + "predict a training step's memory")
    return "examples:\n" + "\n".join(firsts) + "\n"
