"""GPT-OSS checkpoints <-> the hf_tiny causal LM: what differs from the Llama block (conversion/llama.py), as tables.

    ours (layer i)                                  GPT-OSS (on disk, transformers 5)
    self_attn.sinks                                 self_attn.sinks (a logit per head)
    mlp.gate.weight | bias                          mlp.router.weight | bias
    mlp.experts.{e}.gate_proj.weight [I, H]         mlp.experts.gate_up_proj [E, H, 2I], columns 0::2 (transposed)
    mlp.experts.{e}.up_proj.weight [I, H]           mlp.experts.gate_up_proj [E, H, 2I], columns 1::2 (transposed)
    mlp.experts.{e}.gate_proj.bias | up_proj.bias   mlp.experts.gate_up_proj_bias [E, 2I], 0::2 | 1::2
    mlp.experts.{e}.down_proj.weight [H, I]         mlp.experts.down_proj [E, I, H] (transposed)
    mlp.experts.{e}.down_proj.bias                  mlp.experts.down_proj_bias [E, H]

The released checkpoints store the experts' weights in MXFP4 (`*_blocks` uint8 + `*_scales` exponents): they are
dequantised (conversion/mxfp4.py, transformers' own arithmetic) into the same per-expert tensors, in bf16, and the
card says so; converting back writes the fused bf16 layout above.
"""

from __future__ import annotations

import inspect

import torch

from hf_tiny.configuration_causal import field_value
from hf_tiny.transformers_api import TESTED_TRANSFORMERS

from .causal_variant import CausalVariant, llama_named_classes
from .errors import ConversionError
from .keymap import Rule, Transform
from .lazy import LazyTensors, TensorInfo
from .mxfp4 import dequantize_mxfp4

# transformers before 5.2x has no swiglu fields and hard-codes these
DEFAULT_SWIGLU = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}
FIXED = dict(router_scoring="topk_softmax", router_bias=True, expert_bias=True, attention_sinks=True)
MOE_FIELDS = ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits")


def _pairs(experts: int) -> tuple[str, ...]:
    return tuple(f"{e}.{part}" for e in range(experts) for part in ("gate", "up"))


def _gate_up(experts: int, kind: str) -> Transform:
    """gate_up_proj [E, H, 2I] (kind "weight") or gate_up_proj_bias [E, 2I] (kind "bias") <-> each expert's gate
    and up (interleaved in the last dimension; weights transposed to nn.Linear's [out, in])."""

    def split(fused: torch.Tensor):
        parts = []
        for expert in fused:
            for half in (expert[..., 0::2], expert[..., 1::2]):
                parts.append(half.T.contiguous() if kind == "weight" else half.contiguous())
        return tuple(parts)

    def join(*parts: torch.Tensor) -> torch.Tensor:
        experts_ = []
        for gate, up in zip(parts[0::2], parts[1::2]):
            if kind == "weight":
                gate, up = gate.T, up.T
            experts_.append(torch.stack([gate, up], dim=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1]))
        return torch.stack(experts_)

    return Transform(f"gpt_oss_gate_up_{kind}({experts} experts)", split, join)


def _down(experts: int, kind: str) -> Transform:
    """down_proj [E, I, H] (weights, transposed per expert) or down_proj_bias [E, H] <-> each expert's tensor."""

    def split(fused: torch.Tensor):
        return tuple(expert.T.contiguous() if kind == "weight" else expert.contiguous() for expert in fused)

    def join(*parts: torch.Tensor) -> torch.Tensor:
        return torch.stack([part.T if kind == "weight" else part for part in parts])

    return Transform(f"gpt_oss_down_{kind}({experts} experts)", split, join)


def sparse_rules(config, layer: str) -> list:
    """Rules of one GPT-OSS layer's MoE (layer: a concrete layer prefix) in the on-disk bf16 layout."""
    mlp, experts = f"{layer}mlp.", config.num_local_experts
    ours = f"{mlp}experts."
    rules = [(f"{mlp}router.weight", f"{mlp}gate.weight"), (f"{mlp}router.bias", f"{mlp}gate.bias")]
    gate_up = tuple(f"{ours}{pair}_proj" for pair in _pairs(experts))
    rules.append(Rule(f"{ours}gate_up_proj", tuple(f"{name}.weight" for name in gate_up), _gate_up(experts, "weight")))
    rules.append(Rule(f"{ours}gate_up_proj_bias", tuple(f"{name}.bias" for name in gate_up), _gate_up(experts, "bias")))
    down = tuple(f"{ours}{e}.down_proj" for e in range(experts))
    rules.append(Rule(f"{ours}down_proj", tuple(f"{name}.weight" for name in down), _down(experts, "weight")))
    rules.append(Rule(f"{ours}down_proj_bias", tuple(f"{name}.bias" for name in down), _down(experts, "bias")))
    return rules


def claims(config) -> bool:
    return bool(field_value(config, "attention_sinks"))


def adapt_layer_rules(config, layer: str, rules: list) -> list:
    return [*rules, (f"{layer}self_attn.sinks",) * 2]


