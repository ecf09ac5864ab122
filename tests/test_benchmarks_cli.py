"""The benchmark runner checks its optional dependencies before measuring (it used to fail with a raw
ModuleNotFoundError for matplotlib after minutes of measurements)."""

from __future__ import annotations

import importlib.util

import pytest

from benchmarks import run


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
