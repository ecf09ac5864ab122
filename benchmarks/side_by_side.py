"""hf_tiny of two checkouts, side by side, on the rows of `python -m benchmarks.run --device cpu`.

    python -m benchmarks.side_by_side --before /tmp/wt_head --after . [--models minilm,smollm2,overhead]
        [--cases prefill,train_step,generate] [--repeats 5] [--calls 3] [--memory-repeats 2] [--quick] [--tag NAME]

Answers "is a change within noise of what it replaced" for prefill, train-step and generate time and peak memory,
at the shapes of the report (`plans.make_plan`). The harness is this checkout's benchmarks/; only hf_tiny (and the
converter that writes its checkpoints, conversion/) come from the checkout under test. Every measurement runs in
a fresh interpreter that puts its checkout first on sys.path and checks that `hf_tiny.__file__` lies inside it
(an editable install elsewhere would otherwise win). First each checkout converts the official checkpoints into
its own folder; then, per repeat and row, one process per checkout loads the model, makes one warm-up call (a
4-token generate for generate) and times `--calls` calls, the checkouts alternating (before, after; then after,
before; ...) so that a drift of the machine's load falls on both. Reported per row: the median over processes of
each process's median, [min–max] of those, the after/before ratio, and "within noise" when the two [min–max]
ranges overlap; minor page faults per call; aten and Python calls per call (prefill) or per decode step
(generate), counted once per checkout, which do not depend on load; whether greedy tokens are identical; and the
peak memory of each case as the report measures it (benchmarks/memory_probe.py). Before timing, each process
frees one 16 MiB block, which raises glibc's mmap threshold as the report's GEMM-peak measurement does before its
rows (`--allocator fresh` leaves it, as benchmarks.fresh_process does).

Writes benchmarks/results/side-by-side-cpu-<date>[-tag].md and .json (every sample) and prints the markdown.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import resource
import shlex
import sys
import time
from pathlib import Path

import torch

from . import side_by_side_report
from .machine import RESULTS_DIR, REPO_ROOT, cpu_model, file_stem, git_revision
from .measure import CLOCKS, MIB, PROBE_ENV, run_json_process, time_interleaved
from .models import MODELS, OFFICIAL, cache_dir, official_folder
from .plans import make_plan
from .workloads import DECODE, DECODE_COMPILED, PREFILL, TRAIN, Shape, build, build_generate

SIDES = ("before", "after")
DEFAULT_MODELS = "minilm,smollm2,overhead"
DEFAULT_CASES = ",".join((PREFILL, TRAIN, DECODE))
CPU = torch.device("cpu")


def log(message: str) -> None:
    print(f"[side_by_side {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- inside a measuring process ------------------------------------------------------------------------------

def import_checkout(checkout: str, packages: tuple = ("hf_tiny",)) -> dict:
    """Puts `checkout` first on sys.path and imports `packages` from it; {package: its __init__ file}. Raises
    when one was imported already or comes from elsewhere (an editable install, the harness's own checkout)."""
    root = Path(checkout).resolve()
    sys.path.insert(0, str(root))
    files = {}
    for name in packages:
        if name in sys.modules:
            raise RuntimeError(f"{name} was imported before the checkout {root} was put first on sys.path")
        module = __import__(name)
        files[name] = str(Path(module.__file__).resolve())
        if not Path(files[name]).is_relative_to(root):
            raise RuntimeError(f"{name} imported from {files[name]}, not from the checkout {root}")
    return files


def child_convert(spec: dict) -> dict:
    """This checkout's converter writes its hf_tiny folder from the official checkpoint (as load_pair does)."""
    from .models import convert_hf_tiny, load_model

    files = import_checkout(spec["checkout"], ("hf_tiny", "conversion"))
    model_spec = MODELS[spec["model"]]
    reference = None
    if model_spec.family == "causal":  # the converter's parity check uses it instead of dequantizing again
        reference = load_model(model_spec, OFFICIAL, Path(spec["official"]), dtype=torch.float32, device=CPU,
                               attn="sdpa")
    folder = convert_hf_tiny(model_spec, Path(spec["official"]), reference_model=reference, dst=Path(spec["dst"]))
    return {"folder": str(folder), "files": files}


def child_time(spec: dict) -> dict:
    """One checkout's hf_tiny on one row: per-call seconds and minor page faults of `calls` timed calls after a
    warm-up, greedy tokens' digest (generate), and aten / Python calls when spec["ops"]."""
    from .models import load_model
    from .run import count_ops

    files = import_checkout(spec["checkout"])
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    if spec["allocator"] == "run":
        raise_mmap_threshold()
    model_spec = MODELS[spec["model"]]
    model = load_model(model_spec, "hf_tiny", Path(spec["folder"]), dtype=torch.float32, device=CPU, attn="sdpa")
    shape = Shape(spec["batch"], spec["seq"], spec["new_tokens"])
    fn = build(spec["case"], model, model_spec.family, shape, CPU, spec["prefill_extra"])
    faults = []

    def counted():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        output = fn()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        return output

    warm = {"x": build_generate(model, shape, CPU, new_tokens=4)} if spec["case"] == DECODE else None
    timing = time_interleaved({"x": counted}, device=CPU, warmup=1, repeats=spec["calls"], warmup_contenders=warm,
                              clock=CLOCKS[spec["clock"]])["x"]
    answer = {"seconds": timing.samples, "faults": faults[-spec["calls"]:], "files": files, "tokens": None,
              "ops": None}
    if spec["case"] == DECODE:
        answer["tokens"] = token_digest(timing.last_output[:, shape.seq:])
    if spec["ops"] and spec["case"] in (PREFILL, DECODE):
        counts = count_ops(spec["case"], {"x": model}, {"x": fn}, model_spec.family, shape, CPU)
        answer["ops"] = {kind: per_side["x"] for kind, per_side in counts.items()}
    return answer


def raise_mmap_threshold() -> None:
    """Frees one 16 MiB block, as the report's GEMM-peak measurement (2048² fp32 matrices) does before any of its
    rows: glibc then raises its mmap threshold to that size, so smaller temporaries come from its free lists
    instead of fresh mappings that fault in page by page (see benchmarks/fresh_process.py)."""
    block = torch.ones(16 * MIB // 4)
    del block


def token_digest(tokens: torch.Tensor) -> str:
    return hashlib.sha256(json.dumps(tokens.tolist()).encode()).hexdigest()[:16]


def child_memory(spec: dict) -> dict:
    """One checkout's hf_tiny on one memory case, measured by benchmarks.memory_probe's method."""
    from .memory_probe import probe

    files = import_checkout(spec["checkout"])
    return {**probe(spec), "files": files}


CHILDREN = {"convert": child_convert, "time": child_time, "memory": child_memory}


# ---- the parent: what to measure, in which order ---------------------------------------------------------------

def rows_of(models: list[str], cases: list[str], quick: bool, memory: bool) -> list[dict]:
    """The report's rows for these models and cases: {"model", "case", "shape", "kind": "time" | "memory"}; one
    memory row per eager case (generate: the largest batch), as benchmarks.run measures them."""
    plan = make_plan(CPU, quick)
    rows = []
    for name in models:
        family = MODELS[name].family
        for case in sorted((c for c in cases if family == "causal" or c != DECODE), key=lambda c: c == TRAIN):
            shapes = plan.decode if case == DECODE else [(plan.prefill if case == PREFILL else plan.train)[family]]
            for shape in shapes:
                rows.append({"model": name, "case": case, "shape": shape, "kind": "time"})
                largest = case != DECODE or shape.batch == max(s.batch for s in plan.decode)
                if memory and largest:
                    rows.append({"model": name, "case": case, "shape": shape, "kind": "memory"})
    return rows


def run_child(kind: str, spec: dict) -> dict:
    """A fresh interpreter started in the harness's checkout (so `benchmarks` is this package) runs CHILDREN[kind]."""
    answer, failure = run_json_process("benchmarks.side_by_side", ["--child", json.dumps({"kind": kind, **spec})],
                                       env=PROBE_ENV if kind == "memory" else None, cwd=REPO_ROOT)
    if answer is None:
        raise RuntimeError(f"{kind} process for {spec.get('model')} with the checkout {spec['checkout']} {failure}")
    return answer


def convert_all(checkouts: dict, models: list[str], work: Path) -> dict:
    """{side: {model: hf_tiny folder}}, each written by its checkout's converter; checks where hf_tiny came from."""
    folders = {side: {} for side in checkouts}
    for name in models:
        official = official_folder(MODELS[name])
        for side, checkout in checkouts.items():
            log(f"{side}: converting {name}")
            spec = {"checkout": str(checkout["path"]), "model": name, "official": str(official),
                    "dst": str(work / side / f"{name}-hf_tiny")}
            answer = run_child("convert", spec)
            checkout["files"] = answer["files"]
            folders[side][name] = answer["folder"]
    return folders


def order(repeat: int) -> tuple:
    """before, after; after, before; ...: a load drift during a pair of processes falls on both sides."""
    return SIDES if repeat % 2 == 0 else SIDES[::-1]


def measure_rows(rows: list[dict], checkouts: dict, folders: dict, args) -> None:
    """Fills each row's "runs": {side: [one child's answer per repeat]}, alternating the checkouts."""
    for row in rows:
        row["runs"] = {side: [] for side in SIDES}
    repeats = max(args.repeats, args.memory_repeats)
    for repeat in range(repeats):
        for row in rows:
            count = args.repeats if row["kind"] == "time" else args.memory_repeats
            if repeat >= count:
                continue
            for side in order(repeat):
                spec = child_spec(row, side, checkouts, folders, args, first=repeat == 0)
                log(f"repeat {repeat + 1}/{count}: {side} {row['model']} {row['kind']} {row['case']} "
                    f"{row['shape'].label()}")
                answer = run_child(row["kind"], spec)
                if answer.get("error"):
                    raise RuntimeError(f"{side} {row['model']} {row['case']}: {answer['error']}")
                row["runs"][side].append(answer)


def child_spec(row: dict, side: str, checkouts: dict, folders: dict, args, first: bool) -> dict:
    shape, name = row["shape"], row["model"]
    causal = MODELS[name].family == "causal"
    spec = {
        "checkout": str(checkouts[side]["path"]), "model": name, "impl": "hf_tiny", "folder": folders[side][name],
        "case": row["case"], "batch": shape.batch, "seq": shape.seq, "new_tokens": shape.new_tokens,
        # What workloads.prefill_kwargs gives a causal pair whose sides both take logits_to_keep.
        "prefill_extra": {"use_cache": False, "logits_to_keep": 1} if causal else None,
        "threads": args.threads or torch.get_num_threads(),
    }
    if row["kind"] == "memory":
        return {**spec, "dtype": "float32", "attn": "sdpa", "drop_pooler": False,
                "calls": 2 if row["case"] == TRAIN else 1}
    return {**spec, "calls": args.calls, "clock": args.clock, "allocator": args.allocator, "ops": args.ops and first}


# ---- command line --------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.side_by_side", description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="checkout measured first (e.g. the commit a change replaces)")
    parser.add_argument("--after", type=Path, default=Path("."), help="checkout measured second (default: .)")
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"comma-separated subset of {DEFAULT_MODELS}")
    parser.add_argument("--cases", default=DEFAULT_CASES, help=f"comma-separated subset of {DEFAULT_CASES}")
    parser.add_argument("--repeats", type=int, default=5, help="processes per checkout and timed row")
    parser.add_argument("--calls", type=int, default=3, help="timed calls per process, after one warm-up")
    parser.add_argument("--memory-repeats", type=int, default=2, help="processes per checkout and memory row")
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak-memory rows")
    parser.add_argument("--no-ops", dest="ops", action="store_false", help="skip counting aten and Python calls")
    parser.add_argument("--quick", action="store_true", help="the report's --quick shapes")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="cpu = process CPU time, steadier on a shared machine; use with --threads 1")
    parser.add_argument("--allocator", choices=["run", "fresh"], default="run",
                        help="run: glibc's mmap threshold raised as in benchmarks.run; fresh: as a new process has it")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    parser.add_argument("--note", default="", help="free text recorded in the report")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return args
    check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Turns the comma lists into lists and rejects what cannot be measured, naming the option and value."""
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [m for m in args.models if m not in DEFAULT_MODELS.split(",")]
    if unknown:
        parser.error(f"--models: unknown or not a CPU model: {', '.join(unknown)}; choose from {DEFAULT_MODELS}")
    unknown = [c for c in args.cases if c not in DEFAULT_CASES.split(",")]
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)}; choose from {DEFAULT_CASES} "
                     f"({DECODE_COMPILED} is not compared: compiling takes minutes per process)")
    for name in ("repeats", "calls", "memory_repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu measures process CPU time, which equals elapsed time only with --threads 1")
    if args.before is None:
        parser.error("--before: the checkout to compare against is required (e.g. --before /tmp/wt_head)")
    for flag in ("before", "after"):
        path = getattr(args, flag).resolve()
        if not (path / "hf_tiny" / "__init__.py").is_file() or not (path / "conversion").is_dir():
            parser.error(f"--{flag}: {path} is not an hf_tiny checkout (no hf_tiny/__init__.py or conversion/)")
        setattr(args, flag, path)


def metadata(args, checkouts: dict, seconds: float) -> dict:
    import transformers

    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "device_name": cpu_model(), "cores": os.cpu_count(), "threads": args.threads or torch.get_num_threads(),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "repeats": args.repeats, "calls": args.calls, "memory_repeats": args.memory_repeats, "clock": args.clock,
        "allocator": args.allocator, "mode": "quick" if args.quick else "full", "harness": git_revision(REPO_ROOT),
        "command": "python -m benchmarks.side_by_side " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "note": args.note, "elapsed_s": seconds,
        "checkouts": {side: {"path": str(c["path"]), "git": git_revision(c["path"]), "files": c.get("files", {})}
                      for side, c in checkouts.items()},
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(CHILDREN[spec.pop("kind")](spec)), flush=True)
        return {}
    start = time.perf_counter()
    checkouts = {"before": {"path": args.before}, "after": {"path": args.after}}
    work = cache_dir() / "side-by-side"
    folders = convert_all(checkouts, args.models, work)
    rows = rows_of(args.models, args.cases, args.quick, args.memory)
    measure_rows(rows, checkouts, folders, args)
    results = {"meta": metadata(args, checkouts, time.perf_counter() - start),
               "rows": [side_by_side_report.summarize(row) for row in rows]}
    stem = f"side-by-side-cpu-{datetime.date.today().isoformat()}" + (f"-{file_stem(args.tag)}" if args.tag else "")
    markdown = side_by_side_report.render_markdown(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.md").write_text(markdown)
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2))
    print(markdown)
    log(f"wrote {args.out / stem}.md and .json after {results['meta']['elapsed_s'] / 60:,.1f} min")
    return results


if __name__ == "__main__":
    main()
