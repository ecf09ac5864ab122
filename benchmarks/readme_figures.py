"""Every figure in README.md and docs/*.md that a benchmark measured, with the command that measures it again.

    python -m benchmarks.readme_figures                 # the list, as a markdown table
    python -m benchmarks.readme_figures --check         # which pages no longer state what their results files hold
    python -m benchmarks.readme_figures --run cheap     # rerun the cheap ones (seconds, load-independent)
    python -m benchmarks.readme_figures --run cpu       # rerun every CPU one, one after the other (~3.9 h)
    python -m benchmarks.readme_figures --run few-rows,fusion [--dry-run]

Each entry names the page that states its figures, a passage of that page next to them (the command, as a rule),
the results files the page links to, and the figures it quotes: each quote must stand in its page (README.md may
quote a figure of a docs page) and in one of the results files, as the results file writes it. So `--check`
reports a passage that is gone, a results file that is missing or no longer linked, and a figure that a page
states differently from its results file (exit status 1).

Each rerun writes its results page into benchmarks/results/ under today's date (commands that only print are
sent to the file named in the list). An entry whose command needs something the rerun cannot set up (another
transformers, another checkout) names it and is skipped by --run with that reason. Run the timed ones on a quiet
machine: their figures are times and ratios.
Figures that no command reproduces (ad-hoc A/Bs that were not committed, sums over several runs, states of the
code before a change) are listed under HISTORICAL with the reason.
"""

from __future__ import annotations

import argparse
import datetime
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from .machine import REPO_ROOT, RESULTS_DIR

README = "README.md"
SPEED = "docs/speed-and-memory.md"
FAMILIES = "docs/families.md"
CONVERSION = "docs/conversion.md"
ARCHITECTURE = "docs/architecture.md"
COMPATIBILITY = "docs/compatibility.md"


@dataclass(frozen=True)
class Quote:
    page: str  # README.md or docs/<name>.md
    text: str  # the figure as the page states it
    source: str = ""  # as the results file writes it, where the page rounds or formats it otherwise


def quotes(page: str, *figures: Union[str, tuple[str, str]]) -> tuple[Quote, ...]:
    """Quotes of one page: "figure" (written alike in the page and the results file) or ("page's", "results'")."""
    return tuple(Quote(page, f) if isinstance(f, str) else Quote(page, *f) for f in figures)


@dataclass(frozen=True)
class Figure:
    name: str
    page: str  # the page that states the figures and links the results files
    passage: str  # a passage of that page next to the figures, to find them
    figures: str  # what the page states from this run
    command: str  # run from the repository root
    minutes: float  # on the 2-core development machine
    kind: str  # "cheap" (seconds, load-independent), "cpu" (timed: a quiet machine) or "cuda"
    stdout_to: Optional[str] = None  # results file for a command that only prints ({date} = today)
    needs: str = ""  # what the command needs that --run cannot set up (it is skipped, with this reason)
    results: tuple[str, ...] = ()  # files in benchmarks/results/ the page links to and quotes
    quotes: tuple[Quote, ...] = ()


RUN = "python -m benchmarks.run --device cpu"
GPU_CHECK_CALLS = ("an H100 / H200, and a second call with --stages on it, then python -m benchmarks.gpu_report "
                   "--merge (benchmarks/gpu_check.sh's header)")
