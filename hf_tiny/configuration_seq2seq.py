"""Configuration of the encoder-decoder (seq2seq) family (model_type "hf_tiny_seq2seq").

One config expresses the three real checkpoint families the converters read:

* BART / original Transformer: post-LN LayerNorm, learned absolute positions with BART's offset of 2 (or
  sinusoidal positions, as Marian uses), biases everywhere, GELU/ReLU, an embedding LayerNorm, optional
  sqrt(d) embedding scale, a `final_logits_bias` buffer.
* T5: pre-norm RMSNorm, relative position bias with buckets (one table per stack, in its first layer), no
  1/sqrt(d) attention scaling, ReLU or gated-GELU feed-forward, no biases, a final norm per stack, tied head
  with the d_model ** -0.5 rescale (v1.0) or an untied head (v1.1).
* BERT warm start (bert2seq): post-LN, learned positions without offset, a token-type embedding (type 0 is
  added), separate encoder and decoder embeddings, an LM head with BERT's transform (dense, act, LayerNorm) and
  bias.

Standard transformers names are used where they exist; `num_hidden_layers` is the encoder depth and
`num_decoder_layers` the decoder depth (T5 naming).
"""

from __future__ import annotations

import copy
from typing import Optional

from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from .validation import check_bool, check_choice, check_divisible, check_finite_fields, check_positive, check_positive_number
from .validation import check_non_negative, check_probability, check_token_ids, check_unsupported_field, init_arguments
from .validation import store_init_fields

NORM_PLACEMENTS = ("pre", "post")
NORM_TYPES = ("layernorm", "rmsnorm")
POSITION_EMBEDDING_TYPES = ("learned", "sinusoidal", "relative")


# Named presets: the fields each real checkpoint family fixes (sizes, dropouts, token ids and the few options a
# family really varies -- BART's scale_embedding, Marian's shared vocabulary, T5's gated MLP and tied head -- are
# given alongside). TinySeq2SeqConfig.from_style builds one; style_mismatches says what a config changed.
_POST_LN = dict(
    norm_placement="post", norm_type="layernorm", mlp_gated=False, mlp_bias=True, attention_bias=True,
    attention_scale=None, embedding_norm=True, final_norm=False, scale_decoder_outputs=False,
)
_BART = dict(use_padding_idx=True, type_vocab_size=0, lm_head_transform=False, lm_head_bias=False, final_logits_bias=True,
             layer_norm_eps=1e-5)
STYLES = {
    "bart": {**_POST_LN, **_BART, "position_embedding_type": "learned", "position_offset": 2,
             "share_encoder_decoder_embeddings": True},
    "marian": {**_POST_LN, **_BART, "position_embedding_type": "sinusoidal", "position_offset": 0, "embedding_norm": False},
    "t5": dict(
        norm_placement="pre", norm_type="rmsnorm", position_embedding_type="relative", mlp_bias=False,
        attention_bias=False, attention_scale=1.0, embedding_norm=False, final_norm=True, scale_embedding=False,
        use_padding_idx=False, share_encoder_decoder_embeddings=True, type_vocab_size=0, lm_head_transform=False,
        lm_head_bias=False, final_logits_bias=False,
    ),
    "bert2seq": {**_POST_LN, "position_embedding_type": "learned", "position_offset": 0, "scale_embedding": False,
                 "share_encoder_decoder_embeddings": False, "lm_head_transform": True, "lm_head_bias": True,
                 "final_logits_bias": False},
}


