"""BART (and Marian, which shares BART's layout) <-> hf_tiny seq2seq.

    python -m conversion bart SRC DST              official BartForConditionalGeneration / MarianMTModel -> hf_tiny
    python -m conversion bart SRC DST --reverse    hf_tiny seq2seq folder -> official BART (or Marian) folder

BART: post-LN, learned positions with an offset of 2, layernorm_embedding, biases, final_logits_bias.
Marian: the same layers, but fixed sinusoidal positions (not stored), sqrt(d) embedding scale, no embedding norm.
Every tensor maps 1:1 (no reshaping); the embeddings are one `shared` table that the encoder, the decoder and
(tied) the LM head reuse.
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

OFFICIAL_CLASSES = {"bart": "BartForConditionalGeneration", "marian": "MarianMTModel"}

ATTENTION = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "out_proj": "o_proj"}
SELF_ATTENTION = {f"self_attn.{s}": f"self_attn.{t}" for s, t in ATTENTION.items()}
CROSS_ATTENTION = {f"encoder_attn.{s}": f"cross_attn.{t}" for s, t in ATTENTION.items()}
FEED_FORWARD = {
    "self_attn_layer_norm": "input_layernorm",
    "fc1": "mlp.up_proj",
    "fc2": "mlp.down_proj",
    "final_layer_norm": "post_attention_layernorm",
}
DECODER_ONLY = {**CROSS_ATTENTION, "encoder_attn_layer_norm": "cross_attn_layernorm"}


def key_map(*, model_type: str, tied_head: bool, shared_embeddings: bool) -> KeyMap:
    """Official BART/Marian names <-> hf_tiny names. {i}: encoder layer, {j}: decoder layer."""
    rules: list = []
    rules += layer_rules("model.encoder.layers.{i}", "model.encoder.layers.{i}", {**SELF_ATTENTION, **FEED_FORWARD})
    rules += layer_rules(
        "model.decoder.layers.{j}", "model.decoder.layers.{j}", {**SELF_ATTENTION, **FEED_FORWARD, **DECODER_ONLY}
    )
    ours_shared = ("model.shared.weight", "model.encoder.embed_tokens.weight")
    head = ("lm_head.weight",) if tied_head else ()
    if shared_embeddings:
        rules.append(Rule("model.shared.weight", ours_shared + ("model.decoder.embed_tokens.weight",) + head))
    else:  # Marian with separate vocabularies: no `shared` table upstream
        rules.append(Rule("model.encoder.embed_tokens.weight", ours_shared))
        rules.append(Rule("model.decoder.embed_tokens.weight", ("model.decoder.embed_tokens.weight",) + head))
    if not tied_head:
        rules.append(("lm_head.weight", "lm_head.weight"))
    rules.append(("final_logits_bias", "final_logits_bias"))
    ignore = [r"model\.(encoder|decoder)\.version"]
    if model_type == "bart":
        for stack in ("encoder", "decoder"):
            rules.append((f"model.{stack}.embed_positions.weight", f"model.{stack}.embed_positions.weight"))
            rules += layer_rules(f"model.{stack}", f"model.{stack}", {"layernorm_embedding": "embedding_norm"})
    else:  # sinusoidal tables are recomputed by both sides; older Marian checkpoints store them anyway
        ignore.append(r"model\.(encoder|decoder)\.embed_positions\.weight")
    return KeyMap(rules, ignore=ignore)


def _official_config(src: Path, raw: dict):
    from transformers import AutoConfig

    fields = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map")}
    try:
        return AutoConfig.for_model(**fields)
    except (TypeError, ValueError) as error:
        raise ConversionError(f"{src}: config.json is not a valid {raw.get('model_type')} config: {error}") from error


def config_from_official(official, *, src, tied_head: bool):
    """TinySeq2SeqConfig equivalent to an official BART / Marian config; what we cannot express is an error."""
    for ours_name, pair in (
        ("num_attention_heads", ("encoder_attention_heads", "decoder_attention_heads")),
        ("intermediate_size", ("encoder_ffn_dim", "decoder_ffn_dim")),
    ):
        first, second = (getattr(official, name) for name in pair)
        if first != second:
            raise ConversionError(
                f"{src}: {pair[0]}={first} differs from {pair[1]}={second}; hf_tiny seq2seq uses one "
                f"{ours_name} for both stacks"
            )
    marian = official.model_type == "marian"
    shared = bool(getattr(official, "share_encoder_decoder_embeddings", True))
    if marian and official.decoder_vocab_size != official.vocab_size:
        raise ConversionError(
            f"{src}: decoder_vocab_size={official.decoder_vocab_size} differs from vocab_size={official.vocab_size}; "
            "hf_tiny seq2seq uses one vocabulary"
        )
    return our_config(
        src,
        vocab_size=official.vocab_size,
        hidden_size=official.d_model,
        num_attention_heads=official.encoder_attention_heads,
        intermediate_size=official.encoder_ffn_dim,
        num_hidden_layers=official.encoder_layers,
        num_decoder_layers=official.decoder_layers,
        hidden_act=official.activation_function,
        max_position_embeddings=official.max_position_embeddings,
        layer_norm_eps=1e-5,  # BART and Marian use nn.LayerNorm's default
        initializer_range=official.init_std,
        attention_dropout=float(official.attention_dropout),
        hidden_dropout=float(official.dropout),
        activation_dropout=float(official.activation_dropout),
        norm_placement="post",
        norm_type="layernorm",
        position_embedding_type="sinusoidal" if marian else "learned",
        position_offset=0 if marian else 2,
        mlp_bias=True,
        attention_bias=True,
        scale_embedding=bool(official.scale_embedding),
        embedding_norm=not marian,
        final_norm=False,
        use_padding_idx=True,
        share_encoder_decoder_embeddings=shared,
        tie_word_embeddings=tied_head,
        final_logits_bias=True,
        pad_token_id=official.pad_token_id,
        bos_token_id=getattr(official, "bos_token_id", None),
        eos_token_id=official.eos_token_id,
        decoder_start_token_id=official.decoder_start_token_id,
    )


def official_config_from_ours(config, *, src, model_type: str, dtype: torch.dtype):
    from transformers import BartConfig, MarianConfig

    require_equal(
        config,
        src,
        norm_placement="post",
        norm_type="layernorm",
        type_vocab_size=0,
        mlp_gated=False,
        mlp_bias=True,
        attention_bias=True,
        attention_scale=None,
        final_norm=False,
        use_padding_idx=True,
        scale_decoder_outputs=False,
        lm_head_transform=False,
        lm_head_bias=False,
        final_logits_bias=True,
        num_key_value_heads=config.num_attention_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        layer_norm_eps=1e-5,
    )
    common = dict(
        vocab_size=config.vocab_size,
        d_model=config.hidden_size,
        encoder_layers=config.num_hidden_layers,
        decoder_layers=config.num_decoder_layers,
        encoder_attention_heads=config.num_attention_heads,
        decoder_attention_heads=config.num_attention_heads,
        encoder_ffn_dim=config.intermediate_size,
        decoder_ffn_dim=config.intermediate_size,
        activation_function=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        init_std=config.initializer_range,
        dropout=config.hidden_dropout,
        attention_dropout=config.attention_dropout,
        activation_dropout=config.activation_dropout,
        scale_embedding=config.scale_embedding,
        pad_token_id=config.pad_token_id,
        eos_token_id=config.eos_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
        tie_word_embeddings=config.tie_word_embeddings,
        dtype=str(dtype).removeprefix("torch."),
    )
    if model_type == "bart":
        require_equal(config, src, position_embedding_type="learned", position_offset=2, embedding_norm=True,
                      share_encoder_decoder_embeddings=True)
        return BartConfig(**common, bos_token_id=config.bos_token_id, architectures=["BartForConditionalGeneration"])
    require_equal(config, src, position_offset=0, embedding_norm=False)
    return MarianConfig(
        **common,
        bos_token_id=config.bos_token_id,
        share_encoder_decoder_embeddings=config.share_encoder_decoder_embeddings,
        architectures=["MarianMTModel"],
    )


def _official_class(model_type: str):
    import transformers

    return getattr(transformers, OFFICIAL_CLASSES[model_type])


def _normalise_source(state: dict, *, src, shared: bool, tied_head: bool) -> dict:
    """Drops stored copies of tied tables (after checking them) and fills BART's optional final_logits_bias."""
    if shared:
        copies = ["model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"]
        if tied_head:
            copies.append("lm_head.weight")
        state = drop_tied_copies(state, "model.shared.weight", copies, src=src)
    elif tied_head:
        state = drop_tied_copies(state, "model.decoder.embed_tokens.weight", ["lm_head.weight"], src=src)
    if "final_logits_bias" not in state:
        # optional in BART checkpoints (the official class zero-fills it when missing)
        vocab = (state.get("model.shared.weight") if shared else state["model.decoder.embed_tokens.weight"]).shape[0]
        state["final_logits_bias"] = torch.zeros(1, vocab)
    return state


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    force: bool = False,
    dtype: Optional[torch.dtype | str] = None,
    base_model: Optional[str] = None,
) -> dict:
    """Official BART / Marian folder -> hf_tiny seq2seq folder (atomic: DST appears complete or not at all).

    Returns {"dst", "model_type", "parity" (rows measured now), "parity_inputs"}."""
    src, dst = Path(src), Path(dst)
    dtype = parse_dtype(dtype)
    raw = load_config_json(src)
    model_type = require_model_type(raw, tuple(OFFICIAL_CLASSES), src=src)
    official_config = _official_config(src, raw)
    shared = bool(getattr(official_config, "share_encoder_decoder_embeddings", True))

    with atomic_output_dir(dst, force=force) as tmp:
        state = load_checkpoint(src)
        embedding_key = "model.shared.weight" if shared else "model.decoder.embed_tokens.weight"
        tied_head = head_is_tied(state, embedding_key)
        if not tied_head and "lm_head.weight" not in state:
            raise ConversionError(f"{src}: missing tensor lm_head.weight")
        config = config_from_official(official_config, src=src, tied_head=tied_head)
        state = _normalise_source(state, src=src, shared=shared, tied_head=tied_head)
        mapping = key_map(model_type=model_type, tied_head=tied_head, shared_embeddings=shared)
        write_ours(tmp, src, config, mapping, state, dtype=dtype, official_config=official_config)
        rows, inputs = check_parity_and_write_card(
            tmp,
            dst,
            official=_official_class(model_type).from_pretrained(str(src), dtype=torch.float32),
            config=config,
            dtype=dtype,
            flash_ok=True,
            what=OFFICIAL_CLASSES[model_type],
            base_model=base_model or raw.get("_name_or_path") or src.resolve().name,
            description=f"A {model_type.upper() if model_type == 'bart' else 'Marian'} checkpoint "
            f"(`{OFFICIAL_CLASSES[model_type]}`) converted to `TinySeq2SeqForConditionalGeneration`.",
            tags=[model_type, "seq2seq"],
        )
    return {"dst": dst, "model_type": model_type, "parity": rows, "parity_inputs": inputs}


