"""Timing and peak-memory measurement.

Timing: warm-up calls, then `repeats` timed calls per contender, interleaved (A B, B A, A B, ...) so that load
drifts on a shared machine hit every contender alike; the device is synchronized around each call. The median is
the reported number, min and max are kept to show the spread.

Peak memory (extra bytes a call needs above the loaded model and its inputs):
- CUDA: torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), minus memory_allocated() before.
- CPU: tracemalloc does not see torch's allocations, and torch keeps no CPU peak counter, so each case runs in a
  fresh subprocess (benchmarks/memory_probe.py) that reads the kernel's resident-set high-water mark: reset
  VmHWM (write "5" to /proc/self/clear_refs), read VmRSS, run the call, read VmHWM; the peak is the difference.
  The subprocess is started with MALLOC_MMAP_THRESHOLD_=65536 so glibc serves every large tensor with its own
  mmap and returns it on free: the RSS then follows live tensor memory instead of the allocator's free lists.
  A calibration case (allocate and touch a known number of bytes) is reported alongside to show the method's
  error.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

MIB = 1024 * 1024
# What a timed call's seconds are: elapsed time, or this process's CPU time (steadier on a shared machine, and the
# same thing as elapsed time only with one torch thread on a CPU).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """Seconds per call of one contender."""

    samples: list[float] = field(default_factory=list)
    last_output: object = field(default=None, repr=False)  # what the last timed call returned (not serialized)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> tuple[float, float]:
        return min(self.samples), max(self.samples)

    def as_dict(self) -> dict:
        return {"median_s": self.median, "min_s": min(self.samples), "max_s": max(self.samples), "samples_s": self.samples}


def time_interleaved(
    contenders: dict[str, Callable[[], object]],
    *,
    device: torch.device,
    warmup: int,
    repeats: int,
    warmup_contenders: Optional[dict[str, Callable[[], object]]] = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Timing]:
    """Median-of-`repeats` timing of each callable, after `warmup` untimed calls each.

    `warmup_contenders` (same keys) replaces the callables during warm-up, e.g. a short generate() that compiles
    and allocates what the long one needs without costing its full time.
    `clock`: wall time by default; time.process_time (CPU seconds of this process) is steadier on a machine
    shared with other jobs, and means the same thing as wall time only with one torch thread on the CPU.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0; got repeats={repeats}, warmup={warmup}")
    warm = warmup_contenders or contenders
    for _ in range(warmup):
        for name in contenders:
            warm[name]()
    synchronize(device)
    timings = {name: Timing() for name in contenders}
    names = list(contenders)
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else reversed(names):
            synchronize(device)
            start = clock()
            output = contenders[name]()
            synchronize(device)
            timings[name].samples.append(clock() - start)
            timings[name].last_output = output
    return timings


def cuda_peak_bytes(fn: Callable[[], object], device: torch.device, calls: int = 2) -> int:
    """Extra CUDA memory `calls` calls of fn need at their peak, above what is allocated before."""
    synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    for _ in range(calls):
        fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


# ---- CPU: resident-set high-water mark of a fresh process ---------------------------------------------------------

def _proc_status_kib(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field_name} line; the CPU memory probe needs Linux")


def reset_rss_peak() -> None:
    """Resets VmHWM to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def rss_peak_bytes(fn: Callable[[], object], calls: int = 2) -> int:
    """Extra resident memory `calls` calls of fn reach at their peak, above the RSS before (same process)."""
    reset_rss_peak()
    base = _proc_status_kib("VmRSS")
    for _ in range(calls):
        fn()
    return (_proc_status_kib("VmHWM") - base) * 1024


def count_aten_ops(fn: Callable[[], object]) -> int:
    """aten operator calls of one call of fn, nested calls included (torch.profiler, CPU side). Unlike time, this
    does not depend on machine load: it is the dispatcher and Python work the call asks for."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(event.count for event in prof.key_averages() if event.key.startswith("aten::"))


# Where a step's time goes, by the aten calls' self times (profile_groups).
GROUPS = ("weight matmuls", "attention kernel", "copies", "other aten ops", "outside aten ops")
# bmm / baddbmm: hf_tiny's one-row product, one slice of the weight per thread (hf_tiny/runtime.py)
WEIGHT_PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
COPIES = ("aten::cat", "aten::index_copy_", "aten::copy_", "aten::clone", "aten::contiguous")