VENV_5_17 = "transformers==5.17.0 (the GPU image's) installed instead of the tested newest"
FIGURES = [
    Figure("kv-cache", FAMILIES, "python -m benchmarks.kv_cache", "KV-cache bytes per token and layer, MHA / GQA / "
           "MQA / MLA", "python -m benchmarks.kv_cache --tokens 256 --layers 2 --dtype bfloat16", 0.2, "cheap",
           results=("kv-cache-2026-11-26.md",), quotes=quotes(FAMILIES, "8,192", "2,048", "1,152", "0.141")),
    Figure("full", SPEED, "--repeats 3 --tag full", "the speed and memory table (prefill, train step, generate, peak "
           "memory, the vLLM row), GEMM peak, decode GB/s and roofline shares, the fresh-process section",
           f"{RUN} --repeats 3 --tag full", 35, "cpu", results=("cpu-2026-11-26-full.md",),
           quotes=quotes(SPEED, "592.1 ms", "564.4 ms", "1,426.6 ms", "1,411.6 ms", ("12,331 ms", "12,330.9 ms"),
                         ("12,542 ms", "12,541.7 ms"), ("| 33.9 |", "33.9 tok/s"), ("| 117.7 |", "117.7 tok/s"),
                         ("4,833 MiB", "4,833.0 MiB"), ("2,785 MiB", "2,785.1 MiB"), "168.1", "166.2",
                         ("193 GFLOP/s", "193.2 GFLOP/s"), "51.5 GB/s", ("18.4 GB/s", "18.38 GB/s"), "651.4 ms",
                         "589.1 ms", "1,604.8 ms", "1,477.8 ms")
           + quotes(README, ("1.89×", "1.89"), ("1.21× at batch 8", "1.21"), ("51.5 GB/s", "51.5 GB/s"), ("2,785 MiB", "2,785.1 MiB"),
                    ("4,833 MiB", "4,833.0 MiB"), ("(0.58×)", "0.58"), ("1.02×", "1.02"), ("0.99×", "0.99"))),
    Figure("decode-avx2", SPEED, "--tag decode-avx2", "batch-1 and batch-8 decode on a second host, with its "
           "bandwidth and GEMM ceilings", f"{RUN} --models smollm2 --cases generate --no-sweep --no-memory --repeats 3 "
           "--tag decode-avx2", 5, "cpu", results=("cpu-2026-11-27-decode-avx2.md",),
           quotes=quotes(SPEED, "30.7 GB/s", ("GEMM peak 162", "162.4 GFLOP/s"), ("**1.11×**", "1.11"), "13.6", "15.1",
                         ("1.23× at batch 8", "1.23"), ("| 1.11x | 1.23x | 13.6 tokens/s |", "1.11"))),
    Figure("decode-avx2-runs", SPEED, "run four times that day", "batch-1 and batch-8 decode, three more runs on the "
           "second host (before and after the feed-forwards' few-rows forms)", f"{RUN} --models smollm2 --cases "
           "generate --no-sweep --no-memory --repeats 3", 5, "cpu",
           results=("cpu-2026-11-27-decode-avx2-d42b68f.md", "cpu-2026-11-27-ffform.md",
                    "cpu-2026-11-27-decode-avx2-ffform-2.md"),
           quotes=quotes(SPEED, ("| 1.05x | 1.06x | 15.3 tokens/s |", "15.3 tok/s"), ("| 1.22x | 1.23x | 14.0 tokens/s |", "14.0 tok/s"),
                         ("| 1.28x | 1.04x | 12.2 tokens/s |", "12.2 tok/s"), ("30.3–35.1 GB/s", "35.1 GB/s"))
           + quotes(README, ("1.05–1.28×", "1.28"), ("1.04–1.23×", "1.04"), ("12.2", "12.2 tok/s"), ("30.3–35.1 GB/s", "30.3 GB/s"))),
    Figure("decode-avx512", SPEED, "--tag decode-avx512", "batch-1 and batch-8 decode, two runs on a third host (AVX-512) "
           "with its bandwidth and GEMM ceilings", f"{RUN} --models smollm2 --cases generate --no-sweep --no-memory "
           "--repeats 3 --tag decode-avx512", 3, "cpu",
           results=("cpu-2026-11-28-decode-avx512.md", "cpu-2026-11-28-decode-avx512-2.md"),
           quotes=quotes(SPEED, ("| 1.80x | 1.19x | 25.2 tokens/s |", "25.2 tok/s"),
                         ("| 1.62x | 1.13x | 25.5 tokens/s |", "25.5 tok/s"), ("77.5–77.7 GB/s", "77.7 GB/s"),
                         ("GEMM peak 221–222", "222.2 GFLOP/s"))
           + quotes(README, ("77.5–77.7 GB/s", "77.5 GB/s"), ("1.62–1.80×", "1.80"), ("1.13–1.19×", "1.19"))),
    Figure("train-avx512", SPEED, "--tag\ntrain-avx512", "a SmolLM2 training step's peak memory and time on the "
           "third host", f"{RUN} --models smollm2 --cases train_step --no-sweep --no-ops --repeats 3 --tag train-avx512",
           4, "cpu", results=("cpu-2026-11-28-train-avx512.md",),
           quotes=quotes(SPEED, ("0.58x official's memory at 0.74x its time", "0.74"))
           + quotes(README, ("0.58× at 0.74× the time", "0.58"))),
    Figure("fresh-process-avx512", SPEED, "fresh-process-prefill-cpu-2026-11-28-avx512.md", "fresh-process prefill on "
           "the third host", "python -m benchmarks.fresh_process --models minilm,smollm2 --repeats 5 --calls 5", 4,
           "cpu", "fresh-process-prefill-cpu-{date}.md", results=("fresh-process-prefill-cpu-2026-11-28-avx512.md",),
           quotes=quotes(SPEED, ("0.91x (MiniLM)", "0.91"), ("0.87x (SmolLM2)", "0.87"))
           + quotes(README, ("0.91× and 0.87×", "0.87"))),
    Figure("train-avx2", README, "--cases train_step --no-sweep --no-ops --repeats 3", "a SmolLM2 training step's "
           "peak memory and time on the second host", f"{RUN} --models smollm2 --cases train_step --no-sweep --no-ops "
           "--repeats 3 --tag train-avx2", 7, "cpu", results=("cpu-2026-11-27-train-avx2.md",),
           quotes=quotes(README, ("0.58× again", "0.58"), ("0.87× the time", "0.87"))),
    Figure("host-work-smollm2", SPEED, "host-work-cpu-2026-11-27-smollm2-forms.md", "Python calls of a prefill and a "
           "decoding step on SmolLM2's shapes, where the few-row products act", "python -m benchmarks.host_work --models "
           "smollm2 --prompt 16 --repeats 3", 2, "cheap", "host-work-cpu-{date}-smollm2.md",
           results=("host-work-cpu-2026-11-27-smollm2-forms.md",),
           quotes=quotes(SPEED, "7,164", "6,646", "6,166", "5,719", ("0.89x", "0.89"), ("0.87x", "0.87"))),
    Figure("decode-ffform-ab", SPEED, "--tag decode-ffform-ab", "A/B of the feed-forwards' few-rows forms against "
           "d42b68f (calls and time per decode step)", "python -m benchmarks.side_by_side --before <d42b68f checkout> "
           "--after . --models smollm2 --cases generate --repeats 5 --tag decode-ffform-ab", 19, "cpu",
           needs="a checkout of d42b68f, named in place of <d42b68f checkout>",
           results=("side-by-side-cpu-2026-11-27-decode-ffform-ab.md",),
           quotes=quotes(SPEED, ("0.96x the time at batch 1", "0.963"), ("1.05x at batch 8", "1.054"), "8,632")),
    Figure("conversion-avx2", CONVERSION, "conversion-memory-2026-11-27-avx2.md", "the 8B conversion on a second host "
           "and where its time goes", "python -m benchmarks.conversion_memory --models llama3_8b", 8, "cpu",
           results=("conversion-memory-2026-11-27-avx2.md",),
           quotes=quotes(CONVERSION, "138.7 s", "87.5 s", "2.94 GiB", ("(0.20×)", "0.20x"), ("2.3–4.1×", "4.1x"))
           + quotes(README, "2.94 GiB", ("(0.20×)", "0.20x"), ("1.6×", "1.6x"))),
    Figure("conversion-avx512", CONVERSION, "conversion-memory-2026-11-28-avx512.md", "the 8B conversion on a third "
           "host (AVX-512 with bf16 instructions, a fast disk)", "python -m benchmarks.conversion_memory --models "
           "llama3_8b", 4, "cpu", results=("conversion-memory-2026-11-28-avx512.md",),
           quotes=quotes(CONVERSION, "28.2 s", "12.3 s", "2.95 GiB", ("2.3×", "2.3x"))
           + quotes(README, "28.2 s", "12.3 s", "2.95 GiB", ("2.3×", "2.3x"))),
    Figure("host-work-5.17", SPEED, "host-work-cpu-2026-11-28-transformers-5.17.md", "Python calls of a prefill and "
           "a decoding step with the GPU image's transformers (5.17)", "python -m benchmarks.host_work --models "
           "overhead --prompt 16 --repeats 3", 0.2, "cheap", "host-work-cpu-{date}-transformers-5.17.md",
           needs=VENV_5_17,
           results=("host-work-cpu-2026-11-28-transformers-5.17.md",),
           quotes=quotes(SPEED, "5,364", "5,422", "5,232", "5,294", "5,121", "5,441", "5,503")),
    Figure("host-work-gpu-rows", SPEED, "host-work-gpu-rows-cpu-2026-11-28-transformers-5.17.md", "the GPU page's "
           "host-work rows counted on a CPU with transformers 5.17, and against the H200's counts",
           "python -m benchmarks.host_work --gpu-check-rows", 0.3, "cheap",
           "host-work-gpu-rows-cpu-{date}-transformers-5.17.md", needs=VENV_5_17,
           results=("host-work-gpu-rows-cpu-2026-11-28-transformers-5.17.md",),
           quotes=quotes(SPEED, "3,705", "4,173", "3,631", "4,117", ("(0.980x", "0.980"), ("0.987x)", "0.987"), "3,778",
                         "4,264", "3,780", "4,257", ("0.985x", "0.985x"), ("0.993x", "0.993x"))),
    Figure("host-work-gpu-rows-captured", SPEED, "host-work-gpu-rows-cpu-2026-11-28-transformers-5.17-captured.md",
           "the GPU page's host-work rows and its captured decoding steps around the compiled graph, with "
           "transformers 5.17 (and 5.24)", "python -m benchmarks.host_work --gpu-check-rows", 0.7, "cheap",
           "host-work-gpu-rows-cpu-{date}-transformers-5.17-captured.md", needs=VENV_5_17,
           results=("host-work-gpu-rows-cpu-2026-11-28-transformers-5.17-captured.md",),
           quotes=quotes(SPEED, "778", "850", ("753 / 825", "| 753 |"), "832", "904", "863 / 935", ("(1.003x)", "1.003"))),
    Figure("host-work-captured-masks", SPEED, "host-work-gpu-rows-cpu-2026-11-28-transformers-5.17-masks.md",
           "captured decoding's host work around the graph once eager / sdpa build generate's static-cache masks "
           "inside the step, transformers 5.17", "python -m benchmarks.host_work --gpu-check-rows", 0.7, "cheap",
           "host-work-gpu-rows-cpu-{date}-transformers-5.17-masks.md", needs=VENV_5_17,
           results=("host-work-gpu-rows-cpu-2026-11-28-transformers-5.17-masks.md",),
           quotes=quotes(SPEED, "778", "850", "580", "652", ("(0.746x", "0.746"), ("0.767x)", "0.767"))),
    Figure("host-work-captured-masks-5.24", SPEED, "host-work-gpu-rows-cpu-2026-11-28-transformers-5.24-masks.md",
           "the same with transformers 5.24", "python -m benchmarks.host_work --gpu-check-rows", 0.7, "cheap",
           "host-work-gpu-rows-cpu-{date}-transformers-5.24-masks.md",
           results=("host-work-gpu-rows-cpu-2026-11-28-transformers-5.24-masks.md",),
           quotes=quotes(SPEED, ("860 / 932", "| 860 |"), ("645 / 716", "| 645 |"), ("(0.750x", "0.750"), ("0.768x)", "0.768"))
           + quotes(README, ("645 against 860", "| 860 | 645 |"), ("(0.75×", "0.750"))),
    Figure("moe-decode", COMPATIBILITY, "python -m benchmarks.moe_decode", "compiled decoding of a random 8-expert "
           "top-2 Mixtral: hf_tiny's fixed-shape experts against the routed loop in the step, and against official",
           "python -m benchmarks.moe_decode --device cpu", 2.5, "cpu", "moe-decode-cpu-{date}.md",
           results=("moe-decode-cpu-2026-11-28.md",),
           quotes=quotes(COMPATIBILITY, ("0.48x the routed", "0.48x"), ("1.13x at batch 8", "1.13x"),
                         ("0.86x at batch 32", "0.86x"), ("0.43x /", "0.43x"), ("0.93x /", "0.93x"),
                         ("0.80x official's", "0.80x"))),
    Figure("fit-memory-host", SPEED, "python -m benchmarks.fit_memory_host", "fit_memory's host work where a step "
           "fits: a counter read and a 22-layer training step's Python calls, the option off and on",
           "python -m benchmarks.fit_memory_host", 0.3, "cheap", "fit-memory-host-cpu-{date}.md",
           results=("fit-memory-host-cpu-2026-11-28.md",),
           quotes=quotes(SPEED, ("849 calls", "| 849 |"), ("51 µs", "50.6"), "51,369", "14,667", "23,451",
                         ("10 calls", "| 10 |"))),
    Figure("few-rows-avx2", SPEED, "few-rows-cpu-2026-11-27-avx2.md", "F.linear and weight-first read rates for one "
           "row on the second host", "python -m benchmarks.few_rows", 1, "cpu", "few-rows-cpu-{date}.md",
           results=("few-rows-cpu-2026-11-27-avx2.md",), quotes=quotes(SPEED, ("12–21 GB/s", "21.1"))),
    Figure("train-minilm", SPEED, "--tag train-minilm", "MiniLM's training rows of the speed and memory table (after "
           "the dropout exception)", f"{RUN} --models minilm --cases train_step --no-sweep --no-ops --repeats 3 "
           "--tag train-minilm", 2, "cpu", results=("cpu-2026-11-26-train-minilm.md",),
           quotes=quotes(SPEED, ("2,330 ms", "2,330.1 ms"), ("2,325 ms", "2,324.9 ms"), ("1,235 MiB", "1,235.3 MiB"))
           + quotes(README, ("0.94×", "0.94"))),
    Figure("prefill-fresh", SPEED, "--tag prefill-fresh", "fresh-process prefill rows (report section) and its "
           "interleaved ratios (MiniLM 0.90, SmolLM2 0.99)",
           f"{RUN} --models minilm,smollm2 --cases prefill --no-sweep --no-memory --repeats 5 --tag prefill-fresh",
           8, "cpu", results=("cpu-2026-11-26-prefill-fresh.md",),
           quotes=quotes(SPEED, "630.6 ms", "552.5 ms", "1,656.0 ms", "1,440.1 ms", "135,798", "13,793")),
    Figure("fresh-process", SPEED, "python -m benchmarks.fresh_process --models minilm,smollm2", "fresh-process "
           "prefill rows (standalone) and their page faults per call",
           "python -m benchmarks.fresh_process --models minilm,smollm2 --repeats 5 --calls 5", 5, "cpu",
           "fresh-process-prefill-cpu-{date}.md", results=("fresh-process-prefill-cpu-2026-11-26.md",),
           quotes=quotes(SPEED, "639.4 ms", "564.8 ms", "1,575.5 ms", "1,383.1 ms", "133,301")
           + quotes(README, ("0.88×", "0.88"))),
    Figure("prefill-overwrite", SPEED, "--tag prefill-overwrite", "MiniLM prefill 0.87 and SmolLM2 1.01 in one "
           "shared process; decode 1.99x / 1.33x", f"{RUN} --models minilm,smollm2 --cases prefill,generate "
           "--no-sweep --no-memory --repeats 3 --tag prefill-overwrite", 12, "cpu",
           results=("cpu-2026-11-26-prefill-overwrite.md",),
           quotes=quotes(SPEED, ("0.87 in the 2026-11-26 prefill-overwrite run", "0.87"),
                         ("1.01 when it was rerun on 2026-11-26", "1.01"), ("1.99× at batch 1", "1.99"),
                         ("1.33× at batch 8 in the same two runs", "1.33"))),
    Figure("prefill-smollm2-9", SPEED, "--tag prefill-smollm2-9", "SmolLM2 prefill 0.98 with 9 repeats",
           f"{RUN} --models smollm2 --cases prefill --no-sweep --no-ops --no-memory --repeats 9 "
           "--tag prefill-smollm2-9", 6, "cpu", results=("cpu-2026-11-26-prefill-smollm2-9.md",),
           quotes=quotes(SPEED, ("0.98 on 2026-11-26", "0.98"))),
    Figure("few-rows", SPEED, "python -m benchmarks.few_rows", "weight-first product against F.linear per "
           "projection and row count; LM head at 8 rows 6.9 -> 14.6 GB/s", "python -m benchmarks.few_rows --threads 2",
           2, "cpu", "few-rows-cpu-{date}.md", results=("few-rows-cpu-2026-11-26.md",),
           quotes=quotes(SPEED, ("6.9 → 14.6 GB/s", "| 8 | 6.9 | 14.6 |"), "0.72×")),
    Figure("decode-after-fix", SPEED, "decode-after-fix", "decode 2.01x / 1.25x (SmolLM2), 0.89x / 0.92x (overhead)",
           f"{RUN} --models smollm2,overhead --cases generate --no-sweep --no-memory --repeats 3 "
           "--tag decode-after-fix", 10, "cpu", results=("cpu-2026-11-26-decode-after-fix.md",),
           quotes=quotes(SPEED, ("2.01× at batch 1", "2.01"), ("1.25× at batch 8", "1.25"),
                         ("official 17.9 / 93.5 tokens/s", "93.5 tok/s"), ("the overhead model 0.89× / 0.92×", "0.92"))),
    Figure("decode-compiled", SPEED, "decode-compiled-after-weight-first", "compiled decode table (default and "
           "compiled tokens/s both sides, first-call compile times)", f"{RUN} --models smollm2 --cases "
           "generate,generate_compiled --no-sweep --no-ops --no-memory --repeats 3 "
           "--tag decode-compiled-after-weight-first", 15, "cpu",
           results=("cpu-2026-11-26-decode-compiled-after-weight-first.md",),
           quotes=quotes(SPEED, "35.1 tok/s", "111.7 tok/s", "108.8 tok/s", "58.4 s", "64.1 s", "63.3 s", "74.6 s",
                         ("1.98× / 1.34×", "1.98"))),
    Figure("fusion", SPEED, "python -m\nbenchmarks.fusion", "fused q/k/v and gate/up against separate products",
           "python -m benchmarks.fusion --threads 2", 1, "cpu", "fusion-cpu-{date}.md",
           results=("fusion-cpu-2026-11-26.md",), quotes=quotes(SPEED, ("0.95 (gate/up) at 8", "0.95"))),
    Figure("train-4x512", SPEED, "--tag train-4x512", "SmolLM2 train step 4x512 time and peak memory (1.04, 0.58)",
           f"{RUN} --models smollm2 --cases train_step --no-sweep --no-ops --repeats 3 --tag train-4x512", 10,
           "cpu", results=("cpu-2026-11-26-train-4x512.md",),
           quotes=quotes(SPEED, ("12,191 ms", "12,191.2 ms"), ("12,704 ms", "12,704.0 ms"), ("2,786 MiB", "2,786.2 MiB"))),
    Figure("decode-profile", SPEED, "--tag decode-profile", "decode-step profile table (ms per step by group, weight "
           "GB/s); its last run is decode-after-fix's, the same command", f"{RUN} --models smollm2,overhead --cases "
           "generate --no-sweep --no-memory --repeats 3 --tag decode-profile", 10, "cpu",
           results=("cpu-2026-11-26-decode-after-fix.md",),
           quotes=quotes(SPEED, "42.7", "16.8", "74.8", "41.2", "31.9 GB/s", ("| 32.0 GB/s |", "32.0"))),
    Figure("runtime-ab", SPEED, "python -m benchmarks.runtime_ab", "the training recompute's time and memory against "
           "the runtime off (MiniLM with dropout: feed-forward alone; the overhead model; SmolLM2)",
           "python -m benchmarks.runtime_ab --models minilm,overhead,smollm2 --repeats 3", 15, "cpu",
           "runtime-ab-cpu-{date}.md", results=("runtime-ab-cpu-2026-11-26.md", "runtime-ab-cpu-2026-11-26-minilm.md"),
           quotes=quotes(SPEED, "3,791 ms", "3,938 ms", "3,862 ms", "1,727 ms", ("269 MiB", "268.9 MiB"), "23,172 ms",
                         ("1,720 MiB", "1,719.9 MiB"), "22,217 ms", ("2,846 MiB", "2,845.5 MiB"))),
    Figure("vllm", SPEED, "python -m benchmarks.vllm_rows", "vLLM rows (tokens/s both sides, identical tokens): the "
           "standalone 166.4 / 164.4; the full entry measures the report's vLLM row again",
           "python -m benchmarks.vllm_rows --prompts 8 --new-tokens 64 --repeats 3", 8, "cpu",
           results=("vllm-cpu-2026-11-26.md",), quotes=quotes(SPEED, "166.4", "164.4")),
    Figure("mtp-depth1", FAMILIES, "python -m benchmarks.mtp_speculative", "MTP depth 1 row (acceptance, tokens per "
           "forward, tokens/s, speed-up)", "python -m benchmarks.mtp_speculative", 6, "cpu",
           results=("mtp-speculative-cpu-2026-11-26-depth1.md",),
           quotes=quotes(FAMILIES, "124 / 124", "1.97", "208.1 tokens/s", "299.8 tokens/s", ("1.44×", "1.44x"))
           + quotes(README, ("1.44×", "1.44x"))),
    Figure("mtp-depth2", FAMILIES, "python -m benchmarks.mtp_speculative", "MTP depth 2 row",
           "python -m benchmarks.mtp_speculative --depth 2", 7, "cpu", results=("mtp-speculative-cpu-2026-11-26-depth2.md",),
           quotes=quotes(FAMILIES, "168 / 168", "3.00", "213.8 tokens/s", "365.8 tokens/s", ("1.71×", "1.71x"))
           + quotes(README, ("1.71×", "1.71x"))),
    Figure("conversion-memory", CONVERSION, "python -m benchmarks.conversion_memory", "conversion's peak RSS and time "
           "against cp -r (TinyLlama and Llama-3-8B shapes); loading the 8B folder's anonymous memory",
           "python -m benchmarks.conversion_memory --models tinyllama,llama3_8b", 10, "cpu",
           results=("conversion-memory-2026-11-26.md",),
           quotes=quotes(CONVERSION, "2.05 GiB", "14.96 GiB", "0.98 GiB", "2.91 GiB", "11.7 s", "36.3 s", "25.2 s",
                         "2.8 s", "314 MiB", "302 MiB")
           + quotes(README, "14.96 GiB", "2.91 GiB", ("(0.19×)", "0.19x"), ("1.4×", "1.4x"))),
    Figure("reading-path", ARCHITECTURE, "python -m benchmarks.reading_path", "functions, lines and "
           "files a reader follows through one causal forward (the default, runtime on; --runtime off beside it)",
           "python -m benchmarks.reading_path", 0.5, "cheap", "reading-path-{date}.md",
           results=("reading-path-2026-11-29.md",),
           quotes=quotes(ARCHITECTURE, "54 functions, 706 lines, 7 files")
           + quotes(README, ("706 lines in 7 files", "706 lines, 7 files"))),
    Figure("host-work", SPEED, "python -m benchmarks.host_work", "Python calls of a prefill and a decoding step, "
           "official beside hf_tiny (cProfile)", "python -m benchmarks.host_work --models overhead --prompt 16 --repeats 3",
           1, "cheap", "host-work-cpu-{date}.md", results=("host-work-cpu-2026-11-29.md", "host-work-cpu-2026-11-28.md",
                                "host-work-cpu-2026-11-27-gpu-paths.md", "host-work-cpu-2026-11-27.md"),
           quotes=quotes(SPEED, ("| prefill | 7,504 | 5,978 | 0.80 | 5,957 | 5,867 (0.78) |",
                                 "| prefill | 7,504 | 5,978 | 0.80 | 5,957 | 5,867 (0.78) |"),
                         ("| decode step | 5,774 | 5,276 | 0.91 | 5,276 | 5,276 (0.91) |",
                          "| decode step | 5,774 | 5,276 | 0.91 | 5,276 | 5,276 (0.91) |"), ("5,334 calls (0.92)", "5,334"),
                         ("5,714 calls (0.99x)", "5,714"), ("6,182 and 5,542", "6,182"))
           + quotes(README, "5,978", "5,276", "7,504", "5,774", ("0.80×", "0.80"), ("0.91×", "0.91"))),
    Figure("flash-kernel", SPEED, "python -m benchmarks.flash_kernel", "Triton FlashAttention TFLOP/s table (H100)",
           "python -m benchmarks.flash_kernel", 2, "cuda", results=("flash-kernel-nvidia-h100-80gb-hbm3-2026-11-23.md",),
           quotes=quotes(SPEED, ("398 / 311 (1.28) | 455", "398 (55%) | 311 (43%) | 455 (63%) | 1.28"),
                         ("504 / 345 (1.46) | 655", "504 (70%) | 345 (48%) | 655 (91%) | 1.46"))
           + quotes(README, ("1.28×", "1.28"), ("1.46×", "1.46"))),
    Figure("gpu-check", SPEED, "python -m benchmarks.run --device cuda --quick", "the first GPU session's quick "
           "model-level rows (training step 2.0x / 2.4x, prefill 1.13-1.33x official's time, decode 0.86-0.88x its "
           "tokens/s; H100); its CUDA tests are today's gpu_check.sh's first stage",
           "python -m benchmarks.run --device cuda --quick --models overhead,llama1b --cases prefill,train_step,generate "
           "--repeats 3 --no-sweep", 9, "cuda", results=("cuda-h100-2026-11-26-gpu-check.md", "cuda-nvidia-h100-80gb-hbm3-2026-11-26-quick.md"),
           quotes=quotes(SPEED, "2.0x (overhead model)", "2.4x (random TinyLlama-1.1B, bf16, 1x64)",
                         "1.13–1.33x official's time", "0.86–0.88x official's tokens/s")),
    Figure("gpu-check-h200-2", SPEED, "gpu-check-nvidia-h200-2026-11-28.md", "issue 42's GPU rows on an H200, second "
           "run: the same rows, fit_memory's longest sequence and its cost, the CUDA tests",
           "bash benchmarks/gpu_check.sh", 9, "cuda", needs=GPU_CHECK_CALLS, results=("gpu-check-nvidia-h200-2026-11-28.md",),
           quotes=quotes(SPEED, "15.3 ms", "15.0 ms", "91.7 ms", "91.6 ms", "28.6 tok/s", "31.3 tok/s", "234.7 tok/s",
                         "243.1 tok/s", "300.2 tok/s", "319.0 tok/s", "2,531.8 tok/s", "2,054.9 tok/s", "167.1 ms",
                         "168.0 ms", "124.2 ms", "138.1 ms", "181,248", "59,392", ("175.3 against", "175.3 ms"),
                         ("168.0 ms)", "168.0 ms"))
           + quotes(SPEED, ("7.16 / 1.78 s", "1,779–7,156 ms"), ("6.27 / 1.91 s", "1,905–6,273 ms"),
                    ("6.96 / 1.77 s", "1,768–6,960 ms"), ("6.59 / 1.84 s", "1,839–6,585 ms"),
                    ("378-456 ms", "378–456 ms"), ("384-413 ms", "384–413 ms"))
           + quotes(README, ("3.00×", "3.00x"), ("181,248", "181,248"))),
    Figure("gpu-check-h200-3", SPEED, "gpu-check-nvidia-h200-2026-11-30.md", "issue 42's GPU rows on an H200, third "
           "run: captured decoding ahead at both batches, the eager rows behind, fit_memory's cost, the CUDA tests",
           "bash benchmarks/gpu_check.sh", 9, "cuda", needs=GPU_CHECK_CALLS, results=("gpu-check-nvidia-h200-2026-11-30.md",),
           quotes=quotes(SPEED, "15.2 ms", "17.9 ms", "89.8 ms", "90.9 ms", "48.2 tok/s", "39.4 tok/s", "440.9 tok/s",
                         "390.5 tok/s", "292.4 tok/s", "336.4 tok/s", "2,033.5 tok/s", "2,433.0 tok/s", "166.2 ms",
                         "165.7 ms", "122.7 ms", "131.5 ms", "1.000045x", ("696.7 of 4,320 GB/s", "696.7 GB/s of 4,320"),
                         ("3,620 / 3,687", "3,620 / 3,687"), ("4,050 / 4,147", "4,050 / 4,147"),
                         ("473-531 ms", "473–531 ms"), ("168.2 against 166.4", "168.2 / 166.4 ms"))
           + quotes(README, ("1.15×", "1.15x"), ("1.20×", "1.20x"), ("0.98×", "0.98x"), ("1.003×", "1.003x"),
                    ("0.81×", "0.81x"), ("0.66×", "0.66x"), ("1.01×", "1.01x"), ("0.93×)", "0.93x"),
                    ("(16 %)", "16%"))),
    Figure("gpu-check-h200", SPEED, "gpu-check-nvidia-h200-2026-11-27.md", "issue 42's GPU rows on an H200: prefill, "
           "eager and captured decode, training with and without Liger, the longest sequence, host work",
           "bash benchmarks/gpu_check.sh", 9, "cuda", needs=GPU_CHECK_CALLS, results=("gpu-check-nvidia-h200-2026-11-27.md",),
           quotes=quotes(SPEED, "25.4 ms", "22.5 ms", "91.1 ms", "90.9 ms", "16.7 tok/s", "26.8 tok/s", "128.8 tok/s",
                         "153.1 tok/s", "311.9 tok/s", "295.6 tok/s", ("2,498 tok/s", "2,498.0 tok/s"),
                         ("2,329 tok/s", "2,328.5 tok/s"), "166.4 ms", "166.6 ms", "133.2 ms", "124.7 ms", "60,416",
                         "4,303 GB/s", "3,932 / 3,687", "4,403 / 4,147", ("0.75x official's plain time", "0.75x"),
                         ("0.66x its memory", "0.66x"))),
]

