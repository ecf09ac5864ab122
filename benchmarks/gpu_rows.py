"""The GPU check's measuring process: `python -m benchmarks.gpu_rows JOB_JSON`, started by benchmarks.gpu_check.

One job per process (the checkpoints' build; one side's eager rows; one side's captured decode at one shape; one
side's longest trainable sequence), so that a crash (official's compiled generate segfaulted under CUDA graphs on
the first H100 run) or a stuck compile ends that job only. Each finished row is printed at once as one JSON line
{"row": ..., "side": ..., ...}: what a job measured before it died is kept. Rows are timed with
measure.time_interleaved (the device synchronized around each call) after warm-up calls; peak memory is
torch.cuda.max_memory_allocated over the warm-up and timed calls, and "extra" is that peak above the memory
allocated before them (the loaded model and the inputs), as benchmarks.run measures it.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

import torch

from . import cuda_graph_runs, roofline
from .measure import synchronize, time_interleaved
from .models import HF_TINY, MODELS, OFFICIAL, convert_hf_tiny, load_model, official_folder
from .workloads import (DECODE, PREFILL, Shape, apply_liger, build_generate, build_prefill, build_train_step,
                        captured_decoding_config, random_ids)

# the sides: which model, and what is done to it after loading
SIDES = {"official": OFFICIAL, "hf_tiny": HF_TINY, "hf_tiny_off": HF_TINY, "hf_tiny_fit": HF_TINY}
EXTRA_PREFILL = {"use_cache": False, "logits_to_keep": 1}  # generate's prefill, as workloads.prefill_kwargs gives


def emit(row: str, side: str, **values) -> None:
    print(json.dumps({"row": row, "side": side, **values}, default=str), flush=True)


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def shape_of(data) -> Shape:
    """A Shape from its JSON form [batch, seq, new_tokens] (or the Shape itself)."""
    return data if isinstance(data, Shape) else Shape(*data)


# ---- timing and memory of one row --------------------------------------------------------------------------------

def measured(fn, device: torch.device, *, warmup: int, repeats: int) -> dict:
    """{"seconds": median, "samples": [...], "peak_bytes", "extra_bytes"} of `repeats` timed calls after `warmup`
    calls; memory on CUDA only (None elsewhere). The last output under "output"."""
    free()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    timing = time_interleaved({"x": fn}, device=device, warmup=warmup, repeats=repeats)["x"]
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    return {"seconds": timing.median, "samples": timing.samples, "peak_bytes": peak,
            "extra_bytes": None if peak is None else peak - base, "output": timing.last_output}


def emit_measured(row: str, side: str, result: dict, **extra) -> dict:
    result = dict(result)
    result.pop("output", None)
    emit(row, side, **result, **extra)
    return result


def guarded(row: str, side: str, action) -> None:
    """Runs one row; an exception becomes the row's status (out of memory, a missing package, a bug) instead of
    ending the job, so the rows after it still run."""
    try:
        action()
    except Exception as error:  # reported in the table, the job goes on
        emit(row, side, status=failure_status(error))
    free()


def failure_status(error: Exception) -> str:
    if isinstance(error, torch.OutOfMemoryError):
        return "out of memory"
    if isinstance(error, ImportError):
        return f"not installed: {error.name or error}"
    return f"error: {type(error).__name__}: {str(error)[:300]}"


# ---- jobs --------------------------------------------------------------------------------------------------------

def job_build(job: dict) -> None:
    """The official random checkpoint (initialised on the device) and hf_tiny's, by the production converter."""
    spec, device = MODELS[job["model"]], torch.device(job["device"])
    start = time.perf_counter()
    official = official_folder(spec, device=device)
    built = time.perf_counter()
    ours = convert_hf_tiny(spec, official)
    emit("build", "both", official_folder=str(official), hf_tiny_folder=str(ours), device_name=device_name(device),
         official_seconds=built - start, convert_seconds=time.perf_counter() - built)


