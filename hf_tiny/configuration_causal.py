"""Configuration of the Llama-style causal LM family (model_type "hf_tiny_causal")."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Optional

from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from .causal_mechanisms import Alibi, AttentionSinks, AttnTemperature, ChunkedAttention, ClampedSwiglu, MechanismView
from .causal_mechanisms import HalfPrecisionRounding, LongropeCache, Mla, MoeBiases, Mtp, NormLayout, Nope, PaddingRow
from .causal_mechanisms import QkNormPlacement, RouterInputWeights
from .causal_mechanisms import mechanism_views
from .layer_types import LAYER_TYPES, check_layer_types
from .moe import Moe, MoeSpec
from .rope import ROPE_LAYER_TYPES, rope_parameter_sets, rotary_dim, standardize_rope_parameters
from .validation import check_bool, check_choice, check_divisible, check_finite_fields, check_positive
from .validation import check_positive_number, check_probability, check_token_ids, init_arguments, store_init_fields
from .validation import warn_on_token_ids_outside

POSITION_EMBEDDING_TYPES = ("rope", "learned", "alibi")


def _renamed_aliases(owner: str, attribute_map: dict, kwargs: dict) -> dict:
    """kwargs with each alias (attribute_map: num_experts) under the field's own name (num_local_experts)."""
    for alias, name in attribute_map.items():
        if alias in kwargs:
            if name in kwargs and kwargs[name] != kwargs[alias]:
                raise ValueError(f"{owner}: {alias}={kwargs[alias]} and {name}={kwargs[name]} name the same field; "
                                 f"give one")
            kwargs = {**{k: v for k, v in kwargs.items() if k != alias}, name: kwargs[alias]}
    return kwargs


def field_value(config, name: str):
    """A field of a causal config by its name, or for a mechanism the config does not use the field's "off"
    default (a dense config holds no num_local_experts: 0). For conversion/, which names fields in tables of its
    own; hf_tiny reads the typed tables (config.moe.num_local_experts)."""
    for view_name, view in mechanism_views(TinyCausalConfig).items():
        if name in view.table.field_names():
            return getattr(getattr(config, view_name), name)
    if hasattr(config, name):
        return getattr(config, name)
    raise AttributeError(f"{type(config).__name__} has no field {name!r}")


def _check_sizes(owner: str, config) -> None:
    check_positive(
        owner, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
    )


def _head_dim(owner: str, config) -> int:
    """head_dim checked: hidden_size // num_attention_heads unless set, MLA's own sum."""
    heads, head_dim = config.num_attention_heads, config.head_dim
    if config.mla.in_use(config):
        head_dim = config.mla.head_dim()
    elif head_dim is None:
        check_divisible(owner, "hidden_size", config.hidden_size, "num_attention_heads", heads)
        head_dim = config.hidden_size // heads
    check_positive(owner, head_dim=head_dim)
    if config.position_embedding_type == "rope" and head_dim % 2:
        raise ValueError(f"{owner}: head_dim must be even for rotary embeddings, got {head_dim}")
    check_divisible(owner, "num_attention_heads", heads, "num_key_value_heads", config.num_key_value_heads)
    return head_dim


