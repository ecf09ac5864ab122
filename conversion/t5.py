"""T5 (v1.0 and v1.1 layouts) <-> hf_tiny seq2seq.

    python -m conversion t5 SRC DST              official T5ForConditionalGeneration folder -> hf_tiny
    python -m conversion t5 SRC DST --reverse    hf_tiny seq2seq folder (T5 layout) -> official T5 folder

T5: pre-norm RMSNorm (no bias), relative position bias (one table per stack, stored in its first layer), no
1/sqrt(d) attention scaling, ReLU (v1.0) or gated-GELU (v1.1) feed-forward without biases, a final norm per
stack. The head is tied to `shared` (v1.0, decoder outputs rescaled by d_model ** -0.5) or untied (v1.1, no
rescale). As in transformers 5, the head counts as untied exactly when the checkpoint stores an lm_head.weight
that differs from shared.weight; the rescale follows config.json (`scale_decoder_outputs`, or
`tie_word_embeddings` in configs written by transformers 4).
"""

from __future__ import annotations

from pathlib import Path

from .errors import ConversionError
from .keymap import KeyMap, Rule, layer_rules
from .pipeline import Plan, ReversePlan, Source, entry_points
from .readers import official_config, source_name
from .seq2seq_common import SAME_LABEL_FIELDS, Seq2SeqFamily, require_style, stack_depths, styled_config
from .writer import drop_tied_copies, stores_tied_copy

ATTENTION = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
# T5Config field -> TinySeq2SeqConfig field: read one way, written the other
CONFIG_FIELDS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "num_heads": "num_attention_heads",
    "d_kv": "head_dim",
    "d_ff": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_decoder_layers": "num_decoder_layers",
    "layer_norm_epsilon": "layer_norm_eps",
    "relative_attention_num_buckets": "relative_attention_num_buckets",
    "relative_attention_max_distance": "relative_attention_max_distance",
    "pad_token_id": "pad_token_id",
    "eos_token_id": "eos_token_id",
    **SAME_LABEL_FIELDS,
}


def _feed_forward(gated: bool) -> dict[str, str]:
    if gated:
        return {"DenseReluDense.wi_0": "mlp.gate_proj", "DenseReluDense.wi_1": "mlp.up_proj", "DenseReluDense.wo": "mlp.down_proj"}
    return {"DenseReluDense.wi": "mlp.up_proj", "DenseReluDense.wo": "mlp.down_proj"}


