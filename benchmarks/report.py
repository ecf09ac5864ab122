"""Renders a results dict (see run.py) as a markdown report and a PNG plot."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from . import fresh_process, vllm_rows
from .measure import GROUPS, MIB
from .models import HF_TINY, OFFICIAL
from .workloads import DECODE, DECODE_COMPILED, PREFILL, TRAIN

# Issue 17's targets, hf_tiny / official: (ratio name, comparison, bound). Memory of a training step has its own
# bound (the chunked loss and the recomputed activations); other memory rows must simply not be worse.
TARGETS = {
    PREFILL: ("time", "<=", 0.95),
    TRAIN: ("time", "<=", 1.00),
    DECODE: ("tokens/s", ">=", 1.20),
    DECODE_COMPILED: ("tokens/s", ">=", 1.20),
    "memory": ("peak", "<=", 1.00),
    "memory " + TRAIN: ("peak", "<=", 0.60),
}


def memory_target_key(case: str) -> str:
    return "memory " + case if "memory " + case in TARGETS else "memory"


def _met(ratio: Optional[float], key: str) -> str:
    if ratio is None:
        return "—"
    _, op, bound = TARGETS[key]
    ok = ratio <= bound if op == "<=" else ratio >= bound
    return "yes" if ok else "no"


def _target_text(key: str) -> str:
    _, op, bound = TARGETS[key]
    return f"{'≤' if op == '<=' else '≥'} {bound:.2f}"


def _fmt_time(timing: Optional[dict]) -> str:
    if not timing:
        return "—"
    median, low, high = timing["median_s"], timing["min_s"], timing["max_s"]
    return f"{median * 1e3:,.1f} ms [{low * 1e3:,.0f}–{high * 1e3:,.0f}]"


def _fmt_rate(timing: Optional[dict], units: float) -> str:
    if not timing:
        return "—"
    slowest, fastest = units / timing["max_s"], units / timing["min_s"]
    return f"{units / timing['median_s']:,.1f} tok/s [{slowest:,.1f}–{fastest:,.1f}]"


def case_ratio(row: dict) -> Optional[float]:
    """hf_tiny / official: of time for prefill and training, of tokens/s for generate."""
    off, ours = row["timings"].get(OFFICIAL), row["timings"].get(HF_TINY)
    if not off or not ours:
        return None
    if row["case"] in (DECODE, DECODE_COMPILED):
        return off["median_s"] / ours["median_s"]
    return ours["median_s"] / off["median_s"]


def memory_ratio(row: dict) -> Optional[float]:
    off, ours = row.get(OFFICIAL), row.get(HF_TINY)
    if not isinstance(off, (int, float)) or not isinstance(ours, (int, float)) or off <= 0:
        return None
    return ours / off


def _speed_table(results: dict) -> list[str]:
    lines = [
        "| model | case | shape | official | hf_tiny | hf_tiny/official | target | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["cases"]:
        off, ours = row["timings"].get(OFFICIAL), row["timings"].get(HF_TINY)
        if row["case"] in (DECODE, DECODE_COMPILED):
            cells = [_fmt_rate(off, row["tokens"]), _fmt_rate(ours, row["tokens"])]
            name = "generate (tokens/s)" if row["case"] == DECODE else "generate, static cache + torch.compile (tokens/s)"
        else:
            cells = [_fmt_time(off), _fmt_time(ours)]
            name = "prefill forward" if row["case"] == PREFILL else "train step (fwd+bwd+AdamW)"
        ratio = case_ratio(row)
        ratio_text = "—" if ratio is None else f"{ratio:.2f}"
        lines.append(
            f"| {row['model']} | {name} | {row['shape']} | {cells[0]} | {cells[1]} | {ratio_text} | "
            f"{_target_text(row['case'])} | {_met(ratio, row['case'])} |"
        )
    return lines


def _calls_table(results: dict) -> list[str]:
    lines = [
        "| model | case | shape | aten calls official | hf_tiny | ratio | Python calls official | hf_tiny | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cells(counts: dict) -> str:
        off, ours = counts.get(OFFICIAL), counts.get(HF_TINY)
        text = ["—" if v is None else f"{v:,.0f}" for v in (off, ours)]
        return f"{text[0]} | {text[1]} | " + (f"{ours / off:.2f}" if off and ours else "—")

    for row in results["cases"]:
        calls = row.get("calls")
        if not calls:
            continue
        unit = " per decode step" if row["case"] == DECODE else ""
        lines.append(
            f"| {row['model']} | {row['case']}{unit} | {row['shape']} | {cells(calls['aten'])} | {cells(calls['python'])} |"
        )
    return lines


def _step_profile_table(results: dict) -> list[str]:
    lines = [
        "| model | shape | side | profiled ms/step | " + " | ".join(GROUPS) + " | weight products GB/s |",
        "|---|---|---|---|" + "---|" * len(GROUPS) + "---|",
    ]
    for row in results["cases"]:
        for impl, step in (row.get("step_profile") or {}).items():
            wall = step["wall"]
            groups = " | ".join(f"{step[g]:.1f} ({step[g] / wall:.0%})" if wall else f"{step[g]:.1f}" for g in GROUPS)
            products = step["weight matmuls"]
            rate = f"{row['step_weight_bytes'] / products / 1e6:.1f}" if products else "—"  # bytes / ms -> GB/s
            lines.append(f"| {row['model']} | {row['shape']} | {impl} | {wall:.1f} | {groups} | {rate} |")
    return lines


def _mem_cell(value) -> str:
    if isinstance(value, (int, float)):
        return f"{value / MIB:,.1f} MiB"
    return f"error: {value}" if value else "—"


def _memory_table(results: dict) -> list[str]:
    lines = [
        "| model | case | shape | official | hf_tiny | hf_tiny/official | target | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["memory"]:
        ratio = memory_ratio(row)
        ratio_text = "—" if ratio is None else f"{ratio:.2f}"
        lines.append(
            f"| {row['model']} | {row['case']} | {row['shape']} | {_mem_cell(row.get(OFFICIAL))} | "
            f"{_mem_cell(row.get(HF_TINY))} | {ratio_text} | {_target_text(memory_target_key(row['case']))} | "
            f"{_met(ratio, memory_target_key(row['case']))} |"
        )
    return lines


def roofline_rows(results: dict) -> list[dict]:
    ceilings = results["ceilings"]
    rows = []
    for row in results["cases"]:
        if not row.get("roofline", True):
            continue
        for impl in (OFFICIAL, HF_TINY):
            timing = row["timings"].get(impl)
            if not timing:
                continue
            seconds = timing["median_s"]
            peak, bandwidth = ceilings["gemm"]["flops_per_s"], ceilings["bandwidth"]["read_bytes_per_s"]
            common = dict(model=row["model"], case=row["case"], shape=row["shape"], impl=impl, seconds=seconds,
                          flops_per_s=row["flops"] / seconds)
            if row["case"] in (DECODE, DECODE_COMPILED):
                achieved = row["bytes"] / seconds
                # Roofline time: the slower of moving the bytes at full bandwidth and doing the FLOPs at GEMM peak.
                bound = max(row["bytes"] / bandwidth, row["flops"] / peak)
                rows.append(dict(common, kind="bytes", work=row["bytes"], achieved=achieved,
                                 fraction=achieved / bandwidth, bound_s=bound))
            else:
                achieved = row["flops"] / seconds
                rows.append(dict(common, kind="flops", work=row["flops"], achieved=achieved,
                                 fraction=achieved / peak, bound_s=row["flops"] / peak))
    return rows


def _roofline_table(results: dict) -> list[str]:
    gemm, bw = results["ceilings"]["gemm"], results["ceilings"]["bandwidth"]
    lines = [
        f"Ceilings measured in this run (fastest of 7 calls, at the start and at the end of the run): GEMM peak **{gemm['flops_per_s'] / 1e9:,.1f} GFLOP/s** "
        f"({gemm['n']}×{gemm['n']} {gemm['dtype']} torch.matmul); memory bandwidth **{bw['read_bytes_per_s'] / 1e9:,.1f} GB/s** "
        f"read (sum over {bw['megabytes']} MiB), {bw['copy_bytes_per_s'] / 1e9:,.1f} GB/s copy (read + write).",
        "",
        "Prefill and training: achieved FLOP/s against the GEMM peak. Generate: bytes/s (weights + K/V read per "
        "token) against the read bandwidth; its roofline time is the slower of the byte and FLOP bounds.",
        "",
        "| model | case | shape | impl | work | achieved | of ceiling | roofline time / measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in roofline_rows(results):
        if r["kind"] == "bytes":
            work = f"{r['work'] / 1e9:,.2f} GB read"
            achieved = f"{r['achieved'] / 1e9:,.2f} GB/s ({r['flops_per_s'] / 1e9:,.1f} GFLOP/s)"
        else:
            work, achieved = f"{r['work'] / 1e9:,.1f} GFLOP", f"{r['achieved'] / 1e9:,.1f} GFLOP/s"
        lines.append(
            f"| {r['model']} | {r['case']} | {r['shape']} | {r['impl']} | {work} | {achieved} | "
            f"{r['fraction'] * 100:.0f}% | {r['bound_s'] / r['seconds'] * 100:.0f}% |"
        )
    return lines


def _sweep_table(sweep: dict) -> list[str]:
    backends = list(sweep["backends"])
    lines = [
        f"hf_tiny {sweep['model']}, prefill forward, batch {sweep['batch']}, median ms "
        f"(ratio to sdpa in brackets):",
        "",
        "| tokens | " + " | ".join(backends) + " |",
        "|---|" + "---|" * len(backends),
    ]
    for i, length in enumerate(sweep["lengths"]):
        sdpa = sweep["backends"].get("sdpa", [None] * len(sweep["lengths"]))[i]
        cells = []
        for name in backends:
            value = sweep["backends"][name][i]
            if value is None:
                cells.append(sweep.get("errors", {}).get(f"{name}@{length}", "—"))
            elif sdpa and name != "sdpa":
                cells.append(f"{value * 1e3:,.1f} ({value / sdpa:.2f}×)")
            else:
                cells.append(f"{value * 1e3:,.1f}")
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    return lines


def render_markdown(results: dict) -> str:
    out = _header(results)
    out += ["", "## Speed (hf_tiny / official: time for prefill and training, tokens/s for generate)", ""]
    out += _speed_table(results)
    out += _agreement_line(results)
    if results.get("fresh_process"):
        out += ["", "## Prefill with each side alone in a fresh process", "", FRESH_PROCESS_TEXT, ""]
        out += fresh_process.markdown_rows(results["fresh_process"])
    if any(row.get("calls") for row in results["cases"]):
        out += ["", "## Work per call, independent of machine load (aten calls: torch.profiler; Python calls: cProfile)", ""]
        out += _calls_table(results)
    out += _step_profile_section(results)
    out += _memory_section(results)
    out += ["", "## Roofline", ""]
    out += _roofline_table(results)
    if results.get("vllm"):
        out += ["", "## Served by vLLM", ""] + vllm_rows.markdown_lines(results["vllm"])
    if results.get("sweep"):
        out += ["", "## hf_tiny attention backends across sequence lengths", ""]
        out += _sweep_table(results["sweep"])
    return "\n".join(out) + "\n"


FRESH_PROCESS_TEXT = (
    "Each side timed in its own interpreter (one process per side and repeat, alternating; the median of "
    "each process's timed calls after one warm-up, then the median over processes), with the minor page "
    "faults per call. The interleaved rows above share one process, whose allocator state both sides and "
    "the harness set for each other (glibc's mmap threshold: the GEMM-peak measurement's matrices raise it "
    "before any row runs); a process that runs only the model, as a user's does, is this one "
    "(`python -m benchmarks.fresh_process`)."
)


def _header(results: dict) -> list[str]:
    """The title and the run's settings, then one line per model (same-weights check, notes, errors)."""
    meta = results["meta"]
    out = [
        f"# hf_tiny vs transformers — {meta['device_name']} — {meta['date']}",
        "",
        f"- machine: {meta['device_name']}; {meta['cores']} cores, torch threads {meta['threads']}; "
        f"torch {meta['torch']}, transformers {meta['transformers']}, python {meta['python']}",
        f"- hf_tiny commit {meta['git']}; mode **{meta['mode']}**; dtype {meta['dtype']}; attention backend "
        f"`{meta['attn']}` on both sides; median {meta.get('clock', 'wall time')} of {meta['repeats']} timed runs after {meta['warmup']} warm-up, "
        "the two sides interleaved; [min–max] in brackets",
        f"- command: `{meta['command']}`",
    ]
    if meta.get("note"):
        out.append(f"- note: {meta['note']}")
    for name, info in results["models"].items():
        diff = info.get("same_weights_max_abs_diff")
        diff_text = "n/a" if diff is None else f"{diff:.2e}"
        extra = "; ".join(info.get("notes", []) + [f"{k}: {v}" for k, v in info.get("errors", {}).items()])
        out.append(
            f"- {name}: {info['description']}; {info.get('params', 0) / 1e6:,.1f}M params; "
            f"same weights: max |official − hf_tiny| output = {diff_text}" + (f"; {extra}" if extra else "")
        )
    return out


