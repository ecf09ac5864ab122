"""ModernBERT (transformers `model_type: modernbert`) <-> hf_tiny encoder: the BERT tables with ModernBERT's names;
its mechanisms are encoder config fields.

    python -m conversion [modernbert] SRC DST              official ModernBERT folder -> hf_tiny folder
    python -m conversion [modernbert] SRC DST --reverse    hf_tiny encoder folder (pre-norm, rotary) -> ModernBERT

What differs from BERT, each a field of the hf_tiny encoder (FIXED / CONFIG_FIELDS below):
  * rotary positions with one theta per layer type (`rope_parameters`), no position table, no token types;
  * pre-norm layers (`norm_placement="pre"`): layer 0 has no `attn_norm` (its input is the embeddings' norm), and
    `final_norm` follows the last layer;
  * local layers (`layer_types`, from global_attn_every_n_layers) see the keys at most local_attention // 2
    positions away (`sliding_window`; an odd local_attention converts back as the even one with the same window);
  * `attn.Wqkv` stacks q, k and v on the output dimension and `mlp.Wi` the GeGLU's activated half, then its gate:
    split into q/k/v_proj and gate_proj/up_proj (GatedFeedForward: down(act(gate) * up)) and joined back, bit for bit;
  * biases only where the config turns them on (attention_bias, mlp_bias, norm_bias, classifier_bias, decoder_bias);
  * every task head starts with `head` (dense -> act -> norm, `head_transform`), one module under one name in every
    class (`shared_head`), so that a classifier loaded from a masked-LM folder starts from the trained transform:
    the MLM head's transform before its decoder, sequence classification's after its pooling (of the first token or
    the mean, `classifier_pooling`), the transform before token classification and QA (whose `classifier` is
    hf_tiny's `qa_outputs`). Folders converted before shared_head name the MLM's transform `lm_head.dense` /
    `lm_head.layer_norm` and sequence classification's `model.pooler.*`; they convert back as they are.
Refused, with the field named: sparse_prediction (logits at the masked tokens only) and attention_dropout != 0
(ModernBERT drops the attention output at that rate but not the feed-forward's; hf_tiny's pre-norm layer drops
both at hidden_dropout). ModernBertForMultipleChoice has no hf_tiny class.
"""

from __future__ import annotations

import copy

from .bert import EncoderFamily, EncoderVariant, MaskedLMNames
from .errors import ConversionError
from .keymap import KeyMap, Rule, join, layer_rules
from .phi3 import split_rows
from .pipeline import Plan, ReversePlan, Source, entry_points

TOKEN_IDS = ("bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id")
CONFIG_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "intermediate_size": "intermediate_size",
    "hidden_activation": "hidden_act",
    "max_position_embeddings": "max_position_embeddings",
    "initializer_range": "initializer_range",
    "norm_eps": "layer_norm_eps",
    "norm_bias": "norm_bias",
    "pad_token_id": "pad_token_id",
    "attention_bias": "attention_bias",
    "attention_dropout": "attention_dropout",
    "embedding_dropout": "embedding_dropout",
    "mlp_bias": "mlp_bias",
    "mlp_dropout": "activation_dropout",
    "layer_types": "layer_types",
    "sliding_window": "sliding_window",  # official: a property, local_attention // 2
    "rope_parameters": "rope_parameters",
    "decoder_bias": "decoder_bias",
    "classifier_pooling": "classifier_pooling",
    "classifier_dropout": "classifier_dropout",
    "classifier_bias": "classifier_bias",
    "classifier_activation": "classifier_activation",
    "tie_word_embeddings": "tie_word_embeddings",
    **{name: name for name in TOKEN_IDS},  # kept by hf_tiny's config as they are (filled with None where absent)
    "id2label": "id2label",
    "label2id": "label2id",
    "problem_type": "problem_type",
}
# hf_tiny fields read from an official field that another one is mapped from too: the pooler's activation and the
# QA dropout are ModernBERT's classifier ones; the residual dropout is the attention output's (0: refused otherwise)
DERIVED = {"pooler_act": "classifier_activation", "qa_dropout": "classifier_dropout", "hidden_dropout": "attention_dropout"}
FIXED = dict(position_embedding_type="rope", norm_placement="pre", mlp_gated=True, head_transform=True,
             shared_head=True, type_vocab_size=0, add_pooling_layer=False)

