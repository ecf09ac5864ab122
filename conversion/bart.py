"""BART (and Marian, which shares BART's layout) <-> hf_tiny seq2seq.

    python -m conversion bart SRC DST              official BartForConditionalGeneration / MarianMTModel -> hf_tiny
    python -m conversion bart SRC DST --reverse    hf_tiny seq2seq folder -> official BART (or Marian) folder

BART: post-LN, learned positions with an offset of 2, layernorm_embedding, biases, final_logits_bias.
Marian: the same layers, but fixed sinusoidal positions (not stored), sqrt(d) embedding scale, no embedding norm.
Every tensor maps 1:1 (no reshaping); the embeddings are one `shared` table that the encoder, the decoder and
(tied) the LM head reuse.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import ConversionError
from .keymap import KeyMap, Rule, layer_rules
from .lazy import LazyTensors, TensorInfo
from .pipeline import Plan, ReversePlan, Source, entry_points
from .readers import official_config, source_name
from .seq2seq_common import SAME_LABEL_FIELDS, Seq2SeqFamily, require_style, stack_depths, styled_config
from .writer import drop_tied_copies, stores_tied_copy

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


# BART / Marian config field <-> TinySeq2SeqConfig field (both directions; the style fixes the rest).
CONFIG_FIELDS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "encoder_attention_heads": "num_attention_heads",
    "decoder_attention_heads": "decoder_attention_heads",
    "encoder_ffn_dim": "intermediate_size",
    "decoder_ffn_dim": "decoder_intermediate_size",
    "encoder_layers": "num_hidden_layers",
    "decoder_layers": "num_decoder_layers",
    "activation_function": "hidden_act",
    "max_position_embeddings": "max_position_embeddings",
    "init_std": "initializer_range",
    "dropout": "hidden_dropout",
    "attention_dropout": "attention_dropout",
    "activation_dropout": "activation_dropout",
    "scale_embedding": "scale_embedding",
    "pad_token_id": "pad_token_id",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "decoder_start_token_id": "decoder_start_token_id",
    **SAME_LABEL_FIELDS,
}


def config_from_official(official, *, src, tied_head: bool):
    """TinySeq2SeqConfig equivalent to an official BART / Marian config; what we cannot express is an error."""
    marian = official.model_type == "marian"
    if marian and official.decoder_vocab_size != official.vocab_size:
        raise ConversionError(
            f"{src}: decoder_vocab_size={official.decoder_vocab_size} differs from vocab_size={official.vocab_size}; "
            "hf_tiny seq2seq uses one vocabulary"
        )
    for field in ("encoder_layerdrop", "decoder_layerdrop"):
        if getattr(official, field, 0.0):  # official skips whole layers at random in training; hf_tiny has no such step
            raise ConversionError(f"{src}: {field}={getattr(official, field)} is not supported (hf_tiny seq2seq layers "
                                  "never skip in training); set it to 0.0")
    values = {ours: getattr(official, theirs, None) for theirs, ours in CONFIG_FIELDS.items()}
    shared = bool(getattr(official, "share_encoder_decoder_embeddings", True))
    return styled_config("marian" if marian else "bart", src, **values, share_encoder_decoder_embeddings=shared,
                         tie_word_embeddings=tied_head, decoder_inputs_from_input_ids=not marian)


def official_config_from_ours(config, *, src, model_type: str):
    from transformers import BartConfig, MarianConfig

    for stack in (False, True):  # BART's head width is d_model // heads and it has no grouped-query attention
        heads = config.decoder_attention_heads if stack else config.num_attention_heads
        require_style(config, model_type, src, **{
            f"{'decoder_' if stack else ''}head_dim": config.hidden_size // heads,
            "num_key_value_heads": config.num_attention_heads,
            # official BART shifts input_ids into missing decoder inputs, Marian refuses (a folder of either converts
            # to BART; to Marian only one that refuses too)
            **({} if model_type == "bart" else {"decoder_inputs_from_input_ids": False}),
        })
    values = {theirs: getattr(config, ours) for theirs, ours in CONFIG_FIELDS.items()}
    values.update(tie_word_embeddings=config.tie_word_embeddings, architectures=[OFFICIAL_CLASSES[model_type]])
    if model_type == "bart":
        return BartConfig(**values)
    return MarianConfig(**values, share_encoder_decoder_embeddings=config.share_encoder_decoder_embeddings)


def _normalise_source(state: dict, *, src, shared: bool, tied_head: bool) -> dict:
    """Drops stored copies of tied tables (after checking them) and fills BART's optional final_logits_bias."""
    canonical = "model.shared.weight" if shared else "model.decoder.embed_tokens.weight"
    copies = ["model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"] if shared else []
    state = drop_tied_copies(state, canonical, copies + (["lm_head.weight"] if tied_head else []), src=src)
    if canonical not in state:
        raise ConversionError(f"{src}: missing tensor {canonical}")
    if "final_logits_bias" not in state:
        # optional in BART checkpoints (the official class zero-fills it when missing)
        vocab = state.info(canonical).shape[0]
        state = state.with_tensors({"final_logits_bias": (TensorInfo((1, vocab), torch.float32),
                                                          lambda: torch.zeros(1, vocab))})
    return state