def _agreement_line(results: dict) -> list[str]:
    agreement = [r for r in results["cases"] if r.get("token_agreement") is not None]
    if not agreement:
        return []
    text = ", ".join(
        f"{r['model']} {r['shape']}{' compiled' if r['case'] == DECODE_COMPILED else ''}: "
        f"{r['token_agreement'] * 100:.0f}%"
        for r in agreement
    )
    return ["", f"Greedy tokens identical between the two sides: {text}."]


def _step_profile_section(results: dict) -> list[str]:
    profiled = [row for row in results["cases"] if row.get("step_profile")]
    if not profiled:
        return []
    steps = profiled[0]["step_profile_steps"]
    return ["", "## Where a decode step's time goes (torch.profiler self times, ms per step)", "",
            f"A generate of {steps + 1} tokens minus one of 1 token (the prefill drops out), over {steps} steps. "
            "Weight products: "
            "aten mm / addmm, and bmm / baddbmm outside attention (hf_tiny's one-row product); the weights read "
            "per step over their time is the bandwidth those products reach (compare the read bandwidth under "
            "Roofline). The profiler slows Python, so \"outside aten ops\" is overstated and a profiled step is "
            "slower than a timed one.", ""] + _step_profile_table(results)


def _memory_section(results: dict) -> list[str]:
    if not results["memory"]:
        return []
    out = ["", f"## Peak memory above the loaded model ({results['memory_method']})", ""]
    out += _memory_table(results)
    cal = results.get("calibration")
    if cal and "peak_bytes" in cal:
        out += ["", f"Method check: allocating {cal['expected_bytes'] / MIB:,.0f} MiB reads as "
                    f"{cal['peak_bytes'] / MIB:,.1f} MiB; RSS is page-granular, so differences below about "
                    "1 MiB are within the method's resolution."]
    return out