def _check_parts(owner: str, config, kwargs: dict) -> None:
    """The block's parts: activation, norms, dropouts, Gemma's switches, the position scheme."""
    check_choice(owner, "position_embedding_type", config.position_embedding_type, POSITION_EMBEDDING_TYPES)
    check_choice(owner, "norm_type", config.norm_type, ("rmsnorm", "layernorm"))
    check_choice(owner, "hidden_act", config.hidden_act, sorted(ACT2FN))
    check_probability(owner, attention_dropout=config.attention_dropout, hidden_dropout=config.hidden_dropout,
                      embedding_dropout=config.embedding_dropout)
    check_positive_number(owner, rms_norm_eps=config.rms_norm_eps, layer_norm_eps=config.layer_norm_eps,
                          initializer_range=config.initializer_range)
    if config.sliding_window is not None:
        check_positive(owner, sliding_window=config.sliding_window)
    check_bool(owner, qk_norm=config.qk_norm, rms_norm_unit_offset=config.rms_norm_unit_offset,
               scale_embeddings=config.scale_embeddings, sandwich_norms=config.sandwich_norms,
               mlp_gated=config.mlp_gated, norm_bias=config.norm_bias, attention_bias=config.attention_bias,
               mlp_bias=config.mlp_bias, tie_word_embeddings=config.tie_word_embeddings, use_cache=config.use_cache)
    if config.attention_output_bias is not None:
        check_bool(owner, attention_output_bias=config.attention_output_bias)
    if config.rms_norm_unit_offset and config.norm_type != "rmsnorm":
        raise ValueError(f"{owner}: rms_norm_unit_offset=True needs norm_type='rmsnorm', got {config.norm_type!r}")
    for name in ("query_pre_attn_scalar", "final_logit_softcapping"):
        if getattr(config, name) is not None:
            check_positive_number(owner, **{name: getattr(config, name)})
    if kwargs.get("attn_logit_softcapping") is not None:
        raise ValueError(
            f"{owner}: attn_logit_softcapping={kwargs['attn_logit_softcapping']!r} is not supported (it needs the "
            "attention scores, which the sdpa and flash kernels never form); use a model with attn_logit_softcapping=None"
        )


def _rope_parameters(owner: str, config, legacy_scaling, legacy_theta) -> dict:
    """rope_parameters standardized (one dict, or one per layer type); the legacy spellings of Llama 2 era
    config.json files (rope_scaling + rope_theta beside it) accepted."""
    rope_parameters, max_positions = config.rope_parameters, config.max_position_embeddings
    if rope_parameters is None and legacy_scaling is not None:
        rope_parameters = legacy_scaling
    if isinstance(rope_parameters, dict) and set(rope_parameters) & set(LAYER_TYPES):
        # transformers 5.16-5.17 leave a flat rope_type / rope_theta beside the layer types (Gemma 3: {"rope_type":
        # "default", "rope_theta": None, "full_attention": {...}, ...}); its rotary embeddings read only the layer
        # types' entries, and so does this one
        unknown = sorted(set(rope_parameters) - set(ROPE_LAYER_TYPES) - {"rope_type", "rope_theta"})
        if unknown:
            raise ValueError(f"{owner}: rope_parameters keyed by layer type may hold only {list(ROPE_LAYER_TYPES)}; got keys {unknown}")
        rope_parameters = {
            kind: standardize_rope_parameters(rope_parameters.get(kind), max_position_embeddings=max_positions,
                                              rope_theta=legacy_theta, owner=f"{owner} rope_parameters[{kind!r}]")
            for kind in ROPE_LAYER_TYPES
        }
    else:
        rope_parameters = standardize_rope_parameters(rope_parameters, max_position_embeddings=max_positions,
                                                      rope_theta=legacy_theta, owner=owner)
    kind = config.position_embedding_type
    if kind == "alibi" and rope_parameters != standardize_rope_parameters(None, max_position_embeddings=max_positions, owner=owner):
        raise ValueError(
            f"{owner}: position_embedding_type='alibi' takes no rotary embeddings (ALiBi replaces them); got "
            f"rope_parameters={rope_parameters}"
        )
    if kind == "rope":
        mla = config.mla.in_use(config)
        rotated = config.mla.qk_rope_head_dim if mla else config.head_dim
        for params in rope_parameter_sets(rope_parameters):
            if mla and rotary_dim(params, rotated, owner=owner) != rotated:
                raise ValueError(f"{owner}: MLA rotates all qk_rope_head_dim={rotated} dimensions; drop partial_rotary_factor")
            rotary_dim(params, rotated, owner=owner)
    return rope_parameters