class TinySeq2SeqConfig(PretrainedConfig):
    """Encoder-decoder transformer. Defaults describe a BART-base-sized model.

    Variant fields (each needed by a real checkpoint family):
        norm_placement: "post" (BART, BERT: x = norm(x + f(x))) or "pre" (T5: x = x + f(norm(x))).
        norm_type: "layernorm" or "rmsnorm" (T5).
        position_embedding_type: "learned" (table of max_position_embeddings + position_offset rows; BART's offset
            is 2), "sinusoidal" (fixed sin | cos halves, Marian) or "relative" (T5 bucketed bias,
            relative_attention_num_buckets / relative_attention_max_distance).
        type_vocab_size: > 0 adds a token-type embedding table whose row 0 is added to every token (BERT).
        embedding_norm: a norm after the embeddings (BART layernorm_embedding, BERT embeddings.LayerNorm).
        final_norm: a norm after the last layer of each stack (T5 final_layer_norm).
        scale_embedding: multiply token embeddings by sqrt(hidden_size) (BART option, Marian).
        attention_scale: None = head_dim ** -0.5; T5 uses 1.0.
        attention_bias / mlp_bias / mlp_gated: biases of the projections, gated feed-forward (T5 v1.1).
        use_padding_idx: the pad row of the word embeddings gets no gradient (BART, BERT; not T5, whose decoder
            start token is the pad token).
        share_encoder_decoder_embeddings: one `shared` table for encoder and decoder inputs (BART, T5); False keeps
            a separate decoder table (bert2seq).
        tie_word_embeddings: the LM head reuses the decoder input embedding.
        scale_decoder_outputs: multiply decoder outputs by hidden_size ** -0.5 before the LM head (T5 v1.0).
        lm_head_transform: BERT's dense + act + LayerNorm before the LM head; lm_head_bias: a learned bias.
        final_logits_bias: BART's (non-trained) logits bias buffer.
        decoder_attention_heads / decoder_head_dim / decoder_intermediate_size: the decoder stack's heads, head
            width and MLP width where they differ from the encoder's (BART/Marian decoder_attention_heads,
            decoder_ffn_dim); None: the encoder's. A decoder with other heads has no grouped-query attention.
        encoder_hidden_size / decoder_hidden_size: optional, must equal hidden_size (cross-attention reads
            encoder states directly, so the two widths must match).
        decoder_inputs_from_input_ids: a forward given neither decoder inputs nor labels shifts input_ids right
            into decoder_input_ids (BART's denoising and mask-filling call, model(input_ids).logits; set by the BART
            converter); False: such a forward is refused (Marian, T5).
    """

    model_type = "hf_tiny_seq2seq"
    # FSDP2 units (DistributedConfig(fsdp_size=N)), paths relative to TinySeq2SeqModel: transformers' default plan
    # (embed_tokens, layers.*, norm) names nothing here. No tensor-parallel plan yet: the T5 relative position bias
    # is computed for all heads at once, so it would need sharding by head too (see tests/ecosystem/test_distributed.py).
    base_model_fsdp_plan = {"encoder.layers.*": "free_full_weight", "decoder.layers.*": "free_full_weight"}
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self, vocab_size: int = 50265, hidden_size: int = 768, num_attention_heads: int = 12,
        num_key_value_heads: Optional[int] = None, head_dim: Optional[int] = None, intermediate_size: int = 3072,
        num_hidden_layers: int = 6, num_decoder_layers: Optional[int] = None, hidden_act: str = "gelu",
        max_position_embeddings: int = 1024, layer_norm_eps: float = 1e-5, initializer_range: float = 0.02,
        attention_dropout: float = 0.0, hidden_dropout: float = 0.1, activation_dropout: float = 0.0,
        norm_placement: str = "post", norm_type: str = "layernorm", position_embedding_type: str = "learned",
        position_offset: int = 2, relative_attention_num_buckets: int = 32, relative_attention_max_distance: int = 128,
        type_vocab_size: int = 0, mlp_gated: bool = False, mlp_bias: bool = True, attention_bias: bool = True,
        scale_embedding: bool = False, attention_scale: Optional[float] = None, embedding_norm: bool = True,
        final_norm: bool = False, use_padding_idx: bool = True, share_encoder_decoder_embeddings: bool = True,
        tie_word_embeddings: bool = True, scale_decoder_outputs: bool = False, lm_head_transform: bool = False,
        lm_head_bias: bool = False, final_logits_bias: bool = True, pad_token_id: Optional[int] = 1,
        bos_token_id: Optional[int] = 0, eos_token_id: Optional[int] = 2, decoder_start_token_id: Optional[int] = 2,
        use_cache: bool = True, decoder_attention_heads: Optional[int] = None, decoder_head_dim: Optional[int] = None,
        decoder_intermediate_size: Optional[int] = None, decoder_inputs_from_input_ids: bool = False, **kwargs,
    ):
        owner = type(self).__name__
        values = init_arguments(locals())
        check_finite_fields(owner, values)
        values["num_decoder_layers"] = num_hidden_layers if num_decoder_layers is None else num_decoder_layers
        values["num_key_value_heads"] = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        check_positive(owner, **{name: values[name] for name in (
            "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "num_hidden_layers", "num_decoder_layers", "max_position_embeddings")})
        _check_one_width(owner, hidden_size, kwargs)
        values.update(_head_shapes(owner, values))
        _check_parts(owner, values, kwargs)
        check_token_ids(owner, vocab_size, pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                        eos_token_id=eos_token_id, decoder_start_token_id=decoder_start_token_id)
        if use_padding_idx and pad_token_id is None:
            raise ValueError(f"{owner}: use_padding_idx=True needs a pad_token_id, got pad_token_id=None")
        store_init_fields(self, TinySeq2SeqConfig.__init__, values)
        kwargs.pop("is_encoder_decoder", None)
        super().__init__(is_encoder_decoder=True, **kwargs)

    @classmethod
    def from_style(cls, style: str, **fields) -> "TinySeq2SeqConfig":
        """A config of one named style (STYLES: bart, marian, t5, bert2seq) with the given sizes and options; a
        field the style fixes may not be given a different value."""
        check_choice(cls.__name__, "style", style, sorted(STYLES))
        clashes = [f"{k}={v!r} (the style needs {STYLES[style][k]!r})" for k, v in fields.items()
                   if k in STYLES[style] and v != STYLES[style][k]]
        if clashes:
            raise ValueError(f"{cls.__name__}.from_style({style!r}): {', '.join(clashes)}")
        return cls(**{**STYLES[style], **fields})

    def style_mismatches(self, style: str) -> list[str]:
        """`field=value (style needs X)` for every field this config sets differently from the style."""
        check_choice(type(self).__name__, "style", style, sorted(STYLES))
        return [f"{k}={getattr(self, k)!r} (it needs {v!r})" for k, v in STYLES[style].items() if getattr(self, k) != v]

    @property
    def d_model(self) -> int:
        """hidden_size under BART's and T5's name, which transformers' seq2seq export wrapper reads."""
        return self.hidden_size

    @property
    def t5_half_precision(self) -> bool:
        """T5's layout (relative position buckets, which only T5 has here): its official class's half-precision rules
        apply. from_pretrained(dtype=float16) keeps each feed-forward's output projection float32 (official's
        _keep_in_fp32_modules = ["wo"]; bitsandbytes leaves it unquantized too), its input cast to it; the residual
        stream then runs in float32, each norm handing its sublayer the weights' dtype (T5LayerNorm); a float16
        residual stream is clamped away from inf after each sublayer (T5Block)."""
        return self.position_embedding_type == "relative"

    def decoder_key_value_heads(self) -> int:
        """The decoder's key/value heads: num_key_value_heads, unless the decoder has its own head count (then it
        has no grouped-query attention)."""
        heads = self.decoder_attention_heads
        return self.num_key_value_heads if heads == self.num_attention_heads else heads

    def get_text_config(self, decoder=None, encoder=None):
        """transformers sizes generation caches (DynamicCache(config=...)) from the decoder view of the config.
        transformers builds that view by renaming decoder_* fields (decoder_attention_heads -> num_attention_heads,
        decoder_head_dim -> head_dim, decoder_intermediate_size -> intermediate_size, which is why those fields
        carry that prefix); the depth and the key/value heads are set here."""
        text_config = super().get_text_config(decoder=decoder, encoder=encoder)
        if decoder and not encoder:
            if text_config is self:
                text_config = copy.deepcopy(self)
            text_config.num_hidden_layers = self.num_decoder_layers
            if "decoder_attention_heads" in vars(self):  # not yet a decoder view (a view has them renamed)
                text_config.num_key_value_heads = self.decoder_key_value_heads()
        return text_config


def _check_one_width(owner: str, hidden_size: int, kwargs: dict) -> None:
    """encoder_hidden_size / decoder_hidden_size (BART-era configs name them): accepted, not stored, equal to
    hidden_size."""
    widths = {name: kwargs.pop(name, None) for name in ("encoder_hidden_size", "decoder_hidden_size")}
    for name, width in widths.items():
        if width is not None and width != hidden_size:
            raise ValueError(
                f"{owner}: encoder and decoder hidden sizes must match (cross-attention reads the encoder states "
                f"directly); got {name}={width!r} with hidden_size={hidden_size} (encoder_hidden_size="
                f"{widths['encoder_hidden_size']!r}, decoder_hidden_size={widths['decoder_hidden_size']!r})"
            )


def _head_shapes(owner: str, values: dict) -> dict:
    """head_dim and the decoder's heads, head width and MLP width filled in and checked."""
    hidden, heads, kv_heads = values["hidden_size"], values["num_attention_heads"], values["num_key_value_heads"]
    head_dim = values["head_dim"]
    if head_dim is None:
        check_divisible(owner, "hidden_size", hidden, "num_attention_heads", heads)
        head_dim = hidden // heads
    check_positive(owner, head_dim=head_dim)
    decoder_heads = heads if values["decoder_attention_heads"] is None else values["decoder_attention_heads"]
    check_positive(owner, decoder_attention_heads=decoder_heads)
    if decoder_heads != heads and kv_heads != heads:
        raise ValueError(
            f"{owner}: decoder_attention_heads={decoder_heads} differs from num_attention_heads={heads}, which needs "
            f"num_key_value_heads == num_attention_heads (got {kv_heads}): a decoder with its own head count has no "
            "grouped-query attention"
        )
    decoder_head_dim = values["decoder_head_dim"]
    if decoder_head_dim is None:
        if values["head_dim"] is not None or decoder_heads == heads:
            decoder_head_dim = head_dim
        else:
            check_divisible(owner, "hidden_size", hidden, "decoder_attention_heads", decoder_heads)
            decoder_head_dim = hidden // decoder_heads
    decoder_intermediate = values["decoder_intermediate_size"]
    decoder_intermediate = values["intermediate_size"] if decoder_intermediate is None else decoder_intermediate
    check_positive(owner, decoder_head_dim=decoder_head_dim, decoder_intermediate_size=decoder_intermediate)
    check_divisible(owner, "num_attention_heads", heads, "num_key_value_heads", kv_heads)
    return dict(head_dim=head_dim, decoder_attention_heads=decoder_heads, decoder_head_dim=decoder_head_dim,
                decoder_intermediate_size=decoder_intermediate)


def _check_parts(owner: str, values: dict, kwargs: dict) -> None:
    check_choice(owner, "hidden_act", values["hidden_act"], sorted(ACT2FN))
    check_choice(owner, "norm_placement", values["norm_placement"], NORM_PLACEMENTS)
    check_choice(owner, "norm_type", values["norm_type"], NORM_TYPES)
    check_choice(owner, "position_embedding_type", values["position_embedding_type"], POSITION_EMBEDDING_TYPES)
    for field in ("rope_parameters", "rope_scaling"):
        check_unsupported_field(owner, kwargs, field, (None,), "this family has no rotary embeddings; choose "
                                f"position_embedding_type from {list(POSITION_EMBEDDING_TYPES)}")
    check_probability(owner, **{name: values[name] for name in ("attention_dropout", "hidden_dropout", "activation_dropout")})
    check_positive_number(owner, layer_norm_eps=values["layer_norm_eps"], initializer_range=values["initializer_range"])
    if values["attention_scale"] is not None:
        check_positive_number(owner, attention_scale=values["attention_scale"])
    check_non_negative(owner, position_offset=values["position_offset"])
    check_non_negative(owner, "0 = none", type_vocab_size=values["type_vocab_size"])
    check_positive(owner, relative_attention_num_buckets=values["relative_attention_num_buckets"],
                   relative_attention_max_distance=values["relative_attention_max_distance"])
    if values["position_embedding_type"] == "sinusoidal" and values["hidden_size"] % 2:
        raise ValueError(f"{owner}: sinusoidal positions need an even hidden_size, got {values['hidden_size']}")
    check_bool(owner, **{name: values[name] for name in (
        "mlp_gated", "mlp_bias", "attention_bias", "scale_embedding", "embedding_norm", "final_norm", "use_padding_idx",
        "share_encoder_decoder_embeddings", "tie_word_embeddings", "scale_decoder_outputs", "lm_head_transform",
        "lm_head_bias", "final_logits_bias", "use_cache", "decoder_inputs_from_input_ids")})


__all__ = ["STYLES", "TinySeq2SeqConfig"]
