"""The lower end of the supported transformers range: the parity, generation, engine and remote-code tests run again
in a venv that holds the oldest tested transformers (hf_tiny/transformers_api.py: TESTED_TRANSFORMERS[0]).

    python tests/helpers/oldest_transformers.py [pytest arguments]

`.ci/run` calls it after the README's test command (which runs everything with the newest allowed version). The venv
is built on top of the test environment (--system-site-packages: torch, hf_tiny in editable mode and the test
packages are shared; only transformers and what it pins differently are installed into it), in
$HF_TINY_OLDEST_VENV (default ~/.cache/hf_tiny/transformers-<version>), once per machine: it is reused while its
marker file holds the same requirement, and a half-built one is removed and built again (~30 s with downloads).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hf_tiny.transformers_api import TESTED_TRANSFORMERS  # noqa: E402

OLDEST = TESTED_TRANSFORMERS[0]
MARKER = "hf_tiny-oldest-ready"
# What depends on the transformers version: parity against the official classes (every family and converter),
# generation and its caches, the engines' calling conventions (continuous batching, attention interface), the code
# shipped with saved folders, and the fine-tuning integrations.
TEST_FILES = (
    "tests/models/test_generate.py",
    "tests/ecosystem/test_remote_code.py",
    "tests/models/test_causal.py",
    "tests/models/test_smollm2_135m.py",
    "tests/models/test_gemma3_270m.py",
    "tests/models/test_encoder.py",
    "tests/models/test_seq2seq.py",
    "tests/ecosystem/test_engines.py",
    "tests/models/test_moe.py",
    "tests/models/test_mtp.py",
    "tests/models/test_deepseek.py",
    "tests/conversion/test_llama.py",
    "tests/conversion/test_bert.py",
    "tests/conversion/test_bart.py",
    "tests/conversion/test_t5.py",
    "tests/conversion/test_gpt2.py",
    "tests/conversion/test_phi3.py",
    "tests/conversion/test_gguf_architectures.py",
    "tests/conversion/test_streaming.py",
    "tests/models/test_gpt_oss.py",
    "tests/conversion/test_gpt_oss.py",
    "tests/models/test_modernbert.py",
    "tests/models/test_smollm3.py",
    "tests/models/test_olmo2.py",
    "tests/models/test_llama4_text.py",
    "tests/conversion/test_2025_families.py",
    "tests/ecosystem/test_trainer.py",
    "tests/ecosystem/test_peft.py",
)


def requirement() -> str:
    return f"transformers=={OLDEST}"


def venv_dir() -> Path:
    default = Path.home() / ".cache" / "hf_tiny" / f"transformers-{OLDEST}"
    return Path(os.environ.get("HF_TINY_OLDEST_VENV", default))


def _run(command: list, log) -> None:
    log.write(f"$ {' '.join(map(str, command))}\n")
    log.flush()
    result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command))} failed with exit code {result.returncode}; see {log.name}")


def ensure_oldest_venv() -> Path:
    """The venv's python, building the venv first when it is missing or incomplete."""
    root = venv_dir()
    python = root / "bin" / "python"
    marker = root / MARKER
    if marker.is_file() and marker.read_text() == requirement() and python.is_file():
        return python
    if root.exists():
        shutil.rmtree(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    log_path = root.parent / f"{root.name}-build.log"
    with open(log_path, "w") as log:
        _run([sys.executable, "-m", "venv", "--system-site-packages", str(root)], log)
        _run([str(python), "-m", "pip", "install", "--disable-pip-version-check", requirement()], log)
        check = f"import transformers, hf_tiny; assert transformers.__version__ == {OLDEST!r}, transformers.__version__"
        _run([str(python), "-c", check], log)
    marker.write_text(requirement())
    return python


def main(argv: list[str]) -> int:
    python = ensure_oldest_venv()
    version = subprocess.run(
        [str(python), "-c", "import transformers, torch; print(transformers.__version__, torch.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    print(f"== the oldest supported transformers: {version} (transformers, torch) in {python.parent.parent} ==",
          flush=True)
    return subprocess.run([str(python), "-m", "pytest", *TEST_FILES, *argv], cwd=ROOT).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
