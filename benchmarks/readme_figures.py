"""Every figure in the top-level README.md that a benchmark measured, with the command that measures it again.

    python -m benchmarks.readme_figures                 # the list, as a markdown table
    python -m benchmarks.readme_figures --check         # which README passages the list points at are gone
    python -m benchmarks.readme_figures --run cheap     # rerun the cheap ones (seconds, load-independent)
    python -m benchmarks.readme_figures --run cpu       # rerun every CPU one, one after the other (~2.5 h)
    python -m benchmarks.readme_figures --run few-rows,fusion [--dry-run]

Each rerun writes its results page into benchmarks/results/ under today's date (commands that only print are
sent to the file named in the list). Run the timed ones on a quiet machine: their figures are times and ratios.
Figures that no command reproduces (ad-hoc A/Bs that were not committed, sums over several runs, states of the
code before a change) are listed under HISTORICAL with the reason.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

from .machine import REPO_ROOT, RESULTS_DIR


@dataclass(frozen=True)
class Figure:
    name: str
    readme: str  # a passage of README.md next to the figures, to find them (--check)
    figures: str  # what the README states from this run
    command: str  # run from the repository root
    minutes: float  # on the 2-core development machine
    kind: str  # "cheap" (seconds, load-independent), "cpu" (timed: a quiet machine) or "cuda"
    stdout_to: Optional[str] = None  # results file for a command that only prints ({date} = today)


RUN = "python -m benchmarks.run --device cpu"
FIGURES = [
    Figure("kv-cache", "KV cache per\ntoken and layer", "KV-cache bytes per token and layer, MHA / GQA / MQA / MLA",
           "python -m benchmarks.kv_cache --tokens 256 --layers 2 --dtype bfloat16", 0.2, "cheap"),
    Figure("full", "--repeats 3 --tag full", "the speed and memory table (prefill, train step, generate, peak "
           "memory, the vLLM row), GEMM peak, decode GB/s and roofline shares, the fresh-process section",
           f"{RUN} --repeats 3 --tag full", 35, "cpu"),
    Figure("train-minilm", "--tag train-minilm", "MiniLM's training rows of the speed and memory table (after the "
           "dropout exception)", f"{RUN} --models minilm --cases train_step --no-sweep --no-ops --repeats 3 "
           "--tag train-minilm", 2, "cpu"),
    Figure("prefill-fresh", "--tag prefill-fresh", "fresh-process prefill rows (report section) and its "
           "interleaved ratios (MiniLM 0.88, SmolLM2 0.99)",
           f"{RUN} --models minilm,smollm2 --cases prefill --no-sweep --no-memory --repeats 5 --tag prefill-fresh",
           8, "cpu"),
    Figure("fresh-process", "python -m benchmarks.fresh_process --models minilm,smollm2", "fresh-process prefill "
           "rows (standalone), the page faults per call (137k / 9.9k)",
           "python -m benchmarks.fresh_process --models minilm,smollm2 --repeats 5 --calls 5", 5, "cpu",
           "fresh-process-prefill-cpu-{date}.md"),
    Figure("prefill-overwrite", "--tag prefill-overwrite", "SmolLM2 prefill 0.94 in one shared process; decode "
           "1.24x-1.36x", f"{RUN} --models minilm,smollm2 --cases prefill,generate --no-sweep --no-memory "
           "--repeats 3 --tag prefill-overwrite", 12, "cpu"),
    Figure("prefill-smollm2-9", "--tag prefill-smollm2-9", "SmolLM2 prefill 0.99 with 9 repeats",
           f"{RUN} --models smollm2 --cases prefill --no-sweep --no-ops --no-memory --repeats 9 "
           "--tag prefill-smollm2-9", 6, "cpu"),
    Figure("few-rows", "python -m benchmarks.few_rows", "weight-first product: 1.2-2.0x at one row, 1.0-4.2x at "
           "2-8 rows, LM head 2.5 -> 8.2 GB/s", "python -m benchmarks.few_rows --threads 2", 2, "cpu",
           "few-rows-cpu-{date}.md"),
    Figure("decode-after-fix", "decode-after-fix", "decode 1.17x / 1.36x (SmolLM2), 0.92x / 0.96x (overhead)",
           f"{RUN} --models smollm2,overhead --cases generate --no-sweep --no-memory --repeats 3 "
           "--tag decode-after-fix", 10, "cpu"),
    Figure("decode-compiled", "decode-compiled-after-weight-first", "compiled decode table (default and "
           "compiled tokens/s both sides, first-call compile times)", f"{RUN} --models smollm2 --cases "
           "generate,generate_compiled --no-sweep --no-ops --no-memory --repeats 3 "
           "--tag decode-compiled-after-weight-first", 15, "cpu"),
    Figure("fusion", "python -m\nbenchmarks.fusion", "fused q/k/v and gate/up: 0.99-1.00x, 1.01-1.03x, 1.39x "
           "loss at 8 tokens", "python -m benchmarks.fusion --threads 2", 1, "cpu", "fusion-cpu-{date}.md"),
    Figure("train-4x512", "--tag train-4x512", "SmolLM2 train step 4x512 time and peak memory (0.96, 0.54)",
           f"{RUN} --models smollm2 --cases train_step --no-sweep --no-ops --repeats 3 --tag train-4x512", 10,
           "cpu"),
    Figure("decode-profile", "--tag decode-profile", "decode-step profile table (ms per step by group, weight "
           "GB/s), overhead 0.93x / 0.90x", f"{RUN} --models smollm2,overhead --cases generate --no-sweep "
           "--no-memory --repeats 3 --tag decode-profile", 10, "cpu"),
    Figure("runtime-ab", "python -m benchmarks.runtime_ab", "the training recompute's time and memory against the "
           "runtime off (MiniLM with dropout: feed-forward alone; the overhead model: under the size limit; SmolLM2)",
           "python -m benchmarks.runtime_ab --models minilm,overhead,smollm2 --repeats 3", 15, "cpu",
           "runtime-ab-cpu-{date}.md"),
    Figure("vllm", "python -m benchmarks.vllm_rows", "vLLM rows (tokens/s both sides, identical tokens): the "
           "standalone 1.01x; the 67.1 / 64.1 tokens/s (0.96x) of \"Served by vLLM\" are the 2026-11-23 full "
           "run's section (the full entry measures that section again)",
           "python -m benchmarks.vllm_rows --prompts 8 --new-tokens 64 --repeats 3", 8, "cpu"),
    Figure("mtp-depth1", "python -m benchmarks.mtp_speculative", "MTP depth 1 row (acceptance, tokens per "
           "forward, tokens/s, speed-up)", "python -m benchmarks.mtp_speculative", 6, "cpu"),
    Figure("mtp-depth2", "python -m benchmarks.mtp_speculative", "MTP depth 2 row",
           "python -m benchmarks.mtp_speculative --depth 2", 7, "cpu"),
    Figure("flash-kernel", "python -m benchmarks.flash_kernel", "Triton FlashAttention TFLOP/s table (H100)",
           "python -m benchmarks.flash_kernel", 2, "cuda"),
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
    ("batch-1 A/B 9.7 -> 11.9 tokens/s; overhead 0.95-0.98x in A/B runs", "ad-hoc A/Bs that were not committed"),
    ("official train step 30.1-32.2 s over three runs", "a range over the earlier host's runs"),
    ("first compiled calls 135-164 s", "cpu-2026-11-23-decode-compiled.md, before the weight-first product"),
    ("CUDA test counts (126 passed, 22 skipped)", "the test suite on a GPU, not a benchmark"),
]


def markdown() -> str:
    lines = ["| name | kind | ~min | figures in README.md | command |", "|---|---|---|---|---|"]
    for f in FIGURES:
        command = f.command + (f" > benchmarks/results/{f.stdout_to}" if f.stdout_to else "")
        lines.append(f"| {f.name} | {f.kind} | {f.minutes:g} | {f.figures} | `{command}` |")
    cpu_minutes = sum(f.minutes for f in FIGURES if f.kind in ("cheap", "cpu"))
    lines += ["", f"The CPU ones in a row (`--run cpu`): ~{cpu_minutes:,.0f} min on the 2-core machine.", "",
              "Not reproduced by one command:", ""]
    lines += [f"- {figures}: {why}" for figures, why in HISTORICAL]
    return "\n".join(lines) + "\n"


def missing_passages(readme_text: str) -> list[str]:
    """Names of the figures whose README passage is no longer there (the README moved on; update the list)."""
    flat = " ".join(readme_text.split())
    return [f.name for f in FIGURES if " ".join(f.readme.split()) not in flat]


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
        if dry_run:
            continue
        start = time.perf_counter()
        with open(target, "w") if target else open(sys.stdout.fileno(), "w", closefd=False) as out:
            argv = shlex.split(f.command)
            argv[0] = sys.executable if argv[0] == "python" else argv[0]  # this interpreter, not PATH's python
            subprocess.run(argv, cwd=REPO_ROOT, stdout=out, check=True)
        print(f"  done in {(time.perf_counter() - start) / 60:,.1f} min", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="list the figures whose README passage is gone")
    parser.add_argument("--run", help="cheap, cpu, cuda, or comma-separated names")
    parser.add_argument("--dry-run", action="store_true", help="with --run: print the commands only")
    args = parser.parse_args(argv)
    if args.check:
        missing = missing_passages((REPO_ROOT / "README.md").read_text())
        print("every passage found" if not missing else "README passages not found: " + ", ".join(missing))
    elif args.run:
        rerun(selected(args.run), args.dry_run)
    else:
        print(markdown(), end="")


if __name__ == "__main__":
    main()
