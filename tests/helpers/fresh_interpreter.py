"""Run code in a fresh Python interpreter that cannot import hf_tiny: the machine of a user who downloads an
hf_tiny checkpoint without installing hf_tiny.

The child runs `python -I -c CODE` (isolated mode: no PYTHON* variables, no user site, no script or current
directory on sys.path) with a temporary working directory, and a meta-path hook refuses `hf_tiny` and
`conversion` even when they are pip-installed (an editable install would otherwise still be found). The prelude
asserts that `import hf_tiny` fails before the test code runs. With `block_network=True` every socket connect
raises, so the code under test provably makes no network calls.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

_PRELUDE = '''
import importlib.abc, os, sys

class _RefuseHfTiny(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("hf_tiny", "conversion"):
            message = f"No module named {name!r} (this interpreter plays a machine without hf_tiny)"
            raise ModuleNotFoundError(message, name=name)
        return None

sys.meta_path.insert(0, _RefuseHfTiny())
assert not any(p and os.path.realpath(p) == __REPO__ for p in sys.path), sys.path
try:
    import hf_tiny
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("hf_tiny is importable in the isolated interpreter: the test would prove nothing")
'''

_NO_NETWORK = '''
import socket

def _refuse_connect(*args, **kwargs):
    raise RuntimeError(f"network call attempted: connect{args[1:]!r}")

socket.socket.connect = _refuse_connect
socket.socket.connect_ex = _refuse_connect
socket.create_connection = _refuse_connect
'''


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ without Hugging Face, proxy and PYTHON* settings, plus `extra`."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "PYTHON")) and "proxy" not in key.lower()
    }
    env["OMP_NUM_THREADS"] = "1"  # tiny models: threads only add contention (and the parent runs one thread too)
    env.update(extra or {})
    return env


def run_python(
    code: str,
    *,
    cwd: str | os.PathLike,
    env: dict[str, str],
    isolated: bool,
    block_network: bool = False,
    args: tuple[str, ...] = (),
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """Runs `code` in a new interpreter; raises AssertionError with the child's output if it fails.

    isolated=True: the hf_tiny-free interpreter described in the module doc. isolated=False: a normal
    interpreter with the repository on PYTHONPATH (the machine of the person who pushes)."""
    source = textwrap.dedent(code)
    if block_network:
        source = _NO_NETWORK + source
    env = dict(env)
    if isolated:
        source = _PRELUDE.replace("__REPO__", repr(os.path.realpath(REPO_ROOT))) + source
        command = [sys.executable, "-I", "-c", source, *args]
    else:
        env["PYTHONPATH"] = str(REPO_ROOT)
        command = [sys.executable, "-c", source, *args]
    result = subprocess.run(command, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(
            f"child interpreter failed (exit {result.returncode})\n--- stdout ---\n{result.stdout[-4000:]}"
            f"\n--- stderr ---\n{result.stderr[-8000:]}"
        )
    return result