HISTORICAL = [
    ("4,833 -> 3,893 MiB", "the chunked loss alone, measured before the recomputation existed"),
    ("621 ms / 740 ms; ~1.8 µs per page; 84 % aten::mm; MKL packed / oneDNN within ±3 %",
     "ad-hoc profiles and A/Bs that were not committed"),
    ("0.86-0.90 in three runs; 1.17-1.23x across three runs; train ratio 0.96-1.02",
     "ranges over several of the runs above (rerun those and take the range)"),
    ("products ~40 % of a batch-1 step at ~9-11 GB/s (decode-profile-cpu-2026-11-23-before-weight-first.md)",
     "`python -m benchmarks.decode_profile` at a commit before the weight-first product"),
    ("overhead decode 0.89x / 0.97x on 2026-11-21", "cpu-2026-11-21.md, the code before the weight-first product"),
    ("batch-1 A/B 9.7 -> 11.9 tokens/s; MiniLM's whole-layer replay 1.17x / 0.60x", "ad-hoc A/Bs that were not committed"),
    ("official train step 30.1-32.2 s over three runs", "a range over the earlier host's runs"),
    ("first compiled calls 135-164 s", "cpu-2026-11-23-decode-compiled.md, before the weight-first product"),
    ("CUDA test counts (126 passed, 22 skipped)", "the test suite on a GPU, not a benchmark"),
    ("Gemma 3 270M conversion 4 min 00 s, 4.6 GB peak RSS", "`/usr/bin/time -v python -m conversion ...`, by hand"),
]


