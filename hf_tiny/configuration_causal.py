"""Configuration of the Llama-style causal LM family (model_type "hf_tiny_causal")."""

from __future__ import annotations

from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from .rope import standardize_rope_parameters
from .validation import check_bool, check_choice, check_divisible, check_finite_fields, check_positive, check_positive_number
from .validation import check_probability, check_token_ids, init_arguments, store_init_fields


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
    - sliding_window: None (full causal attention) or the number of most recent keys each query sees (Mistral).
    - qk_norm: an RMSNorm over each head's query and key (weights of head_dim, eps rms_norm_eps) before RoPE
      (Qwen3).
    """

    model_type = "hf_tiny_causal"
    keys_to_ignore_at_inference = ["past_key_values"]
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

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 4096,
        intermediate_size: int = 11008,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 2048,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        rope_parameters: dict | None = None,
        attention_bias: bool = False,
        attention_output_bias: bool | None = None,
        attention_dropout: float = 0.0,
        mlp_bias: bool = False,
        sliding_window: int | None = None,
        qk_norm: bool = False,
        tie_word_embeddings: bool = False,
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | list[int] | None = 2,
        use_cache: bool = True,
        **kwargs,
    ):
        owner = type(self).__name__
        check_finite_fields(owner, init_arguments(locals()))
        if num_key_value_heads is None:
            num_key_value_heads = num_attention_heads
        check_positive(
            owner,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            max_position_embeddings=max_position_embeddings,
        )
        if head_dim is None:
            check_divisible(owner, "hidden_size", hidden_size, "num_attention_heads", num_attention_heads)
            head_dim = hidden_size // num_attention_heads
        check_positive(owner, head_dim=head_dim)
        if head_dim % 2:
            raise ValueError(f"{owner}: head_dim must be even for rotary embeddings, got {head_dim}")
        check_divisible(owner, "num_attention_heads", num_attention_heads, "num_key_value_heads", num_key_value_heads)
        check_choice(owner, "hidden_act", hidden_act, sorted(ACT2FN))
        check_probability(owner, attention_dropout=attention_dropout)
        check_positive_number(owner, rms_norm_eps=rms_norm_eps, initializer_range=initializer_range)
        if sliding_window is not None:
            check_positive(owner, sliding_window=sliding_window)
        check_bool(owner, qk_norm=qk_norm)
        check_token_ids(owner, vocab_size, pad_token_id=pad_token_id, bos_token_id=bos_token_id)

        # Legacy spellings (Llama 2 era config.json files): rope_scaling + rope_theta beside it.
        legacy_scaling = kwargs.pop("rope_scaling", None)
        legacy_theta = kwargs.pop("rope_theta", None)
        if rope_parameters is None and legacy_scaling is not None:
            rope_parameters = legacy_scaling
        rope_parameters = standardize_rope_parameters(
            rope_parameters, max_position_embeddings=max_position_embeddings, rope_theta=legacy_theta, owner=owner
        )

        store_init_fields(self, TinyCausalConfig.__init__, locals())
        super().__init__(**kwargs)

    def block_spec(self):
        """The decoder block: pre-norm RMSNorm, gated (SwiGLU) MLP, grouped-query attention (Llama)."""
        from .layers import BlockSpec

        output_bias = self.attention_bias if self.attention_output_bias is None else self.attention_output_bias
        return BlockSpec(
            hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, attention_scale=None,
            attention_dropout=self.attention_dropout, attention_bias=self.attention_bias,
            attention_output_bias=output_bias, intermediate_size=self.intermediate_size, hidden_act=self.hidden_act,
            mlp_gated=True, mlp_bias=self.mlp_bias, pre_norm=True, norm_type="rmsnorm", norm_eps=self.rms_norm_eps,
            qk_norm=self.qk_norm,
        )


__all__ = ["TinyCausalConfig"]