def _with_model_prefix(state: LazyTensors, *, model_type: str) -> tuple[LazyTensors, list[str]]:
    """A bare BartModel / MarianModel stores its tensors without the `model.` prefix and has no LM head: read as
    the ForConditionalGeneration class reads it (transformers' AutoModelForSeq2SeqLM does the same), with the head
    tied to the embeddings and a zero final_logits_bias."""
    if any(key.startswith("model.") for key in state) or not any(key.startswith(("shared.", "encoder.", "decoder."))
                                                                  for key in state):
        return state, []
    bare = {"bart": "BartModel", "marian": "MarianModel"}[model_type]
    note = (f"The checkpoint is a bare `{bare}` (no `model.` prefix, no LM head): converted as "
            f"`{OFFICIAL_CLASSES[model_type]}` loads it, with the head tied to the embeddings and a zero final_logits_bias")
    return state.renamed(lambda key: "model." + key), [note]


def _check_untied_tables(state: LazyTensors, *, src, official) -> None:
    """With tie_word_embeddings=False transformers 5 keeps BART's model.shared, encoder and decoder tables apart;
    hf_tiny's encoder reads `shared`, so a table that differs from it has nowhere to go."""
    if getattr(official, "tie_word_embeddings", True) or "model.shared.weight" not in state:
        return
    differing = [key for key in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")
                 if not stores_tied_copy(state, "model.shared.weight", key)]
    if differing:
        raise ConversionError(
            f"{src}: tie_word_embeddings=False and {', '.join(differing)} differ from model.shared.weight: this "
            "checkpoint keeps separate embedding tables, which transformers 5 reads apart; hf_tiny's seq2seq model "
            "has one table shared by the encoder and the decoder, so it cannot hold this checkpoint"
        )


class BartFamily(Seq2SeqFamily):
    name = "bart"
    model_types = tuple(OFFICIAL_CLASSES)
    tags = ("seq2seq",)

    def plan(self, source: Source) -> Plan:
        src, state = source.path, source.state
        official = official_config(source.raw_config, src=src)
        model_type = official.model_type
        shared = bool(getattr(official, "share_encoder_decoder_embeddings", True))
        state, notes = _with_model_prefix(LazyTensors.of(state), model_type=model_type)
        if shared:
            _check_untied_tables(state, src=src, official=official)
        tied_head = stores_tied_copy(state, "model.shared.weight" if shared else "model.decoder.embed_tokens.weight",
                                     "lm_head.weight")
        if not tied_head and "lm_head.weight" not in state:
            raise ConversionError(f"{src}: missing tensor lm_head.weight")
        config = config_from_official(official, src=src, tied_head=tied_head)
        state = _normalise_source(state, src=src, shared=shared, tied_head=tied_head)
        mapping = key_map(model_type=model_type, tied_head=tied_head, shared_embeddings=shared)
        source.description = f"the official `{OFFICIAL_CLASSES[model_type]}` checkpoint `{source_name(src)}`"
        return Plan(config, "TinySeq2SeqForConditionalGeneration", OFFICIAL_CLASSES[model_type], mapping,
                    stack_depths(config), state, official_config=official, notes=notes)

    def reverse(self, config, our_class: str, src: Path) -> ReversePlan:
        if config.position_embedding_type == "relative":
            raise ConversionError(f"{src}: position_embedding_type='relative' is T5's layout; use `python -m conversion t5 --reverse`")
        model_type = "marian" if config.position_embedding_type == "sinusoidal" else "bart"
        mapping = key_map(model_type=model_type, tied_head=config.tie_word_embeddings,
                          shared_embeddings=config.share_encoder_decoder_embeddings)
        return ReversePlan(OFFICIAL_CLASSES[model_type], official_config_from_ours(config, src=src, model_type=model_type),
                           mapping, stack_depths(config))

    def finish_official_state(self, state: LazyTensors, config, plan: ReversePlan) -> LazyTensors:
        if plan.official_class == OFFICIAL_CLASSES["bart"] and not config.tie_word_embeddings:
            # transformers unties BART's encoder/decoder tables from `shared` too when tie_word_embeddings=False
            return state.aliased({f"model.{stack}.embed_tokens.weight": "model.shared.weight"
                                  for stack in ("encoder", "decoder")})
        return state


FAMILY = BartFamily()
convert, convert_back = entry_points(FAMILY)
