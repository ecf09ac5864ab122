"""The GPU check's benchmark part: hf_tiny beside official transformers at the shapes users run on a GPU, in a
fixed time budget, every target of issue 42 printed beside its measured value.

    python -m benchmarks.gpu_check [--out DIR] [--budget-s 480] [--stages build,main-official,...]
        [--tests-log FILE ...] [--dry-run]

benchmarks/gpu_check.sh runs the CUDA tests first, then this. The model is a random TinyLlama-1.1B-shaped Llama in
bf16 with sdpa on both sides (the GPU image has no weight packages); hf_tiny's checkpoint is written from it by the
production converter. Stages run in order of value, each job in its own process (benchmarks.gpu_rows) with a time
cap, and the whole within --budget-s: a stage that no longer fits is reported "not run (time budget)", a job that
crashes or overruns its cap is reported as such, and the rows after it still run.

--dry-run: the same stages on the CPU with a 2-layer model and tiny shapes (a couple of minutes), so that every
measuring function, the target table and the output files are exercised before device time is spent.

Writes <out>/gpu-check-<device>-<date>[-dry-run].md and .json (every row, every sample, the stages' times).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import gpu_report
from .gpu_rows import expected_rows, longest_fit_start
from .machine import REPO_ROOT, file_stem, git_revision
from .workloads import Shape

@dataclass(frozen=True)
class GpuPlan:
    """The shapes and counts one run measures."""

    model: str
    device: str
    dtype: str
    prefill: tuple
    decode: tuple  # batch-1 first: the captured stages are built from it
    train: Shape
    warmup: int = 1
    # 5: the H200's Liger steps spread 132-152 ms over 3 calls (2026-11-28); a prefill or training call costs < 0.2 s
    repeats: int = 5
    decode_repeats: int = 3  # a 128-token eager generate takes 1-2 s warm (after the full-length warm-up)
    longest_start: int = 2048
    longest_cap: int = 262144
    longest_resolution: int = 1024
    longest_seconds: int = 60
    longest_fit_seconds: int = 20
    gemm_n: int = 8192
    bandwidth_mb: int = 4096
    threads: int = 0


GPU_PLAN = GpuPlan("llama1b", "cuda", "bfloat16", prefill=(Shape(1, 2048), Shape(8, 2048)),
                   decode=(Shape(1, 32, 128), Shape(8, 32, 128)), train=Shape(4, 2048))
DRY_RUN_PLAN = GpuPlan("tiny", "cpu", "float32", prefill=(Shape(1, 32), Shape(2, 32)),
                       decode=(Shape(1, 8, 4), Shape(2, 8, 4)), train=Shape(2, 32), repeats=1, decode_repeats=1,
                       longest_start=16,
                       longest_cap=128, longest_resolution=16, longest_seconds=20, gemm_n=256, bandwidth_mb=16,
                       threads=1)


@dataclass
class Stage:
    """One job (one process) of the run: its cap, and the estimate of its time with its basis."""

    name: str
    job: dict
    cap_s: int
    estimate_s: int
    basis: str
    outcome: dict = field(default_factory=dict)


# name -> (cap s, estimate s, basis of the estimate): measured on one H200, 2026-11-27
# (results/gpu-check-nvidia-h200-2026-11-27.md; an H100 is within a few seconds of it)
ESTIMATES = {
    "build": (150, 35, "measured 28.0-35.4 s on the H200 (three calls): 1.1B random init on the GPU, a 2.2 GB save "
                       "and the production conversion"),
    "main": (130, 90, "measured 61.6 s (official) and 73.2 s (hf_tiny) on the H200 (2026-11-30): eager decode is "
                      "host-bound there (39-48 tok/s at batch 1, 2.3-3.4 s a 128-token call) and is most of it; one "
                      "profiled eager call per decode shape since adds an estimated 5-8 s per shape"),
    "captured": (110, 55, "measured 38.6-51.5 s on the H200 (four stages): dynamo, inductor and the CUDA graph "
                          "capture of the 22-layer decode step, then 4 calls of ~0.4 s"),
    "longest": (90, 40, "measured 35.7-36.4 s on the H200: 11 probes up to 64K tokens, stopped by OOM at 61,440"),
    "liger_paired": (110, 50, "not measured yet: two 1.1B loads, Liger's Triton kernels compiled for both models "
                              "(~20 s in the main stages), then 12 training steps of ~0.13 s"),
    "eager_paired": (120, 60, "not measured yet: two 1.1B loads (~10 s each in the main stages), then per side 6 "
                              "prefill calls of 15-90 ms and 4 eager 128-token calls of 2.3-3.4 s at each decode shape"),
    "longest_fit": (120, 50, "measured 48.8 s on the H200 (2026-11-28): start and load, then one probe at 3x "
                             "official's longest (181,248 tokens), which fit"),
}
MIN_STAGE_S = 25  # a stage is started only when this much of the budget is left


def stages_of(plan: GpuPlan, folders: dict, args) -> list[Stage]:
    """Every stage after the build, in order of value (what the last run left unsettled first): the eager rows of
    both sides (training, prefill, decode, host work), prefill and eager decode again with both models in one
    process (0.82x-0.99x on the H200, 2026-11-30, against 0.93x-1.02x by warm calls two days before), batch-1
    captured decode, Liger on both sides in one process, batch-8 captured decode (0.81x on the H200, 2026-11-28),
    the longest trainable sequence with the fit_memory option (3.00x there) and without it, the runtime-off rows."""
    common = {"model": plan.model, "device": plan.device, "dtype": plan.dtype, "folders": folders,
              "warmup": plan.warmup, "repeats": plan.repeats, "decode_repeats": plan.decode_repeats,
              "threads": plan.threads}
    main = {**common, "kind": "main", "prefill": plan.prefill, "decode": plan.decode, "train": plan.train,
            "liger": True, "gemm_n": plan.gemm_n,
            "bandwidth_mb": plan.bandwidth_mb}
    longest = {**common, "kind": "longest", "start": plan.longest_start, "cap": plan.longest_cap,
               "resolution": plan.longest_resolution, "seconds": plan.longest_seconds}
    # fit_memory on: from 3x official's longest when that is known by then (start_after_official), so that the first
    # probe answers the target; the job's seconds stop the search after about one probe that long
    longest_fit = {**longest, "side": "hf_tiny_fit", "seconds": plan.longest_fit_seconds,
                   "start_after_official": gpu_report.LONGEST_FACTOR}

    def stage(name: str, estimated_as: str, job: dict) -> Stage:
        cap, estimate, basis = ESTIMATES[estimated_as]
        return Stage(name, job, cap, estimate, basis)

    captured = [[stage(f"captured-{side}-{shape.batch}", "captured",
                       {**common, "kind": "captured", "side": side, "shape": shape}) for side in ("official", "hf_tiny")]
                for shape in plan.decode]
    return [
        stage("main-official", "main", {**main, "side": "official", "ceilings": True}),
        stage("main-hf_tiny", "main", {**main, "side": "hf_tiny", "ceilings": True}),
        stage("eager-paired", "eager_paired", {**common, "kind": "eager_paired", "prefill": plan.prefill,
                                               "decode": plan.decode, "sides": ["official", "hf_tiny"]}),
        *captured[0],
        stage("liger-paired", "liger_paired", {**common, "kind": "liger_paired", "train": plan.train,
                                               "sides": ["official", "hf_tiny"]}),
        *[s for later in captured[1:] for s in later],
        stage("longest-official", "longest", {**longest, "side": "official"}),
        stage("longest-hf_tiny_fit", "longest_fit", longest_fit),
        # hf_tiny's default on CUDA has fit_memory on since 2026-11-30: its search also starts at 3x official's
        stage("longest-hf_tiny", "longest_fit", {**longest_fit, "side": "hf_tiny"}),
        stage("main-hf_tiny_off", "main", {**main, "side": "hf_tiny_off"}),
    ]


# ---- running one job ---------------------------------------------------------------------------------------------

def run_job(job: dict, timeout_s: float) -> tuple[list[dict], dict]:
    """(the rows the job printed, its outcome {"status", "seconds"}): "ok", "exit N: last lines", "crashed:
    signal N (NAME)" or "timed out after N s". The job runs in its own process group, killed whole on timeout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_rows", json.dumps(job, default=_shape_json)],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        status = "ok" if proc.returncode == 0 else describe_exit(proc.returncode, err)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        status = f"timed out after {timeout_s:.0f} s"
    rows = [row for row in map(json_line, out.splitlines()) if row is not None]
    if err.strip():
        sys.stderr.write(err[-4000:])
    return rows, {"status": status, "seconds": round(time.perf_counter() - start, 1)}


