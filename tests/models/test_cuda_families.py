"""Every family on CUDA that had no CUDA test: the production converter's folder against the official model on the
same device, fp32 and bf16 x eager / sdpa / flash_attention_2, on a padded batch, each with a negative control.
(Llama: test_cuda.py; GPT-OSS: test_gpt_oss.py; BERT, BART, T5: tests/conversion/.)

Reference: the official model in fp32, eager attention, TF32 off, on the same device. Bounds (tolerances.py):
- fp32: relative error (max |Δ| / max |official|) <= rounding_bound(fp32, model_reduction_length(config, tokens));
- bf16: no worse than official's own bf16 run (sdpa) against the fp32 reference, measured as the mean |Δ| over
  the mean |official| of the real tokens' logits: <= BF16_FACTOR x official's + the fp32 rounding bound. The
  mean, not the max: bf16 rounding moves a random MoE router's top-k choice for a token now and then (GPT-OSS on
  an H100, 2026-11-26), on either side, which a max would read as an error of the whole model.
Flash on CUDA is our Triton kernel (the flash-attn package where installed; a family whose masks that package's path
refuses is then skipped, with the refusal as the reason); in fp32 it is a clear error, and where a family's attention
is something no flash kernel here applies (MPT's additive ALiBi bias, ModernBERT's bidirectional window, MLA's
value heads narrower than its query heads) that clear refusal is the expected result.
Negative control: the same comparison, in the same dtype, must reject ours with its last layer's attention output
zeroed (measured on the CPU stand-in: 2-48x the bf16 bound, thousands of times the fp32 one).

Skipped with a reason without a GPU (the `cuda` mark). `HF_TINY_CUDA_STAND_IN=1` runs them on the CPU instead
(flash_attention_2 is then our Triton kernel under Triton's interpreter, `hf_tiny_flash`, as CUDA runs it), to
check the tests themselves on a machine without a GPU:
    HF_TINY_CUDA_STAND_IN=1 python -m pytest tests/models/test_cuda_families.py
"""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import torch
import transformers

import hf_tiny  # noqa: F401  (registers the Auto classes)
from causal_helpers import BASE, left_padded_batch, randomize, tiny_official
from conversion.registry import detect_family, family_module
from tolerances import model_reduction_length, relative_error, rounding_bound

STAND_IN = os.environ.get("HF_TINY_CUDA_STAND_IN") == "1" and not torch.cuda.is_available()
DEVICE = torch.device("cpu" if STAND_IN else "cuda")
# conftest skips `cuda` tests with a reason without a GPU
pytestmark = [pytest.mark.usefixtures("no_tf32")] + ([] if STAND_IN else [pytest.mark.cuda])

BACKENDS = ("eager", "sdpa", "flash_attention_2")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BF16_FACTOR = 2.0
LENGTHS = (24, 17, 5)  # the padded batch's real lengths: longer than every family's window or chunk below

# ---- the families: an official model with odd shapes and large random weights (causal_helpers.randomize) ----------

SMALL = dict(BASE, hidden_size=36, intermediate_size=44, num_hidden_layers=4, num_attention_heads=6,
             num_key_value_heads=2)
ENCODER = dict(vocab_size=97, hidden_size=48, num_hidden_layers=3, num_attention_heads=3, intermediate_size=40,
               max_position_embeddings=64, pad_token_id=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
MLA_MOE = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
               n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
               moe_intermediate_size=8, n_shared_experts=1, routed_scaling_factor=2.5, num_hidden_layers=3)
