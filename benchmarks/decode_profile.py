"""`python -m benchmarks.decode_profile [--model smollm2] [--batches 1,8] [--new-tokens 32]`: where a greedy decode
step's time goes, hf_tiny and official transformers side by side (same weights, fp32, sdpa, CPU).

Each side runs generate() `--repeats` times unprofiled (the median step time) and once under torch.profiler
(which slows the Python side, so its shares overstate "outside aten ops" a little); the profile's self times
are grouped: weight matrix products (aten::mm / addmm, and bmm / baddbmm outside attention: hf_tiny's one-row
product; the weights are read here), the attention kernel (with whatever runs inside it), copies
(the KV cache's cat / index_copy, contiguous), the other aten operators (norms, RoPE, activations, sampling), and
the rest of the step's wall time outside any aten operator (Python: modules, generate()'s loop, the cache's
bookkeeping). The weight bytes a step must read divided by the time in the matrix products is the bandwidth those
products reach, against the read bandwidth measured in the same run; a step's product time holds 1/N of the
prefill's (N new tokens), which reads the weights once more, so that rate is understated by about 1/N. The two
sides run one after the other, not interleaved. Writes decode-profile-<device>-<date>.md.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import torch

from . import roofline
from .measure import GROUPS, profile_groups
from .machine import RESULTS_DIR, cpu_model
from .models import HF_TINY, MODELS, OFFICIAL, load_pair
from .workloads import Shape, build_generate


def profile_generate(fn, steps: int) -> dict:
    """Per decode step: ms by group, aten calls; profiled wall time included."""
    profiled = profile_groups(fn)
    return {"ms_per_step": {g: profiled[g] / 1e3 / steps for g in GROUPS},
            "aten_calls_per_step": profiled["aten_calls"] / steps, "profiled_ms_per_step": profiled["wall"] / 1e3 / steps}


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=[n for n, s in MODELS.items() if s.family == "causal"])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="unprofiled runs per side; the median is reported")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    device, dtype = torch.device("cpu"), torch.float32
    spec = MODELS[args.model]
    _, models, errors = load_pair(spec, device, dtype, "sdpa", refresh=False)
    if errors:
        raise SystemExit(f"hf_tiny side missing: {errors}")
    bandwidth = roofline.memory_bandwidth(device, 512)["read_bytes_per_s"]
    arch = roofline.Arch.from_config(models[OFFICIAL].config, "causal")
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        shape = Shape(batch=batch, seq=args.prompt, new_tokens=args.new_tokens)
        # weight bytes one decode step must read (the K/V cache excluded: small at these lengths)
        weight_bytes = roofline.generate_bytes(arch, batch=batch, prompt=0, new_tokens=1, bytes_per_value=4)
        for impl in (OFFICIAL, HF_TINY):
            fn = build_generate(models[impl], shape, device)
            fn()  # warm-up
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                tokens = fn()
                times.append((time.perf_counter() - start) * 1e3 / args.new_tokens)
            step_ms = statistics.median(times)
            profiled = profile_generate(fn, args.new_tokens)
            matmul_s = profiled["ms_per_step"]["weight matmuls"] / 1e3
            rows.append(dict(impl=impl, batch=batch, step_ms=step_ms, tokens=tokens, **profiled,
                             matmul_bandwidth=weight_bytes / matmul_s if matmul_s else float("nan")))
        same = torch.equal(rows[-1].pop("tokens"), rows[-2].pop("tokens"))
        rows[-1]["same_tokens"] = rows[-2]["same_tokens"] = same
    markdown = render(rows, args, bandwidth, weight_bytes_b1=roofline.generate_bytes(
        arch, batch=1, prompt=0, new_tokens=1, bytes_per_value=4))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decode-profile-cpu-{datetime.date.today().isoformat()}.md"
    path.write_text(markdown)
    print(markdown)
    return markdown


def render(rows, args, bandwidth, weight_bytes_b1) -> str:
    lines = [
        f"# Where a decode step's time goes: {args.model}, fp32, sdpa, CPU ({datetime.date.today().isoformat()})",
        "",
        f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}. Command: `python -m "
        f"benchmarks.decode_profile --model {args.model} --batches {args.batches} --prompt {args.prompt} --new-tokens "
        f"{args.new_tokens} --repeats {args.repeats}`. Greedy generate() of {args.new_tokens} tokens after a {args.prompt}-token prompt; "
        f"times per generated token (prefill included, 1/{args.new_tokens} of it per step).",
        "",
        f"A step reads {weight_bytes_b1 / 1e6:.0f} MB of weights; read bandwidth measured in this run: "
        f"{bandwidth / 1e9:.1f} GB/s, so the weight reads alone need {weight_bytes_b1 / bandwidth * 1e3:.1f} ms.",
        "",
        "| side | batch | ms/step (unprofiled, median) | ms/step profiled | " + " | ".join(GROUPS)
        + " | aten calls/step | weight-matmul GB/s | tokens identical |",
        "|---|---|---|---|" + "---|" * len(GROUPS) + "---|---|---|",
    ]
    for r in rows:
        groups = " | ".join(f"{r['ms_per_step'][g]:.1f} ({r['ms_per_step'][g] / r['profiled_ms_per_step']:.0%})"
                            for g in GROUPS)
        lines.append(f"| {r['impl']} | {r['batch']} | {r['step_ms']:.1f} | {r['profiled_ms_per_step']:.1f} | {groups} | "
                     f"{r['aten_calls_per_step']:.0f} | {r['matmul_bandwidth'] / 1e9:.1f} | {r['same_tokens']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
