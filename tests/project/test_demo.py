"""The demo's own verdicts: it exits non-zero when its generation differs from official transformers'."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import demo_smollm2  # noqa: E402


def test_identical_generation_is_reported_as_such():
    assert demo_smollm2.generation_verdict([5, 6, 7], [5, 6, 7]) == (True, "identical (3 tokens)")


def test_a_difference_names_the_first_differing_token():
    same, verdict = demo_smollm2.generation_verdict([5, 6, 9, 9, 1], [5, 6, 7, 8, 2])
    assert not same
    assert verdict == "DIFFERENT from token 2 on (ours [9, 9, 1], official [7, 8, 2])"


def test_a_shorter_generation_differs():
    same, verdict = demo_smollm2.generation_verdict([5, 6], [5, 6, 7])
    assert not same and "from token 2 on" in verdict
