"""The text and HTML forms of `explain`'s and `tune`'s answers: what ``vram explain`` / ``vram
tune`` print, ``str()`` of their results, and the ``_repr_html_`` a notebook shows."""
from __future__ import annotations

from html import escape
from typing import Any

from vram.replay.messages import printable
from vram.units import format_size as f


def _shown(text: Any, limit: int = 200) -> str:
    return printable(str(text), limit)


def paste_line(conf: str) -> str:
    """The line to paste before the command that runs the program."""
    return f"PYTORCH_CUDA_ALLOC_CONF={conf}" if conf else "unset PYTORCH_CUDA_ALLOC_CONF  # the default is best"


def _moment(at: dict[str, Any]) -> str:
    return {"oom": f"the OOM at event {at['event_index']:,}",
            "state": "the state in the file (no allocation events)",
            "allocated_peak": f"the allocated peak (event {at['event_index']:,}; reserved memory is flat)",
            }.get(at["kind"], f"the reserved peak (event {at['event_index']:,})")


def explanation_text(ex: Any) -> str:
    """``vram explain``'s report of an `vram.analysis.explain.Explanation`."""
    at = ex.at
    lines = [f"{_shown(ex.path)}, device {ex.device}: {_moment(at)}"]
    if at["kind"] == "oom":
        lines.append("  " + _shown(at["message"], 2000))
        if at.get("frame"):
            lines.append(f"  requested at {_shown(at['frame'], 300)}")
    gpu = _shown(ex.gpu_from) if ex.gpu is None else f"{ex.gpu:,} B ({_shown(ex.gpu_from)})"
    lines += ["", f"GPU: {gpu}",
              f"allocated {f(ex.allocated)}, reserved {f(ex.reserved)}, reserved but unallocated "
              f"{f(ex.reserved_unallocated)}, largest free block {f(ex.largest_free_block)}", "",
              "top consumers (live tensors by the user's stack frame):"]
    for c in ex.top_consumers:
        lines.append(f"  {f(c['bytes']):>12}  {c['blocks']:>6,} blocks  {_shown(c['frame'], 300)}")
    if ex.free_by_pool:
        lines += ["", "free blocks by pool and stream:"]
        lines += [f"  {r['pool']:<5} stream {r['stream']:<4} {f(r['free_bytes']):>12} in {r['blocks']:,} blocks, "
                  f"largest {f(r['largest'])}" for r in ex.free_by_pool]
    lines += ["", "why:"] + [f"  - {w}" for w in ex.why]
    lines += ["", "what would have avoided it (each replayed through the whole recording):" if at["kind"] == "oom"
              else "what lowers the peak (each replayed through the whole recording):"]
    if not ex.fixes:
        lines.append("  nothing found")
    for fix in ex.fixes:
        mark = "verified" if fix["verified"] else "fails   "
        extra = f"  (peak reserved {f(fix['peak_reserved'])})" if "peak_reserved" in fix else ""
        lines.append(f"  [{mark}] {_shown(fix['change'], 400)}{extra}")
    return "\n".join(lines)


def explanation_repr(ex: Any) -> str:
    """One line: the moment, the memory there and how many fixes were verified."""
    verified = sum(1 for fix in ex.fixes if fix["verified"])
    return (f"<Explanation of {_shown(ex.path, 80)!r}, device {ex.device}: {_moment(ex.at)}; allocated "
            f"{f(ex.allocated)}, reserved {f(ex.reserved)}; {verified} of {len(ex.fixes)} fixes verified>")


def explanation_html(ex: Any) -> str:
    """A notebook's view of an explanation: the moment, the top consumers, why, the fixes."""
    rows = "".join(f"<tr><td style='text-align:right'>{escape(f(c['bytes']))}</td><td>{c['blocks']:,}</td>"
                   f"<td><code>{escape(str(c['frame']))}</code></td></tr>" for c in ex.top_consumers)
    fixes = "".join(f"<li>[{'verified' if fix['verified'] else 'fails'}] {escape(str(fix['change']))}</li>"
                    for fix in ex.fixes) or "<li>nothing found</li>"
    message = f"<pre>{escape(str(ex.at['message']))}</pre>" if ex.at["kind"] == "oom" else ""
    return (f"<div><b>{escape(str(ex.path))}</b>, device {ex.device}: {escape(_moment(ex.at))}{message}"
            f"<p>allocated {escape(f(ex.allocated))}, reserved {escape(f(ex.reserved))}, reserved but unallocated "
            f"{escape(f(ex.reserved_unallocated))}, largest free block {escape(f(ex.largest_free_block))}</p>"
            f"<table><tr><th>bytes</th><th>blocks</th><th>where</th></tr>{rows}</table>"
            f"<p>why:</p><ul>{''.join(f'<li>{escape(w)}</li>' for w in ex.why)}</ul>"
            f"<p>fixes (each replayed through the whole recording):</p><ul>{fixes}</ul></div>")