def device_name(device: torch.device) -> str:
    from .machine import cpu_model

    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


def expected_rows(job: dict) -> list[str]:
    """The rows a job reports (those it never reported take the job's outcome in the report)."""
    if job["kind"] == "build":
        return ["build"]
    if job["kind"] == "captured":
        return [f"decode {shape_of(job['shape']).label()} captured"]
    if job["kind"] == "longest":
        return ["longest batch 1"]
    if job["kind"] == "liger_paired":
        return [f"train {shape_of(job['train']).label()} liger paired"]
    if job["kind"] == "eager_paired":
        return [*(f"prefill {shape_of(s).label()} paired" for s in job["prefill"]),
                *(f"decode {shape_of(s).label()} eager paired" for s in job["decode"])]
    train = shape_of(job["train"]).label()
    rows = (["ceilings"] if job.get("ceilings") else []) + [f"prefill {shape_of(s).label()}" for s in job["prefill"]]
    rows += [f"decode {shape_of(s).label()} eager" for s in job["decode"]] + ["host prefill", "host decode step"]
    rows.append(f"train {train}")
    if job["side"] == "hf_tiny":
        rows += [f"train {train} recompute", f"train {train} fit_memory"]
    if job.get("liger") and job["side"] != "hf_tiny_off":
        rows.append(f"train {train} liger")
    if job.get("liger") and job["side"] == "hf_tiny":
        rows.append(f"train {train} liger rebuild")
    return rows


def load(job: dict, *, max_positions: int | None = None):
    spec, device = MODELS[job["model"]], torch.device(job["device"])
    overrides = {"max_position_embeddings": max_positions} if max_positions else {}
    impl = SIDES[job["side"]]
    model = load_model(spec, impl, Path(job["folders"][impl]), dtype=getattr(torch, job["dtype"]), device=device,
                       attn="sdpa", **overrides)
    if job["side"] == "hf_tiny_off":
        model.set_runtime(False)
    if job["side"] == "hf_tiny_fit":
        model.set_runtime(fit_memory=True)
    return model


def job_main(job: dict) -> None:
    """One side's eager rows: ceilings, prefill, eager decode, host work, training step (plain, the recompute
    switch, Liger last: it patches the model for good)."""
    device, side = torch.device(job["device"]), job["side"]
    if job.get("ceilings"):
        guarded("ceilings", side, lambda: emit("ceilings", side, **ceilings(job, device)))
    model = load(job)
    for data in job["prefill"]:
        shape = shape_of(data)
        fn = build_prefill(model, "causal", shape, device, EXTRA_PREFILL)
        guarded(f"prefill {shape.label()}", side, lambda: emit_measured(
            f"prefill {shape.label()}", side, measured(fn, device, warmup=job["warmup"], repeats=job["repeats"])))
    for data in job["decode"]:
        profiled_decode_row(model, shape_of(data), device, job, side)
    for case, data in ((PREFILL, job["prefill"][0]), (DECODE, job["decode"][0])):
        label = "host prefill" if case == PREFILL else "host decode step"
        guarded(label, side, lambda: host_row(model, case, shape_of(data), device, label, side))
    train = shape_of(job["train"])
    guarded(f"train {train.label()}", side, lambda: train_row(model, train, device, job, f"train {train.label()}", side))
    del model  # the rows below load the model again, changed for good
    free()
    if side == "hf_tiny":
        for path in ("recompute", "fit_memory"):
            guarded(f"train {train.label()} {path}", side, lambda: runtime_option_row(job, train, device, side, path))
    if job.get("liger") and side != "hf_tiny_off":
        guarded(f"train {train.label()} liger", side, lambda: liger_row(job, train, device, side))
    if job.get("liger") and side == "hf_tiny":
        guarded(f"train {train.label()} liger rebuild", side,
                lambda: runtime_option_row(job, train, device, side, "rebuild", liger=True))