WORD_EMBEDDINGS = "embeddings.tok_embeddings.weight"
STACK_MODULES = {"embeddings.norm": "embed_norm", "final_norm": "norm"}
LAYER_MODULES = {"attn.Wo": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm", "mlp.Wo": "mlp.down_proj"}


def head(target: str) -> dict[str, str]:
    """ModernBERT's prediction head (head.dense -> act -> head.norm) under hf_tiny's module `target`."""
    return {"head.dense": f"{target}.dense", "head.norm": f"{target}.layer_norm"}


# Which config field says an official module (by the end of its name) has a bias; modules not listed always have one.
BIAS_FIELDS = {"attn.Wqkv": "attention_bias", "attn.Wo": "attention_bias", "mlp.Wi": "mlp_bias", "mlp.Wo": "mlp_bias",
               "norm": "norm_bias", "head.dense": "classifier_bias", "decoder": "decoder_bias"}


def params(module: str, config) -> tuple[str, ...]:
    field = next((name for end, name in BIAS_FIELDS.items() if module.endswith(end)), None)
    return ("weight", "bias") if field is None or getattr(config, field) else ("weight",)


def modules_rules(source: str, target: str, modules: dict[str, str], config) -> list:
    return [rule for official, ours in modules.items()
            for rule in layer_rules(source, target, {official: ours}, params=params(official, config))]


def fused_rules(source: str, target: str, config) -> list[Rule]:
    """One layer's fused projections: Wqkv -> q/k/v_proj, Wi -> gate_proj (activated half) / up_proj."""
    hidden, inner = config.hidden_size, config.intermediate_size
    rules = [Rule(f"{source}.attn.Wqkv.{p}", tuple(f"{target}.self_attn.{n}_proj.{p}" for n in "qkv"),
                  split_rows(f"Wqkv.{p}", (hidden, hidden, hidden))) for p in params("attn.Wqkv", config)]
    rules += [Rule(f"{source}.mlp.Wi.{p}", (f"{target}.mlp.gate_proj.{p}", f"{target}.mlp.up_proj.{p}"),
                   split_rows(f"Wi.{p}", (inner, inner))) for p in params("mlp.Wi", config)]
    return rules


def key_map(variant: EncoderVariant, suffix: str, config) -> KeyMap:
    """The official <-> hf_tiny key map of one ModernBERT class for an hf_tiny encoder config."""
    source = target = "" if suffix == "Model" else variant.base_prefix
    parts = variant.class_parts[suffix]
    words, embed = join(source, WORD_EMBEDDINGS), join(target, "embed_tokens.weight")
    tied_decoder = "masked_lm" in parts and config.tie_word_embeddings
    rules: list = [Rule(words, (embed, "lm_head.decoder.weight")) if tied_decoder else (words, embed)]
    rules += modules_rules(source, target, STACK_MODULES, config)
    official_layer, our_layer = join(source, "layers.{i}"), join(target, "layers.{i}")
    rules += fused_rules(official_layer, our_layer, config) + modules_rules(official_layer, our_layer, LAYER_MODULES, config)
    for i in range(1, config.num_hidden_layers):  # layer 0 has no attn_norm
        rules += modules_rules(official_layer.format(i=i), our_layer.format(i=i), {"attn_norm": "input_layernorm"}, config)
    task_parts = SHARED_HEAD_PARTS if config.shared_head else variant.parts
    for part in parts:
        if part == "masked_lm":
            names = variant.masked_lm
            rules += modules_rules("", "", head("head") if config.shared_head else names.modules, config)
            if not tied_decoder:
                rules += modules_rules("", "", {names.decoder: "lm_head.decoder"}, config)
            elif config.decoder_bias:  # the tied weight is the word embeddings' rule
                rules.append((f"{names.decoder}.bias", "lm_head.decoder.bias"))
        else:
            rules += modules_rules("", "", task_parts[part], config)
    return KeyMap(rules)


MODERNBERT = EncoderVariant(
    model_type="modernbert",
    class_prefix="ModernBert",
    base_prefix="model",
    masked_lm=MaskedLMNames("head.dense", "head.norm", decoder="decoder"),
    parts={
        "classification_head": {**head("model.pooler"), "classifier": "classifier"},
        "token_head": {**head("head"), "classifier": "classifier"},
        "qa_head": {**head("head"), "classifier": "qa_outputs"},
    },
    class_parts={"Model": (), "ForMaskedLM": ("masked_lm",), "ForSequenceClassification": ("classification_head",),
                 "ForTokenClassification": ("token_head",), "ForQuestionAnswering": ("qa_head",)},
    fixed_config=FIXED,
    config_fields=CONFIG_FIELDS,
    derived_config=DERIVED,
    layout_fields=("shared_head",),
    layer_path="layers.{i}",
    word_embeddings=WORD_EMBEDDINGS,
    own_key_map=key_map,
)


def refuse_unsupported(raw_config: dict, *, src) -> None:
    if raw_config.get("sparse_prediction"):
        raise ConversionError(
            f"{src}: sparse_prediction=True (ModernBertForMaskedLM returns logits at the masked tokens only) is not "
            "supported; hf_tiny's MLM head returns every token's logits (the loss is the same): set "
            "sparse_prediction=false in config.json"
        )
    if raw_config.get("attention_dropout", 0.0):
        raise ConversionError(
            f"{src}: attention_dropout={raw_config['attention_dropout']!r} is not supported: ModernBERT drops the "
            "attention output at that rate but not the feed-forward's, while hf_tiny's pre-norm layer drops both at "
            "hidden_dropout; set attention_dropout=0.0 in config.json (ModernBERT's published checkpoints have 0.0)"
        )


class ModernBertFamily(EncoderFamily):
    kept_fields = ("deterministic_flash_attn",)  # flash-attn's deterministic backward, official's only

    def plan(self, source: Source) -> Plan:
        refuse_unsupported(source.raw_config, src=source.path)
        return super().plan(source)

    def reverse(self, config, our_class: str, src) -> ReversePlan:
        if config.attention_dropout or config.hidden_dropout:
            raise ConversionError(
                f"{src}: attention_dropout={config.attention_dropout}, hidden_dropout={config.hidden_dropout}: "
                "ModernBERT's dropout of the attention output has no place for hf_tiny's residual dropout of both "
                "sublayers; set both to 0.0 in config.json"
            )
        config = copy.copy(config)  # an hf_tiny config made from scratch may hold no token ids
        for name in TOKEN_IDS:
            setattr(config, name, getattr(config, name, None))
        return super().reverse(config, our_class, src)


FAMILY = ModernBertFamily(
    MODERNBERT, "hf_tiny_encoder (ModernBERT: pre-norm, rotary positions, local / global attention, GeGLU)")
convert, convert_back = entry_points(FAMILY)
# The task heads' modules with shared_head (every class's transform is `head`); MODERNBERT.parts are those of folders
# converted before it, where sequence classification's transform is the pooler's.
SHARED_HEAD_PARTS = {**MODERNBERT.parts, "classification_head": {**head("head"), "classifier": "classifier"}}
