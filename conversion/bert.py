"""BERT-style encoder checkpoints (transformers `model_type: bert`, `roberta`) <-> hf_tiny encoder
(`model_type: hf_tiny_encoder`).

    python -m conversion [bert|roberta] SRC DST              official folder -> hf_tiny folder
    python -m conversion [bert|roberta] SRC DST --reverse    hf_tiny encoder folder -> official folder

A checkpoint is an encoder plus the parts its class holds (pooler, MLM head, next-sentence head, classifier,
QA head). Head classes prefix the encoder's tensors (`bert.`); a bare BertModel state dict has no prefix. The
target class is the one config.json names (else guessed from the tensors); parts of the checkpoint that class
lacks are dropped with a note naming the tensors, as transformers' from_pretrained drops them (e.g. the
next-sentence head of the original BERT checkpoints, whose config names BertForMaskedLM). Every tensor maps 1:1
(no reshaping); the MLM decoder is tied to the word embeddings unless the config unties it.

A variant (BERT, RoBERTa) is a table: its class-name prefix, its tensor names per part, its config fields.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from .errors import ConversionError, list_names
from .keymap import KeyMap, Rule, join, layer_rules
from .lazy import LazyTensors
from .pipeline import Family, Plan, ReversePlan, Source, entry_points
from .readers import official_config, source_name
from .writer import drop_tied_copies

# official class suffix -> (hf_tiny class, Auto class, pipeline tag)
CLASSES = {
    "Model": ("TinyEncoderModel", "AutoModel", "feature-extraction"),
    "ForPreTraining": ("TinyEncoderForPreTraining", "AutoModelForPreTraining", "fill-mask"),
    "ForMaskedLM": ("TinyEncoderForMaskedLM", "AutoModelForMaskedLM", "fill-mask"),
    "ForSequenceClassification": ("TinyEncoderForSequenceClassification", "AutoModelForSequenceClassification", "text-classification"),
    "ForTokenClassification": ("TinyEncoderForTokenClassification", "AutoModelForTokenClassification", "token-classification"),
    "ForQuestionAnswering": ("TinyEncoderForQuestionAnswering", "AutoModelForQuestionAnswering", "question-answering"),
}
# ELECTRA's ForPreTraining is its discriminator, not BERT's MLM + next-sentence model
DISCRIMINATOR_CLASS = ("TinyEncoderForReplacedTokenDetection", "AutoModelForPreTraining", "token-classification")

# Official config field -> TinyEncoderConfig field (label maps and problem_type pass through PretrainedConfig).
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
WORD_EMBEDDINGS = "embeddings.word_embeddings.weight"
# Buffers some official checkpoints carry; the model recomputes them.
IGNORED_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")
UNTIED_HINT = "; set tie_word_embeddings=false in config.json if the checkpoint really has an untied decoder"


@dataclass(frozen=True)
class MaskedLMNames:
    """Official names of an MLM head: its transform (dense, then norm), the decoder (tied to the word embeddings)
    and the output bias, which official code ties to `decoder.bias` (a stored copy is dropped on reading); a head
    whose decoder holds the bias itself (DistilBERT, ELECTRA, ModernBERT) names no other."""

    dense: str
    norm: str
    decoder: str
    bias: str = ""  # default: the decoder's own bias

    def __post_init__(self):
        if not self.bias:
            object.__setattr__(self, "bias", self.decoder + ".bias")

    @property
    def modules(self) -> dict[str, str]:
        """The transform's official module -> hf_tiny module."""
        return {self.dense: "lm_head.dense", self.norm: "lm_head.layer_norm"}