def ceilings(job: dict, device: torch.device) -> dict:
    return {"gemm": roofline.gemm_peak(device, getattr(torch, job["dtype"]), job["gemm_n"]),
            "bandwidth": roofline.memory_bandwidth(device, job["bandwidth_mb"])}


def decode_row(model, shape: Shape, device: torch.device, job: dict, side: str, *, captured: bool = False):
    """generate() of shape.new_tokens tokens: eager (DynamicCache) or captured (static cache, generate's
    auto-compile, which the warm-up compiles and records; how the CUDA graph trees ran the step over the warm-up and
    timed calls: cuda_graph_runs). The warm-up is one full call on both: on the H200 (2026-11-28) the first
    128-token eager call after a 4-token one took 3-4x the next, on both sides."""
    label = f"decode {shape.label()} {'captured' if captured else 'eager'}"
    config = captured_decoding_config(device) if captured else None
    fn = build_generate(model, shape, device, static_cache=captured, compile_config=config)
    graphs_before = compiled_graphs()
    start = time.perf_counter()
    repeats = job["repeats"] if captured else job["decode_repeats"]
    with cuda_graph_runs.counting() as graph_runs:
        result = measured(fn, device, warmup=job["warmup"], repeats=repeats)
    tokens = result["output"][:, shape.seq:]
    extra = {"tokens_per_s": shape.batch * shape.new_tokens / result["seconds"], "tokens": tokens.tolist(),
             "wall_seconds": time.perf_counter() - start}
    if captured:
        extra["graphs_compiled"] = compiled_graphs() - graphs_before
        extra["cuda_graph_runs"] = graph_runs
    emit_measured(label, side, result, **extra)
    return fn


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def host_row(model, case: str, shape: Shape, device: torch.device, label: str, side: str) -> None:
    counts = host_counts(model, case, shape, device)
    emit(label, side, shape=shape.label(), python_calls=counts["python"], aten_calls=counts["aten"])


def host_counts(model, case: str, shape: Shape, device: torch.device) -> dict:
    """{"python": calls (cProfile), "aten": calls (torch.profiler)} of one prefill (generate's: no cache, the last
    logits) or one decode step, as benchmarks.run counts them (a decode step: a 9-token generate minus a 1-token
    one, over 8)."""
    from .run import count_ops

    fns = {"x": build_prefill(model, "causal", shape, device, EXTRA_PREFILL)} if case == PREFILL else None
    counts = count_ops(case, {"x": model}, fns, "causal", shape, device)
    return {kind: counts[kind]["x"] for kind in ("python", "aten")}


def train_row(model, shape: Shape, device: torch.device, job: dict, label: str, side: str, **extra):
    """forward + backward + AdamW step; the first warm-up step creates AdamW's state, which the peak includes.
    Returns the step (its AdamW state held until the caller drops it)."""
    step = build_train_step(model, "causal", shape, device)
    result = measured(step, device, warmup=max(job["warmup"], 1), repeats=job["repeats"])
    emit_measured(label, side, result, **extra)
    model.zero_grad(set_to_none=True)
    return step


def peak_kept(call, peaks: dict, key, device: torch.device):
    """call, with the device's peak allocated memory over its calls kept in peaks[key] (CUDA only): two contenders
    timed interleaved, each with its own peak."""
    if device.type != "cuda":
        return call

    def tracked():
        torch.cuda.reset_peak_memory_stats(device)
        output = call()
        peaks[key] = max(peaks[key], torch.cuda.max_memory_allocated(device))
        return output
    return tracked


PAIRED_REPEATS = 5  # a named path's step beside the same model's without it: a few percent apart at most