# name -> (official class name, config class name, config fields, "causal" | "encoder")
FAMILIES = {
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(BASE, sliding_window=5), "causal"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", BASE, "causal"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", BASE, "causal"),
    "gemma3_text": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(BASE, sliding_window=5, head_dim=8), "causal"),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", BASE, "causal"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", BASE, "causal"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", BASE, "causal"),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config",
                    dict(BASE, num_key_value_heads=BASE["num_attention_heads"], **MLA_MOE), "causal"),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config",
                dict(SMALL, num_key_value_heads=3, no_rope_layer_interval=2, tie_word_embeddings=False), "causal"),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict(SMALL, num_hidden_layers=3), "causal"),
    "llama4_text": ("Llama4ForCausalLM", "Llama4TextConfig",
                    dict(SMALL, intermediate_size=20, intermediate_size_mlp=44, head_dim=6, num_local_experts=3,
                         interleave_moe_layer_step=1, attention_chunk_size=5, no_rope_layer_interval=2,
                         floor_scale=4, attn_scale=0.5), "causal"),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", BASE, "causal"),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config",
             dict(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.3,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
             "causal"),
    "mpt": ("MptForCausalLM", "MptConfig",
            dict(vocab_size=97, d_model=32, n_heads=4, n_layers=2, max_seq_len=64, initializer_range=0.3,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2), "causal"),
    "roberta": ("RobertaForMaskedLM", "RobertaConfig", dict(ENCODER, pad_token_id=1), "encoder"),
    "distilbert": ("DistilBertForMaskedLM", "DistilBertConfig",
                   dict(vocab_size=97, dim=48, n_layers=3, n_heads=3, hidden_dim=40, max_position_embeddings=64,
                        pad_token_id=0, dropout=0.0, attention_dropout=0.0), "encoder"),
    "electra": ("ElectraForMaskedLM", "ElectraConfig", dict(ENCODER, embedding_size=24), "encoder"),
    "albert": ("AlbertForMaskedLM", "AlbertConfig", dict(ENCODER, embedding_size=24), "encoder"),
    "modernbert": ("ModernBertForMaskedLM", "ModernBertConfig",
                   dict(vocab_size=97, hidden_size=48, num_attention_heads=3, num_hidden_layers=5,
                        intermediate_size=40, global_attn_every_n_layers=3, local_attention=6,
                        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        cls_token_id=1, sep_token_id=2), "encoder"),
}
# What flash cannot apply, refused with a clear error that names the alternatives.
FLASH_REFUSES = {"mpt": "additive", "modernbert": "bidirectional sliding window", "deepseek_v3": "one head_dim"}
# With the flash-attn package, flash_attention_2 runs it instead of our Triton kernel (which takes the windows).
FLASH_ATTN_PACKAGE = not STAND_IN and importlib.util.find_spec("flash_attn") is not None


def official_model(name: str, seed: int = 0):
    class_name, config_name, fields, _ = FAMILIES[name]
    torch.manual_seed(seed)
    model = getattr(transformers, class_name)(getattr(transformers, config_name)(**fields))
    randomize(model, seed)
    with torch.no_grad():
        for module in model.modules():  # buffers randomize leaves at 0 (DeepSeek's routing correction)
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.3)
    return model.eval()


