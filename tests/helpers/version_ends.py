"""The ends of the tested version ranges (hf_tiny/transformers_api.py: TESTED_TRANSFORMERS, TESTED_TORCH): the tests
that depend on that package's version run again in a venv that holds one end.

    python tests/helpers/version_ends.py END [pytest arguments]
    python tests/helpers/version_ends.py --build END [END ...]     (build the venvs only)
    END: transformers-oldest, torch-oldest or torch-newest

`.ci/run` calls it for each end after the README's test command (which runs everything with the newest allowed
transformers and the README's torch). A venv is built on top of the test environment (--system-site-packages:
hf_tiny in editable mode and the test packages are shared; only the package of that end and what it pins differently
are installed into it), in $HF_TINY_VERSION_VENVS/<package>-<version> (default ~/.cache/hf_tiny), once per machine:
it is reused while its marker file holds the same requirement, and a half-built one is removed and built again.
An end names its exact version, so a machine-wide pip constraint (a cap on torch in pip's configuration, as on the
machines this project is developed on) does not apply to its install; nothing outside the venv changes.

PyPI holds no CPU build of torch for x86_64: a torch end installs the CUDA build with its nvidia-* libraries (it does
not import without them), ~5-7 GB in the venv. It runs on the CPU all the same. The triton that torch pins is removed
from a torch end's venv, so that our Triton kernel runs there with the triton of the test extra, as in the main run:
only torch changes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hf_tiny.transformers_api import TESTED_TORCH, TESTED_TRANSFORMERS  # noqa: E402
from venvs import ensure_venv as ensure, run  # noqa: E402

MARKER = "hf_tiny-version-end-ready"
# What depends on the transformers version: parity against the official classes (every family and converter),
# generation and its caches, the engines' calling conventions (continuous batching, attention interface), the code
# shipped with saved folders, and the fine-tuning integrations.
TRANSFORMERS_TESTS = (
    "tests/models/test_generate.py",
    "tests/ecosystem/test_captured_decoding.py",
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
    "tests/conversion/test_variant_claims.py",
    "tests/ecosystem/test_trainer.py",
    "tests/ecosystem/test_peft.py",
    "tests/ecosystem/test_peft_classification_heads.py",
    "tests/conversion/test_tokenizer_files.py",
    # every family on CUDA against the official model, run on the CPU stand-in (HF_TINY_CUDA_STAND_IN, below): the
    # GPU sessions run the image's transformers (5.17), and this is where a family's config of an older transformers
    # shows (Gemma 3's rope_parameters under 5.16-5.17, found on an H200, 2026-11-27)
    "tests/models/test_cuda_families.py",
)
# What depends on the torch version: dynamo, export and ONNX export (the runtime's forwards must trace), the runtime's
# in-place inference and training recompute (checkpoint, saved-tensor hooks), the attention backends (sdpa, flex
# attention's block masks, masks), generation with its caches, DDP and FSDP2 (DTensor), the families' parity, and our
# Triton kernel called from the models (its fp64 sweeps, ~3 min under the interpreter, depend on triton, not torch).
TORCH_TESTS = (
    "tests/ecosystem/test_compile.py",
    "tests/ecosystem/test_captured_decoding.py",  # dynamo's guards of the compiled decoding step
    "tests/runtime/test_memory_off_the_cpu.py",  # a dispatch mode counts the live storage
    "tests/runtime/test_runtime.py",
    "tests/models/test_attention.py",
    "tests/models/test_masks.py",
    "tests/models/test_causal.py",
    "tests/models/test_generate.py",
    "tests/models/test_encoder.py",
    "tests/models/test_chunked_loss.py",
    "tests/models/test_packing.py",
    "tests/ecosystem/test_engines.py",
    "tests/ecosystem/test_distributed.py",
    "tests/ecosystem/test_transformers_versions.py",
    "tests/models/test_flash_triton.py::test_kernel_negative_control",
    "tests/models/test_flash_triton.py::test_backend_left_padded_causal_batch_matches_eager",
    "tests/models/test_flash_triton.py::test_backend_gradients_match_eager_on_a_padded_batch",
    "tests/models/test_flash_triton.py::test_backend_packed_rows_match_eager",
    "tests/models/test_flash_triton.py::test_backend_generate_matches_eager_tokens",
    "tests/models/test_flash_triton.py::test_backend_chunked_attention_matches_eager",
    "tests/models/test_flash_triton.py::test_backend_encoder_right_padding_matches_eager",
)


@dataclass(frozen=True)
class End:
    package: str
    version: str
    tests: tuple
    removed: tuple = ()  # what the install brings that the test environment's own version must replace
    env: tuple = ()  # (name, value) pairs set for the end's test run

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def venv_dir(self) -> Path:
        root = Path(os.environ.get("HF_TINY_VERSION_VENVS", Path.home() / ".cache" / "hf_tiny"))
        return root / f"{self.package}-{self.version}"


ENDS = {
    "transformers-oldest": End("transformers", TESTED_TRANSFORMERS[0], TRANSFORMERS_TESTS,
                               env=(("HF_TINY_CUDA_STAND_IN", "1"),)),
    "torch-oldest": End("torch", TESTED_TORCH[0], TORCH_TESTS, removed=("triton",)),
    "torch-newest": End("torch", TESTED_TORCH[1], TORCH_TESTS, removed=("triton",)),
}


def ensure_venv(end: End) -> Path:
    """The venv's python, building the venv first when it is missing or incomplete."""

    def build(python: Path, log) -> None:
        run([sys.executable, "-m", "venv", "--system-site-packages", str(python.parent.parent)], log)
        pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
        run([*pip, "install", "--no-compile", "--progress-bar", "off", end.requirement], log,
            env={**os.environ, "PIP_CONSTRAINT": os.devnull})
        if end.removed:
            run([*pip, "uninstall", "-y", *end.removed], log)
        check = (f"import {end.package}, hf_tiny; version = {end.package}.__version__.split('+')[0]; "
                 f"assert version == {end.version!r}, version")
        run([str(python), "-c", check], log)

    return ensure(end.venv_dir(), end.requirement, MARKER, build)


USAGE = f"""usage: python tests/helpers/version_ends.py END [pytest arguments]
       python tests/helpers/version_ends.py --build END [END ...]
END: {', '.join(ENDS)}"""


def main(argv: list[str]) -> int:
    if argv[:1] == ["--build"] and len(argv) > 1 and all(name in ENDS for name in argv[1:]):
        for name in argv[1:]:
            ensure_venv(ENDS[name])
        return 0
    if not argv or argv[0] not in ENDS:
        print(USAGE, file=sys.stderr)
        return 2
    name, end = argv[0], ENDS[argv[0]]
    python = ensure_venv(end)
    version = subprocess.run(
        [str(python), "-c", "import transformers, torch; print(transformers.__version__, torch.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    print(f"== {name}: {version} (transformers, torch) in {python.parent.parent} ==", flush=True)
    return subprocess.run([str(python), "-m", "pytest", *end.tests, *argv[1:]], cwd=ROOT,
                          env={**os.environ, **dict(end.env)}).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