def json_line(line: str):
    """A row the job printed ({"row": ..., "side": ..., ...}), or None for any other line of its output."""
    try:
        row = json.loads(line) if line.startswith("{") else None
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) and {"row", "side"} <= row.keys() else None


def describe_exit(code: int, stderr: str) -> str:
    if code < 0:
        return f"crashed: signal {-code} ({signal.Signals(-code).name})"
    tail = " | ".join(stderr.strip().splitlines()[-3:])
    return f"exit {code}: {tail[-400:]}"


def _shape_json(value):
    if isinstance(value, Shape):
        return [value.batch, value.seq, value.new_tokens]
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


# ---- the run -----------------------------------------------------------------------------------------------------

def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(args, save=lambda results: None) -> dict:
    """Every stage in order within the budget; `save(results)` after each (a run cut off from outside keeps what
    it measured)."""
    plan = DRY_RUN_PLAN if args.dry_run else GPU_PLAN
    deadline = time.monotonic() + args.budget_s
    results = {"meta": metadata(args, plan), "rows": {}, "stages": []}
    build = Stage("build", {"kind": "build", "model": plan.model, "device": plan.device}, *ESTIMATES["build"])
    run_stage(build, results, deadline, args)
    results["stages"].append(summary(build))
    save(results)
    built = results["rows"].get("build", {}).get("both", {})
    folders = None
    if built.get("hf_tiny_folder"):
        folders = {"official": built["official_folder"], "hf_tiny": built["hf_tiny_folder"]}
    for stage in stages_of(plan, folders or {}, args):
        if args.stages and stage.name not in args.stages:
            stage.outcome = {"status": "not run (not in --stages)"}
            fill_missing_rows(stage, results)
        elif folders is None:
            stage.outcome = {"status": "not run (no checkpoints: the build failed)"}
            fill_missing_rows(stage, results)
        else:
            start_after_official(stage, results)
            run_stage(stage, results, deadline, args)
        results["stages"].append(summary(stage))
        save(results)
    results["meta"]["elapsed_s"] = round(args.budget_s - (deadline - time.monotonic()), 1)
    return results