def padded_batch(name: str, vocab_size: int) -> dict:
    """Causal: left-padded with generate()'s position ids; encoders: right-padded, as tokenizers pad."""
    batch = left_padded_batch(vocab_size, LENGTHS)
    if FAMILIES[name][3] == "causal":
        return batch
    mask = batch["attention_mask"].flip(-1)
    pad = FAMILIES[name][2]["pad_token_id"]
    return {"input_ids": batch["input_ids"].flip(-1).masked_fill(mask == 0, pad), "attention_mask": mask}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{family: (official fp32 model on DEVICE, the hf_tiny folder, the batch on DEVICE, fp32 eager reference
    logits at the real tokens, official's own bf16 error)}, converted on first use by the production converter."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = _convert(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


def _convert(name: str, folder):
    official = official_model(name)
    official.save_pretrained(folder / "src")
    family, _ = detect_family(folder / "src")
    family_module(family).convert(folder / "src", folder / "ours")
    batch = {key: value.to(DEVICE) for key, value in padded_batch(name, official.config.vocab_size).items()}
    official = official.to(DEVICE)
    official.set_attn_implementation("eager")
    reference = real_logits(official, batch)
    lossy = copy.deepcopy(official).to(torch.bfloat16)
    lossy.set_attn_implementation("sdpa")
    official_bf16_error = mean_relative_error(real_logits(lossy, batch), reference)
    return official, folder / "ours", batch, reference, official_bf16_error


def real_logits(model, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        logits = model(**batch).logits
    return logits[batch["attention_mask"].bool()].float()


def mean_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """mean |actual - expected| / mean |expected|, in float64."""
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).abs().mean() / expected.abs().mean())


def ours_model(folder, name: str, dtype: torch.dtype, backend: str):
    auto = transformers.AutoModelForCausalLM if FAMILIES[name][3] == "causal" else transformers.AutoModelForMaskedLM
    if STAND_IN and backend == "flash_attention_2":
        backend = "hf_tiny_flash"  # CUDA's flash_attention_2 without the flash-attn package: our Triton kernel
    return auto.from_pretrained(folder, dtype=dtype, attn_implementation=backend).to(DEVICE).eval()


def error_and_bound(name: str, produced: torch.Tensor, config, dtype: torch.dtype, converted) -> tuple[float, float]:
    """(the error of ours' logits at the real tokens against the fp32 reference, its bound) by the module
    docstring's rules; config: ours' (its widths give the rounding bound)."""
    _, _, _, reference, official_bf16_error = converted(name)
    fp32_bound = rounding_bound(torch.float32, model_reduction_length(config, tokens=max(LENGTHS)))
    if dtype == torch.float32:
        return relative_error(produced, reference), fp32_bound
    return mean_relative_error(produced, reference), BF16_FACTOR * official_bf16_error + fp32_bound


def flash_refusal(name: str, dtype: torch.dtype):
    """The error flash_attention_2 must give for this family and dtype (a regex), or None where it runs."""
    reasons = [FLASH_REFUSES[name]] if name in FLASH_REFUSES else []
    if not STAND_IN and dtype == torch.float32:
        reasons.append("float16 or bfloat16")  # flash on CUDA is half precision only (checked before or after)
    return "|".join(reasons) or None


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_parity_on_device(converted, name, backend, dtype_name):
    dtype = DTYPES[dtype_name]
    _, folder, batch, _, _ = converted(name)
    ours = ours_model(folder, name, dtype, backend)
    if backend == "flash_attention_2" and flash_refusal(name, dtype):
        with pytest.raises(ValueError, match=flash_refusal(name, dtype)) as refusal:
            real_logits(ours, batch)
        assert "'sdpa'" in str(refusal.value) or "'eager'" in str(refusal.value)
        return
    try:
        produced = real_logits(ours, batch)
    except ValueError as refusal:
        if backend == "flash_attention_2" and FLASH_ATTN_PACKAGE and "'sdpa'" in str(refusal):
            pytest.skip(f"the flash-attn package's path refuses {name}: {refusal}")
        raise
    error, bound = error_and_bound(name, produced, ours.config, dtype, converted)
    assert error <= bound, f"{name} {backend} {dtype_name}: error {error:.3g} > bound {bound:.3g}"


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_negative_control_last_attention_dropped(converted, name, dtype_name):
    """The comparison above rejects ours with its last layer's attention output zeroed (a path that returns
    nothing: what a broken kernel or a dropped mask row gives), in the same dtype."""
    dtype = DTYPES[dtype_name]
    _, folder, batch, _, _ = converted(name)
    ours = ours_model(folder, name, dtype, "sdpa")
    drop_last_attention(ours)
    error, bound = error_and_bound(name, real_logits(ours, batch), ours.config, dtype, converted)
    assert error > bound, f"{name} {dtype_name}: the control's error {error:.3g} is within the bound {bound:.3g}"


def drop_last_attention(model) -> None:
    """Zeroes the output projection of the last layer's attention (every hf_tiny family names it
    layers.N.self_attn.o_proj)."""
    projections = [module for name, module in model.named_modules() if name.endswith("self_attn.o_proj")]
    with torch.no_grad():
        for param in projections[-1].parameters():
            param.zero_()
