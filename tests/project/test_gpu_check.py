"""benchmarks.gpu_check, the GPU session's script, checked on the CPU: its dry run measures every row and writes a
target table with every target of issue 42; the longest-sequence search, the exit of a crashed job and the
target verdicts on hand-made results."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu_check, gpu_report
from benchmarks.gpu_rows import search_longest

REPO = Path(__file__).resolve().parents[2]


# ---- the longest-sequence search -----------------------------------------------------------------------------------

def recording(limit: int):
    probes = []

    def fits(length: int) -> bool:
        probes.append(length)
        return length <= limit

    return fits, probes


def test_search_doubles_then_bisects_to_the_resolution():
    fits, probes = recording(5000)
    found = search_longest(fits, start=1024, cap=65536, resolution=256, deadline=time.monotonic() + 60)
    # by hand: 1024, 2048, 4096 fit, 8192 does not; then 6144 no, 5120 no, 4608 yes, 4864 yes; 5120 - 4864 = 256
    assert found == (4864, "fails at 5120")
    assert probes == [1024, 2048, 4096, 8192, 6144, 5120, 4608, 4864]


def test_search_stops_at_the_cap_the_start_and_the_deadline():
    fits, probes = recording(10**9)
    assert search_longest(fits, start=16, cap=128, resolution=16, deadline=time.monotonic() + 60) == (128, "cap 128 reached")
    assert probes == [16, 32, 64, 128]
    fits, _ = recording(8)
    assert search_longest(fits, start=16, cap=128, resolution=16, deadline=time.monotonic() + 60) == (0, "16 tokens do not fit")
    fits, probes = recording(10**9)
    assert search_longest(fits, start=16, cap=128, resolution=16, deadline=time.monotonic() - 1) == (
        0, "time cap before the first probe")
    assert probes == []


def test_a_crashed_job_is_named_by_its_signal():
    proc = subprocess.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"], check=False)
    assert proc.returncode == -signal.SIGSEGV
    assert gpu_check.describe_exit(proc.returncode, "") == "crashed: signal 11 (SIGSEGV)"
    assert gpu_check.describe_exit(3, "a\nb\nValueError: bad") == "exit 3: a | b | ValueError: bad"


# ---- the verdicts, on hand-made results ---------------------------------------------------------------------------

PLAN = {"model": "tiny", "dtype": "float32", "prefill": [[1, 32, 0]], "decode": [[1, 8, 4]], "train": [2, 32, 0],
        "repeats": 1, "warmup": 1, "decode_repeats": 1}


def timed(seconds: float, extra_mib: float, **more) -> dict:
    return {"seconds": seconds, "samples": [seconds], "extra_bytes": extra_mib * 2**20, "peak_bytes": 2 * extra_mib * 2**20,
            **more}


def hand_made_results() -> dict:
    rows = {
        "host prefill": {"official": {"python_calls": 1000, "aten_calls": 1, "shape": "1x32"},
                         "hf_tiny": {"python_calls": 900, "aten_calls": 1, "shape": "1x32"}},
        "host decode step": {"official": {"python_calls": 1000, "aten_calls": 1, "shape": "1x8"},
                             "hf_tiny": {"python_calls": 1100, "aten_calls": 1, "shape": "1x8"}},
        "prefill 1x32": {"official": timed(0.010, 100), "hf_tiny": timed(0.008, 100)},  # faster, same memory
        "decode 1x8 +4 new eager": {"official": timed(1.0, 10, tokens_per_s=4.0, tokens=[[5, 6, 7, 8]]),
                                    "hf_tiny": timed(1.0, 11, tokens_per_s=4.0, tokens=[[5, 6, 7, 8]])},  # 1.1x memory
        "decode 1x8 +4 new captured": {"official": {"status": "crashed: signal 11 (SIGSEGV)"},
                                       "hf_tiny": timed(0.5, 10, tokens_per_s=8.0, tokens=[[5, 6, 7, 8]])},
        "train 2x32": {"official": timed(1.0, 1000), "hf_tiny": timed(0.8, 500)},
        "train 2x32 liger": {"official": {"status": "not installed: liger_kernel"},
                             "hf_tiny": {"status": "not installed: liger_kernel"}},
        "ceilings": {"official": {"bandwidth": {"read_bytes_per_s": 1e12}}},
        "longest batch 1": {"official": {"longest": 1024, "stopped": "fails at 2048", "probes": []},
                            "hf_tiny": {"longest": 4096, "stopped": "fails at 5120", "probes": []}},
    }
    return {"meta": {"plan": PLAN, "dry_run": True}, "rows": rows, "stages": []}


def test_verdicts_of_hand_made_results():
    verdicts = {name: (text, status) for name, text, status in gpu_report.targets(hand_made_results())}
    assert verdicts["Host work: prefill Python calls <= 1.0x official's"] == ("900 / 1,000 = 0.90x", "PASS")
    assert verdicts["Host work: decode step Python calls <= 1.0x official's"][1] == "FAIL"
    assert verdicts["prefill 1x32: >= 1.0x official's speed at <= 1.0x its memory"] == (
        "speed 1.25x, memory 1.00x", "PASS")
    assert verdicts["decode 1x8 +4 new eager: >= 1.0x official's speed at <= 1.0x its memory"] == (
        "speed 1.00x, memory 1.10x", "FAIL")
    assert verdicts["decode 1x8 +4 new captured: >= 1.0x official's speed at <= 1.0x its memory"] == (
        "official: crashed: signal 11 (SIGSEGV)", "not run")
    assert verdicts["Batch-1 captured decode >= official's (where official's runs)"] == (
        "official's failed: crashed: signal 11 (SIGSEGV)", "PASS")
    liger_time = verdicts["Training 2x32: time <= 0.85x official's, Liger on ours, none on official's"]
    assert liger_time == ("hf_tiny: not installed: liger_kernel", "not run")
    assert verdicts["Longest trainable sequence at batch 1 >= 3x official's"][1] == "PASS"  # 4096 / 1024 = 4


def test_the_fit_memory_option_is_judged_by_its_longest_sequence_and_its_cost_where_the_step_fits():
    results = hand_made_results()
    fit_target = "With fit_memory on (CUDA's default since both rows below passed): longest >= 3x official's"
    cost_target = "With fit_memory on, where the 2x32 step fits: <= 1.02x hf_tiny's time without it"
    verdicts = {name: (text, status) for name, text, status in gpu_report.targets(results)}
    assert verdicts[fit_target] == ("hf_tiny, fit_memory on: not run", "not run")
    assert verdicts[cost_target] == ("hf_tiny: not run", "not run")
    rows = results["rows"]
    rows["longest batch 1"]["hf_tiny_fit"] = {"longest": 3072, "stopped": "time cap while doubling", "probes": []}
    rows["train 2x32 fit_memory"] = {"hf_tiny": timed(0.81, 500)}  # 0.81 / 0.8 s
    verdicts = {name: (text, status) for name, text, status in gpu_report.targets(results)}
    assert verdicts[fit_target] == ("3,072 / 1,024 tokens = 3.00x (fit_memory: time cap while doubling)", "PASS")
    assert verdicts[cost_target] == ("1.01x", "PASS")
    # timed interleaved with the same model's step without it: that pair decides, not the separately loaded row
    rows["train 2x32 fit_memory"] = {"hf_tiny": {**timed(0.81, 500), "paired_off_seconds": 0.75}}  # 1.08x
    verdicts = {name: (text, status) for name, text, status in gpu_report.targets(results)}
    assert verdicts[cost_target] == ("1.08x (810.0 / 750.0 ms, interleaved)", "FAIL")
    rows["longest batch 1"]["hf_tiny_fit"] = {"longest": 0, "stopped": "3072 tokens do not fit", "probes": []}
    rows["train 2x32 fit_memory"] = {"hf_tiny": timed(0.84, 500)}  # 1.05x
    verdicts = {name: status for name, _, status in gpu_report.targets(results)}
    assert verdicts[fit_target] == "FAIL" and verdicts[cost_target] == "FAIL"
    rows["longest batch 1"]["hf_tiny_fit"] = {"longest": 2048, "stopped": "cap 2048 reached", "probes": []}
    verdicts = {name: (text, status) for name, text, status in gpu_report.targets(results)}
    assert verdicts[fit_target][1] == "not run" and "stopped before its limit" in verdicts[fit_target][0]
    rows["longest batch 1"]["hf_tiny_fit"] = {"longest": 2048, "stopped": "time cap while doubling", "probes": []}
    verdicts = {name: (text, status) for name, text, status in gpu_report.targets(results)}
    assert verdicts[fit_target][1] == "not run"
    rows["longest batch 1"]["official"]["stopped"] = "cap 1024 reached"
    verdicts = {name: (text, status) for name, text, status in gpu_report.targets(results)}
    assert verdicts[fit_target][1] == "not run" and "did not reach its limit" in verdicts[fit_target][0]


def test_the_rebuild_option_is_judged_by_its_memory_beside_liger_and_its_cost():
    """official's plain 2x32 step keeps 1000 bytes above the model; ours with Liger and rebuild 550 (0.55x), timed
    interleaved at 0.81 s against 0.80 s without it (1.01x)."""
    results = hand_made_results()
    memory = ("With rebuild on (a named option until both rows below pass): Training 2x32: peak memory <= 0.6x "
              "official's, Liger on ours, none on official's")
    cost = "With rebuild on, Liger on ours: <= 1.02x the time without it"
    verdicts = {name: (text, status) for name, text, status in gpu_report.targets(results)}
    assert verdicts[memory][1] == verdicts[cost][1] == "not run"
    results["rows"]["train 2x32 liger rebuild"] = {"hf_tiny": {**timed(0.81, 550), "paired_off_seconds": 0.80}}
    verdicts = {name: (text, status) for name, text, status in gpu_report.targets(results)}
    assert verdicts[memory] == ("0.55x", "PASS")
    assert verdicts[cost] == ("1.01x (810.0 / 800.0 ms, interleaved)", "PASS")
    results["rows"]["train 2x32 liger rebuild"] = {"hf_tiny": {**timed(0.81, 650), "paired_off_seconds": 0.70}}
    verdicts = {name: status for name, _, status in gpu_report.targets(results)}
    assert verdicts[memory] == verdicts[cost] == "FAIL"
    assert not any(name.startswith("train 2x32 liger rebuild:") for name in verdicts)  # an option: no row target


def test_liger_on_both_sides_is_judged_from_the_paired_row_where_it_ran():
    results = hand_made_results()
    results["rows"]["train 2x32 liger"] = {"official": timed(1.0, 100), "hf_tiny": timed(1.1, 100)}
    verdicts = {name: (text, status) for name, text, status in gpu_report.targets(results)}
    both = "Training 2x32, Liger on both sides: no slower than official"
    assert verdicts[both] == ("1.10x official's time", "FAIL")  # the separate rows, two processes
    results["rows"]["train 2x32 liger paired"] = {"official": timed(1.0, 100), "hf_tiny": timed(0.98, 100)}
    verdicts = {name: (text, status) for name, text, status in gpu_report.targets(results)}
    assert verdicts[both] == ("0.98x official's time (interleaved in one process)", "PASS")
    assert verdicts["train 2x32 liger paired: >= 1.0x official's speed at <= 1.0x its memory"][1] == "PASS"


def test_a_cut_off_verbose_test_log_says_how_far_it_got(tmp_path):
    log = tmp_path / "cuda_tests.log"
    log.write_text("bringing up nodes...\n[gw0] [  1%] PASSED tests/a.py::x \n[gw1] [  2%] FAILED tests/a.py::y\n"
                   "[gw1] [  3%] PASSED tests/b.py::z\n")
    assert gpu_report.test_summary(log)["summary"] == "no summary line (cut off?): 2 passed, 1 failed"
    log.write_text("[gw1] [100%] PASSED tests/b.py::z\n==== 1 failed, 2 passed in 9.1s ====\n")
    assert gpu_report.test_summary(log)["summary"] == "1 failed, 2 passed in 9.1s"


def test_a_gpu_profile_shows_the_hosts_own_calls_beside_the_kernels():
    results = hand_made_results()
    kernels = {"busy_of": "GPU kernels", "wall_us": 4000.0, "busy_us": 1000.0, "kernel_launches": 300,
               "kernels": [["gemv_bf16", 150, 700.0], ["fmha_cutlassF", 22, 300.0]]}
    results["rows"]["decode 1x8 +4 new captured kernels"] = {
        "official": kernels,
        "hf_tiny": {**kernels, "host_us": 2500.0, "host_calls": [["cudaGraphLaunch", 4, 1200.0], ["aten::copy_", 9, 90.0]]},
    }
    results["rows"]["train 2x32 liger kernels"] = {"hf_tiny": {**kernels, "kernels": [["liger_rope", 6, 40.0]]}}
    page = "\n".join(gpu_report.kernel_lines(results))
    assert "wall 4.0 ms; GPU kernels' own time 1.0 ms (25% of it), 300 of them; the host's own time 2.5 ms" in page
    assert "| hf_tiny | `cudaGraphLaunch` | 4 | 1.20 |" in page and "| hf_tiny | `gemv_bf16` | 150 | 0.70 |" in page
    assert "host's own time" not in page.split("hf_tiny")[0]  # official's profile has none: no host column for it
    # the training step with Liger, profiled on its side only
    assert "**train 2x32 liger**" in page and "| hf_tiny | `liger_rope` | 6 | 0.04 |" in page


def test_the_decode_table_shows_how_the_cuda_graphs_ran_and_each_sides_own_agreement():
    results = hand_made_results()
    row = results["rows"]["decode 1x8 +4 new captured"]
    row["hf_tiny"]["cuda_graph_runs"] = {"calls": 30, "replayed": 2, "recorded": 1, "warm_up": 1, "without_graph": 26}
    row["official"] = timed(0.5, 10, tokens_per_s=8.0, tokens=[[5, 6, 7, 9]], graphs_compiled=1, cuda_graph_runs={
        "calls": 30, "replayed": 28, "recorded": 1, "warm_up": 1, "without_graph": 0})
    page = "\n".join(gpu_report.decode_lines(results))
    assert "| 1 | 28 replayed, 1 recorded, 1 warm-up, 0 without a graph (of 30) | — |" in page
    assert "| — | 2 replayed, 1 recorded, 1 warm-up, **26 without a graph** (of 30) | 75% |" in page
    assert "| decode 1x8 +4 new eager | official | 4.0 |" in page and "| — | — | — |" in page  # eager: no counts
    assert gpu_report.graph_runs({"calls": 0, "replayed": 0, "recorded": 0, "warm_up": 0, "without_graph": 0}) == "—"
    # each side's captured tokens against its own eager ones: the scale of the sides' agreement
    assert ("- decode 1x8 +4 new captured: each side's greedy tokens against its own eager ones: official 75%, "
            "hf_tiny 100%.") in page

def test_the_fit_memory_search_starts_at_three_times_officials_longest():
    """60,416 x 3 = 181,248 = 177 x 1,024; 1,000 x 3 rounds up to 3,072; never past the cap."""
    assert gpu_check.longest_fit_start(60_416, factor=3.0, resolution=1024, cap=262_144) == 181_248
    assert gpu_check.longest_fit_start(1_000, factor=3.0, resolution=1024, cap=262_144) == 3_072
    assert gpu_check.longest_fit_start(100_000, factor=3.0, resolution=1024, cap=262_144) == 262_144
    stage = gpu_check.Stage("longest-hf_tiny_fit", {"start": 16, "resolution": 16, "cap": 128,
                                                    "start_after_official": 3.0}, 1, 1, "")
    gpu_check.start_after_official(stage, {"rows": {}})
    assert stage.job == {"start": 16, "resolution": 16, "cap": 128}
    stage.job["start_after_official"] = 3.0
    gpu_check.start_after_official(stage, {"rows": {"longest batch 1": {"official": {"longest": 32}}}})
    assert stage.job["start"] == 96


def test_an_official_side_left_out_passes_nothing():
    """Official's captured decode not run in this call (`--stages`, the budget) is no crash of official's: "not run"."""
    results = hand_made_results()
    for status in ("not run (not in --stages)", "not run (time budget: 0 s left)"):
        results["rows"]["decode 1x8 +4 new captured"]["official"] = {"status": status}
        verdicts = {name: (text, verdict) for name, text, verdict in gpu_report.targets(results)}
        assert verdicts["Batch-1 captured decode >= official's (where official's runs)"] == (f"official: {status}", "not run")


def test_a_ratio_next_to_its_bound_prints_the_digits_its_verdict_reads():
    assert [gpu_report.times(v) for v in (0.93, 0.9994, 1.0001, 1.0, 1.25)] == ["0.93x", "0.999x", "1.0001x", "1.00x", "1.25x"]
    assert gpu_report.times(0.6004, 0.6) == "0.6004x"
    results = hand_made_results()
    results["rows"]["train 2x32"] = {"official": timed(1.0, 1000), "hf_tiny": timed(1.0004, 1000)}
    verdicts = {name: (text, verdict) for name, text, verdict in gpu_report.targets(results)}
    assert verdicts["train 2x32: >= 1.0x official's speed at <= 1.0x its memory"] == ("speed 0.9996x, memory 1.00x", "FAIL")


def test_calls_merge_into_one_page_each_row_from_the_call_that_measured_it(tmp_path):
    first = hand_made_results()
    first["rows"]["train 2x32"]["hf_tiny"] = {"status": "not run (time budget: 0 s left)"}
    first["meta"].update(date="d1", git="abc", command="first", budget_s=500, elapsed_s=500, versions={}, cores=2,
                         python="3.12",
                         tests=[{"log": "cuda_tests.log", "summary": "3 passed"}], failed_tests=["t::a"])
    first["stages"] = [{"name": "main-hf_tiny", "status": "ok", "cap_s": 1, "estimate_s": 1, "basis": ""}]
    second = json.loads(json.dumps(hand_made_results()))
    second["rows"] = {"train 2x32": {"hf_tiny": timed(0.5, 400), "official": {"status": "not run (not in --stages)"}},
                      "prefill 1x32": {"hf_tiny": {"status": "not run (not in --stages)"}}}
    second["meta"].update(date="d2", git="abc", command="second", budget_s=200, elapsed_s=100,
                          tests=[{"log": "cuda_tests.log", "summary": "no log (not run)"}])
    second["stages"] = [{"name": "main-official", "status": "not run (not in --stages)", "cap_s": 1, "estimate_s": 1,
                         "basis": ""}, {"name": "train-hf_tiny", "status": "ok", "cap_s": 1, "estimate_s": 1, "basis": ""}]
    paths = []
    for number, run in enumerate((first, second)):
        paths.append(tmp_path / f"{number}.json")
        paths[-1].write_text(json.dumps(run))
    page = gpu_report.main(["--merge", *map(str, paths), "--out", str(tmp_path / "merged.md")])
    merged = json.loads(page.with_suffix(".json").read_text())
    assert merged["rows"]["train 2x32"] == {"official": first["rows"]["train 2x32"]["official"],
                                           "hf_tiny": second["rows"]["train 2x32"]["hf_tiny"]}
    assert merged["rows"]["prefill 1x32"] == first["rows"]["prefill 1x32"]  # a later "not in --stages" never wins
    assert [(s["name"], s["run"]) for s in merged["stages"]] == [("main-hf_tiny", 1), ("train-hf_tiny", 2)]
    assert merged["meta"]["tests"] == [{"log": "cuda_tests.log", "summary": "3 passed"}]
    text = page.read_text()
    assert "call 1: hf_tiny commit abc, d1; command: `first`" in text and "call 2: hf_tiny commit abc, d2" in text
    assert "failing tests (1, tracebacks in failures.log): `t::a`" in text
    second["meta"]["plan"] = dict(PLAN, dtype="bfloat16")
    with pytest.raises(ValueError, match="different plans"):
        gpu_report.merge([first, second])


def test_the_failure_log_names_each_failure_as_it_happens(tmp_path):
    """tests/conftest.py's HF_TINY_FAILURE_LOG: a failing and a passing test, the log holds the failing one's id and
    its assertion, and the report reads the id back."""
    (tmp_path / "test_two.py").write_text("def test_good():\n    pass\n\ndef test_bad():\n    assert 1 == 2, 'planted'\n")
    log = tmp_path / "failures.log"
    env = dict(os.environ, HF_TINY_FAILURE_LOG=str(log), PYTHONPATH=str(REPO / "tests"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                           str(tmp_path / "test_two.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert gpu_report.failed_tests(log) == ["test_two.py::test_bad"]
    assert "planted" in log.read_text()
    assert "  at test_two.py:5\n" in log.read_text()  # every frame named, however long the traceback's tail


def test_a_search_stopped_by_its_cap_proves_no_ratio():
    results = hand_made_results()
    results["rows"]["longest batch 1"]["official"]["stopped"] = "cap 1024 reached"
    name, text, status = gpu_report.longest_target(results)
    assert status == "not run" and "official's search did not reach its limit" in text


# ---- the dry run ----------------------------------------------------------------------------------------------------

DRY_RUN_TARGETS = [
    "Host work: prefill Python calls <= 1.0x official's",
    "Host work: decode step Python calls <= 1.0x official's",
    *[f"{row}: >= 1.0x official's speed at <= 1.0x its memory" for row in (
        "prefill 1x32", "prefill 2x32", "prefill 1x32 paired", "prefill 2x32 paired", "decode 1x8 +4 new eager",
        "decode 2x8 +4 new eager", "decode 1x8 +4 new eager paired", "decode 2x8 +4 new eager paired",
        "decode 1x8 +4 new captured", "decode 2x8 +4 new captured", "train 2x32", "train 2x32 liger",
        "train 2x32 liger paired")],
    "Batch-1 captured decode >= 40% of the measured HBM read bandwidth",
    "Batch-1 captured decode >= official's (where official's runs)",
    "Training 2x32: time <= 0.85x official's, Liger on ours, none on official's",
    "Training 2x32: peak memory <= 0.6x official's, Liger on ours, none on official's",
    "Training 2x32, Liger on both sides: no slower than official",
    "Longest trainable sequence at batch 1 >= 3x official's",
    "With fit_memory on (CUDA's default since both rows below passed): longest >= 3x official's",
    "With fit_memory on, where the 2x32 step fits: <= 1.02x hf_tiny's time without it",
    "With rebuild on (a named option until both rows below pass): Training 2x32: peak memory <= 0.6x official's, "
    "Liger on ours, none on official's",
    "With rebuild on, Liger on ours: <= 1.02x the time without it",
]


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the script's budget < the child's timeout < pytest's: each limit names what ran over
def test_dry_run_runs_every_kind_of_job_and_lists_every_target(tmp_path):
    """The script on the CPU, hf_tiny's side of every kind of job (the build, the eager rows, captured decode, the
    longest-sequence search; each a process of its own; the official side runs the same functions): every selected
    stage ends "ok" and measures its rows, the others say they were not selected, and the page and the JSON list
    every target. (`python -m benchmarks.gpu_check --dry-run` runs all twelve stages: ~5 min on 2 busy cores.)"""
    stages = "main-hf_tiny,eager-paired,captured-hf_tiny-1,longest-hf_tiny,longest-hf_tiny_fit,liger-paired"
    env = dict(os.environ, HF_TINY_BENCH_CACHE=str(tmp_path / "checkpoints"))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(tmp_path),
                           "--budget-s", "1200", "--stages", stages], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (page,), (data,) = tmp_path.glob("*-dry-run.md"), tmp_path.glob("*-dry-run.json")
    results = json.loads(data.read_text())
    ran = {stage["name"]: stage["status"] for stage in results["stages"]}
    assert {name for name, status in ran.items() if status == "ok"} == {"build", *stages.split(",")}, ran
    assert all(status == "not run (not in --stages)" for name, status in ran.items() if name not in stages + ",build")
    assert [name for name, _, _ in gpu_report.targets(results)] == DRY_RUN_TARGETS
    markdown = page.read_text()
    assert all(f"| {name} |" in markdown for name in DRY_RUN_TARGETS)
    rows = results["rows"]
    measured = ["prefill 1x32", "prefill 2x32", "decode 1x8 +4 new eager", "decode 2x8 +4 new eager", "train 2x32",
                "decode 1x8 +4 new captured"]
    assert all("seconds" in rows[row]["hf_tiny"] for row in measured), {row: rows[row]["hf_tiny"] for row in measured}
    assert rows["decode 2x8 +4 new captured"]["hf_tiny"] == {"status": "not run (not in --stages)"}
    assert rows["decode 1x8 +4 new captured"]["hf_tiny"]["graphs_compiled"] >= 1
    assert rows["decode 1x8 +4 new captured"]["hf_tiny"]["cuda_graph_runs"]["calls"] == 0  # no CUDA graph on a CPU
    assert rows["host decode step"]["hf_tiny"]["python_calls"] > 0
    assert "seconds" in rows["train 2x32 recompute"]["hf_tiny"]  # set_runtime(recompute=True)
    assert "status" in rows["train 2x32 liger"]["hf_tiny"]  # Liger's Triton kernels need a GPU, or it is absent
    assert "status" in rows["train 2x32 liger rebuild"]["hf_tiny"]
    assert all("status" in rows["train 2x32 liger paired"][side] for side in ("official", "hf_tiny"))
    # both models in one process, timed interleaved: a measured cell and a ratio on each paired row
    for row in ("prefill 1x32 paired", "prefill 2x32 paired", "decode 1x8 +4 new eager paired",
                "decode 2x8 +4 new eager paired"):
        assert all("seconds" in rows[row][side] for side in ("official", "hf_tiny")), rows[row]
        assert gpu_report.ratio(results, row, gpu_report.speed) is not None
    assert rows["decode 2x8 +4 new eager paired"]["hf_tiny"]["tokens_per_s"] > 0
    assert rows["longest batch 1"]["hf_tiny"]["longest"] == 128  # the dry run's cap: no OOM on a CPU
    # set_runtime(fit_memory=True): its row, and its search from the plan's start (official's longest not run)
    assert "seconds" in rows["train 2x32 fit_memory"]["hf_tiny"]
    assert len(rows["train 2x32 fit_memory"]["hf_tiny"]["paired_off_samples"]) == 5  # interleaved, same model
    assert rows["longest batch 1"]["hf_tiny_fit"]["probes"][0] == [16, True]
    assert rows["ceilings"]["hf_tiny"]["bandwidth"]["read_bytes_per_s"] > 0
    # each decode call's profile, eager and captured: its own time within its wall time, the most expensive first,
    # on the page
    for mode in ("eager", "captured"):
        profile = rows[f"decode 1x8 +4 new {mode} kernels"]["hf_tiny"]
        owns = [own for _, _, own in profile["kernels"]]
        assert 0 < owns[0] and owns == sorted(owns, reverse=True) and profile["kernel_launches"] >= len(owns)
        assert f"**decode 1x8 +4 new {mode}**" in markdown and f"`{profile['kernels'][0][0]}`" in markdown


# ---- the CUDA tests it runs ------------------------------------------------------------------------------------------

def cuda_marked_files_run_by_the_script() -> set[str]:
    """The test files benchmarks/gpu_check.sh hands pytest -m cuda (its CUDA_MARKED=( ... ) list)."""
    script = (REPO / "benchmarks" / "gpu_check.sh").read_text()
    listed = script.split("CUDA_MARKED=(", 1)[1].split(")", 1)[0]
    return set(listed.split())


# a cuda-marked test or module: @cuda_only, @pytest.mark.cuda, or a pytestmark holding pytest.mark.cuda
CUDA_MARK = re.compile(r"^\s*@cuda_only\b|^\s*@pytest\.mark\.cuda\b|^pytestmark\b.*\bpytest\.mark\.cuda\b", re.M)


def test_the_gpu_script_runs_every_file_that_has_cuda_tests():
    """A file whose CUDA tests the script does not list never runs on a GPU (the captured-decoding, Liger and
    flash-attn package tests had been left out)."""
    marked = {str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py")
              if CUDA_MARK.search(path.read_text())}
    listed = cuda_marked_files_run_by_the_script()
    assert all((REPO / path).is_file() for path in listed), sorted(p for p in listed if not (REPO / p).is_file())
    assert marked - listed == set(), sorted(marked - listed)
    # negative controls: the scan finds each kind of mark
    assert {"tests/ecosystem/test_captured_decoding.py", "tests/models/test_cuda_families.py",
            "tests/models/test_cuda.py"} <= marked