def doc_pages(root: Path = REPO_ROOT) -> dict[str, str]:
    """README.md and every docs/*.md page, by their path from the repository root."""
    paths = [root / README, *sorted((root / "docs").glob("*.md"))]
    return {path.relative_to(root).as_posix(): path.read_text(encoding="utf-8") for path in paths}


def _flat(text: str) -> str:
    return " ".join(text.split())


def states(text: str, figure: str) -> bool:
    """Whether `text` holds `figure` as a whole number: "0.58" is not found in "10.58" nor in "0.585"."""
    pattern = r"(?<!\d)(?<!\d[.,])" + re.escape(_flat(figure)) + r"(?!\d|[.,]\d)"
    return re.search(pattern, _flat(text)) is not None


def figure_problems(figure: Figure, pages: dict[str, str], results_dir: Path) -> list[str]:
    """What no longer holds for one entry: its passage, its results files and their links, its quotes."""
    if figure.page not in pages:
        return [f"{figure.name}: page {figure.page} not found"]
    page = pages[figure.page]
    problems = [] if _flat(figure.passage) in _flat(page) else [f"{figure.name}: {figure.page} no longer holds the "
                                                                 f"passage {figure.passage!r}"]
    sources = []
    for name in figure.results:
        if not (results_dir / name).is_file():
            problems.append(f"{figure.name}: results file {name} not found")
            continue
        if f"benchmarks/results/{name}" not in page:
            problems.append(f"{figure.name}: {figure.page} does not link benchmarks/results/{name}")
        sources.append((results_dir / name).read_text(encoding="utf-8"))
    for quote in figure.quotes:
        if not states(pages.get(quote.page, ""), quote.text):
            problems.append(f"{figure.name}: {quote.page} no longer states {quote.text!r}")
        elif sources and not any(states(source, quote.source or quote.text) for source in sources):
            problems.append(f"{figure.name}: {quote.page} states {quote.text!r}, but {' / '.join(figure.results)} "
                            f"hold no {quote.source or quote.text!r}")
    return problems