@dataclass(frozen=True)
class EncoderVariant:
    model_type: str
    class_prefix: str  # "Bert": BertModel, BertForMaskedLM, ...
    masked_lm: MaskedLMNames
    # part -> {official module: hf_tiny module}; "pooler" lives inside the encoder (under base_prefix), the
    # others at the top level of the checkpoint
    parts: dict[str, dict[str, str]]
    class_parts: dict[str, tuple[str, ...]]  # official class suffix -> parts it holds besides the encoder
    base_prefix: str = ""  # the encoder's tensor prefix in head checkpoints (default: model_type)
    fixed_config: dict = field(default_factory=dict)  # hf_tiny config fields the variant implies
    # hf_tiny config fields that only name tensors (the key map reads them): any value converts back
    layout_fields: tuple[str, ...] = ()
    # the encoder's own names (BERT's unless a variant renames them)
    config_fields: dict[str, str] = field(default_factory=lambda: CONFIG_FIELDS)
    layer_path: str = "encoder.layer.{i}"
    layer_modules: dict[str, str] = field(default_factory=lambda: LAYER_MODULES)
    embedding_modules: dict[str, str] = field(default_factory=lambda: EMBEDDING_MODULES)
    embedding_tables: dict[str, str] = field(default_factory=lambda: EMBEDDING_TABLES)
    word_embeddings: str = WORD_EMBEDDINGS
    # hf_tiny fields read from an official field another one is mapped from too (ALBERT's classifier_dropout_prob)
    derived_config: dict[str, str] = field(default_factory=dict)
    # (official layer prefix, hf_tiny layer prefix) pairs for a config; default: layer_path <-> layers.{i}
    layer_pairs: Optional[Callable] = None
    embedding_projection: str = ""  # the projection of factorized embeddings to hidden_size (ELECTRA)
    class_overrides: dict[str, tuple[str, str, str]] = field(default_factory=dict)  # suffix -> CLASSES entry
    # own_key_map(variant, suffix, config) -> KeyMap: the key map of a variant whose tensors do not map 1:1 by the
    # tables above (ModernBERT's fused projections, biases the config turns off); None: key_map() below
    own_key_map: Optional[Callable] = None

    def __post_init__(self):
        if not self.base_prefix:
            object.__setattr__(self, "base_prefix", self.model_type)

    def hf_tiny_class(self, suffix: str) -> tuple[str, str, str]:
        """(hf_tiny class, Auto class, pipeline tag) of an official class suffix."""
        return self.class_overrides.get(suffix) or CLASSES[suffix]

    def suffix_for(self, our_class: str) -> str:
        return next(suffix for suffix in self.class_parts if self.hf_tiny_class(suffix)[0] == our_class)

    def family_classes(self) -> dict[str, tuple[str, str]]:
        """hf_tiny class -> (Auto class, pipeline tag) for Family.classes."""
        return {ours: (auto, tag) for ours, auto, tag in map(self.hf_tiny_class, self.class_parts)}

    def official_class(self, suffix: str) -> str:
        return self.class_prefix + suffix

    def suffix_of(self, official_class: str, *, src) -> str:
        suffix = official_class[len(self.class_prefix):] if official_class.startswith(self.class_prefix) else None
        if suffix not in self.class_parts:
            supported = ", ".join(self.official_class(s) for s in self.class_parts)
            raise ConversionError(f"{src}: architecture {official_class!r} is not supported; supported: {supported}")
        return suffix


# Parts every variant names alike, and RoBERTa's classification head (ELECTRA's too): dense -> the sequence
# classifier's pooler (the encoder's, ENCODER_POOLER_DENSE, or its own: with_classifier_pooler), out_proj -> classifier
TASK_PARTS = {"classifier": {"classifier": "classifier"}, "qa": {"qa_outputs": "qa_outputs"}}
ENCODER_POOLER_DENSE = "model.pooler.dense"  # the encoder's pooler; `pre_classifier.dense` with config.pre_classifier
CLASSIFICATION_HEAD = {"classifier.dense": ENCODER_POOLER_DENSE, "classifier.out_proj": "classifier"}


def with_classifier_pooler(modules: dict[str, str], config) -> dict[str, str]:
    """A part's official -> hf_tiny modules, the sequence classifier's pooler named as the config lays it out: the
    classifier's own `pre_classifier` (pre_classifier=True, what the converters write) or the encoder's pooler."""
    if not config.pre_classifier:
        return modules
    own = "pre_classifier.dense"
    return {official: own if ours == ENCODER_POOLER_DENSE else ours for official, ours in modules.items()}


def class_parts(*, base_pooler: bool, pretraining: tuple[str, ...] = (), sequence=("pooler", "classifier")) -> dict:
    """Official class suffix -> the parts it holds besides the encoder (no ForPreTraining without `pretraining`)."""
    parts = {"Model": ("pooler",) if base_pooler else ()}
    if pretraining:
        parts["ForPreTraining"] = pretraining
    return {**parts, "ForMaskedLM": ("masked_lm",), "ForSequenceClassification": sequence,
            "ForTokenClassification": ("classifier",), "ForQuestionAnswering": ("qa",)}