def official_reads_swiglu() -> bool:
    """Whether the installed transformers' GPT-OSS reads swiglu_limit / swiglu_alpha from its config (5.24 does);
    before 5.2x (5.16.1) GptOssExperts hard-codes DEFAULT_SWIGLU and a config.json's values are ignored."""
    import transformers

    return "swiglu_limit" in inspect.signature(transformers.GptOssConfig.__init__).parameters


def _ignored_swiglu(swiglu: dict, what: str) -> ConversionError:
    import transformers

    return ConversionError(
        f"{what} has {swiglu}, but transformers {transformers.__version__}'s GptOssForCausalLM ignores these fields "
        f"and computes with {DEFAULT_SWIGLU}, so the official model is not this checkpoint's; transformers "
        f"{TESTED_TRANSFORMERS[-1]} reads them"
    )


def fields_from_official(official, *, src) -> dict:
    """TinyCausalConfig's fields for an official GptOssConfig beyond the Llama ones; a SwiGLU clamp the installed
    transformers ignores is an error naming that cause (parity could only fail)."""
    values = {name: getattr(official, name) for name in MOE_FIELDS}
    # norm_product_float32: GptOssRMSNorm multiplies its weight in float32 (bf16 / fp16 rounding; the way back does
    # not require it of a config)
    values.update(FIXED, norm_product_float32=True, attention_bias=official.attention_bias,
                  moe_intermediate_size=official.intermediate_size,
                  mlp_layer_types=["sparse"] * official.num_hidden_layers)
    swiglu = {name: getattr(official, name, default) for name, default in DEFAULT_SWIGLU.items()}
    if swiglu != DEFAULT_SWIGLU and not official_reads_swiglu():
        raise _ignored_swiglu(swiglu, f"{src}: config.json")
    return {**values, **swiglu}


def check_holds(config) -> None:
    """GPT-OSS holds a config with sinks, biased router and experts, clamped SwiGLU, every layer sparse, softmax over
    the top-k logits; anything else is an error naming the fields."""
    wanted = {**FIXED, "mlp_layer_types": ["sparse"] * config.num_hidden_layers, "shared_expert_intermediate_size": 0,
              "qk_norm": False, "sandwich_norms": False, "mlp_bias": False}
    got = {name: field_value(config, name) for name in wanted}
    differ = {name: got[name] for name in wanted if got[name] != wanted[name]}
    if field_value(config, "swiglu_limit") is None:
        differ["swiglu_limit"] = None
    if differ:
        raise ConversionError(f"GPT-OSS needs {wanted} and a swiglu_limit; this config has {differ}")


def official_fields(config) -> dict:
    """The official GptOssConfig's fields beyond the Llama ones, for an hf_tiny config check_holds accepted."""
    values = {name: field_value(config, name) for name in MOE_FIELDS}
    values.update(head_dim=config.head_dim, sliding_window=config.sliding_window, layer_types=list(config.layer_types),
                  attention_bias=config.attention_bias, intermediate_size=config.moe_intermediate_size)
    swiglu = {name: field_value(config, name) for name in DEFAULT_SWIGLU}
    if official_reads_swiglu():
        values.update(swiglu)
    elif swiglu != DEFAULT_SWIGLU:
        raise _ignored_swiglu(swiglu, "this hf_tiny config")
    return values


VARIANT = CausalVariant(
    "gpt_oss", "GptOssConfig", llama_named_classes("GptOss"), fields_from_official=fields_from_official,
    official_fields=official_fields, claims=claims, check_holds=check_holds, adapt_layer_rules=adapt_layer_rules,
    sparse_rules=sparse_rules,
)


MXFP4_NOTE = ("The source's experts were stored in MXFP4 (`*_blocks` / `*_scales`, quantization_config "
              "{quant_method: mxfp4}); they were dequantised to bfloat16 (transformers' arithmetic) and hf_tiny holds "
              "them unquantised; the official reference of the parity table holds the same dequantised weights.")


def dequantized_view(state: LazyTensors, *, src) -> tuple[LazyTensors, str | None]:
    """An MXFP4 checkpoint's state with each `<name>_blocks` / `<name>_scales` pair read as the bf16 `<name>` of
    the unquantised layout (gate_up_proj [E, H, 2I], down_proj [E, I, H]), dequantised when read; (state, note)."""
    pairs = [key[: -len("_blocks")] for key in state if key.endswith("_blocks")]
    if not pairs:
        return state, None
    added = {}
    for name in pairs:
        blocks, scales = f"{name}_blocks", f"{name}_scales"
        if scales not in state:
            raise ConversionError(f"{src}: MXFP4 tensor {blocks} has no {scales}")
        *experts, rows, groups, packed = state.info(blocks).shape
        shape = (*experts, groups * packed * 2, rows)  # stored [E, out, in]; the official layout is [E, in, out]

        def read(blocks=blocks, scales=scales):
            return dequantize_mxfp4(state[blocks], state[scales], dtype=torch.bfloat16).transpose(-1, -2).contiguous()

        added[name] = (TensorInfo(shape, torch.bfloat16), read)
    dropped = [f"{name}_{part}" for name in pairs for part in ("blocks", "scales")]
    return state.without(dropped).with_tensors(added), MXFP4_NOTE