def runtime_option_row(job: dict, shape: Shape, device: torch.device, side: str, path: str, *,
                       liger: bool = False) -> None:
    """The training step with one of hf_tiny's runtime paths that are named options off the CPU
    (runtime.ON_BY_DEFAULT) turned on: the benchmark that decides whether it becomes a default on this device.
    recompute: its time and memory; fit_memory (hf_tiny/memory_fit.py), at a step that fits: what it costs when it
    has nothing to do. Timed interleaved with the same model's step with the path off (set_runtime toggled before
    each call): "paired_off_seconds" is that step's median, so the ratio compares the path alone, not two loads of
    the model in a process whose allocator earlier rows have shaped. Peak memory: the path's calls only.
    liger: on a model with Liger's kernels (rebuild: what it saves beside Liger's feed-forward)."""
    if liger:
        import liger_kernel  # noqa: F401  (ImportError before loading: the row says "not installed")
    model = load(job)
    if liger:
        apply_liger(model)
    step = build_train_step(model, "causal", shape, device)
    cuda = device.type == "cuda"
    peaks = {True: 0, False: 0}

    def with_path(on: bool):
        def call():
            model.set_runtime(**{path: on})
            return step()
        return peak_kept(call, peaks, on, device)

    free()
    base = torch.cuda.memory_allocated(device) if cuda else None
    timings = time_interleaved({"on": with_path(True), "off": with_path(False)}, device=device,
                               warmup=max(job["warmup"], 1), repeats=max(job["repeats"], PAIRED_REPEATS))
    on, off = timings["on"], timings["off"]
    emit(f"train {shape.label()}{' liger' if liger else ''} {path}", side, seconds=on.median, samples=on.samples,
         peak_bytes=peaks[True] if cuda else None, extra_bytes=peaks[True] - base if cuda else None,
         paired_off_seconds=off.median, paired_off_samples=off.samples,
         paired_off_extra_bytes=peaks[False] - base if cuda else None, switch=f"set_runtime({path}=True)")
    del step
    model.zero_grad(set_to_none=True)


def liger_row(job: dict, shape: Shape, device: torch.device, side: str) -> None:
    import liger_kernel  # noqa: F401  (ImportError before loading: the row says "not installed")

    model = load(job)
    patched = apply_liger(model)
    label = f"train {shape.label()} liger"
    step = train_row(model, shape, device, job, label, side, **patched)
    # one more step under the profiler: with Liger on both sides ours took 1.07x official's time on the H200
    # (2026-11-30, interleaved), and the kernels each side ran say where
    guarded(f"{label} kernels", side, lambda: kernel_row(step, device, f"{label} kernels", side))


def job_liger_paired(job: dict) -> None:
    """Liger on both sides in one process: official's and hf_tiny's training steps timed interleaved, so that the
    two are compared on the same warm device minutes apart from nothing (the separate liger rows come from two
    processes; on the H200 hf_tiny's spread 132-152 ms over three calls while official's held at 124)."""
    shape, device = shape_of(job["train"]), torch.device(job["device"])
    label = f"train {shape.label()} liger paired"
    try:
        liger_paired_row(job, shape, device, label)
    except Exception as error:  # each side's cell says why, as guarded does for one side
        for side in PAIRED_SIDES:
            emit(label, side, status=failure_status(error))
    free()


PAIRED_SIDES = ("official", "hf_tiny")


def liger_paired_row(job: dict, shape: Shape, device: torch.device, label: str) -> None:
    import liger_kernel  # noqa: F401  (ImportError before loading: the cells say "not installed")

    models = {side: load({**job, "side": side}) for side in PAIRED_SIDES}
    patched = {side: apply_liger(model) for side, model in models.items()}
    steps = {side: build_train_step(model, "causal", shape, device) for side, model in models.items()}
    paired_row(label, steps, device, warmup=max(job["warmup"], 1), repeats=max(job["repeats"], PAIRED_REPEATS),
               extra=patched)


