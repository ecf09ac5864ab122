"""CUDA variants of the causal parity tests: fp32 / bf16 / fp16 × eager / sdpa / flash_attention_2, through the
production converter, against the official model. Skipped with a reason on machines without a GPU.

Tolerances (max |Δ logits| at real tokens of a left-padded batch, reference = official fp32 eager on CUDA with
TF32 off):
- fp32: 1e-4 absolute (logits of magnitude ~5-10; CUDA kernels sum in another order than the CPU);
- bf16 / fp16: at most 2x the error of the official model run in the same dtype (+1e-3), i.e. our reduced
  precision costs no more than transformers' own (flash is measured against official sdpa in that dtype, as
  the flash-attn package is not required).
Static-cache generation on CUDA must give the dynamic-cache tokens (and the official tokens in fp32).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, StaticCache

import hf_tiny  # noqa: F401
from causal_helpers import left_padded_batch, max_diff, tiny_official
from conversion import llama

# conftest skips `cuda` tests with a reason when CUDA is unavailable
pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("no_tf32")]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BACKENDS = ("eager", "sdpa", "flash_attention_2")
FP32_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    official = tiny_official("llama", num_key_value_heads=2, hidden_size=64, num_attention_heads=4, head_dim=16)
    folder = tmp_path_factory.mktemp("cuda_causal")
    official.save_pretrained(folder / "src")
    llama.convert(folder / "src", folder / "ours")
    batch = {k: v.cuda() for k, v in left_padded_batch(official.config.vocab_size).items()}
    official = official.cuda()
    official.set_attn_implementation("eager")
    with torch.no_grad():
        reference = official(**batch).logits[batch["attention_mask"].bool()].float()
    return official, folder / "ours", batch, reference


def official_error(official, batch, reference, dtype, backend):
    """How far the official model itself moves from its fp32 logits when run in `dtype`."""
    clone = type(official)(copy.deepcopy(official.config)).to("cuda", dtype)
    clone.load_state_dict(official.state_dict())
    clone.set_attn_implementation("sdpa" if backend == "flash_attention_2" else backend)  # flash-attn not required here
    with torch.no_grad():
        logits = clone.eval()(**batch).logits[batch["attention_mask"].bool()].float()
    return max_diff(logits, reference)


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_parity(converted, dtype_name, backend):
    official, folder, batch, reference = converted
    dtype = DTYPES[dtype_name]
    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=backend).cuda().eval()
    if backend == "flash_attention_2" and dtype == torch.float32:
        with pytest.raises(ValueError, match="sdpa"):
            ours(**batch)
        return
    with torch.no_grad():
        produced = ours(**batch).logits[batch["attention_mask"].bool()].float()
    diff = max_diff(produced, reference)
    if dtype == torch.float32:
        assert diff <= FP32_TOLERANCE, f"{backend} fp32: {diff}"
    else:
        budget = 2 * official_error(official, batch, reference, dtype, backend) + 1e-3
        assert diff <= budget, f"{backend} {dtype_name}: {diff} > {budget}"


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_cuda_static_cache_generation(converted, dtype_name):
    official, folder, batch, _ = converted
    dtype = DTYPES[dtype_name]
    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").cuda().eval()
    settings = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    dynamic = ours.generate(ids, attention_mask=mask, **settings)
    static = ours.generate(ids, attention_mask=mask, past_key_values=StaticCache(config=ours.config, max_cache_len=40), **settings)
    assert torch.equal(static, dynamic)
    if dtype == torch.float32:
        official.set_attn_implementation("sdpa")
        assert torch.equal(official.generate(ids, attention_mask=mask, **settings), dynamic)