def group_of(event) -> str:
    """The group of one profiled aten call (a torch.profiler FunctionEvent): whatever runs inside an attention
    operator (the math backend's bmm, softmax) is attention, not a weight product."""
    if _inside_attention(event):
        return "attention kernel"
    if event.name in WEIGHT_PRODUCTS:
        return "weight matmuls"
    if event.name in COPIES:
        return "copies"
    return "other aten ops"


def _inside_attention(event) -> bool:
    while event is not None:
        if "scaled_dot_product" in event.name:
            return True
        event = event.cpu_parent
    return False


def group_self_times(events, wall_us: float) -> dict:
    """Self CPU time (µs) of the aten calls among `events` by group, and as "outside aten ops" the rest of the
    wall time `wall_us` they were profiled in (Python, at least 0)."""
    by_group = dict.fromkeys(GROUPS, 0.0)
    for event in events:
        if event.name.startswith("aten::"):
            by_group[group_of(event)] += event.self_cpu_time_total
    by_group["outside aten ops"] = max(0.0, wall_us - sum(by_group.values()))
    return by_group


def profile_groups(fn: Callable[[], object]) -> dict:
    """One call of fn under torch.profiler (CPU side): {group: µs} (group_self_times), "wall" (µs, profiled) and
    "aten_calls". The profiler slows the Python side, so "outside aten ops" is somewhat overstated."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    wall_us = (time.perf_counter() - start) * 1e6
    events = prof.events()
    aten_calls = sum(1 for event in events if event.name.startswith("aten::"))
    return {**group_self_times(events, wall_us), "wall": wall_us, "aten_calls": aten_calls}


def count_python_calls(fn: Callable[[], object]) -> int:
    """Python-level function calls (built-ins included) of one call of fn, counted by cProfile; like aten calls,
    a load-independent measure of the interpreter work a call costs."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        fn()
    finally:
        profiler.disable()
    return pstats.Stats(profiler).total_calls


def count_python_calls_outside_graphs(fn: Callable[[], object]) -> int:
    """count_python_calls, less the calls made inside the graphs dynamo compiled with a Python backend (its "eager"
    backend runs each FX graph's generated code, in files named "<eval_with_key>..."): the host work around a
    compiled step, which a GPU's CUDA graph replay leaves as it is."""
    calls, inside = 0, 0

    def record(frame, event, arg):
        nonlocal calls, inside
        if event == "call":
            if inside or frame.f_code.co_filename.startswith("<eval_with_key"):
                inside += 1
            else:
                calls += 1
        elif event == "return" and inside:
            inside -= 1
        elif event == "c_call" and not inside:
            calls += 1

    previous = sys.getprofile()
    sys.setprofile(record)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return calls


def print_table(header: str, lines: list[str], out=None) -> None:
    """Prints a benchmark's header line and table; with `out` (a Path), also writes them there as a results page."""
    print(header, *lines, sep="\n")
    if out is not None:
        out.write_text(f"# {header}\n\n" + "\n".join(lines) + "\n")


PROBE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def run_memory_probe(spec: dict, timeout_s: float = 900.0) -> dict:
    """Runs benchmarks.memory_probe in a fresh interpreter with `spec` (JSON) and returns its JSON answer."""
    answer, failure = run_json_process("benchmarks.memory_probe", [json.dumps(spec)], env=PROBE_ENV,
                                       timeout_s=timeout_s)
    # a failed probe is reported in the table, not raised
    return answer if answer is not None else {"error": f"memory probe {failure}"}


def run_json_process(module: str, argv: list[str], *, env: Optional[dict] = None, cwd=None,
                     timeout_s: Optional[float] = None) -> tuple[Optional[dict], str]:
    """`python -m module *argv` in a fresh interpreter (environment variables `env` added, the current folder
    first on PYTHONPATH). Returns (the last JSON object line it printed, ""), or (None, "exited with N: the
    last lines of its output") when it failed or printed none."""
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), full_env.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", module, *argv],
        capture_output=True, text=True, timeout=timeout_s, env=full_env, cwd=cwd, check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return None, f"exited with {proc.returncode}: {' | '.join(tail)}"
    return json.loads(lines[-1]), ""
