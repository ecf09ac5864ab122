"""Warm-start an hf_tiny seq2seq model from one BERT checkpoint (bert2bert), as transformers' EncoderDecoderModel does.

    python -m conversion bert2seq SRC DST

What transformers' `EncoderDecoderModel.from_encoder_decoder_pretrained(SRC, SRC)` builds, and so what this
produces: the encoder is SRC's BertModel; the decoder is SRC's BERT loaded as BertLMHeadModel with
is_decoder=True and add_cross_attention=True, i.e. the same weights (its own copy: encoder and decoder
embeddings are separate tables) plus newly initialized cross-attention (normal(0, initializer_range) weights,
zero biases, LayerNorm 1/0) and, when SRC has no MLM head, a newly initialized LM-head transform; the LM head
is tied to the decoder's word embeddings. The new weights are drawn by transformers itself (seeded): this
converter builds that official model and maps its tensors, so the output equals the official warm start.

In hf_tiny terms: post-LN, learned absolute positions without offset, token-type embedding (type 0 added),
embedding LayerNorm, GELU, separate encoder/decoder embeddings, BERT's LM-head transform and bias.
The encoder's pooler is unused by a seq2seq model and dropped. decoder_start_token_id / bos = [CLS] and
eos = [SEP] of SRC's tokenizer (the usual bert2bert recipe). There is no reverse direction.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from . import bert as bert_conversion
from .errors import ConversionError
from .keymap import KeyMap, Rule, check_shapes, expected_shapes, layer_rules
from .pipeline import Plan, Source
from .pipeline import convert as run_conversion
from .readers import official_config, source_name
from .seq2seq_common import Seq2SeqFamily, stack_depths, styled_config
from .writer import drop_tied_copies, stores_tied_copy

# A BERT layer maps onto an hf_tiny seq2seq layer exactly as onto an hf_tiny encoder layer.
BERT_LAYER = bert_conversion.LAYER_MODULES
BERT_CROSS = {
    "crossattention.self.query": "cross_attn.q_proj",
    "crossattention.self.key": "cross_attn.k_proj",
    "crossattention.self.value": "cross_attn.v_proj",
    "crossattention.output.dense": "cross_attn.o_proj",
    "crossattention.output.LayerNorm": "cross_attn_layernorm",
}
HEAD = {"cls.predictions.transform.dense": "lm_head_transform.dense", "cls.predictions.transform.LayerNorm": "lm_head_transform.norm"}


def key_map(*, tied_head: bool) -> KeyMap:
    """EncoderDecoderModel(BertModel, BertLMHeadModel) names -> hf_tiny names. {i}: encoder, {j}: decoder layer."""
    rules: list = []
    for source, target in (("encoder.", "model.encoder."), ("decoder.bert.", "model.decoder.")):
        rules.append((f"{source}embeddings.position_embeddings.weight", f"{target}embed_positions.weight"))
        rules.append((f"{source}embeddings.token_type_embeddings.weight", f"{target}token_type_embeddings.weight"))
        rules += layer_rules(f"{source}embeddings", target.rstrip("."), {"LayerNorm": "embedding_norm"})
    rules.append(Rule("encoder.embeddings.word_embeddings.weight", ("model.shared.weight", "model.encoder.embed_tokens.weight")))
    decoder_words = ("model.decoder.embed_tokens.weight",) + (("lm_head.weight",) if tied_head else ())
    rules.append(Rule("decoder.bert.embeddings.word_embeddings.weight", decoder_words))
    if not tied_head:
        rules.append(("decoder.cls.predictions.decoder.weight", "lm_head.weight"))
    rules += layer_rules("encoder.encoder.layer.{i}", "model.encoder.layers.{i}", BERT_LAYER)
    rules += layer_rules("decoder.bert.encoder.layer.{j}", "model.decoder.layers.{j}", {**BERT_LAYER, **BERT_CROSS})
    rules += [(f"decoder.{s}.{p}", f"{t}.{p}") for s, t in HEAD.items() for p in ("weight", "bias")]
    rules.append(("decoder.cls.predictions.bias", "lm_head.bias"))
    ignore = [r"encoder\.pooler\.dense\.(weight|bias)", r".*embeddings\.(position_ids|token_type_ids)"]
    return KeyMap(rules, ignore=ignore)


def special_token_ids(src: Path, bert_config) -> dict:
    """[CLS] starts decoding (and is bos), [SEP] ends it, [PAD] pads: read from SRC's tokenizer when it loads."""
    ids = {"pad_token_id": bert_config.pad_token_id, "bos_token_id": None, "eos_token_id": None, "decoder_start_token_id": None}
    if not any((src / name).is_file() for name in ("tokenizer.json", "vocab.txt")):
        # (transformers would build an empty placeholder tokenizer whose ids mean nothing)
        return ids
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(src))
    except Exception:  # no usable tokenizer files: ids stay unset, generate() then asks for them
        return ids
    for field, value in (
        ("pad_token_id", tokenizer.pad_token_id),
        ("bos_token_id", tokenizer.cls_token_id),
        ("eos_token_id", tokenizer.sep_token_id),
        ("decoder_start_token_id", tokenizer.cls_token_id),
    ):
        if value is not None and 0 <= value < bert_config.vocab_size:
            ids[field] = value
    return ids


