"""Host work: the Python calls of a prefill and of one decoding step, official transformers beside hf_tiny (runtime on,
the default, and off), with their wall times.

    python -m benchmarks.host_work [--models overhead] [--prompt 16] [--repeats 5] [--out FILE.md]
    python -m benchmarks.host_work --gpu-check-rows [--out FILE.md]

At small shapes on a GPU the host's work is the time: the interpreter has to issue every kernel. cProfile counts
the Python-level function calls (built-ins included) of one call, a measure that does not depend on the machine's
load. The prefill is generate()'s first forward (a cache filled, the last position's logits); the decoding step is
the difference between a generate of 9 new tokens and one of 1, divided by 8, so the prompt drops out. The column
"paths as on a GPU" counts hf_tiny with every runtime path at its default off the CPU. Wall times
are medians of --repeats interleaved calls after a warm-up (on a shared machine, read them as indications).

--gpu-check-rows counts what the GPU check's page counts (benchmarks.gpu_rows.host_row: generate's prefill without
a cache at 1x2048, and a decoding step after a 1x32 prompt), with every path as on a GPU, on `layout1b` (llama1b's
22 layers and heads at width 256). At a86341c it gave hf_tiny 3,778 and 4,264 calls where the H200 counted 3,780
and 4,257; official's count there was 17-25 calls below this one (transformers 5.17 both). Its last rows count the
page's captured decoding steps (static cache, generate's auto-compile) around the compiled graph, which a GPU
replays as one CUDA graph: generate's loop, the compiled call's guards and wrappers (dynamo's eager backend here, so
the wrappers are not inductor's nor its CUDA graph trees', the same on both sides).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import sys
from pathlib import Path

import torch
import transformers

from . import measure
from .machine import cpu_model, git_revision
from .models import HF_TINY, MODELS, OFFICIAL, load_pair
from .workloads import Shape, build_generate, captured_decoding_config, random_ids

from hf_tiny.step import CACHE_FIELD  # the cache argument generate() passes with the installed transformers

HF_TINY_OFF = "hf_tiny, runtime off"
HF_TINY_GPU = "hf_tiny, paths as on a GPU"


@contextlib.contextmanager
def paths_as_on_a_gpu():
    """Every runtime path at its default off the CPU (off: none has won on a GPU yet), in hf_tiny's runtime and in the
    copies that saved folders load as custom code: the host work a GPU's step makes, counted on this CPU."""
    runtimes = [module for name, module in list(sys.modules.items())
                if name.split(".")[-1] == "runtime" and hasattr(module, "ON_BY_DEFAULT") and hasattr(module, "PATHS")]
    saved = [module.ON_BY_DEFAULT for module in runtimes]
    for module in runtimes:
        module.ON_BY_DEFAULT = {path: devices - {"cpu"} for path, devices in module.ON_BY_DEFAULT.items()}
    try:
        yield
    finally:
        for module, defaults in zip(runtimes, saved):
            module.ON_BY_DEFAULT = defaults


def build_prefill_with_cache(model, shape: Shape, device: torch.device):
    """generate()'s first forward: the prompt into a fresh dynamic cache, the last position's logits."""
    ids = random_ids(shape.batch, shape.seq, model.config.vocab_size, device)
    mask = torch.ones_like(ids)

    @torch.inference_mode()
    def prefill():
        cache = transformers.DynamicCache(config=model.config)
        return model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1, **{CACHE_FIELD: cache})

    return prefill


def decode_step_calls(model, shape: Shape, device: torch.device) -> float:
    long = measure.count_python_calls(build_generate(model, shape, device, new_tokens=9))
    short = measure.count_python_calls(build_generate(model, shape, device, new_tokens=1))
    return (long - short) / 8


def captured_step_calls(model, shape: Shape, device: torch.device) -> float:
    """A captured decoding step's host work: generate() with a static cache and its auto-compile (dynamo's eager
    backend off CUDA: workloads.captured_decoding_config), 17 new tokens less 9, over 8, leaving out the calls inside
    the compiled graph (a CUDA graph replay on a GPU). Each generate runs twice first: to compile, and to settle."""
    config = captured_decoding_config(device)
    long, short = (build_generate(model, shape, device, new_tokens=count, static_cache=True, compile_config=config)
                   for count in (17, 9))
    for generate in (long, short, long, short):
        generate()
    return (measure.count_python_calls_outside_graphs(long) - measure.count_python_calls_outside_graphs(short)) / 8


def decode_step_seconds(sides: dict, shape: Shape, device: torch.device, repeats: int) -> dict:
    long = {name: build_generate(model, shape, device, new_tokens=9) for name, model in sides.items()}
    short = {name: build_generate(model, shape, device, new_tokens=1) for name, model in sides.items()}
    t_long = measure.time_interleaved(long, device=device, warmup=1, repeats=repeats)
    t_short = measure.time_interleaved(short, device=device, warmup=1, repeats=repeats)
    return {name: max(t_long[name].median - t_short[name].median, 0.0) / 8 for name in sides}


