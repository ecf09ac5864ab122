"""BERT (transformers `model_type: bert`) <-> hf_tiny encoder (`model_type: hf_tiny_encoder`).

    python -m conversion [bert] SRC DST              official BERT folder -> hf_tiny folder
    python -m conversion [bert] SRC DST --reverse    hf_tiny encoder folder -> official BERT folder

Head models prefix the encoder with `bert.`; a bare BertModel has no prefix. Every official tensor maps 1:1 to
an hf_tiny tensor (no reshaping); the MLM decoder is tied to the word embeddings unless the config unties it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .errors import ConversionError
from .keymap import KeyMap, Rule, join, layer_rules
from .pipeline import Family, Plan, ReversePlan, Source, entry_points
from .readers import official_config
from .writer import drop_tied_copies

# official class -> (hf_tiny class, Auto class, pipeline tag, has pooler)
ARCHITECTURES = {
    "BertModel": ("TinyEncoderModel", "AutoModel", "feature-extraction", True),
    "BertForMaskedLM": ("TinyEncoderForMaskedLM", "AutoModelForMaskedLM", "fill-mask", False),
    "BertForSequenceClassification": (
        "TinyEncoderForSequenceClassification", "AutoModelForSequenceClassification", "text-classification", True,
    ),
    "BertForTokenClassification": (
        "TinyEncoderForTokenClassification", "AutoModelForTokenClassification", "token-classification", False,
    ),
    "BertForQuestionAnswering": (
        "TinyEncoderForQuestionAnswering", "AutoModelForQuestionAnswering", "question-answering", False,
    ),
}
OFFICIAL_BY_OURS = {ours: official for official, (ours, *_rest) in ARCHITECTURES.items()}

# BERT config field -> TinyEncoderConfig field (label maps and problem_type pass through PretrainedConfig).
CONFIG_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "intermediate_size": "intermediate_size",
    "hidden_act": "hidden_act",
    "hidden_dropout_prob": "hidden_dropout",
    "attention_probs_dropout_prob": "attention_dropout",
    "max_position_embeddings": "max_position_embeddings",
    "type_vocab_size": "type_vocab_size",
    "layer_norm_eps": "layer_norm_eps",
    "initializer_range": "initializer_range",
    "pad_token_id": "pad_token_id",
    "classifier_dropout": "classifier_dropout",
    "tie_word_embeddings": "tie_word_embeddings",
    "id2label": "id2label",
    "label2id": "label2id",
    "problem_type": "problem_type",
}

# Per layer: official name -> hf_tiny name (weight and bias alike). In this post-LN block each norm is named
# by the sub-layer it follows: input_layernorm after attention, post_attention_layernorm after the MLP.
LAYER_MODULES = {
    "attention.self.query": "self_attn.q_proj",
    "attention.self.key": "self_attn.k_proj",
    "attention.self.value": "self_attn.v_proj",
    "attention.output.dense": "self_attn.o_proj",
    "attention.output.LayerNorm": "input_layernorm",
    "intermediate.dense": "mlp.up_proj",
    "output.dense": "mlp.down_proj",
    "output.LayerNorm": "post_attention_layernorm",
}
EMBEDDING_MODULES = {"embeddings.LayerNorm": "embed_norm"}
EMBEDDING_TABLES = {"embeddings.position_embeddings": "embed_positions", "embeddings.token_type_embeddings": "embed_token_types"}
HEAD_MODULES = {
    "BertForMaskedLM": {"cls.predictions.transform.dense": "lm_head.dense", "cls.predictions.transform.LayerNorm": "lm_head.layer_norm"},
    "BertForSequenceClassification": {"classifier": "classifier"},
    "BertForTokenClassification": {"classifier": "classifier"},
    "BertForQuestionAnswering": {"qa_outputs": "qa_outputs"},
}
# Buffers some official checkpoints carry; the model recomputes them.
IGNORED_BUFFERS = (r"(bert\.)?embeddings\.position_ids", r"(bert\.)?embeddings\.token_type_ids")
UNTIED_HINT = "; set tie_word_embeddings=false in config.json if the checkpoint really has an untied decoder"


def key_map(architecture: str, *, tied: bool = True) -> KeyMap:
    """The official <-> hf_tiny key map of one official class."""
    if architecture not in ARCHITECTURES:
        raise ConversionError(f"unsupported BERT architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    source, target = ("", "") if architecture == "BertModel" else ("bert", "model")
    has_pooler = ARCHITECTURES[architecture][3]
    mlm = architecture == "BertForMaskedLM"
    words, embed = join(source, "embeddings.word_embeddings.weight"), join(target, "embed_tokens.weight")
    rules: list = [Rule(words, (embed, "lm_head.decoder.weight")) if mlm and tied else (words, embed)]
    rules += layer_rules(source, target, EMBEDDING_TABLES, params=("weight",))
    rules += layer_rules(source, target, EMBEDDING_MODULES)
    rules += layer_rules(join(source, "encoder.layer.{i}"), join(target, "layers.{i}"), LAYER_MODULES)
    if has_pooler:
        rules += layer_rules(source, target, {"pooler.dense": "pooler.dense"})
    rules += layer_rules("", "", HEAD_MODULES.get(architecture, {}))
    ignore = list(IGNORED_BUFFERS)
    if mlm and tied:  # official BERT ties decoder.bias to predictions.bias; the stored copy is dropped on reading
        rules.append(("cls.predictions.bias", "lm_head.decoder.bias"))
    elif mlm:
        rules += layer_rules("cls.predictions", "lm_head", {"decoder": "decoder"})
        ignore.append(r"cls\.predictions\.bias")  # untied, the official forward reads decoder.bias only
    if not has_pooler:
        ignore.append(r"bert\.pooler\.dense\.(weight|bias)")  # the official class ignores them too
    return KeyMap(rules, ignore=ignore)


def detect_architecture(bert_config: dict, state: dict, *, src) -> str:
    """The official class of a checkpoint: config.json `architectures` when it names a supported class, else
    guessed from the tensor names."""
    named = bert_config.get("architectures") or []
    if named:
        if named[0] not in ARCHITECTURES:
            raise ConversionError(
                f"{src}: architecture {named[0]!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
            )
        return named[0]
    keys = set(state)
    if not any(k.startswith("bert.") for k in keys):
        return "BertModel"
    if any(k.startswith("cls.predictions.") for k in keys):
        return "BertForMaskedLM"
    if "qa_outputs.weight" in keys:
        return "BertForQuestionAnswering"
    if "classifier.weight" in keys:
        return "BertForSequenceClassification" if "bert.pooler.dense.weight" in keys else "BertForTokenClassification"
    raise ConversionError(
        f"{src}: cannot tell which BERT class the checkpoint holds (no `architectures` in config.json and no known "
        "head tensors); add `architectures` to config.json"
    )


def encoder_config_from_bert(bert_config: dict, *, src):
    """TinyEncoderConfig equivalent to an official BERT config.json; unsupported BERT variants are errors."""
    from hf_tiny import TinyEncoderConfig

    bert = official_config({**bert_config, "model_type": "bert"}, src=src)
    position_type = getattr(bert, "position_embedding_type", None) or "absolute"
    if position_type != "absolute":
        raise ConversionError(
            f"{src}: position_embedding_type={position_type!r} is not supported (hf_tiny encoders use learned "
            "absolute positions only)"
        )
    for flag in ("is_decoder", "add_cross_attention"):
        if getattr(bert, flag, False):
            raise ConversionError(f"{src}: {flag}=True (a BERT decoder) is not supported; hf_tiny encoders are bidirectional")
    values = {ours: getattr(bert, official) for official, ours in CONFIG_FIELDS.items()}
    if values["id2label"] is None:
        values.pop("id2label")
        values.pop("label2id")
    try:
        return TinyEncoderConfig(**values)
    except (TypeError, ValueError) as error:
        raise ConversionError(f"{src}: this BERT config has no hf_tiny equivalent: {error}") from error


def bert_config_from_encoder(config, architecture: str):
    from transformers import BertConfig

    values = {official: getattr(config, ours) for official, ours in CONFIG_FIELDS.items()}
    if values["id2label"] is None:
        values.pop("id2label")
        values.pop("label2id")
    return BertConfig(**values, architectures=[architecture], position_embedding_type="absolute")


def mapped_bert(source: Source) -> tuple[str, object, dict]:
    """(official class, hf_tiny config, tensors with stored tied copies dropped) of a BERT source: shared by
    `bert` and `bert2seq`, which reads its source as strictly."""
    architecture = detect_architecture(source.raw_config, source.state, src=source.path)
    config = encoder_config_from_bert(source.raw_config, src=source.path)
    state = source.state
    if architecture == "BertForMaskedLM" and config.tie_word_embeddings:
        state = drop_tied_copies(state, "bert.embeddings.word_embeddings.weight", ["cls.predictions.decoder.weight"],
                                 src=source.path, hint=UNTIED_HINT)
        state = drop_tied_copies(state, "cls.predictions.bias", ["cls.predictions.decoder.bias"], src=source.path)
    return architecture, config, state


class BertFamily(Family):
    name = "bert"
    model_types = ("bert",)
    config_class = "TinyEncoderConfig"
    classes = {ours: (auto, tag) for ours, auto, tag, _ in ARCHITECTURES.values()}
    default_class = "TinyEncoderModel"
    modality = "encoder"
    card_family = "hf_tiny_encoder (BERT-style encoder)"
    tags = ("bert", "encoder")

    def plan(self, source: Source) -> Plan:
        architecture, config, state = mapped_bert(source)
        if not ARCHITECTURES[architecture][3]:
            unused = sorted(k for k in state if k.startswith("bert.pooler."))
            if unused:
                print(f"note: ignoring {', '.join(unused)}: {architecture} has no pooler (transformers ignores them "
                      "too)", file=sys.stderr)
        source.description = f"the official `{architecture}` checkpoint `{source.path.resolve().name}`"
        return Plan(config, ARCHITECTURES[architecture][0], architecture,
                    key_map(architecture, tied=config.tie_word_embeddings), config.num_hidden_layers, state)

    def reverse(self, config, our_class: str, src: Path) -> ReversePlan:
        architecture = OFFICIAL_BY_OURS[our_class]
        return ReversePlan(architecture, bert_config_from_encoder(config, architecture),
                           key_map(architecture, tied=config.tie_word_embeddings), config.num_hidden_layers)

    def finish_official_state(self, state: dict, config, plan: ReversePlan) -> dict:
        if plan.official_class == "BertForMaskedLM" and not config.tie_word_embeddings:
            state["cls.predictions.bias"] = state["cls.predictions.decoder.bias"].clone()  # read by nothing, expected
        return state


FAMILY = BertFamily()
convert, convert_back = entry_points(FAMILY)