def render_plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = results.get("sweep")
    bar_count = len(results["cases"]) + len(results["memory"])
    fig, axes = plt.subplots(1, 3 if sweep else 2, figsize=(19 if sweep else 13, max(5.0, 0.32 * bar_count + 2)),
                             gridspec_kw={"width_ratios": [1.3, 1, 0.8] if sweep else [1.3, 1]})
    meta = results["meta"]
    fig.suptitle(f"hf_tiny vs transformers — {meta['device_name']} — {meta['dtype']} — {meta['date']} ({meta['mode']})")
    _plot_advantage(axes[0], results)
    _plot_roofline(axes[1], results)
    if sweep:
        _plot_sweep(axes[2], sweep)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _advantages(results: dict) -> tuple[list, list, list]:
    """(labels, hf_tiny's advantage, the target's advantage) per bar: > 1 is better for hf_tiny."""
    labels, values, goals = [], [], []
    for row in results["cases"]:
        ratio = case_ratio(row)
        if ratio is None:
            continue
        labels.append(f"{row['model']} {row['case']} {row['shape']}")
        decode = row["case"] in (DECODE, DECODE_COMPILED)
        values.append(ratio if decode else 1 / ratio)
        bound = TARGETS[row["case"]][2]
        goals.append(bound if decode else 1 / bound)
    for row in results["memory"]:
        ratio = memory_ratio(row)
        if ratio is None:
            continue
        labels.append(f"{row['model']} peak memory {row['case']} {row['shape']}")
        values.append(1 / ratio)
        goals.append(1.0)
    return labels, values, goals


