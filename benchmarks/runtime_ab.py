"""What the runtime's training recompute buys and costs: a training step of official, hf_tiny with the runtime on,
and hf_tiny with it off (`model.set_runtime(False)`: the modeling files' math only), each in its own process.

    python -m benchmarks.runtime_ab [--models minilm,overhead] [--repeats 3] [--threads 1]

Time: process CPU time of one step (forward + backward + AdamW, benchmarks.workloads), median of --repeats after
one warm-up, with --threads intra-op threads (1 by default: CPU time is then steady under other load). Memory:
peak RSS above the RSS before two steps, after one warm-up step (AdamW's state exists), with glibc's mmap
threshold lowered as benchmarks.measure does. Prints a markdown table; the ratios are against the runtime off.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import torch

from .measure import PROBE_ENV, rss_peak_bytes, run_json_process
from .models import HF_TINY, MODELS, OFFICIAL, load_pair, align_work
from .plans import make_plan
from .workloads import TRAIN, Shape, build

SIDES = ("official", "runtime on", "runtime off")
# The report's CPU plan: its models and their training-step shapes.
CPU_PLAN = make_plan(torch.device("cpu"), quick=False)


def train_shape(name: str) -> Shape:
    return CPU_PLAN.train[MODELS[name].family]


def measure_side(name: str, side: str, repeats: int, threads: int, memory: bool) -> dict:
    """One side's step time (CPU seconds, median) or peak memory (bytes), in this process."""
    torch.set_num_threads(threads)
    spec, device = MODELS[name], torch.device("cpu")
    _, models, errors = load_pair(spec, device, torch.float32, "sdpa", refresh=False)
    if HF_TINY not in models:
        raise RuntimeError(errors[HF_TINY])
    align_work(spec, models)
    model = models[OFFICIAL] if side == "official" else models[HF_TINY]
    if side == "runtime off":
        model.set_runtime(False)
    step = build(TRAIN, model, spec.family, train_shape(name), device)
    step()
    if memory:
        return {"peak_bytes": rss_peak_bytes(step, calls=2)}
    times = []
    for _ in range(repeats):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return {"seconds": statistics.median(times), "all": times}


def _in_fresh_process(name: str, side: str, args, memory: bool) -> dict:
    argv = ["--child", json.dumps({"name": name, "side": side, "memory": memory}),
            "--repeats", str(args.repeats), "--threads", str(args.threads)]
    answer, failure = run_json_process("benchmarks.runtime_ab", argv, env=PROBE_ENV if memory else None)
    if answer is None:
        raise RuntimeError(f"{name} / {side}: {failure}")
    return answer


def report(args) -> str:
    lines = [
        f"# Training step: the runtime's recompute on and off — {datetime.date.today()}",
        "",
        f"- command: `python -m benchmarks.runtime_ab --models {','.join(args.models)} --repeats {args.repeats} "
        f"--threads {args.threads}`; torch {torch.__version__}; each side in its own process",
        "- time: process CPU time per step, median; memory: peak RSS above the start of two steps (after one)",
        "",
        "| model | shape | side | time per step | / runtime off | peak memory | / runtime off |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in args.models:
        rows = {side: {**_in_fresh_process(name, side, args, False), **_in_fresh_process(name, side, args, True)}
                for side in SIDES}
        off = rows["runtime off"]
        for side in SIDES:
            row = rows[side]
            lines.append(
                f"| {name} | {train_shape(name).label()} | {side} | {row['seconds'] * 1000:,.0f} ms "
                f"[{min(row['all']) * 1000:,.0f}–{max(row['all']) * 1000:,.0f}] | {row['seconds'] / off['seconds']:.2f} | "
                f"{row['peak_bytes'] / 2**20:,.1f} MiB | {row['peak_bytes'] / off['peak_bytes']:.2f} |"
            )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="minilm,overhead", type=lambda text: text.split(","))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        job = json.loads(args.child)
        print(json.dumps(measure_side(job["name"], job["side"], args.repeats, args.threads, job["memory"])), flush=True)
        return
    unknown = [name for name in args.models if name not in CPU_PLAN.models]
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {CPU_PLAN.models}")
    print(report(args))


if __name__ == "__main__":
    sys.exit(main())