def job_eager_paired(job: dict) -> None:
    """Prefill and eager decode with both models in one process, their calls timed interleaved: the main stages time
    the sides in two processes minutes apart, and on the H200 (2026-11-30) eager decode spread 2.3-3.1 s a call on
    official's side and 2.8-3.4 s on hf_tiny's, drift of the host between the stages as much as either side's code."""
    device = torch.device(job["device"])
    models = {side: load({**job, "side": side}) for side in PAIRED_SIDES}
    for data in job["prefill"]:
        shape = shape_of(data)
        calls = {side: build_prefill(model, "causal", shape, device, EXTRA_PREFILL) for side, model in models.items()}
        paired_row(f"prefill {shape.label()} paired", calls, device, warmup=job["warmup"],
                   repeats=max(job["repeats"], PAIRED_REPEATS))
    for data in job["decode"]:
        shape = shape_of(data)
        calls = {side: build_generate(model, shape, device) for side, model in models.items()}
        paired_row(f"decode {shape.label()} eager paired", calls, device, warmup=max(job["warmup"], 1),
                   repeats=job["decode_repeats"], tokens=shape.batch * shape.new_tokens)
    free()


def paired_row(label: str, calls: dict, device: torch.device, *, warmup: int, repeats: int,
               tokens: int | None = None, extra: dict | None = None) -> None:
    """Both sides' calls timed interleaved, each with its own peak above the memory both models hold (the other
    model's weights, and in training its gradients and AdamW state, are resident too: comparable between the sides,
    not with the separate rows' extra); tokens: a decode row's tokens per call; extra: {side: more fields}."""
    cuda = device.type == "cuda"
    peaks = dict.fromkeys(calls, 0)
    free()
    base = torch.cuda.memory_allocated(device) if cuda else None
    try:
        timings = time_interleaved({side: peak_kept(call, peaks, side, device) for side, call in calls.items()},
                                   device=device, warmup=warmup, repeats=repeats)
    except Exception as error:  # each side's cell says why, as guarded does for one side
        for side in calls:
            emit(label, side, status=failure_status(error))
        return
    for side, timing in timings.items():
        rate = {} if tokens is None else {"tokens_per_s": tokens / timing.median}
        emit(label, side, seconds=timing.median, samples=timing.samples, peak_bytes=peaks[side] if cuda else None,
             extra_bytes=peaks[side] - base if cuda else None, **rate, **(extra or {}).get(side, {}))


def job_captured(job: dict) -> None:
    """One side's captured decode at one shape, in a process of its own (a crash ends this job only)."""
    device, side, shape = torch.device(job["device"]), job["side"], shape_of(job["shape"])
    profiled_decode_row(load(job), shape, device, job, side, captured=True)


def profiled_decode_row(model, shape: Shape, device: torch.device, job: dict, side: str, *,
                        captured: bool = False) -> None:
    """decode_row, then one more call of it under the profiler (kernel_row): where an eager step's host time goes
    is what the H200 runs could not see (eager decode 0.82x official's there on 2026-11-30, at 0.98x its Python
    calls and 1.02x its aten calls)."""
    label = f"decode {shape.label()} {'captured' if captured else 'eager'}"
    calls = []
    guarded(label, side, lambda: calls.append(decode_row(model, shape, device, job, side, captured=captured)))
    if calls:
        guarded(f"{label} kernels", side, lambda: kernel_row(calls[0], device, f"{label} kernels", side))


KERNELS_SHOWN = 12