def run_stage(stage: Stage, results: dict, deadline: float, args) -> None:
    left = deadline - time.monotonic()
    if left < MIN_STAGE_S:
        stage.outcome = {"status": f"not run (time budget: {max(left, 0):.0f} s left)"}
        log(f"{stage.name}: {stage.outcome['status']}")
        fill_missing_rows(stage, results)
        return
    timeout = min(stage.cap_s if not args.dry_run else stage.cap_s * 4, left)
    log(f"{stage.name}: starting (cap {timeout:.0f} s, estimate {stage.estimate_s} s)")
    rows, stage.outcome = run_job(stage.job, timeout)
    for row in rows:
        results["rows"].setdefault(row.pop("row"), {})[row.pop("side")] = row
    fill_missing_rows(stage, results)
    log(f"{stage.name}: {stage.outcome['status']} after {stage.outcome['seconds']} s")


def start_after_official(stage: Stage, results: dict) -> None:
    """A job with "start_after_official": its search starts at that many times official's longest sequence, when
    official's stage found it (else at the plan's start)."""
    factor = stage.job.pop("start_after_official", None)
    official = results["rows"].get("longest batch 1", {}).get("official", {}).get("longest")
    if factor and official:
        stage.job["start"] = longest_fit_start(official, factor=factor, resolution=stage.job["resolution"],
                                               cap=stage.job["cap"])


