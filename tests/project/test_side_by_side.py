"""benchmarks.side_by_side: each measuring process imports hf_tiny from its own checkout, rows follow the report's
plan, and the summary's ratio and noise verdict follow the samples (computed by hand here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import side_by_side, side_by_side_report
from benchmarks.workloads import Shape

ROOT = Path(__file__).resolve().parents[2]


def fake_checkout(path: Path) -> Path:
    (path / "hf_tiny").mkdir(parents=True)
    (path / "hf_tiny" / "__init__.py").write_text("")
    (path / "conversion").mkdir()
    return path


def test_a_measuring_process_imports_hf_tiny_from_its_checkout(tmp_path):
    checkout = fake_checkout(tmp_path / "before")
    code = ("import json; from benchmarks.side_by_side import import_checkout; "
            f"print(json.dumps(import_checkout({str(checkout)!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == {"hf_tiny": str(checkout.resolve() / "hf_tiny" / "__init__.py")}


def test_a_package_imported_before_the_checkout_is_refused(tmp_path):
    import hf_tiny  # noqa: F401  (this process has it from the checkout under test)

    with pytest.raises(RuntimeError, match="hf_tiny was imported before the checkout"):
        side_by_side.import_checkout(str(fake_checkout(tmp_path / "other")))
    sys.path.remove(str((tmp_path / "other").resolve()))


def test_rows_follow_the_report_plan():
    rows = side_by_side.rows_of(["minilm", "smollm2"], ["prefill", "train_step", "generate"], quick=False, memory=True)
    labels = [(r["model"], r["case"], r["shape"].label(), r["kind"]) for r in rows]
    assert labels == [
        ("minilm", "prefill", "32x128", "time"), ("minilm", "prefill", "32x128", "memory"),
        ("minilm", "train_step", "32x128", "time"), ("minilm", "train_step", "32x128", "memory"),
        ("smollm2", "prefill", "4x256", "time"), ("smollm2", "prefill", "4x256", "memory"),
        ("smollm2", "generate", "1x32 +128 new", "time"),
        ("smollm2", "generate", "8x32 +128 new", "time"), ("smollm2", "generate", "8x32 +128 new", "memory"),
        ("smollm2", "train_step", "4x512", "time"), ("smollm2", "train_step", "4x512", "memory"),
    ]


def timed_row(before: list, after: list) -> dict:
    run = lambda seconds: {"seconds": seconds, "faults": [10, 12, 14], "ops": None, "tokens": "abc"}  # noqa: E731
    return {"model": "overhead", "case": "generate", "shape": Shape(1, 16, 16), "kind": "time",
            "runs": {"before": [run(s) for s in before], "after": [run(s) for s in after]}}


def test_summary_of_a_timed_row():
    row = side_by_side_report.summarize(timed_row(before=[[1.0, 2.0, 3.0], [4.0, 4.0, 4.0], [2.5, 2.5, 2.5]],
                                                  after=[[3.0, 3.0, 3.0], [1.0, 1.5, 9.0], [2.0, 2.0, 2.0]]))
    # process medians: before 2, 4, 2.5 -> median 2.5 [2, 4]; after 3, 1.5, 2 -> median 2 [1.5, 3]
    assert row["sides"]["before"]["median"] == 2.5 and row["sides"]["after"]["median"] == 2.0
    assert row["after_over_before"] == pytest.approx(0.8)
    assert row["within_noise"] and row["same_tokens"] and row["sides"]["after"]["faults"] == 12
    apart = side_by_side_report.summarize(timed_row(before=[[1.0], [1.1]], after=[[1.3], [1.2]]))
    assert not apart["within_noise"]  # negative control: ranges [1.0, 1.1] and [1.2, 1.3] do not overlap
    assert "| overhead | generate | 1x16 +16 new |" in side_by_side_report._time_table([apart])[2]


@pytest.mark.parametrize("argv,message", [
    (["--after", "."], "--before: the checkout to compare against is required"),
    (["--before", "/nonexistent"], "--before: /nonexistent is not an hf_tiny checkout"),
    (["--before", ".", "--models", "llama1b"], "--models: unknown or not a CPU model: llama1b"),
    (["--before", ".", "--cases", "generate_compiled"], "--cases: unknown generate_compiled"),
    (["--before", ".", "--repeats", "0"], "--repeats must be at least 1, got 0"),
])
def test_bad_arguments_name_the_option(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit):
        side_by_side.parse_args(argv)
    assert message in capsys.readouterr().err
