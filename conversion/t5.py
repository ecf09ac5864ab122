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

import os
from pathlib import Path
from typing import Optional

import torch

from .core import (
    ConversionError,
    KeyMap,
    Rule,
    atomic_output_dir,
    load_checkpoint,
    load_config_json,
    parse_dtype,
    require_model_type,
)
from .seq2seq_common import (
    check_parity_and_write_card,
    drop_tied_copies,
    head_is_tied,
    layer_rules,
    load_our_config,
    our_config,
    read_ours_for_reverse,
    require_equal,
    save_official,
    to_official_names,
    write_ours,
)

ATTENTION = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}


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


def _official_config(src: Path, raw: dict):
    from transformers import T5Config

    fields = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "model_type")}
    try:
        return T5Config(**fields)
    except (TypeError, ValueError) as error:
        raise ConversionError(f"{src}: config.json is not a valid T5 config: {error}") from error


def config_from_official(official, *, src, tied_head: bool):
    """TinySeq2SeqConfig equivalent to an official T5 config."""
    dropout = float(official.dropout_rate)
    start = getattr(official, "decoder_start_token_id", None)
    return our_config(
        src,
        vocab_size=official.vocab_size,
        hidden_size=official.d_model,
        num_attention_heads=official.num_heads,
        head_dim=official.d_kv,
        intermediate_size=official.d_ff,
        num_hidden_layers=official.num_layers,
        num_decoder_layers=official.num_decoder_layers,
        hidden_act=official.dense_act_fn,
        max_position_embeddings=512,  # T5 has no position table; kept for tools that read the field
        layer_norm_eps=official.layer_norm_epsilon,
        initializer_range=float(official.initializer_factor) * official.d_model**-0.5,
        attention_dropout=dropout,
        hidden_dropout=dropout,
        activation_dropout=dropout,
        norm_placement="pre",
        norm_type="rmsnorm",
        position_embedding_type="relative",
        relative_attention_num_buckets=official.relative_attention_num_buckets,
        relative_attention_max_distance=official.relative_attention_max_distance,
        mlp_gated=bool(official.is_gated_act),
        mlp_bias=False,
        attention_bias=False,
        attention_scale=1.0,
        embedding_norm=False,
        final_norm=True,
        use_padding_idx=False,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=tied_head,
        scale_decoder_outputs=bool(official.scale_decoder_outputs),
        final_logits_bias=False,
        pad_token_id=official.pad_token_id,
        bos_token_id=None,
        eos_token_id=official.eos_token_id,
        # T5 starts decoding with the pad token
        decoder_start_token_id=start if start is not None else official.pad_token_id,
    )


def official_config_from_ours(config, *, src, dtype: torch.dtype):
    from transformers import T5Config

    require_equal(
        config,
        src,
        norm_placement="pre",
        norm_type="rmsnorm",
        position_embedding_type="relative",
        type_vocab_size=0,
        mlp_bias=False,
        attention_bias=False,
        attention_scale=1.0,
        embedding_norm=False,
        final_norm=True,
        scale_embedding=False,
        use_padding_idx=False,
        share_encoder_decoder_embeddings=True,
        lm_head_transform=False,
        lm_head_bias=False,
        final_logits_bias=False,
        num_key_value_heads=config.num_attention_heads,
    )
    act = config.hidden_act
    if config.mlp_gated:
        if act != "gelu_new":
            feed_forward = f"gated-{act}"
        else:
            feed_forward = "gated-gelu"  # T5Config maps gated-gelu to gelu_new
    else:
        feed_forward = act
    official = T5Config(
        vocab_size=config.vocab_size,
        d_model=config.hidden_size,
        d_kv=config.head_dim,
        d_ff=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_decoder_layers=config.num_decoder_layers,
        num_heads=config.num_attention_heads,
        relative_attention_num_buckets=config.relative_attention_num_buckets,
        relative_attention_max_distance=config.relative_attention_max_distance,
        dropout_rate=config.hidden_dropout,
        layer_norm_epsilon=config.layer_norm_eps,
        feed_forward_proj=feed_forward,
        pad_token_id=config.pad_token_id,
        eos_token_id=config.eos_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
        # T5Config turns this into scale_decoder_outputs; the head's tying follows the stored tensors
        tie_word_embeddings=config.scale_decoder_outputs,
        architectures=["T5ForConditionalGeneration"],
        dtype=str(dtype).removeprefix("torch."),
    )
    if official.dense_act_fn != act:
        raise ConversionError(f"{src}: hidden_act={act!r} with mlp_gated={config.mlp_gated} has no T5 feed_forward_proj")
    return official


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    force: bool = False,
    dtype: Optional[torch.dtype | str] = None,
    base_model: Optional[str] = None,
) -> dict:
    """Official T5 folder -> hf_tiny seq2seq folder (atomic). Returns {"dst", "parity", "parity_inputs"}."""
    from transformers import T5ForConditionalGeneration

    src, dst = Path(src), Path(dst)
    dtype = parse_dtype(dtype)
    raw = load_config_json(src)
    require_model_type(raw, "t5", src=src)
    official_config = _official_config(src, raw)

    with atomic_output_dir(dst, force=force) as tmp:
        state = load_checkpoint(src)
        tied_head = head_is_tied(state, "shared.weight")
        copies = ["encoder.embed_tokens.weight", "decoder.embed_tokens.weight"] + (["lm_head.weight"] if tied_head else [])
        state = drop_tied_copies(state, "shared.weight", copies, src=src)
        config = config_from_official(official_config, src=src, tied_head=tied_head)
        mapping = key_map(gated=config.mlp_gated, tied_head=tied_head)
        write_ours(tmp, src, config, mapping, state, dtype=dtype, official_config=official_config)
        version = "v1.1 layout (gated-GELU, untied head)" if config.mlp_gated else "v1.0 layout"
        rows, inputs = check_parity_and_write_card(
            tmp,
            dst,
            official=T5ForConditionalGeneration.from_pretrained(str(src), dtype=torch.float32),
            config=config,
            dtype=dtype,
            # flash kernels take no additive bias: T5's relative position bias needs eager or sdpa
            flash_ok=False,
            what="T5ForConditionalGeneration",
            base_model=base_model or raw.get("_name_or_path") or src.resolve().name,
            description=f"A T5 checkpoint ({version}) converted to `TinySeq2SeqForConditionalGeneration`.",
            tags=["t5", "seq2seq"],
            extra="\n`flash_attention_2` cannot run this model: T5's relative position bias is an additive attention "
            "bias, which flash kernels do not take (the model raises a clear error).\n",
        )
    return {"dst": dst, "parity": rows, "parity_inputs": inputs}


def convert_back(src: str | os.PathLike, dst: str | os.PathLike, *, force: bool = False) -> dict:
    """hf_tiny seq2seq folder (T5 layout) -> official T5 folder, loadable by T5ForConditionalGeneration with no
    missing or unexpected keys. Returns {"dst"}."""
    from transformers import T5ForConditionalGeneration

    src, dst = Path(src), Path(dst)
    config = load_our_config(src)
    with atomic_output_dir(dst, force=force) as tmp:
        state, dtype = read_ours_for_reverse(src, config)
        official_config = official_config_from_ours(config, src=src, dtype=dtype)
        official_state = to_official_names(key_map(gated=config.mlp_gated, tied_head=config.tie_word_embeddings), state, config)
        save_official(T5ForConditionalGeneration, official_config, official_state, tmp, src)
    return {"dst": dst}


__all__ = ["convert", "convert_back", "key_map", "config_from_official", "official_config_from_ours"]