def key_map(*, gated: bool, tied_head: bool) -> KeyMap:
    """Official T5 names <-> hf_tiny names. {i}: encoder block, {j}: decoder block (layer.0 self-attention,
    decoder layer.1 cross-attention, last layer the feed-forward)."""
    weight = ("weight",)
    rules: list = []
    encoder = "encoder.block.{i}.layer"
    decoder = "decoder.block.{j}.layer"
    ours_encoder = "model.encoder.layers.{i}"
    ours_decoder = "model.decoder.layers.{j}"
    for source, target, ff_index in ((encoder, ours_encoder, 1), (decoder, ours_decoder, 2)):
        modules = {f"0.SelfAttention.{s}": f"self_attn.{t}" for s, t in ATTENTION.items()}
        modules["0.layer_norm"] = "input_layernorm"
        modules.update({f"{ff_index}.{s}": t for s, t in _feed_forward(gated).items()})
        modules[f"{ff_index}.layer_norm"] = "post_attention_layernorm"
        if source == decoder:
            modules.update({f"1.EncDecAttention.{s}": f"cross_attn.{t}" for s, t in ATTENTION.items()})
            modules["1.layer_norm"] = "cross_attn_layernorm"
        rules += layer_rules(source, target, modules, params=weight)
    for stack in ("encoder", "decoder"):
        rules.append(
            (f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", f"model.{stack}.relative_attention_bias.weight")
        )
        rules.append((f"{stack}.final_layer_norm.weight", f"model.{stack}.norm.weight"))
    shared = ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")
    if tied_head:
        rules.append(Rule("shared.weight", shared + ("lm_head.weight",)))
    else:
        rules.append(Rule("shared.weight", shared))
        rules.append(("lm_head.weight", "lm_head.weight"))
    # Old checkpoints carry a cross-attention bias table that T5 never uses (transformers ignores it too).
    ignore = [r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight"]
    return KeyMap(rules, ignore=ignore)


def config_from_official(official, *, src, tied_head: bool):
    """TinySeq2SeqConfig equivalent to an official T5 config."""
    dropout = float(official.dropout_rate)
    start = getattr(official, "decoder_start_token_id", None)
    return styled_config(
        "t5",
        src,
        **{ours: getattr(official, name) for name, ours in CONFIG_FIELDS.items()},
        hidden_act=official.dense_act_fn,
        max_position_embeddings=512,  # T5 has no position table; kept for tools that read the field
        initializer_range=float(official.initializer_factor) * official.d_model**-0.5,
        attention_dropout=dropout,
        hidden_dropout=dropout,
        activation_dropout=dropout,
        mlp_gated=bool(official.is_gated_act),
        tie_word_embeddings=tied_head,
        scale_decoder_outputs=bool(official.scale_decoder_outputs),
        bos_token_id=None,
        # T5 starts decoding with the pad token
        decoder_start_token_id=start if start is not None else official.pad_token_id,
    )


def official_config_from_ours(config, *, src):
    from transformers import T5Config

    require_style(config, "t5", src, num_key_value_heads=config.num_attention_heads, decoder_inputs_from_input_ids=False)
    act = config.hidden_act
    if config.mlp_gated:
        if act != "gelu_new":
            feed_forward = f"gated-{act}"
        else:
            feed_forward = "gated-gelu"  # T5Config maps gated-gelu to gelu_new
    else:
        feed_forward = act
    official = T5Config(
        **{name: getattr(config, ours) for name, ours in CONFIG_FIELDS.items()},
        dropout_rate=config.hidden_dropout,
        # the factor initializer_range was read from (its float product rounded back: 1.5 stays 1.5)
        initializer_factor=round(config.initializer_range * config.hidden_size**0.5, 12),
        feed_forward_proj=feed_forward,
        decoder_start_token_id=config.decoder_start_token_id,
        # T5Config turns this into scale_decoder_outputs; the head's tying follows the stored tensors
        tie_word_embeddings=config.scale_decoder_outputs,
        architectures=["T5ForConditionalGeneration"],
    )
    if official.dense_act_fn != act:
        raise ConversionError(f"{src}: hidden_act={act!r} with mlp_gated={config.mlp_gated} has no T5 feed_forward_proj")
    return official


RELATIVE_BIAS_NOTE = (
    "`flash_attention_2` cannot run this model: T5's relative position bias is an additive attention bias, which "
    "flash kernels do not take (the model raises a clear error)."
)


class T5Family(Seq2SeqFamily):
    name = "t5"
    model_types = ("t5",)
    tags = ("t5", "seq2seq")
    parity_backends = ("eager", "sdpa")  # see RELATIVE_BIAS_NOTE

    def plan(self, source: Source) -> Plan:
        src, state = source.path, source.state
        official = official_config(source.raw_config, src=src)
        tied_head = stores_tied_copy(state, "shared.weight", "lm_head.weight")
        copies = ["encoder.embed_tokens.weight", "decoder.embed_tokens.weight"] + (["lm_head.weight"] if tied_head else [])
        state = drop_tied_copies(state, "shared.weight", copies, src=src)
        if "shared.weight" not in state:
            raise ConversionError(f"{src}: missing tensor shared.weight")
        config = config_from_official(official, src=src, tied_head=tied_head)
        version = "v1.1 layout (gated-GELU, untied head)" if config.mlp_gated else "v1.0 layout"
        source.description = f"the official T5 checkpoint `{source_name(src)}` ({version})"
        return Plan(config, "TinySeq2SeqForConditionalGeneration", "T5ForConditionalGeneration",
                    key_map(gated=config.mlp_gated, tied_head=tied_head), stack_depths(config), state,
                    official_config=official, notes=[RELATIVE_BIAS_NOTE])

    def reverse(self, config, our_class: str, src: Path) -> ReversePlan:
        return ReversePlan("T5ForConditionalGeneration", official_config_from_ours(config, src=src),
                           key_map(gated=config.mlp_gated, tied_head=config.tie_word_embeddings), stack_depths(config))


FAMILY = T5Family()
convert, convert_back = entry_points(FAMILY)
