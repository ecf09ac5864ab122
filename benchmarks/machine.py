"""Where a run happens: the processor's name, a checkout's git revision, and the results folder."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    """The processor's name and the instruction set torch's CPU kernels use there (AVX512, AVX2, ...): two hosts sold
    under one name ("AMD EPYC") can run different kernels, and their CPU figures differ with them."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import torch

    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"


def git_revision(root: Path = REPO_ROOT) -> str:
    """The short commit of the checkout at `root`, "+local changes" when tracked files differ from it."""
    try:
        def git(*command: str) -> str:
            return subprocess.run(["git", *command], cwd=root, capture_output=True, text=True, check=False).stdout.strip()

        rev = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return (rev or "unknown") + ("+local changes" if dirty else "")
    except OSError:
        return "unknown"


def file_stem(text: str) -> str:
    """`text` with every character other than letters, digits, '-' and '_' replaced by '-' (for file names)."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in text)
