"""Prefill time with each side alone in a fresh interpreter, and the page faults it takes.

    python -m benchmarks.fresh_process [--models minilm,smollm2] [--repeats 5] [--calls 5] [--threads N]

`python -m benchmarks.run --device cpu` runs the same measurement for its prefill rows (`--no-fresh-process` skips it).

Why beside the interleaved rows of `benchmarks.run`: on a CPU a prefill's time includes the page faults of the
memory its temporaries are given, and that depends on the state of the allocator, which in one shared process both
sides and the harness change for each other. glibc maps a block from the OS when it is at least its mmap threshold,
and raises the threshold to the size of each mapped block freed; blocks of the same size as the last one freed are
therefore mapped, faulted in page by page and unmapped again on every call. In `benchmarks.run` the GEMM-peak
measurement (16 MiB matrices) lifts the threshold above SmolLM2's temporaries for both sides before any row runs;
a user's process, which runs only the model, does not get that. Here each repeat starts one interpreter per side
(official, then hf_tiny), which loads the model, runs one warm-up prefill and times `--calls` more, counting each
call's minor page faults (getrusage). Printed: per side the median over the repeats of each process's median time,
and of its faults per call; same shapes, dtype (fp32) and backend (sdpa) as the prefill rows of the report.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import time
from pathlib import Path

import torch

from .measure import run_json_process
from .models import MODELS, OFFICIAL, official_folder, convert_hf_tiny, load_model
from .plans import make_plan
from .workloads import Shape, build_prefill, prefill_kwargs

SIDES = (OFFICIAL, "hf_tiny")


def child(spec: dict) -> dict:
    """One side in this (fresh) interpreter: per-call seconds and minor page faults of `calls` prefills."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    model_spec = MODELS[spec["model"]]
    model = load_model(model_spec, spec["impl"], Path(spec["folder"]), dtype=torch.float32,
                       device=torch.device("cpu"), attn=spec.get("attn", "sdpa"))
    if spec.get("drop_pooler"):  # as run.py's align_work: hf_tiny's encoder has none to match it
        model.pooler = None
    shape = Shape(spec["batch"], spec["seq"])
    prefill = build_prefill(model, model_spec.family, shape, torch.device("cpu"), prefill_kwargs({"model": model}))
    prefill()
    seconds, faults = [], []
    for _ in range(spec["calls"]):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        prefill()
        seconds.append(time.perf_counter() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return {"seconds": seconds, "faults": faults}


def run_child(spec: dict) -> dict:
    answer, failure = run_json_process("benchmarks.fresh_process", ["--child", json.dumps(spec)])
    if answer is None:
        raise RuntimeError(f"{spec['impl']} process for {spec['model']} {failure}")
    return answer


def measure_folders(model: str, folders: dict, shape: Shape, *, repeats: int, calls: int, threads=None,
                    attn: str = "sdpa") -> dict:
    """Per side (folders: {"official": ..., "hf_tiny": ...}): median over `repeats` fresh processes of each one's
    median prefill time (ms, with the min and max of those) and minor page faults per call."""
    per_side = {side: {"times": [], "faults": []} for side in SIDES}
    drop_pooler = MODELS[model].family == "encoder" and not _has_pooler(folders["hf_tiny"])
    for _ in range(repeats):
        for side in SIDES:
            result = run_child(dict(model=model, impl=side, folder=str(folders[side]), calls=calls, threads=threads,
                                    attn=attn, batch=shape.batch, seq=shape.seq,
                                    drop_pooler=drop_pooler and side == OFFICIAL))
            per_side[side]["times"].append(statistics.median(result["seconds"]))
            per_side[side]["faults"].append(statistics.median(result["faults"]))
    summary = {side: {"ms": 1000 * statistics.median(v["times"]), "ms_min": 1000 * min(v["times"]),
                      "ms_max": 1000 * max(v["times"]), "faults": statistics.median(v["faults"])}
               for side, v in per_side.items()}
    return {"model": model, "shape": shape.label(), "repeats": repeats, "calls": calls, **summary}


def _has_pooler(folder) -> bool:
    """Whether an hf_tiny encoder folder's base model has a pooler (TinyEncoderConfig.add_pooling_layer)."""
    return json.loads((Path(folder) / "config.json").read_text()).get("add_pooling_layer", True)


def measure(model: str, repeats: int, calls: int, threads) -> dict:
    """At the report's prefill shape, from the report's checkpoints (the hf_tiny one converted again)."""
    spec = MODELS[model]
    official = official_folder(spec)
    folders = {OFFICIAL: official, "hf_tiny": convert_hf_tiny(spec, official)}
    shape = make_plan(torch.device("cpu"), quick=False).prefill[spec.family]
    return measure_folders(model, folders, shape, repeats=repeats, calls=calls, threads=threads)


def markdown_rows(results: list) -> list[str]:
    lines = ["| model | shape | official | hf_tiny | hf_tiny/official | official faults/call | hf_tiny faults/call |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        o, t = r[OFFICIAL], r["hf_tiny"]
        lines.append(f"| {r['model']} | {r['shape']} | {o['ms']:,.1f} ms [{o['ms_min']:,.0f}–{o['ms_max']:,.0f}] | "
                     f"{t['ms']:,.1f} ms [{t['ms_min']:,.0f}–{t['ms_max']:,.0f}] | {t['ms'] / o['ms']:.2f} | "
                     f"{o['faults']:,.0f} | {t['faults']:,.0f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="minilm,smollm2")
    parser.add_argument("--repeats", type=int, default=5, help="processes per side")
    parser.add_argument("--calls", type=int, default=5, help="timed prefills per process")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in ("minilm", "smollm2", "overhead")]
    if unknown:
        parser.error(f"--models: unknown or not a CPU model: {', '.join(unknown)}; choose from minilm, smollm2, overhead")
    print(f"# Prefill, each side alone in a fresh process — {datetime.date.today()}, {os.cpu_count()} CPUs, torch "
          f"threads {args.threads or torch.get_num_threads()}, torch {torch.__version__}, fp32, sdpa")
    print(f"\n`python -m benchmarks.fresh_process --models {args.models} --repeats {args.repeats} --calls {args.calls}`: "
          f"{args.repeats} processes per side, alternating, each timing {args.calls} prefills after one warm-up; "
          "median over processes of each process's median [min–max of those], and minor page faults per call.\n")
    print("\n".join(markdown_rows([])), flush=True)
    for model in models:
        print(markdown_rows([measure(model, args.repeats, args.calls, args.threads)])[-1], flush=True)


if __name__ == "__main__":
    main()