def measure_model(name: str, prompt: int, repeats: int, device: torch.device) -> dict:
    _, models, errors = load_pair(MODELS[name], device, torch.float32, "sdpa", refresh=False)
    if errors:
        raise RuntimeError(f"{name}: {errors}")
    off = models[HF_TINY]
    sides = {OFFICIAL: models[OFFICIAL], HF_TINY: models[HF_TINY]}
    shape = Shape(1, prompt)
    rows = {}
    prefills = {side: build_prefill_with_cache(model, shape, device) for side, model in sides.items()}
    calls = {side: measure.count_python_calls(fn) for side, fn in prefills.items()}
    timed = measure.time_interleaved(prefills, device=device, warmup=2, repeats=repeats)
    seconds = {side: timed[side].median for side in sides}
    off.set_runtime(False)
    calls[HF_TINY_OFF] = measure.count_python_calls(prefills[HF_TINY])
    off.set_runtime(True)
    with paths_as_on_a_gpu():
        calls[HF_TINY_GPU] = measure.count_python_calls(prefills[HF_TINY])
    rows["prefill"] = {"calls": calls, "seconds": seconds}
    calls = {side: decode_step_calls(model, shape, device) for side, model in sides.items()}
    off.set_runtime(False)
    calls[HF_TINY_OFF] = decode_step_calls(off, shape, device)
    off.set_runtime(True)
    with paths_as_on_a_gpu():
        calls[HF_TINY_GPU] = decode_step_calls(off, shape, device)
    rows["decode step"] = {"calls": calls, "seconds": decode_step_seconds(sides, shape, device, repeats)}
    return rows


def gpu_check_rows(device: torch.device) -> dict:
    """{case: {side: Python calls}} of the GPU check's host-work rows, paths as on a GPU (see the module's doc)."""
    from .gpu_check import GPU_PLAN
    from .gpu_rows import host_counts
    from .workloads import DECODE, PREFILL

    _, models, errors = load_pair(MODELS["layout1b"], device, torch.float32, "sdpa", refresh=False)
    if errors:
        raise RuntimeError(f"layout1b: {errors}")
    sides = {OFFICIAL: models[OFFICIAL], HF_TINY: models[HF_TINY]}
    rows = {f"prefill ({GPU_PLAN.prefill[0].label()})": (PREFILL, GPU_PLAN.prefill[0]),
            f"decode step ({GPU_PLAN.decode[0].label()})": (DECODE, GPU_PLAN.decode[0])}
    with paths_as_on_a_gpu():
        counts = {row: {side: host_counts(model, case, shape, device)["python"] for side, model in sides.items()}
                  for row, (case, shape) in rows.items()}
        for shape in GPU_PLAN.decode:  # the page's captured rows, batch 1 and 8
            counts[f"captured decode step ({shape.label()}), outside the graph"] = {
                side: captured_step_calls(model, Shape(shape.batch, shape.seq), device) for side, model in sides.items()}
    return counts


def gpu_check_table(counts: dict) -> list[str]:
    lines = ["| case (paths as on a GPU) | official calls | hf_tiny calls | ratio (target <= 1.00) |", "|---|---|---|---|"]
    for case, calls in counts.items():
        lines.append(f"| {case} | {calls[OFFICIAL]:,.0f} | {calls[HF_TINY]:,.0f} | "
                     f"{calls[HF_TINY] / calls[OFFICIAL]:.3f} |")
    return lines


def table(results: dict, prompt: int) -> list[str]:
    lines = [f"| model | case (1x{prompt} prompt) | official calls | hf_tiny calls | ratio (target <= 1.00) | "
             "hf_tiny runtime off | hf_tiny, paths as on a GPU (ratio) | official ms | hf_tiny ms | time ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for model, rows in results.items():
        for case, row in rows.items():
            calls, seconds = row["calls"], row["seconds"]
            ratio = calls[HF_TINY] / calls[OFFICIAL]
            lines.append(
                f"| {model} | {case} | {calls[OFFICIAL]:,.0f} | {calls[HF_TINY]:,.0f} | {ratio:.2f} | "
                f"{calls[HF_TINY_OFF]:,.0f} | {calls[HF_TINY_GPU]:,.0f} ({calls[HF_TINY_GPU] / calls[OFFICIAL]:.2f}) | "
                f"{seconds[OFFICIAL] * 1e3:.2f} | {seconds[HF_TINY] * 1e3:.2f} | "
                f"{seconds[HF_TINY] / seconds[OFFICIAL]:.2f} |"
            )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="overhead", help="comma-separated benchmarks.models names")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens (batch 1)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help="also write the table, with the machine and versions, to this file")
    parser.add_argument("--gpu-check-rows", action="store_true",
                        help="count the GPU check's host-work rows on layout1b instead (calls only)")
    args = parser.parse_args(argv)
    device = torch.device("cpu")
    machine = (f"{datetime.date.today()}, {cpu_model()} ({platform.machine()}), torch {torch.__version__}, "
               f"transformers {transformers.__version__}, hf_tiny {git_revision()}, fp32, sdpa")
    if args.gpu_check_rows:
        header = f"Host work of the GPU check's rows on a CPU, {machine}: `python -m benchmarks.host_work --gpu-check-rows`"
        lines = gpu_check_table(gpu_check_rows(device))
    else:
        results = {name: measure_model(name, args.prompt, args.repeats, device) for name in args.models.split(",")}
        header = (f"Host work, {machine}, {torch.get_num_threads()} threads: `python -m benchmarks.host_work --models "
                  f"{args.models} --prompt {args.prompt} --repeats {args.repeats}`")
        lines = table(results, args.prompt)
    measure.print_table(header, lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