class TinyCausalConfig(PretrainedConfig):
    """A pre-norm decoder-only transformer: token embeddings, N blocks of (RMSNorm, rotary self-attention with
    GQA/MQA, RMSNorm, SwiGLU feed-forward), final RMSNorm, LM head. Field names are the transformers standard ones
    (those of LlamaConfig), so Llama / Mistral / Qwen2 checkpoints map onto it field by field:

    - num_key_value_heads < num_attention_heads: grouped-query attention (1: multi-query).
    - head_dim: defaults to hidden_size // num_attention_heads; may be set explicitly (then hidden_size need not
      divide).
    - rope_parameters: {"rope_type": "default" | "linear" | "dynamic" | "yarn" | "llama3", "rope_theta": ..., and
      the type's own fields}, the semantics of transformers' `rope_parameters`. The legacy `rope_scaling` +
      `rope_theta` keywords are accepted too.
    - attention_bias: bias of q/k/v (and of o_proj unless attention_output_bias says otherwise; Qwen2 has biases
      on q/k/v only: attention_bias=True, attention_output_bias=False). mlp_bias: biases of the feed-forward.
    - sliding_window: None (full causal attention) or the number of most recent keys (itself included) a query
      of a "sliding_attention" layer sees.
    - layer_types: one entry per layer, "full_attention" or "sliding_attention"; by default every layer is
      "sliding_attention" when sliding_window is set (Mistral) and "full_attention" otherwise. Mixed lists are
      Qwen2's `max_window_layers` and Gemma 3's 5 local : 1 global pattern.
    - rope_parameters may also be keyed by layer type ({"full_attention": {...}, "sliding_attention": {...}}):
      each kind of layer then rotates with its own parameters (Gemma 3: theta 1e6 global, 1e4 local).
    - qk_norm: an RMSNorm over each head's query and key (weights of head_dim, eps rms_norm_eps) before RoPE
      (Qwen3, Gemma 3).

    Gemma 3 is this block with five switches (all off for Llama):
    - rms_norm_unit_offset: every RMSNorm stores w and scales by (1 + w), multiplying in float32 before the cast
      back (Gemma's `Gemma3RMSNorm`; weights are zero-initialized).
    - scale_embeddings: token embeddings times sqrt(hidden_size), rounded to the weights' dtype, in the embedding
      module (layers.ScaledEmbedding), as official Gemma 3: get_input_embeddings()(ids) is scaled.
    - sandwich_norms: besides the pre-norms, a norm on the output of attention and of the MLP before each
      residual add (`attn_output_layernorm`, `mlp_output_layernorm`).
    - query_pre_attn_scalar: attention scale query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5.
    - final_logit_softcapping: logits = c * tanh(logits / c) (None: off).

    GPT-2 is this block with other choices of its parts:
    - position_embedding_type: "rope" (default), "learned" (absolute positions added to the token embeddings,
      `embed_positions`, max_position_embeddings of them; no rotation) or "alibi" (BLOOM, MPT; the alibi_bias
      table). norm_bias=False: LayerNorms without bias (MPT).
    - norm_type: "rmsnorm" (eps rms_norm_eps) or "layernorm" (with bias, eps layer_norm_eps), for every norm.
    - mlp_gated: True (down(act(gate(x)) * up(x))) or False (down(act(up(x))), GPT-2's c_fc / c_proj).
    - hidden_dropout: dropout on each sublayer's output before the residual add (GPT-2 / Phi-3 resid_pdrop);
      embedding_dropout: on the embeddings (embd_pdrop).

    The optional mechanisms (Mixture-of-Experts, MLA, MTP, ALiBi, GPT-OSS's and the 2025 decoders' switches) are
    tables in causal_mechanisms.py, each with its fields, their meaning and checks; the config holds a table's
    fields only while the mechanism is in use and reads them typed through the views below (config.moe,
    config.mla, ...), held or not. GPT-OSS is a MoE model with alternating sliding / full layer_types,
    attention_bias, YaRN (truncate=False), attention sinks, router and expert biases, the clamped SwiGLU and
    router_scoring "topk_softmax"; Llama 4 text has chunked attention, NoPE layers with a query temperature, L2 q/k
    norms and router weights on the experts' inputs.
    """

    model_type = "hf_tiny_causal"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    # official MoE configs' (Mixtral, Qwen3-MoE) alias, which tools read (TRL's load-balancing loss); a dense config
    # holds no num_local_experts, so it has no num_experts either
    attribute_map = {"num_experts": "num_local_experts"}
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }
    # The optional mechanisms, one table each (causal_mechanisms.py), read typed whether the config holds their
    # fields or not: config.moe.num_local_experts is 0 on a dense model. Their checks run in this order.
    mla = MechanismView(Mla)
    alibi_bias = MechanismView(Alibi)
    nope = MechanismView(Nope)
    qk_norm_placement = MechanismView(QkNormPlacement)
    norm_layout = MechanismView(NormLayout)
    padding_row = MechanismView(PaddingRow)
    rounding = MechanismView(HalfPrecisionRounding)
    longrope_cache = MechanismView(LongropeCache)
    attn_temperature = MechanismView(AttnTemperature)
    chunked_attention = MechanismView(ChunkedAttention)
    moe = MechanismView(Moe)
    router_input_weights = MechanismView(RouterInputWeights)
    moe_biases = MechanismView(MoeBiases)
    sinks = MechanismView(AttentionSinks)
    clamped_swiglu = MechanismView(ClampedSwiglu)
    mtp = MechanismView(Mtp)

    def __init__(
        self, vocab_size: int = 32000, hidden_size: int = 4096, intermediate_size: int = 11008,
        num_hidden_layers: int = 32, num_attention_heads: int = 32, num_key_value_heads: int | None = None,
        head_dim: int | None = None, hidden_act: str = "silu", max_position_embeddings: int = 2048,
        initializer_range: float = 0.02, rms_norm_eps: float = 1e-6, rope_parameters: dict | None = None,
        attention_bias: bool = False, attention_output_bias: bool | None = None, attention_dropout: float = 0.0,
        mlp_bias: bool = False, sliding_window: int | None = None, layer_types: list[str] | None = None,
        qk_norm: bool = False, rms_norm_unit_offset: bool = False, scale_embeddings: bool = False,
        sandwich_norms: bool = False, query_pre_attn_scalar: float | None = None,
        final_logit_softcapping: float | None = None, position_embedding_type: str = "rope", norm_type: str = "rmsnorm",
        layer_norm_eps: float = 1e-5, norm_bias: bool = True, mlp_gated: bool = True, hidden_dropout: float = 0.0,
        embedding_dropout: float = 0.0, tie_word_embeddings: bool = False, pad_token_id: int | None = None,
        bos_token_id: int | None = 1, eos_token_id: int | list[int] | None = 2, use_cache: bool = True, **kwargs,
    ):
        """Every field this docstring's class describes; the optional mechanisms' fields arrive through kwargs and
        are held only when their mechanism is in use."""
        owner = type(self).__name__
        kwargs = _renamed_aliases(owner, type(self).attribute_map, kwargs)
        tables = {name: view.table.taken_from(kwargs) for name, view in mechanism_views(TinyCausalConfig).items()}
        values = init_arguments({k: v for k, v in locals().items() if k not in ("owner", "tables")})
        check_finite_fields(owner, {**values, **{k: v for table in tables.values() for k, v in table.values().items()}})
        fields = SimpleNamespace(**{**values, **tables})
        fields.first_k_dense_replace = kwargs.pop("first_k_dense_replace", None)  # DeepSeek's form of mlp_layer_types
        fields.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        _check_sizes(owner, fields)
        _check_parts(owner, fields, kwargs)
        fields.layer_types = check_layer_types(owner, layer_types, num_hidden_layers, sliding_window)
        fields.rope_scaling = kwargs.get("rope_scaling")  # the legacy spelling, read by a table's checks too
        for name in tables:
            tables[name] = getattr(fields, name).checked(owner, fields)
            setattr(fields, name, tables[name])
        fields.head_dim = _head_dim(owner, fields)
        if pad_token_id == -1:  # old LLaMA configs: official warns and loads (nn.Embedding reads -1 as the last row)
            warn_on_token_ids_outside(owner, vocab_size, pad_token_id=pad_token_id)
        else:
            check_token_ids(owner, vocab_size, pad_token_id=pad_token_id)
        warn_on_token_ids_outside(owner, vocab_size, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
        standardized = _rope_parameters(owner, fields, kwargs.pop("rope_scaling", None), kwargs.pop("rope_theta", None))
        store_init_fields(self, TinyCausalConfig.__init__, vars(fields), skip=("rope_parameters",))
        for table in tables.values():
            if table.in_use(fields):
                for name, value in table.values().items():
                    setattr(self, name, value)
        # PretrainedConfig.__init__ standardizes rope_parameters itself, differently per transformers version (5.17
        # adds rope_theta into a dict keyed by layer type, then fails validating it); ours is standardized already.
        super().__init__(**kwargs)
        self.rope_parameters = standardized

    def rope_parameters_for(self, layer_type: str) -> dict:
        """The rope parameters a layer of this type rotates with (chunked layers: the full layers')."""
        if set(self.rope_parameters) == set(ROPE_LAYER_TYPES):
            return self.rope_parameters["sliding_attention" if layer_type == "sliding_attention" else "full_attention"]
        return self.rope_parameters

    def uses_rope(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` rotates its queries and keys: every layer of a RoPE model but its NoPE layers
        (the MTP modules' blocks, past num_hidden_layers, rotate)."""
        return self.position_embedding_type == "rope" and layer_idx not in self.nope.nope_layers

    def sliding_window_for(self, layer_type: str) -> int | None:
        return self.sliding_window if layer_type == "sliding_attention" else None

    def norm_type_eps(self) -> float:
        """The epsilon of this model's norms: rms_norm_eps or layer_norm_eps by norm_type."""
        return self.rms_norm_eps if self.norm_type == "rmsnorm" else self.layer_norm_eps

    def moe_spec(self) -> Optional[MoeSpec]:
        """The sparse feed-forward's description, or None for a dense model (which holds no MoE field)."""
        moe = self.moe
        if not moe.in_use(self):
            return None
        return MoeSpec(
            num_experts=moe.num_local_experts, top_k=moe.num_experts_per_tok, intermediate_size=moe.moe_intermediate_size,
            scoring=moe.router_scoring, norm_topk_prob=moe.norm_topk_prob, n_group=moe.n_group,
            topk_group=moe.topk_group, routed_scaling_factor=moe.routed_scaling_factor,
            shared_intermediate_size=moe.shared_expert_intermediate_size, shared_expert_gate=moe.shared_expert_gate,
            jitter_noise=moe.router_jitter_noise, router_bias=self.moe_biases.router_bias,
            weights_on_input=self.router_input_weights.apply_router_weight_on_input,
        )

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Layers past num_hidden_layers are the MTP modules' blocks: sparse in a MoE model (DeepSeek-V3)."""
        moe = self.moe
        if not moe.in_use(self):
            return False
        return layer_idx >= self.num_hidden_layers or moe.mlp_layer_types[layer_idx] == "sparse"

    def mla_spec(self) -> Optional["MlaSpec"]:
        """Multi-head Latent Attention's description, or None (then the config holds no MLA field)."""
        from .mla import MlaSpec

        mla = self.mla
        if not mla.in_use(self):
            return None
        return MlaSpec(
            kv_lora_rank=mla.kv_lora_rank, q_lora_rank=mla.q_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
            qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim, bias=self.attention_bias,
        )

    def mtp_depth(self) -> int:
        """The number of Multi-Token Prediction modules (0: none, and no MTP field)."""
        return self.mtp.num_nextn_predict_layers

    def rotary_head_dim(self) -> int:
        """The dimensions RoPE rotates per head: MLA's qk_rope_head_dim, else head_dim."""
        mla = self.mla
        return mla.qk_rope_head_dim if mla.in_use(self) else self.head_dim

    def cache_layout(self) -> tuple[int, int]:
        """(heads, key dimension) of what the KV cache stores per layer and token: MLA stores one latent."""
        mla = self.mla
        return (1, mla.kv_lora_rank) if mla.in_use(self) else (self.num_key_value_heads, self.head_dim)

    def attention_scale(self) -> float:
        """head_dim ** -0.5; Gemma's query_pre_attn_scalar ** -0.5; DeepSeek's YaRN scales scores by
        mscale(factor, mscale_all_dim) ** 2 too (official yarn_apply_mscale)."""
        if self.mla.in_use(self):
            params = self.rope_parameters_for("full_attention")
            mscale_all_dim = params.get("mscale_all_dim")
            if params["rope_type"] == "default" or not mscale_all_dim or params.get("factor", 1.0) <= 1:
                return self.head_dim**-0.5
            mscale = 0.1 * mscale_all_dim * math.log(params["factor"]) + 1.0
            return self.head_dim**-0.5 * mscale * mscale
        if self.query_pre_attn_scalar is not None:
            return self.query_pre_attn_scalar**-0.5
        return self.head_dim**-0.5


__all__ = ["TinyCausalConfig"]
