"""The GPU check's page: issue 42's targets beside their measured values (PASS / FAIL / not run), the rows side by
side, decode against the measured HBM bandwidth, host work, the longest trainable sequence and the stages' times.
Reads what benchmarks.gpu_check collected; measures nothing."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from . import roofline
from .models import LLAMA_1B_CONFIG, TINY_CONFIG
from .workloads import Shape

MIB = 1024 * 1024
SIDES = ("official", "hf_tiny", "hf_tiny_off")
SIDE_TITLES = {"official": "official", "hf_tiny": "hf_tiny", "hf_tiny_off": "hf_tiny, runtime off",
               "hf_tiny_fit": "hf_tiny, fit_memory on"}
# The fit_memory option's cost where a step fits (its training row against hf_tiny's plain one): at most this much
# slower, or it does not become a default (hf_tiny/memory_fit.py)
FIT_MEMORY_COST = 1.02
CONFIGS = {"llama1b": LLAMA_1B_CONFIG, "tiny": TINY_CONFIG}
BANDWIDTH_SHARE = 0.40  # batch-1 captured decode, of the measured HBM read bandwidth
TRAIN_TIME, TRAIN_MEMORY, LONGEST_FACTOR = 0.85, 0.60, 3.0


def test_summary(log: Path) -> dict:
    """{"log": name, "summary": pytest's last summary line} of one pytest log (or why there is none)."""
    if not log.is_file():
        return {"log": log.name, "summary": "no log (not run)"}
    lines = [line.strip("= \n") for line in log.read_text(errors="replace").splitlines()]
    found = [line for line in lines if re.search(r"\d+ (passed|failed|error|skipped)", line)]
    if found:
        return {"log": log.name, "summary": found[-1]}
    # a verbose run cut at its cap: what its per-test lines ("[gw3] [ 90%] PASSED tests/...") reached
    outcomes = re.findall(r"\b(PASSED|FAILED|SKIPPED|ERROR) tests/", "\n".join(lines))
    reached = ", ".join(f"{outcomes.count(o)} {o.lower()}" for o in ("PASSED", "FAILED", "SKIPPED", "ERROR")
                        if o in outcomes)
    return {"log": log.name, "summary": f"no summary line (cut off?): {reached or ' | '.join(lines[-2:])}"}


def failed_tests(log: Path) -> list[str]:
    """The test ids in a failures log (tests/conftest.py's HF_TINY_FAILURE_LOG), in the order they failed."""
    if not log.is_file():
        return []
    return re.findall(r"^=== FAILED (\S+)", log.read_text(errors="replace"), flags=re.MULTILINE)


def device_name(results: dict) -> str:
    built = results["rows"].get("build", {}).get("both", {})
    return built.get("device_name") or ("cpu" if results["meta"]["dry_run"] else "cuda")


# ---- reading the rows --------------------------------------------------------------------------------------------

def cell(results: dict, row: str, side: str) -> dict:
    return results["rows"].get(row, {}).get(side, {"status": "not run"})


def measured(entry: dict) -> bool:
    return "seconds" in entry or "python_calls" in entry or "longest" in entry


def status_of(entry: dict) -> str:
    return entry.get("status", "no result")


def speed(entry: dict) -> float:
    """Work per second: tokens/s for decode, calls per second otherwise."""
    return entry["tokens_per_s"] if "tokens_per_s" in entry else 1.0 / entry["seconds"]


def ratio(results: dict, row: str, key, ours: str = "hf_tiny", theirs: str = "official") -> Optional[float]:
    """key(hf_tiny's cell) / key(official's cell), None when either was not measured or the key is missing."""
    a, b = cell(results, row, ours), cell(results, row, theirs)
    if not (measured(a) and measured(b)):
        return None
    x, y = key(a), key(b)
    return None if x is None or y is None or y == 0 else x / y


def why_missing(results: dict, row: str, sides=("hf_tiny", "official")) -> str:
    for side in sides:
        entry = cell(results, row, side)
        if not measured(entry):
            return f"{SIDE_TITLES[side]}: {status_of(entry)}"
    return "not measured"


def extra_bytes(entry: dict) -> Optional[float]:
    return entry.get("extra_bytes")


def bandwidth(results: dict) -> Optional[float]:
    """The best HBM read bandwidth measured (bytes/s) by any job's ceilings."""
    found = [e["bandwidth"]["read_bytes_per_s"] for e in results["rows"].get("ceilings", {}).values() if "bandwidth" in e]
    return max(found) if found else None


def decode_bytes_per_s(results: dict, label: str, entry: dict) -> Optional[float]:
    """Minimum bytes a generate reads (roofline.generate_bytes: weights every step + the K/V so far) per second."""
    if "seconds" not in entry:
        return None
    plan = results["meta"]["plan"]
    arch = roofline.Arch.from_config(SimpleNamespace(**CONFIGS[plan["model"]]), "causal")
    shape = decode_shape(label)
    per_value = 2 if plan["dtype"] in ("bfloat16", "float16") else 4
    total = roofline.generate_bytes(arch, batch=shape.batch, prompt=shape.seq, new_tokens=shape.new_tokens,
                                    bytes_per_value=per_value)
    return total / entry["seconds"]


def decode_shape(label: str) -> Shape:
    """The Shape of a decode row's label ("decode 1x32 +128 new captured")."""
    batch, seq, new = map(int, re.match(r"decode (\d+)x(\d+) \+(\d+) new", label).groups())
    return Shape(batch, seq, new)


# ---- the targets -------------------------------------------------------------------------------------------------

def verdict(value: Optional[float], ok) -> str:
    return "not run" if value is None else ("PASS" if ok(value) else "FAIL")


def times(value: float, bound: float = 1.0) -> str:
    """value as "0.93x", with more digits where two would print the bound itself (0.9994 -> "0.999x", never a
    "1.00x" beside FAIL)."""
    for digits in (2, 3, 4):
        text = f"{value:.{digits}f}"
        if value == bound or float(text) != bound:
            return text + "x"
    return f"{value:.6f}x"


def host_targets(results: dict) -> list:
    rows = []
    for label, title in (("host prefill", "prefill"), ("host decode step", "decode step")):
        value = ratio(results, label, lambda e: e["python_calls"])
        text = why_missing(results, label) if value is None else (
            f"{cell(results, label, 'hf_tiny')['python_calls']:,.0f} / {cell(results, label, 'official')['python_calls']:,.0f}"
            f" = {times(value)}")
        rows.append((f"Host work: {title} Python calls <= 1.0x official's", text, verdict(value, lambda v: v <= 1.0)))
    return rows


def row_labels(results: dict) -> list[str]:
    """The side-by-side rows of the run's plan, in the plan's order."""
    plan = results["meta"]["plan"]
    shapes = lambda key: [Shape(*s) for s in plan[key]]  # noqa: E731
    train = Shape(*plan["train"]).label()
    return ([f"prefill {s.label()}{paired}" for paired in ("", " paired") for s in shapes("prefill")]
            + [f"decode {s.label()} {mode}" for mode in ("eager", "eager paired", "captured") for s in shapes("decode")]
            + [f"train {train}", f"train {train} liger", f"train {train} liger paired", f"train {train} recompute",
               f"train {train} fit_memory", f"train {train} liger rebuild"])


def row_targets(results: dict) -> list:
    """Every row (runtime on, Liger on both sides in the Liger row): >= 1.0x official's speed at <= 1.0x memory."""
    rows = []
    for label in row_labels(results):
        if label.endswith(("recompute", "fit_memory", "rebuild")):
            continue  # opt-in switches: in the side-by-side table, fit_memory and rebuild in their own targets
        faster = ratio(results, label, speed)
        memory = ratio(results, label, extra_bytes)
        if faster is None:
            text, status = why_missing(results, label), "not run"
        else:
            memory_text = "memory not measured" if memory is None else f"memory {times(memory)}"
            text = f"speed {times(faster)}, {memory_text}"
            status = "PASS" if faster >= 1.0 and (memory is None or memory <= 1.0) else "FAIL"
        rows.append((f"{label}: >= 1.0x official's speed at <= 1.0x its memory", text, status))
    return rows


def decode_targets(results: dict) -> list:
    plan = results["meta"]["plan"]
    label = f"decode {Shape(*plan['decode'][0]).label()} captured"
    ours, read = cell(results, label, "hf_tiny"), bandwidth(results)
    share = None if read is None or not measured(ours) else decode_bytes_per_s(results, label, ours) / read
    text = why_missing(results, label, ("hf_tiny",)) if share is None else (
        f"{decode_bytes_per_s(results, label, ours) / 1e9:,.1f} GB/s of {read / 1e9:,.0f} GB/s = {share:.0%}")
    rows = [(f"Batch-1 captured decode >= {BANDWIDTH_SHARE:.0%} of the measured HBM read bandwidth", text,
             verdict(share, lambda v: v >= BANDWIDTH_SHARE))]
    official = cell(results, label, "official")
    if measured(ours) and not measured(official) and not status_of(official).startswith("not "):
        # official's job ran and failed (crashed, timed out): ours running at all is the target
        rows.append(("Batch-1 captured decode >= official's (where official's runs)",
                     f"official's failed: {status_of(official)}", "PASS"))
    else:
        value = ratio(results, label, speed)
        rows.append(("Batch-1 captured decode >= official's (where official's runs)",
                     why_missing(results, label) if value is None else f"{times(value)} official's tokens/s",
                     verdict(value, lambda v: v >= 1.0)))
    return rows


def train_targets(results: dict) -> list:
    """4x2048: Liger on ours against none on official's (time, memory); Liger on both (time)."""
    train = Shape(*results["meta"]["plan"]["train"]).label()
    plain, liger = f"train {train}", f"train {train} liger"
    ours = cell(results, liger, "hf_tiny")
    rows = []
    for title, key, bound in ((f"time <= {TRAIN_TIME}x", lambda e: e["seconds"], TRAIN_TIME),
                              (f"peak memory <= {TRAIN_MEMORY}x", extra_bytes, TRAIN_MEMORY)):
        name = f"Training {train}: {title} official's, Liger on ours, none on official's"
        if not measured(ours) or not measured(cell(results, plain, "official")):
            fallback = _ratio_between(results, plain, plain, key)
            note = "" if fallback is None else f"; without Liger on either side: {fallback:.2f}x"
            rows.append((name, why_missing(results, liger, ("hf_tiny",)) if not measured(ours)
                         else why_missing(results, plain, ("official",)) + note, "not run"))
            continue
        value = _ratio_between(results, liger, plain, key)
        rows.append((name, "memory not measured" if value is None else times(value, bound),
                     verdict(value, lambda v: v <= bound)))
    rows.append(liger_both_sides_target(results, train))
    return rows


def liger_both_sides_target(results: dict, train: str) -> tuple:
    """Liger on both sides: from the paired row (both steps in one process, interleaved) where it was measured,
    else from the two sides' separate liger rows."""
    name = f"Training {train}, Liger on both sides: no slower than official"
    separate = f"train {train} liger"
    for row, how in ((f"{separate} paired", " (interleaved in one process)"), (separate, "")):
        value = ratio(results, row, lambda e: e["seconds"])
        if value is not None:
            return name, f"{times(value)} official's time{how}", verdict(value, lambda v: v <= 1.0)
    return name, why_missing(results, separate), "not run"


def _ratio_between(results: dict, our_row: str, their_row: str, key) -> Optional[float]:
    a, b = cell(results, our_row, "hf_tiny"), cell(results, their_row, "official")
    if not (measured(a) and measured(b)) or key(a) is None or key(b) in (None, 0):
        return None
    return key(a) / key(b)


def longest_target(results: dict) -> tuple:
    name = f"Longest trainable sequence at batch 1 >= {LONGEST_FACTOR:.0f}x official's"
    ours, theirs = cell(results, "longest batch 1", "hf_tiny"), cell(results, "longest batch 1", "official")
    if not (measured(ours) and measured(theirs)) or not theirs["longest"]:
        return name, why_missing(results, "longest batch 1"), "not run"
    value = ours["longest"] / theirs["longest"]
    text = (f"{ours['longest']:,} / {theirs['longest']:,} tokens = {times(value, LONGEST_FACTOR)} (hf_tiny: {ours['stopped']}; "
            f"official: {theirs['stopped']})")
    if not theirs["stopped"].startswith("fails at"):
        return name, text + " — official's search did not reach its limit", "not run"
    if value < LONGEST_FACTOR and not ours["stopped"].startswith("fails at"):
        return name, text + " — hf_tiny's search did not reach its limit", "not run"
    return name, text, verdict(value, lambda v: v >= LONGEST_FACTOR)


def fit_memory_targets(results: dict) -> list:
    """What made the fit_memory path CUDA's default (runtime.ON_BY_DEFAULT), measured again at each run: the longest
    sequence it trains >= 3x official's, at no cost where the step fits (its 4x2048 step against hf_tiny's without
    it). hf_tiny's own rows have it on since."""
    name = f"With fit_memory on (CUDA's default since both rows below passed): longest >= {LONGEST_FACTOR:.0f}x official's"
    fit, theirs = cell(results, "longest batch 1", "hf_tiny_fit"), cell(results, "longest batch 1", "official")
    if not (measured(fit) and measured(theirs)) or not theirs["longest"]:
        rows = [(name, why_missing(results, "longest batch 1", ("official", "hf_tiny_fit")), "not run")]
    else:
        value = fit["longest"] / theirs["longest"]
        text = f"{fit['longest']:,} / {theirs['longest']:,} tokens = {times(value, LONGEST_FACTOR)} (fit_memory: {fit['stopped']})"
        if not theirs["stopped"].startswith("fails at"):
            rows = [(name, text + " — official's search did not reach its limit", "not run")]
        elif value < LONGEST_FACTOR and not fit["stopped"].startswith("fails at") and not fit["stopped"].endswith(
                "do not fit"):
            rows = [(name, text + " — its search stopped before its limit", "not run")]
        else:
            rows = [(name, text, verdict(value, lambda v: v >= LONGEST_FACTOR))]
    train = Shape(*results["meta"]["plan"]["train"]).label()
    on, off = cell(results, f"train {train} fit_memory", "hf_tiny"), cell(results, f"train {train}", "hf_tiny")
    name = f"With fit_memory on, where the {train} step fits: <= {FIT_MEMORY_COST}x hf_tiny's time without it"
    if not (measured(on) and measured(off)):
        rows.append((name, why_missing(results, f"train {train} fit_memory", ("hf_tiny",)), "not run"))
    elif "paired_off_seconds" in on:  # timed interleaved with the same model's step without it
        rows.append((name, *paired_cost(on)))
    else:
        value = on["seconds"] / off["seconds"]
        rows.append((name, times(value, FIT_MEMORY_COST), verdict(value, lambda v: v <= FIT_MEMORY_COST)))
    return rows


def rebuild_targets(results: dict) -> list:
    """What would make the rebuild option a default beside Liger on this device: the 4x2048 step's memory with Liger
    and it on <= 0.6x official's plain step's, at <= 1.02x the time of the same model without it (interleaved)."""
    train = Shape(*results["meta"]["plan"]["train"]).label()
    row, plain = f"train {train} liger rebuild", f"train {train}"
    on = cell(results, row, "hf_tiny")
    memory = f"With rebuild on (a named option until both rows below pass): Training {train}: peak memory <= " \
             f"{TRAIN_MEMORY}x official's, Liger on ours, none on official's"
    cost = f"With rebuild on, Liger on ours: <= {FIT_MEMORY_COST}x the time without it"
    if not measured(on) or not measured(cell(results, plain, "official")):
        return [(name, why_missing(results, row, ("hf_tiny",)) if not measured(on)
                 else why_missing(results, plain, ("official",)), "not run") for name in (memory, cost)]
    value = _ratio_between(results, row, plain, extra_bytes)
    rows = [(memory, "memory not measured" if value is None else times(value, TRAIN_MEMORY),
             verdict(value, lambda v: v <= TRAIN_MEMORY))]
    rows.append((cost, *paired_cost(on)))
    return rows


def paired_cost(on: dict) -> tuple[str, str]:
    """(text, verdict) of a named path's step against the same model's without it, timed interleaved
    (gpu_rows.runtime_option_row): at most FIT_MEMORY_COST times."""
    value = on["seconds"] / on["paired_off_seconds"]
    text = f"{times(value, FIT_MEMORY_COST)} ({on['seconds'] * 1e3:,.1f} / {on['paired_off_seconds'] * 1e3:,.1f} ms, interleaved)"
    return text, verdict(value, lambda v: v <= FIT_MEMORY_COST)


def targets(results: dict) -> list:
    """[(target, measured, PASS | FAIL | not run)] for every GPU target of issue 42."""
    return [*host_targets(results), *row_targets(results), *decode_targets(results), *train_targets(results),
            longest_target(results), *fit_memory_targets(results), *rebuild_targets(results)]


# ---- the page ----------------------------------------------------------------------------------------------------

def render_markdown(results: dict) -> str:
    meta = results["meta"]
    title = f"# GPU check — {device_name(results)} — {meta['date']}" + (" (dry run on the CPU)" if meta["dry_run"] else "")
    if not meta.get("complete", True):
        title += " — partial: written after a stage, the run did not finish"
    lines = [title,
             "", *header_lines(results), "", "## Targets (issue 42)", "", "| target | measured | status |", "|---|---|---|"]
    lines += [f"| {name} | {text} | **{status}** |" for name, text, status in targets(results)]
    lines += ["", *side_by_side_lines(results), "", *decode_lines(results), "", *host_lines(results), "",
              *longest_lines(results), "", *kernel_lines(results), "", *stage_lines(results)]
    return "\n".join(lines) + "\n"


def header_lines(results: dict) -> list[str]:
    meta = results["meta"]
    plan, versions = meta["plan"], meta["versions"]
    lines = [
        f"- device: {device_name(results)}; {meta['cores']} CPU cores; Python {meta['python']}; "
        + ", ".join(f"{name} {version}" for name, version in versions.items()),
        *[f"- {'call ' + str(number) + ': ' if 'runs' in meta else ''}hf_tiny commit {run['git']}, {run['date']}; "
          f"command: `{run['command']}`; budget {run['budget_s']:.0f} s, used {run.get('elapsed_s', 0):.0f} s"
          for number, run in enumerate(meta.get("runs", [meta]), 1)],
        f"- model: `{plan['model']}` (random weights, both sides the same tensors: hf_tiny's written from official's "
        f"by the production converter); {plan['dtype']}; attention `sdpa` on both sides; {plan['repeats']} timed "
        f"calls after {plan['warmup']} warm-up, median (eager decode: {plan['decode_repeats']} after a 4-token "
        "generate; captured decode: the warm-up call compiles and records)",
        "- memory: torch.cuda.max_memory_allocated over the warm-up and timed calls; ratios use the peak above the "
        "memory allocated before them (the loaded model and inputs); a training step's includes AdamW's state",
    ]
    if meta.get("device_text"):
        lines.append("- device file: " + " / ".join(meta["device_text"].splitlines()))
    for test in meta.get("tests", []):
        lines.append(f"- tests `{test['log']}`: {test['summary']}")
    if meta.get("failed_tests"):
        lines.append(f"- failing tests ({len(meta['failed_tests'])}, tracebacks in failures.log): "
                     + ", ".join(f"`{name}`" for name in meta["failed_tests"]))
    return lines


def value_text(label: str, entry: dict) -> str:
    if "seconds" not in entry:
        return status_of(entry)
    speed_text = f"{entry['tokens_per_s']:,.1f} tok/s" if "tokens_per_s" in entry else f"{entry['seconds'] * 1e3:,.1f} ms"
    spread = f" [{min(entry['samples']) * 1e3:,.0f}–{max(entry['samples']) * 1e3:,.0f} ms]" if len(entry["samples"]) > 1 else ""
    memory = "" if entry.get("extra_bytes") is None else (
        f"; {entry['extra_bytes'] / MIB:,.0f} MiB above the model ({entry['peak_bytes'] / MIB:,.0f} MiB peak)")
    paired = "" if "paired_off_seconds" not in entry else (
        f"; the same model without it, interleaved: {entry['paired_off_seconds'] * 1e3:,.1f} ms")
    return speed_text + spread + memory + paired


def side_by_side_lines(results: dict) -> list[str]:
    lines = ["## Side by side", "",
             "| row | official | hf_tiny | hf_tiny, runtime off | hf_tiny speed / official | memory / official | runtime off speed / official |",
             "|---|---|---|---|---|---|---|"]
    for label in row_labels(results):
        cells = [value_text(label, cell(results, label, side)) for side in SIDES]
        faster, memory = ratio(results, label, speed), ratio(results, label, extra_bytes)
        off = ratio(results, label, speed, ours="hf_tiny_off")
        lines.append(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(
            "—" if v is None else f"{v:.2f}x" for v in (faster, memory, off)) + " |")
    liger = [(side, cell(results, row, side)) for row in row_labels(results) if row.endswith("liger") for side in SIDES]
    notes = [f"{SIDE_TITLES[side]} {e['modules_patched']}" for side, e in liger if "modules_patched" in e]
    if notes:
        lines += ["", "Liger, applied by transformers' `use_liger_kernel` entry point: modules (the model itself "
                  "included) with another class or forward afterwards: " + ", ".join(notes) + "."]
    return lines


def decode_lines(results: dict) -> list[str]:
    read = bandwidth(results)
    lines = ["## Decode against the measured HBM read bandwidth", "",
             f"Read bandwidth (roofline.memory_bandwidth, best of the jobs): "
             f"{'not measured' if read is None else f'{read / 1e9:,.0f} GB/s'}. Bytes: every weight matrix once per "
             "step plus the K/V cache so far (roofline.generate_bytes).", "",
             "CUDA graph runs: of the compiled step's runs over the warm-up and timed calls, how many replayed a "
             "recorded graph, recorded one, warmed up, and ran without a graph (benchmarks/cuda_graph_runs.py).", "",
             "| row | side | tokens/s | GB/s | of read bandwidth | graphs compiled | CUDA graph runs | "
             "greedy tokens = official's |",
             "|---|---|---|---|---|---|---|---|"]
    for label in [r for r in row_labels(results) if r.startswith("decode")]:
        reference = cell(results, label, "official").get("tokens")
        for side in SIDES:
            entry = cell(results, label, side)
            if "tokens_per_s" not in entry:
                continue
            rate = decode_bytes_per_s(results, label, entry)
            share = "—" if read is None else f"{rate / read:.1%}"
            same = "—" if reference is None or side == "official" else f"{agreement(entry['tokens'], reference):.0%}"
            runs = graph_runs(entry.get("cuda_graph_runs"))
            lines.append(f"| {label} | {SIDE_TITLES[side]} | {entry['tokens_per_s']:,.1f} | {rate / 1e9:,.1f} | {share} | "
                         f"{entry.get('graphs_compiled', '—')} | {runs} | {same} |")
    return lines + own_agreement_lines(results)


def own_agreement_lines(results: dict) -> list[str]:
    """The scale to read the greedy-token column against: each side's captured tokens beside its own eager ones at
    the same shape. Random weights in bf16 leave near-ties among the logits, and a compiled step rounds otherwise
    than the eager one (fused kernels keep fp32 between operators), so a greedy sequence can leave its eager twin
    within a few tokens; an agreement between the sides at or above a side's own is no sign of other math."""
    lines = []
    for label in [r for r in row_labels(results) if r.startswith("decode") and r.endswith("captured")]:
        eager = label[: -len("captured")] + "eager"
        own = {side: agreement(cell(results, label, side)["tokens"], cell(results, eager, side)["tokens"])
               for side in ("official", "hf_tiny")
               if "tokens" in cell(results, label, side) and "tokens" in cell(results, eager, side)}
        if own:
            shown = ", ".join(f"{SIDE_TITLES[side]} {share:.0%}" for side, share in own.items())
            lines.append(f"- {label}: each side's greedy tokens against its own eager ones: {shown}.")
    if not lines:
        return []
    return ["", "Each side against itself (the scale of the last column: bf16 greedy decoding from random weights, "
            "compiled against eager):", "", *lines]


def graph_runs(runs) -> str:
    """A captured row's cuda_graph_runs in words; a dash where none was counted (eager rows, a torch without the
    tree manager) or no CUDA graph ran at all (a CPU)."""
    if not runs or not runs.get("calls"):
        return "—"
    parts = [f"{runs['replayed']:,} replayed", f"{runs['recorded']:,} recorded", f"{runs['warm_up']:,} warm-up"]
    without = f"{runs['without_graph']:,} without a graph"
    if runs["without_graph"]:
        without = f"**{without}**"
    return f"{', '.join(parts)}, {without} (of {runs['calls']:,})"


def kernel_lines(results: dict) -> list[str]:
    """Each profiled call (gpu_rows.kernel_row: eager and captured decode, the training step with Liger): how long the
    device was busy of the wall time, and the kernels that took most of it, side by side (on a CPU dry run:
    operators)."""
    lines = ["## Where one call's time goes (torch.profiler, one call after the timed ones)", ""]
    profiled_rows = [r for r in row_labels(results)
                     if r.startswith("decode") and r.endswith(("eager", "captured")) or r.endswith(" liger")]
    for label in profiled_rows:
        profiled = {side: cell(results, f"{label} kernels", side) for side in SIDES}
        profiled = {side: entry for side, entry in profiled.items() if "kernels" in entry}
        if not profiled:
            continue
        lines += [f"**{label}**", ""]
        for side, entry in profiled.items():
            busy = entry["busy_us"] / max(entry["wall_us"], 1e-9)
            lines.append(f"- {SIDE_TITLES[side]}: wall {entry['wall_us'] / 1e3:,.1f} ms; {entry['busy_of']}' own time "
                         f"{entry['busy_us'] / 1e3:,.1f} ms ({busy:.0%} of it), {entry['kernel_launches']:,} of them"
                         + (f"; the host's own time {entry['host_us'] / 1e3:,.1f} ms" if "host_us" in entry else ""))
        lines += _profile_table(profiled, "kernels", "kernel")
        lines += _profile_table(profiled, "host_calls", "host call (CPU, own time)")
        lines.append("")
    return lines if len(lines) > 2 else lines + ["not run"]


def _profile_table(profiled: dict, key: str, title: str) -> list[str]:
    """The sides' [name, calls, own time in us] entries under `key`, one table (none where no side has them)."""
    rows = [f"| {SIDE_TITLES[side]} | `{name}` | {count:,} | {own / 1e3:,.2f} |"
            for side, entry in profiled.items() for name, count, own in entry.get(key, ())]
    return ["", f"| side | {title} | calls | own time (ms) |", "|---|---|---|---|", *rows] if rows else []


def agreement(tokens: list, reference: list) -> float:
    pairs = [(a, b) for row, ref in zip(tokens, reference) for a, b in zip(row, ref)]
    return sum(a == b for a, b in pairs) / max(len(pairs), 1)


def host_lines(results: dict) -> list[str]:
    """Python calls (cProfile) and aten calls per prefill / decode step, beside the wall time of one."""
    plan = results["meta"]["plan"]
    walls = {"host prefill": (f"prefill {Shape(*plan['prefill'][0]).label()}", 1),
             "host decode step": (f"decode {Shape(*plan['decode'][0]).label()} eager", Shape(*plan["decode"][0]).new_tokens)}
    lines = ["## Host work (load-independent counts, on this machine's CPU)", "",
             "| work | side | Python calls | aten calls | wall time of one (ms) |", "|---|---|---|---|---|"]
    for label, (timed, per) in walls.items():
        for side in SIDES:
            entry, timing = cell(results, label, side), cell(results, timed, side)
            if "python_calls" not in entry:
                continue
            wall = "—" if "seconds" not in timing else f"{timing['seconds'] / per * 1e3:,.2f}"
            lines.append(f"| {label.removeprefix('host ')} ({entry['shape']}) | {SIDE_TITLES[side]} | "
                         f"{entry['python_calls']:,.0f} | {entry['aten_calls']:,.0f} | {wall} |")
    return lines


def longest_lines(results: dict) -> list[str]:
    lines = ["## Longest trainable sequence at batch 1", "",
             "One training step (forward, backward, AdamW) per probe, doubling then bisecting; the allocator emptied "
             "between probes.", "", "| side | longest | stopped | probes (tokens: fits) |", "|---|---|---|---|"]
    for side in ("official", "hf_tiny", "hf_tiny_fit"):
        entry = cell(results, "longest batch 1", side)
        if "longest" not in entry:
            lines.append(f"| {SIDE_TITLES[side]} | {status_of(entry)} | | |")
            continue
        probes = ", ".join(f"{n:,}: {'yes' if ok else 'no'}" for n, ok in entry["probes"])
        lines.append(f"| {SIDE_TITLES[side]} | {entry['longest']:,} | {entry['stopped']} | {probes} |")
    return lines


def stage_lines(results: dict) -> list[str]:
    lines = ["## Stages (one process each, in this order)", "",
             "| stage | status | seconds | cap | estimate | basis of the estimate |", "|---|---|---|---|---|---|"]
    for stage in results["stages"]:
        name = stage["name"] + (f" (call {stage['run']})" if "run" in stage else "")
        lines.append(f"| {name} | {stage['status']} | {stage.get('seconds', '—')} | {stage['cap_s']} | "
                     f"{stage['estimate_s']} | {stage['basis']} |")
    return lines


# ---- several calls on one machine ---------------------------------------------------------------------------------

def merge(runs: list[dict]) -> dict:
    """One page from several calls on one warm machine (a later call runs the stages an earlier one had no time
    for, `--stages`): each row's side from the first call that measured it, else the first call's reason; the
    stages that ran, in order, each with its call; every call's command in the header."""
    devices = sorted({device_name(run) for run in runs})
    if len(devices) != 1:
        raise ValueError(f"runs: calls on different devices cannot share a page, got {devices}")
    plans = [run["meta"]["plan"] for run in runs]
    if any(plan != plans[0] for plan in plans):
        raise ValueError("runs: the calls measured different plans (shapes, dtype or model); merge only one plan's calls")
    merged = {"meta": dict(runs[0]["meta"]), "rows": {}, "stages": []}
    for number, run in enumerate(runs, 1):
        for label, sides in run["rows"].items():
            row = merged["rows"].setdefault(label, {})
            for side, entry in sides.items():
                kept = row.get(side)
                if kept is None or (not measured(kept) and (measured(entry) or status_of(kept).startswith("not run"))):
                    row[side] = entry
        merged["stages"] += [dict(stage, run=number) for stage in run["stages"]
                             if stage["status"] != "not run (not in --stages)"]
    keys = ("date", "git", "command", "budget_s", "elapsed_s")
    merged["meta"]["runs"] = [{key: run["meta"].get(key) for key in keys} for run in runs]
    tests = [test for run in runs for test in run["meta"].get("tests", [])]
    merged["meta"]["tests"] = ([test for test in tests if test["summary"] != "no log (not run)"]
                               or runs[0]["meta"].get("tests", []))
    merged["meta"]["failed_tests"] = [name for run in runs for name in run["meta"].get("failed_tests", [])]
    merged["meta"]["complete"] = all(run["meta"].get("complete", True) for run in runs)
    return merged


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_report",
                                     description="One GPU-check page (.md and .json) from several calls' JSON.")
    parser.add_argument("--merge", nargs="+", type=Path, required=True, help="gpu-check JSON files, in call order")
    parser.add_argument("--out", type=Path, required=True, help="the page to write (PATH.md; PATH.json beside it)")
    args = parser.parse_args(argv)
    if args.out.suffix != ".md":
        parser.error(f"--out must name a .md page, got {args.out}")
    merged = merge([json.loads(path.read_text()) for path in args.merge])
    args.out.write_text(render_markdown(merged))
    args.out.with_suffix(".json").write_text(json.dumps(merged, indent=2))
    return args.out


if __name__ == "__main__":
    print(main())