def check(pages: Optional[dict[str, str]] = None, results_dir: Path = RESULTS_DIR) -> list[str]:
    """Every problem of every entry; none when README.md and docs/ state what the results files hold."""
    pages = doc_pages() if pages is None else pages
    return [problem for figure in FIGURES for problem in figure_problems(figure, pages, results_dir)]


def markdown() -> str:
    lines = ["| name | kind | ~min | page | figures | command |", "|---|---|---|---|---|---|"]
    for f in FIGURES:
        command = f.command + (f" > benchmarks/results/{f.stdout_to}" if f.stdout_to else "")
        command += f"` (needs {f.needs})" if f.needs else "`"
        lines.append(f"| {f.name} | {f.kind} | {f.minutes:g} | {f.page} | {f.figures} | `{command} |")
    cpu_minutes = sum(f.minutes for f in FIGURES if f.kind in ("cheap", "cpu"))
    lines += ["", f"The CPU ones in a row (`--run cpu`): ~{cpu_minutes:,.0f} min on the 2-core machine.", "",
              "Not reproduced by one command:", ""]
    lines += [f"- {figures}: {why}" for figures, why in HISTORICAL]
    return "\n".join(lines) + "\n"


def selected(choice: str) -> list[Figure]:
    if choice in ("cheap", "cpu", "cuda"):
        return [f for f in FIGURES if f.kind == choice or (choice == "cpu" and f.kind == "cheap")]
    names = [n.strip() for n in choice.split(",") if n.strip()]
    known = {f.name: f for f in FIGURES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"error: --run: unknown {', '.join(unknown)}; choose cheap, cpu, cuda or names from "
                         f"{', '.join(known)}")
    return [known[n] for n in names]