def _plot_advantage(ax, results: dict) -> None:
    """hf_tiny's advantage per row, > 1 is better, with each target as a marker."""
    labels, values, goals = _advantages(results)
    if values:
        ys = range(len(values))
        ax.barh(list(ys), values, color=["tab:green" if v >= g else "tab:red" for v, g in zip(values, goals)])
        ax.scatter(goals, list(ys), marker="|", s=300, color="black", label="target", zorder=3)
        ax.set_yticks(list(ys), labels, fontsize=7)
        ax.invert_yaxis()
        ax.axvline(1.0, color="grey", lw=0.8)
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel("official / hf_tiny (time, peak memory) or hf_tiny / official (tok/s)")
    ax.set_title("hf_tiny advantage: > 1 is better; | = target", fontsize=9)


def _plot_roofline(ax, results: dict) -> None:
    """Each side's fraction of the measured ceiling per row."""
    rows = roofline_rows(results)
    if not rows:
        return
    names = list(dict.fromkeys((r["model"], r["case"], r["shape"]) for r in rows))  # first-seen order
    width = 0.4
    for offset, impl, color in ((-width / 2, OFFICIAL, "tab:blue"), (width / 2, HF_TINY, "tab:orange")):
        fractions = []
        for key in names:
            match = [r for r in rows if (r["model"], r["case"], r["shape"]) == key and r["impl"] == impl]
            fractions.append(match[0]["fraction"] * 100 if match else 0)
        ax.bar([i + offset for i in range(len(names))], fractions, width, label=impl, color=color)
    ax.set_xticks(range(len(names)), [f"{m} {c} {s}" for m, c, s in names], fontsize=7, rotation=35, ha="right")
    ax.set_ylabel("% of measured ceiling")
    ax.set_title("roofline: GEMM peak (prefill, train), read bandwidth (generate)", fontsize=9)
    ax.legend(fontsize=8)


def _plot_sweep(ax, sweep: dict) -> None:
    """hf_tiny's backends across sequence lengths."""
    for name, values in sweep["backends"].items():
        points = [(n, v * 1e3) for n, v in zip(sweep["lengths"], values) if v is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens (batch 1)")
    ax.set_ylabel("prefill ms (median)")
    ax.set_title(f"hf_tiny {sweep['model']} backends", fontsize=9)
    ax.legend(fontsize=8)


def write_result(lines: list[str], output: Path) -> Path:
    """A results page: written to `output` (folders made) and printed."""
    text = "\n".join(lines) + "\n"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    print(text)
    return output