def fill_missing_rows(stage: Stage, results: dict) -> None:
    """Each row the stage's job should have reported and did not gets the job's outcome as its status (a crash,
    a timeout, "not run (time budget)")."""
    status = stage.outcome["status"]
    if status == "ok":
        status = "no result (the job ended without reporting this row)"
    sides = stage.job.get("sides") or [stage.job.get("side", "both")]
    for label in expected_rows(stage.job):
        for side in sides:
            results["rows"].setdefault(label, {}).setdefault(side, {"status": status})


def summary(stage: Stage) -> dict:
    side = stage.job.get("side")
    return {"name": stage.name, "side": side, "cap_s": stage.cap_s, "estimate_s": stage.estimate_s,
            "basis": stage.basis, **stage.outcome}


def package_versions() -> dict:
    """Versions of what the rows depend on (importlib.metadata: nothing is imported, no device touched)."""
    versions = {}
    for name in ("torch", "transformers", "triton", "liger_kernel", "flash_attn", "accelerate"):
        try:
            versions[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            try:
                versions[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                versions[name] = "not installed"
    return versions


def metadata(args, plan: GpuPlan) -> dict:
    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "dry_run": args.dry_run, "plan": json.loads(json.dumps(vars(plan), default=_shape_json)), "budget_s": args.budget_s,
        "git": os.environ.get("HF_TINY_REVISION") or git_revision(),
        "python": platform.python_version(), "versions": package_versions(), "cores": os.cpu_count(),
        "command": "python -m benchmarks.gpu_check " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "tests": [gpu_report.test_summary(Path(p)) for p in args.tests_log],
        "failed_tests": gpu_report.failed_tests(Path(args.failures_log)) if args.failures_log else [],
        "device_text": Path(args.device_file).read_text().strip() if args.device_file else "",
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu_check")),
                        help="results folder (default: $OUT or /tmp/gpu_check)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="seconds for all stages together")
    parser.add_argument("--stages", type=lambda text: [s for s in text.split(",") if s],
                        help="run only these stages after the build (names as in the report's stage table)")
    parser.add_argument("--tests-log", action="append", default=[], help="a pytest log whose summary the report quotes")
    parser.add_argument("--failures-log", help="the tests' HF_TINY_FAILURE_LOG, whose failing test ids the report lists")
    parser.add_argument("--device-file", help="a text file describing the device (nvidia-smi), quoted in the report")
    parser.add_argument("--dry-run", action="store_true", help="CPU, a 2-layer model, tiny shapes: checks the script")
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    if not args.dry_run:
        import torch  # only to refuse a machine without a GPU; the jobs use it in their own processes

        if not torch.cuda.is_available():
            parser.error("no CUDA device is available: use --dry-run to check the script on a CPU")
    return args


def write(results: dict, out: Path, *, final: bool = False) -> Path:
    """<out>/gpu-check-<device>-<date>[-dry-run].md and .json; returns the .md."""
    out.mkdir(parents=True, exist_ok=True)
    results["meta"]["complete"] = final
    # the run's start date (meta["date"]): a run across midnight rewrites one page, not two
    stem = f"gpu-check-{file_stem(gpu_report.device_name(results))}-{results['meta']['date'][:10]}"
    stem += "-dry-run" if results["meta"]["dry_run"] else ""
    (out / f"{stem}.md").write_text(gpu_report.render_markdown(results))
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2, default=_shape_json))
    return out / f"{stem}.md"


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = run(args, save=lambda partial: write(partial, args.out))
    page = write(results, args.out, final=True)
    print(page.read_text())
    log(f"wrote {page} and its .json")
    return results


if __name__ == "__main__":
    main()