BERT = EncoderVariant(
    model_type="bert",
    class_prefix="Bert",
    masked_lm=MaskedLMNames("cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm",
                            decoder="cls.predictions.decoder", bias="cls.predictions.bias"),
    parts={"pooler": {"pooler.dense": "pooler.dense"}, "next_sentence": {"cls.seq_relationship": "next_sentence"}, **TASK_PARTS},
    class_parts=class_parts(base_pooler=True, pretraining=("pooler", "masked_lm", "next_sentence")),
)


def part_modules(variant: EncoderVariant, part: str) -> dict[str, str]:
    if part == "masked_lm":
        return {**variant.masked_lm.modules, variant.masked_lm.decoder: "lm_head.decoder"}
    return variant.parts[part]


def part_keys(variant: EncoderVariant, part: str, state, *, prefixed: bool) -> list[str]:
    """The tensors of `part` present in a checkpoint."""
    prefix = variant.base_prefix + "." if part == "pooler" and prefixed else ""
    names = {f"{prefix}{module}.{param}" for module in part_modules(variant, part) for param in ("weight", "bias")}
    if part == "masked_lm":
        names.add(variant.masked_lm.bias)
    return sorted(k for k in state if k in names)


def key_map(variant: EncoderVariant, suffix: str, config) -> KeyMap:
    """The official <-> hf_tiny key map of one official class, for an hf_tiny encoder config (tied decoder,
    embedding projection, shared layers)."""
    if variant.own_key_map is not None:
        return variant.own_key_map(variant, suffix, config)
    tied, projected = config.tie_word_embeddings, config.project_embeddings
    source, target = ("", "") if suffix == "Model" else (variant.base_prefix, "model")
    parts = variant.class_parts[suffix]
    masked_lm = "masked_lm" in parts
    words, embed = join(source, variant.word_embeddings), join(target, "embed_tokens.weight")
    rules: list = [Rule(words, (embed, "lm_head.decoder.weight")) if masked_lm and tied else (words, embed)]
    rules += layer_rules(source, target, variant.embedding_tables, params=("weight",))
    rules += layer_rules(source, target, variant.embedding_modules)
    if projected:
        rules += layer_rules(source, target, {variant.embedding_projection: "embed_projection"})
    layers = variant.layer_pairs(config) if variant.layer_pairs else [(variant.layer_path, "layers.{i}")]
    for official_layer, our_layer in layers:
        rules += layer_rules(join(source, official_layer), join(target, our_layer), variant.layer_modules)
    ignore = [rf"({variant.base_prefix}\.)?" + buffer.replace(".", r"\.") for buffer in IGNORED_BUFFERS]
    for part in parts:
        if part == "pooler":
            if suffix != "Model" or config.add_pooling_layer:  # a base model may be converted without one
                rules += layer_rules(source, target, variant.parts["pooler"])
        elif part == "masked_lm":
            names = variant.masked_lm
            rules += layer_rules("", "", names.modules)
            own_bias = names.bias == names.decoder + ".bias"  # DistilBERT, ELECTRA: the decoder's bias is the bias
            if tied or own_bias:
                rules.append((names.bias, "lm_head.decoder.bias"))
            if not tied:
                rules.append((names.decoder + ".weight", "lm_head.decoder.weight"))
            if not tied and not own_bias:
                # BERT untied: the official forward reads decoder.bias only; predictions.bias is a stale copy
                rules.append((names.decoder + ".bias", "lm_head.decoder.bias"))
                ignore.append(names.bias.replace(".", r"\."))
        else:
            rules += layer_rules("", "", with_classifier_pooler(variant.parts[part], config))
    return KeyMap(rules, ignore=ignore)


def guess_suffix(variant: EncoderVariant, present: set[str], *, prefixed: bool, src) -> str:
    """The official class of a checkpoint whose config.json names none, from the parts it holds."""
    if not prefixed:
        return "Model"
    for suffix in ("ForPreTraining", "ForMaskedLM", "ForQuestionAnswering", "ForSequenceClassification", "ForTokenClassification"):
        if suffix in variant.class_parts and set(variant.class_parts[suffix]) <= present:
            return suffix
    raise ConversionError(
        f"{src}: cannot tell which {variant.class_prefix} class the checkpoint holds (no `architectures` in "
        "config.json and no known head tensors); add `architectures` to config.json"
    )