def kernel_row(call, device: torch.device, label: str, side: str) -> None:
    """One more call (compiled and recorded by then) under torch.profiler: its wall time, the device's busy time
    (the kernels' own times summed) and the kernels taking most of it; on a CPU (the dry run), operators' own CPU
    times. Where a side's decode step goes: kernels (which, how many, how long) or idle device (host-bound); on a
    GPU also the host's own calls (launches, copies into the graph's inputs, synchronisations, the eager prefill)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
    synchronize(device)
    start = time.perf_counter()
    with profile(activities=activities) as profiler:
        call()
        synchronize(device)
    wall = time.perf_counter() - start
    own = (lambda e: e.self_device_time_total) if on_gpu else (lambda e: e.self_cpu_time_total)
    averages = profiler.key_averages()
    events = [e for e in averages if own(e) > 0 and (not on_gpu or e.device_type == DeviceType.CUDA)]
    events.sort(key=own, reverse=True)
    host = {}
    if on_gpu:  # the host's side of the same call: what it spent its time on between (or while) kernels ran
        calls = sorted((e for e in averages if e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0),
                       key=lambda e: e.self_cpu_time_total, reverse=True)
        host = {"host_us": sum(e.self_cpu_time_total for e in calls),
                "host_calls": [[e.key[:100], e.count, e.self_cpu_time_total] for e in calls[:KERNELS_SHOWN]]}
    emit(label, side, busy_of="GPU kernels" if on_gpu else "CPU operators (nested ones counted twice)",
         wall_us=wall * 1e6, busy_us=sum(own(e) for e in events), kernel_launches=sum(e.count for e in events),
         kernels=[[e.key[:100], e.count, own(e)] for e in events[:KERNELS_SHOWN]], **host)


def job_longest(job: dict) -> None:
    """The longest sequence one training step (forward, backward, AdamW) fits at batch 1: doubling from
    job["start"], then bisecting to job["resolution"] tokens, every probe after the allocator is emptied."""
    device, side = torch.device(job["device"]), job["side"]
    model = load(job, max_positions=job["cap"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    probes = []

    def fits(length: int) -> bool:
        ok = train_probe(model, optimizer, length, device)
        probes.append([length, ok])
        # what is proven so far, in case the job is cut off during the next probe (the last line counts)
        emit("longest batch 1", side, longest=max([n for n, fit in probes if fit], default=0),
             stopped="cut off during the next probe", probes=probes)
        return ok

    deadline = time.monotonic() + job["seconds"]
    longest, reason = search_longest(fits, start=job["start"], cap=job["cap"], resolution=job["resolution"],
                                     deadline=deadline)
    emit("longest batch 1", side, longest=longest, stopped=reason, probes=probes)


def train_probe(model, optimizer, length: int, device: torch.device) -> bool:
    """One training step on 1 x length tokens: True when it ran, False when it ran out of device memory."""
    ids = random_ids(1, length, model.config.vocab_size, device)
    model.train()
    try:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        ok = True
    except torch.OutOfMemoryError:
        ok = False
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    del ids
    free()
    return ok


def search_longest(fits, *, start: int, cap: int, resolution: int, deadline: float) -> tuple:
    """(the longest length found to fit, why the search stopped): doubling from `start` while `fits(length)`
    holds (up to `cap`), then bisecting between the last fit and the first failure down to `resolution`. Stops
    early at `deadline` (time.monotonic), reporting what was proven so far. (0, ...) when `start` does not fit."""
    if time.monotonic() >= deadline:
        return 0, "time cap before the first probe"
    if not fits(start):
        return 0, f"{start} tokens do not fit"
    good, bad = start, None
    while bad is None:
        if good >= cap:
            return good, f"cap {cap} reached"
        if time.monotonic() >= deadline:
            return good, "time cap while doubling"
        candidate = min(2 * good, cap)
        if fits(candidate):
            good = candidate
        else:
            bad = candidate
    while bad - good > resolution:
        if time.monotonic() >= deadline:
            return good, f"time cap while bisecting (fails at {bad})"
        middle = (good + bad) // 2 // resolution * resolution
        if middle <= good:
            break
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good, f"fails at {bad}"


JOBS = {"build": job_build, "main": job_main, "captured": job_captured, "longest": job_longest,
        "liger_paired": job_liger_paired, "eager_paired": job_eager_paired}


def longest_fit_start(official_longest: int, *, factor: float, resolution: int, cap: int) -> int:
    """Where the fit_memory side's search starts: `factor` times official's longest, rounded up to `resolution`
    (its first probe answers the target), at most `cap`."""
    return min(-(-int(official_longest * factor) // resolution) * resolution, cap)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m benchmarks.gpu_rows JOB_JSON (started by benchmarks.gpu_check)")
    job = json.loads(argv[0])
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    JOBS[job["kind"]](job)


if __name__ == "__main__":
    main()