def convert_back(src: str | os.PathLike, dst: str | os.PathLike, *, force: bool = False) -> dict:
    """hf_tiny seq2seq folder -> official BART folder (Marian when the config uses sinusoidal positions), loadable
    by the official class with no missing or unexpected keys. Returns {"dst", "model_type"}."""
    src, dst = Path(src), Path(dst)
    config = load_our_config(src)
    model_type = "marian" if config.position_embedding_type == "sinusoidal" else "bart"
    if config.position_embedding_type == "relative":
        raise ConversionError(f"{src}: position_embedding_type='relative' is T5's layout; use `python -m conversion t5 --reverse`")
    shared = config.share_encoder_decoder_embeddings
    with atomic_output_dir(dst, force=force) as tmp:
        state, dtype = read_ours_for_reverse(src, config)
        official_config = official_config_from_ours(config, src=src, model_type=model_type, dtype=dtype)
        mapping = key_map(model_type=model_type, tied_head=config.tie_word_embeddings, shared_embeddings=shared)
        official_state = to_official_names(mapping, state, config)
        if model_type == "bart" and not config.tie_word_embeddings:
            # transformers unties BART's encoder/decoder tables from `shared` too when tie_word_embeddings=False
            for stack in ("encoder", "decoder"):
                official_state[f"model.{stack}.embed_tokens.weight"] = official_state["model.shared.weight"]
        save_official(_official_class(model_type), official_config, official_state, tmp, src)
    return {"dst": dst, "model_type": model_type}


__all__ = ["convert", "convert_back", "key_map", "config_from_official", "official_config_from_ours"]
