"""Tiny official GPT-OSS models and their hf_tiny twins."""

from __future__ import annotations

import pytest
import torch
import transformers
from causal_helpers import randomize
from hf_tiny import TinyCausalConfig, TinyCausalForCausalLM


TOLERANCE = 1e-5  # fp32, relative to max |official logit|


FIELDS = dict(
    vocab_size=97, hidden_size=44, intermediate_size=20, num_hidden_layers=2, num_attention_heads=6,
    num_key_value_heads=2, head_dim=12, max_position_embeddings=128, initializer_range=0.3, pad_token_id=0,
    bos_token_id=1, eos_token_id=2, num_local_experts=5, num_experts_per_tok=2, sliding_window=4,
    router_aux_loss_coef=0.02,
    # YaRN where truncating the correction range changes the frequencies (GPT-OSS: truncate=False)
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 32},
)


def tiny_official(seed: int = 0, **overrides) -> transformers.GptOssForCausalLM:
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**FIELDS, **overrides}))
    randomize(model, seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight.mul_(4.0)  # expert inputs large enough for the clamp at 7
            layer.self_attn.sinks.mul_(5.0)
    return model.eval()


def ours_config(official, **overrides) -> TinyCausalConfig:
    """The config field map: official GptOssConfig -> TinyCausalConfig."""
    c = official.config
    same = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "sliding_window",
            "attention_bias", "attention_dropout", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef",
            "output_router_logits", "tie_word_embeddings", "initializer_range", "hidden_act", "pad_token_id",
            "bos_token_id", "eos_token_id")
    fields = {name: getattr(c, name) for name in same}
    fields.update(
        layer_types=list(c.layer_types), rope_parameters=dict(c.rope_parameters), moe_intermediate_size=c.intermediate_size,
        router_scoring="topk_softmax", router_bias=True, expert_bias=True, attention_sinks=True, norm_product_float32=True,
        # fields from transformers 5.24 on; 5.16.1 hard-codes these values in GptOssExperts
        swiglu_limit=getattr(c, "swiglu_limit", 7.0), swiglu_alpha=getattr(c, "swiglu_alpha", 1.702),
    )
    return TinyCausalConfig(**{**fields, **overrides})


def official_to_ours(state: dict, *, interleaved: bool = True) -> dict:
    """The key table: router -> gate; each expert's slice of the fused tensors -> Llama-named nn.Linear weights
    ([out, in]: official stores x @ W, so transposed), gate and up interleaved in gate_up_proj's last dimension
    (interleaved=False reads them as halves: the negative control). Every other key is the same."""
    out = {}
    for key, tensor in state.items():
        if ".mlp.router." in key:
            out[key.replace(".mlp.router.", ".mlp.gate.")] = tensor
            continue
        if ".mlp.experts." not in key:
            out[key] = tensor
            continue
        prefix, name = key.rsplit(".", 1)
        half = tensor.shape[-1] // 2
        gate, up = (slice(0, None, 2), slice(1, None, 2)) if interleaved else (slice(0, half), slice(half, None))
        for e, expert in enumerate(tensor):
            if name == "gate_up_proj":  # [hidden, 2 * intermediate]
                parts = {"gate_proj.weight": expert[:, gate].T, "up_proj.weight": expert[:, up].T}
            elif name == "gate_up_proj_bias":
                parts = {"gate_proj.bias": expert[gate], "up_proj.bias": expert[up]}
            else:  # down_proj [intermediate, hidden], down_proj_bias
                parts = {"down_proj.weight": expert.T} if name == "down_proj" else {"down_proj.bias": expert}
            out.update({f"{prefix}.{e}.{part}": value.contiguous() for part, value in parts.items()})
    return out


def ours_from(official, *, interleaved: bool = True, **overrides) -> TinyCausalForCausalLM:
    model = TinyCausalForCausalLM(ours_config(official, **overrides))
    model.load_state_dict(official_to_ours(official.state_dict(), interleaved=interleaved), strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def official():
    return tiny_official()
