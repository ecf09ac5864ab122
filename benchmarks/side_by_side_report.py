"""Summaries and the markdown page of `python -m benchmarks.side_by_side` (before / after of hf_tiny)."""

from __future__ import annotations

import statistics

from .measure import MIB
from .workloads import DECODE

SIDES = ("before", "after")
MEMORY_RESOLUTION = MIB  # RSS is page-granular: the report's calibration reads 256 MiB within about 1 MiB


def spread(values: list) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def overlap(a: dict, b: dict) -> bool:
    return a["min"] <= b["max"] and b["min"] <= a["max"]


def summarize(row: dict) -> dict:
    """A measured row (side_by_side.measure_rows) as the report's JSON: per side the median over processes of
    each process's median time [min, max of those] (or peak bytes), after / before, and whether that is noise."""
    shape = row["shape"]
    out = {"model": row["model"], "case": row["case"], "shape": shape.label(), "kind": row["kind"]}
    runs = row["runs"]
    if row["kind"] == "memory":
        sides = {side: spread([r["peak_bytes"] for r in runs[side]]) for side in SIDES}
        difference = abs(sides["after"]["median"] - sides["before"]["median"])
        out["within_noise"] = difference <= MEMORY_RESOLUTION or overlap(sides["before"], sides["after"])
    else:
        sides = {side: time_side(runs[side]) for side in SIDES}
        out["within_noise"] = overlap(sides["before"], sides["after"])
        if row["case"] == DECODE:
            out["tokens_per_call"] = shape.batch * shape.new_tokens
            digests = {digest for side in SIDES for digest in sides[side]["token_digests"]}
            out["same_tokens"] = len(digests) == 1
    out["sides"] = sides
    out["after_over_before"] = sides["after"]["median"] / sides["before"]["median"]
    return out


def time_side(runs: list) -> dict:
    """One checkout's processes on a timed row: seconds (spread of the process medians, and every sample), minor
    page faults per call (median over processes of each one's median), operator counts, greedy tokens' digests."""
    side = spread([statistics.median(r["seconds"]) for r in runs])
    side["samples"] = [r["seconds"] for r in runs]
    side["faults"] = statistics.median(statistics.median(r["faults"]) for r in runs)
    side["ops"] = next((r["ops"] for r in runs if r.get("ops")), None)
    side["token_digests"] = sorted({r["tokens"] for r in runs if r.get("tokens")})
    return side


def render_markdown(results: dict) -> str:
    meta = results["meta"]
    rows = results["rows"]
    out = _header(meta)
    timed = [r for r in rows if r["kind"] == "time"]
    if timed:
        out += ["", "## Time per call (after / before < 1: after is faster)", ""] + _time_table(timed)
        out += _tokens_line(timed)
    counted = [r for r in timed if r["sides"]["before"]["ops"] and r["sides"]["after"]["ops"]]
    if counted:
        out += ["", "## Work per call, independent of machine load (aten calls: torch.profiler; Python calls: "
                    "cProfile; generate: per decode step)", ""] + _ops_table(counted)
    memory = [r for r in rows if r["kind"] == "memory"]
    if memory:
        out += ["", "## Peak memory above the loaded model (benchmarks/memory_probe.py: peak RSS in a fresh process, "
                    "two calls for a training step)", ""] + _memory_table(memory)
    return "\n".join(out) + "\n"


def _header(meta: dict) -> list[str]:
    out = [f"# hf_tiny before / after — {meta['device_name']} — {meta['date']}", ""]
    for side, checkout in meta["checkouts"].items():
        files = ", ".join(f"{name} from {path}" for name, path in checkout["files"].items())
        out.append(f"- {side}: `{checkout['path']}` at {checkout['git']} ({files})")
    allocator = ("glibc's mmap threshold raised first as in benchmarks.run" if meta["allocator"] == "run"
                 else "glibc's allocator as a new process has it")
    out += [
        f"- machine: {meta['device_name']}; {meta['cores']} cores, torch threads {meta['threads']}; torch "
        f"{meta['torch']}, transformers {meta['transformers']}, python {meta['python']}; harness (benchmarks/) at "
        f"{meta['harness']}",
        f"- method: mode **{meta['mode']}**, fp32, sdpa; per timed row {meta['repeats']} processes per checkout, "
        f"the checkouts alternating, each timing {meta['calls']} calls ({meta['clock']} clock) after one warm-up; "
        f"{allocator}; median over processes of each process's median [min–max of those]; within noise = the "
        f"two ranges overlap. Memory: {meta['memory_repeats']} processes per checkout; within noise = ranges "
        f"overlap or the medians differ by at most {MEMORY_RESOLUTION / MIB:.0f} MiB",
        f"- command: `{meta['command']}`; took {meta['elapsed_s'] / 60:,.1f} min",
    ]
    if meta.get("note"):
        out.append(f"- note: {meta['note']}")
    return out


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(cells) + " |" for cells in rows])


def _ms(row: dict, side: dict) -> str:
    text = f"{side['median'] * 1e3:,.1f} ms [{side['min'] * 1e3:,.0f}–{side['max'] * 1e3:,.0f}]"
    if row.get("tokens_per_call"):
        text += f" ({row['tokens_per_call'] / side['median']:,.1f} tok/s)"
    return text


def _time_table(rows: list) -> list[str]:
    cells = []
    for row in rows:
        before, after = row["sides"]["before"], row["sides"]["after"]
        cells.append([row["model"], row["case"], row["shape"], _ms(row, before), _ms(row, after),
                      f"{row['after_over_before']:.3f}", _yes(row["within_noise"]),
                      f"{before['faults']:,.0f} / {after['faults']:,.0f}"])
    return _table(["model", "case", "shape", "before", "after", "after / before", "within noise",
                   "page faults per call, before / after"], cells)


def _tokens_line(rows: list) -> list[str]:
    decoded = [r for r in rows if "same_tokens" in r]
    if not decoded:
        return []
    text = ", ".join(f"{r['model']} {r['shape']}: {_yes(r['same_tokens'])}" for r in decoded)
    return ["", f"Greedy tokens identical in every process of both checkouts: {text}."]


def _counts(before: float, after: float) -> list[str]:
    return [f"{before:,.0f}", f"{after:,.0f}", f"{after / before:.2f}"]


def _ops_table(rows: list) -> list[str]:
    cells = []
    for row in rows:
        before, after = row["sides"]["before"]["ops"], row["sides"]["after"]["ops"]
        unit = " per decode step" if row["case"] == DECODE else ""
        cells.append([row["model"], row["case"] + unit, row["shape"], *_counts(before["aten"], after["aten"]),
                      *_counts(before["python"], after["python"])])
    return _table(["model", "case", "shape", "aten calls before", "after", "ratio", "Python calls before", "after",
                   "ratio"], cells)


def _mib(side: dict) -> str:
    return f"{side['median'] / MIB:,.1f} MiB [{side['min'] / MIB:,.1f}–{side['max'] / MIB:,.1f}]"


def _memory_table(rows: list) -> list[str]:
    cells = [[row["model"], row["case"], row["shape"], _mib(row["sides"]["before"]), _mib(row["sides"]["after"]),
              f"{row['after_over_before']:.3f}", _yes(row["within_noise"])] for row in rows]
    return _table(["model", "case", "shape", "before", "after", "after / before", "within noise"], cells)


def _yes(value: bool) -> str:
    return "yes" if value else "**no**"