def choose_class(variant: EncoderVariant, source: Source, notes: list[str]) -> tuple[str, dict]:
    """(official class suffix, tensors ready for its key map): the class config.json names, or the one the tensors
    show; parts it lacks dropped with a note; the encoder prefix added or removed as the class stores it."""
    state, src = source.state, source.path
    prefixed = any(k.startswith(variant.base_prefix + ".") for k in state)
    present = {part for part in ("masked_lm", *variant.parts) if part_keys(variant, part, state, prefixed=prefixed)}
    named = (source.raw_config.get("architectures") or [None])[0]
    suffix = variant.suffix_of(named, src=src) if named else guess_suffix(variant, present, prefixed=prefixed, src=src)
    heads = set(variant.class_parts[suffix]) - {"pooler"}
    if heads and not prefixed and not heads & present:
        notes.append(f"config.json names {named} but the checkpoint is a bare {variant.official_class('Model')} state "
                     f"dict (no `{variant.base_prefix}.` prefix, no head tensors): converted as "
                     f"{variant.official_class('Model')}.")
        suffix = "Model"
    official = variant.official_class(suffix)
    kept = {k for part in variant.class_parts[suffix] for k in part_keys(variant, part, state, prefixed=prefixed)}
    for part in sorted(present - set(variant.class_parts[suffix])):
        dropped = [k for k in part_keys(variant, part, state, prefixed=prefixed) if k not in kept]
        if not dropped:  # a part whose names the target's parts share (DistilBERT's `classifier`)
            continue
        notes.append(f"Dropped {list_names(dropped)}: {official} has no {part.replace('_', ' ')} part "
                     "(transformers' from_pretrained drops them too).")
        state = {k: v for k, v in state.items() if k not in dropped}
    if suffix == "Model" and prefixed:
        state = {k.removeprefix(variant.base_prefix + "."): v for k, v in state.items()}
    return suffix, state


def encoder_config_from_official(variant: EncoderVariant, raw_config: dict, *, src):
    """TinyEncoderConfig equivalent to an official config.json; unsupported options are errors."""
    from hf_tiny import TinyEncoderConfig

    official = official_config({**raw_config, "model_type": variant.model_type}, src=src)
    position_type = getattr(official, "position_embedding_type", None) or "absolute"
    if position_type != "absolute":
        raise ConversionError(
            f"{src}: position_embedding_type={position_type!r} is not supported (hf_tiny encoders use learned "
            "absolute positions only)"
        )
    for flag in ("is_decoder", "add_cross_attention"):
        if getattr(official, flag, False):
            raise ConversionError(f"{src}: {flag}=True (a decoder) is not supported; hf_tiny encoders are bidirectional")
    values = {ours: getattr(official, name) for name, ours in variant.config_fields.items()}
    values.update({ours: getattr(official, name) for ours, name in variant.derived_config.items()})
    if values["id2label"] is None:
        values.pop("id2label")
        values.pop("label2id")
    try:
        return TinyEncoderConfig(**values, **variant.fixed_config)
    except (TypeError, ValueError) as error:
        raise ConversionError(f"{src}: this {variant.model_type} config has no hf_tiny equivalent: {error}") from error


def official_config_from_encoder(variant: EncoderVariant, config, official_class: str):
    """The official config of an hf_tiny encoder. It must carry everything: converted back to hf_tiny it must give
    the same fields, else the config holds something this variant has no place for (an error naming it)."""
    import inspect

    from transformers import AutoConfig

    missing = [ours for ours in variant.config_fields.values() if not hasattr(config, ours)]
    if missing:
        raise ConversionError(f"this hf_tiny encoder is not {_an(variant.model_type)} model: its config has no "
                              f"{', '.join(missing)}")
    values = {name: getattr(config, ours) for name, ours in variant.config_fields.items()}
    if values["id2label"] is None:
        values.pop("id2label")
        values.pop("label2id")
    from huggingface_hub.errors import StrictDataclassError

    try:
        official = AutoConfig.for_model(variant.model_type, **values, architectures=[official_class])
    except (TypeError, ValueError, StrictDataclassError) as error:  # a value the official config refuses
        raise ConversionError(f"this hf_tiny encoder is not {_an(variant.model_type)} model: {error}") from error
    try:
        again = encoder_config_from_official(variant, official.to_dict(), src=f"the {variant.model_type} config")
    except ConversionError as error:
        raise ConversionError(f"this hf_tiny encoder is not {_an(variant.model_type)} model ({error})") from error
    fields = [name for name in inspect.signature(type(config).__init__).parameters if name not in ("self", "kwargs")]
    fields = [name for name in fields if name not in variant.layout_fields]
    lost = [f"{name}={getattr(config, name)!r}" for name in fields if getattr(config, name) != getattr(again, name)]
    if lost:
        raise ConversionError(
            f"this hf_tiny encoder is not {_an(variant.model_type)} model: {', '.join(lost)} "
            f"({_an(variant.model_type)} config has no place for it)"
        )
    return official


