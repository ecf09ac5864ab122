"""Venvs the tests build once per machine and reuse (version_ends.py, vllm_env.py). A venv is complete only once
its marker file holds what it was built with: a half-built one (an interrupted install) is removed and built again.
Each build's commands and their output go to <venv>-build.log beside the venv. Builders of one venv take turns
(<venv>.lock): .ci/run builds them in the background while the suite runs, and a test that needs one waits for
that build instead of starting its own."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
from pathlib import Path
from typing import IO, Callable, Optional


def run(command: list, log: IO, env: Optional[dict] = None) -> None:
    log.write(f"$ {' '.join(map(str, command))}\n")
    log.flush()
    result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command))} failed with exit code {result.returncode}; see {log.name}")


def ensure_venv(root: Path, wanted: str, marker_name: str, build: Callable[[Path, IO], None]) -> Path:
    """The venv's python; `build(python, log)` makes the venv first when it is missing, incomplete or was built with
    something other than `wanted`."""
    python = root / "bin" / "python"
    marker = root / marker_name

    def complete() -> bool:
        return marker.is_file() and marker.read_text() == wanted and python.is_file()

    if complete():
        return python
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when a killed builder's process ends
        if complete():  # built by the holder we waited for
            return python
        if root.exists():
            shutil.rmtree(root)
        with open(root.parent / f"{root.name}-build.log", "w") as log:
            build(python, log)
        marker.write_text(wanted)
    return python