def config_from_bert(bert, *, src, tied_head: bool, token_ids: dict):
    position_type = getattr(bert, "position_embedding_type", None) or "absolute"
    if position_type != "absolute":
        raise ConversionError(f"{src}: position_embedding_type={position_type!r} is not supported (only 'absolute')")
    return styled_config(
        "bert2seq",
        src,
        vocab_size=bert.vocab_size,
        hidden_size=bert.hidden_size,
        num_attention_heads=bert.num_attention_heads,
        intermediate_size=bert.intermediate_size,
        num_hidden_layers=bert.num_hidden_layers,
        num_decoder_layers=bert.num_hidden_layers,
        hidden_act=bert.hidden_act,
        max_position_embeddings=bert.max_position_embeddings,
        layer_norm_eps=bert.layer_norm_eps,
        initializer_range=bert.initializer_range,
        attention_dropout=float(bert.attention_probs_dropout_prob),
        hidden_dropout=float(bert.hidden_dropout_prob),
        activation_dropout=0.0,
        type_vocab_size=bert.type_vocab_size,
        use_padding_idx=bert.pad_token_id is not None,
        tie_word_embeddings=tied_head,
        **token_ids,
    )


@contextlib.contextmanager
def _quiet_transformers():
    """from_encoder_decoder_pretrained reports every newly initialized tensor; that is the point here."""
    from transformers.utils import logging

    previous = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(previous)


def official_warm_start(src: Path, *, seed: int):
    """transformers' own bert2bert warm start of SRC (fp32, eval mode), new weights drawn after manual_seed(seed)."""
    from transformers import EncoderDecoderModel

    torch.manual_seed(seed)
    with _quiet_transformers():
        model = EncoderDecoderModel.from_encoder_decoder_pretrained(str(src), str(src), dtype=torch.float32)
    return model.eval()


def check_source_weights(source: Source) -> None:
    """Reads SRC as strictly as `python -m conversion bert` does. transformers' warm start alone would re-initialize
    a missing BERT tensor and skip an unknown one without an error, and reports damaged files in its own terms."""
    plan = bert_conversion.FAMILY.plan(source)
    mapped = plan.key_map.to_target(plan.state, num_layers=plan.num_layers)
    with torch.device("meta"):
        body = bert_conversion.FAMILY.hf_tiny_class(plan.our_class)(plan.config)
    check_shapes(mapped, expected_shapes(body))


DECODER_WORDS = "decoder.bert.embeddings.word_embeddings.weight"


class Bert2SeqFamily(Seq2SeqFamily):
    name = "bert2seq"
    model_types = ("bert",)
    tags = ("bert", "bert2bert", "seq2seq")
    reversible = False
    detected = False  # a BERT folder converts with `bert` unless bert2seq is asked for by name
    keep_source_generation_config = False  # a BERT folder's generation_config.json would be for another model
    seed = 0

    def read(self, src: Path) -> Source:
        source = super().read(src)
        check_source_weights(source)
        source.official = official_warm_start(source.folder, seed=self.seed)
        source.state = {k: v.detach().clone() for k, v in source.official.state_dict().items()}
        source.kind = "warm start"
        source.description = (
            f"an encoder-decoder warm-started from the BERT checkpoint `{source_name(src)}`, as transformers' "
            "`EncoderDecoderModel.from_encoder_decoder_pretrained` does: encoder and decoder carry the BERT weights, "
            "cross-attention (and the LM-head transform, when the checkpoint has none) is newly initialized "
            f"(seed {self.seed}). Fine-tune it before use"
        )
        return source

    def plan(self, source: Source) -> Plan:
        state, src = source.state, source.path
        tied_head = stores_tied_copy(state, DECODER_WORDS, "decoder.cls.predictions.decoder.weight")
        state = drop_tied_copies(state, DECODER_WORDS, ["decoder.cls.predictions.decoder.weight"] if tied_head else [], src=src)
        # BertLMPredictionHead ties decoder.bias to predictions.bias
        state = drop_tied_copies(state, "decoder.cls.predictions.bias", ["decoder.cls.predictions.decoder.bias"], src=src)
        bert = official_config(source.raw_config, src=src)
        config = config_from_bert(bert, src=src, tied_head=tied_head, token_ids=special_token_ids(source.folder, bert))
        note = ("Parity reference: `EncoderDecoderModel.from_encoder_decoder_pretrained(SRC, SRC)` built with the "
                "same seed, whose newly initialized tensors are the ones stored here.")
        return Plan(config, "TinySeq2SeqForConditionalGeneration", "EncoderDecoderModel", key_map(tied_head=tied_head),
                    stack_depths(config), state, notes=[note])


FAMILY = Bert2SeqFamily()


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, force=False, dtype=None, seed: int = 0, base_model=None) -> dict:
    """One BERT folder -> hf_tiny seq2seq folder warm-started like EncoderDecoderModel (seeded); see
    conversion.pipeline.convert for what it returns. There is no reverse direction."""
    family = Bert2SeqFamily()
    family.seed = seed
    return run_conversion(family, src, dst, force=force, dtype=dtype, base_model=base_model)