def ranked_rows(result: Any, top: int) -> list[tuple[int, str, str, str, str, str]]:
    """The `top` ranked rows, and the default config's wherever it ranks (it is always shown):
    (rank, peak reserved, against the default, OOM, cudaMalloc calls, config)."""
    # the default config, or (when it could not be replayed: see the notes) the first row
    base = next((r for r in result.results if r["conf"] == ""), result.results[0])
    shown = result.results[:top]
    if base not in shown:
        shown = shown + [base]
    out = []
    for r in shown:
        delta = r["peak_reserved"] - base["peak_reserved"]
        out.append((result.results.index(r) + 1, f(r["peak_reserved"]), ("-" if delta < 0 else "+") + f(abs(delta)),
                    "yes" if r["oom"] else "no", f"{r['segment_allocs']:,}", _shown(r["conf"] or "(default)", 200)))
    return out


def _no_fit(result: Any) -> list[str]:
    """What tune says when every config runs out of memory: no best, and what the least
    demanding one needs."""
    lines = [f"no config fits: every one of the {len(result.results)} tried runs out of memory (a peak "
             "reserved above is where it failed, not what it needs)"]
    least = result.least_demanding
    if least is not None:
        lines.append(f"the least demanding found, {_shown(least['conf'] or '(default)', 200)}, needs "
                     f"{'at least ' if least.get('lower_bound') else ''}{f(least['more'])} more: it fits in "
                     f"{least['gpu']:,} B for PyTorch (checked by replay)" + (
                         "; the recording stops at the failure, so what the program needs after it is not in it"
                         if least.get("lower_bound") else ""))
    return lines


def tune_text(result: Any, top: int = 15) -> str:
    """``vram tune``'s report of a `vram.analysis.tune.TuneResult`."""
    lines = []
    for p, b in zip(result.snapshots, result.budgets):
        gpu = (f"with room, under a per-process cap of {b.cap:,} B" if b.cap is not None else "unlimited"
               if b.gpu is None else f"{b.gpu:,} B" if isinstance(b.gpu, int) else b.gpu)
        lines.append(f"{_shown(p)}: GPU {gpu} ({_shown(b.why)})")
    lines.append(f"\n{'rank':>4}  {'peak reserved':>14}  {'vs default':>11}  {'OOM':<4} {'cudaMalloc':>10}  config")
    for k, peak, delta, oom, mallocs, conf in ranked_rows(result, top):
        lines.append(f"{k:>4}  {peak:>14}  {delta:>11}  {oom:<4} {mallocs:>10}  {conf}")
    lines += [f"note: {_shown(note, 400)}" for note in result.notes]
    best = result.best
    if best is None:
        return "\n".join([*lines, "", *_no_fit(result)])
    lines.append(f"\nbest: {paste_line(best['conf'])}")
    if "per_process_memory_fraction" in best["conf"]:
        lines.append("(per_process_memory_fraction in PYTORCH_CUDA_ALLOC_CONF needs a recent PyTorch; else call "
                     "torch.cuda.set_per_process_memory_fraction)")
    return "\n".join(lines)


def tune_repr(result: Any) -> str:
    best = result.best
    if best is None:
        return f"<TuneResult: no config fits; {len(result.results)} configs replayed>"
    return (f"<TuneResult: best {paste_line(best['conf'])!r}, peak reserved {f(best['peak_reserved'])}; "
            f"{len(result.results)} configs replayed>")


def tune_html(result: Any, top: int = 15) -> str:
    """A notebook's view of a tuning: the ranked configs and the line to paste."""
    rows = "".join(f"<tr><td>{row[0]}</td>" + "".join(f"<td>{escape(c)}</td>" for c in row[1:5])
                   + f"<td><code>{escape(row[5])}</code></td></tr>" for row in ranked_rows(result, top))
    answer = (f"<p>best: <code>{escape(paste_line(result.best['conf']))}</code></p>" if result.best is not None
              else "".join(f"<p>{escape(line)}</p>" for line in _no_fit(result)))
    return (f"<div><table><tr><th>rank</th><th>peak reserved</th><th>vs default</th><th>OOM</th>"
            f"<th>cudaMalloc</th><th>config</th></tr>{rows}</table>{answer}</div>")