def _an(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


class EncoderFamily(Family):
    """The family of a BERT-style encoder variant: its name, model type, classes, tags and the marker tensor of its
    head checkpoints follow from the variant; `markers` adds tensors only its bare checkpoints hold."""

    config_class = "TinyEncoderConfig"
    default_class = "TinyEncoderModel"
    modality = "encoder"

    def __init__(self, variant: EncoderVariant, card_family: str, *, markers: tuple[str, ...] = ()):
        self.variant = variant
        self.name = variant.model_type
        self.model_types = (variant.model_type,)
        self.classes = variant.family_classes()
        self.card_family = card_family
        self.tags = (variant.model_type, "encoder")
        self.tensor_markers = (f"{variant.base_prefix}.{variant.word_embeddings}", *markers)

    def read(self, src: Path) -> Source:
        return self.read_hf_folder(src, allow_missing_model_type=True)

    def plan(self, source: Source) -> Plan:
        variant, notes = self.variant, list(source.notes)
        suffix, state = choose_class(variant, source, notes)
        config = encoder_config_from_official(variant, source.raw_config, src=source.path)
        official_kwargs = {}
        if suffix == "Model" and "pooler" in variant.class_parts["Model"] and not part_keys(variant, "pooler", state, prefixed=False):
            # e.g. sentence-transformers models saved without one; official loading would make a random pooler
            notes.append(f"The checkpoint has no pooler tensors: converted without a pooler (add_pooling_layer=False); "
                         f"parity is measured against {variant.official_class('Model')}(add_pooling_layer=False).")
            config.add_pooling_layer = False
            official_kwargs["add_pooling_layer"] = False
        tied, names = config.tie_word_embeddings, variant.masked_lm
        if "masked_lm" in variant.class_parts[suffix] and tied:
            prefix = "" if suffix == "Model" else variant.base_prefix + "."
            state = drop_tied_copies(state, prefix + variant.word_embeddings, [names.decoder + ".weight"],
                                     src=source.path, hint=UNTIED_HINT)
        if "masked_lm" in variant.class_parts[suffix] and tied and names.bias != names.decoder + ".bias":
            # BERT ties decoder.bias to predictions.bias: a stored copy must equal it
            state = drop_tied_copies(state, names.bias, [names.decoder + ".bias"], src=source.path)
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        official = variant.official_class(suffix)
        source.description = f"the official `{official}` checkpoint `{source_name(source.path)}`"
        return Plan(config, variant.hf_tiny_class(suffix)[0], official, key_map(variant, suffix, config), config.num_blocks(),
                    state, notes=notes, official_kwargs=official_kwargs)

    def reverse(self, config, our_class: str, src: Path) -> ReversePlan:
        suffix = self.variant.suffix_for(our_class)
        official = self.variant.official_class(suffix)
        return ReversePlan(official, official_config_from_encoder(self.variant, config, official),
                           key_map(self.variant, suffix, config), config.num_blocks())

    def finish_official_state(self, state: LazyTensors, config, plan: ReversePlan) -> LazyTensors:
        names = self.variant.masked_lm
        if names.decoder + ".bias" in state and names.bias not in state:
            return state.aliased({names.bias: names.decoder + ".bias"})  # untied BERT: read by nothing, expected
        return state


FAMILY = EncoderFamily(BERT, "hf_tiny_encoder (BERT-style encoder)")
convert, convert_back = entry_points(FAMILY)