def rerun(figures: list[Figure], dry_run: bool) -> None:
    date = datetime.date.today().isoformat()
    for f in figures:
        target = RESULTS_DIR / f.stdout_to.format(date=date) if f.stdout_to else None
        print(f"$ {f.command}" + (f" > {target}" if target else "") + f"   # ~{f.minutes:g} min", flush=True)
        if f.needs:
            print(f"  skipped: it needs {f.needs}", flush=True)
            continue
        if dry_run:
            continue
        start = time.perf_counter()
        with open(target, "w") if target else open(sys.stdout.fileno(), "w", closefd=False) as out:
            argv = shlex.split(f.command)
            argv[0] = sys.executable if argv[0] == "python" else argv[0]  # this interpreter, not PATH's python
            subprocess.run(argv, cwd=REPO_ROOT, stdout=out, check=True)
        print(f"  done in {(time.perf_counter() - start) / 60:,.1f} min", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="list what README.md and docs/ no longer state as their results files hold")
    parser.add_argument("--run", help="cheap, cpu, cuda, or comma-separated names")
    parser.add_argument("--dry-run", action="store_true", help="with --run: print the commands only")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        print("every figure found" if not problems else "\n".join(problems))
        return 1 if problems else 0
    if args.run:
        rerun(selected(args.run), args.dry_run)
    else:
        print(markdown(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
