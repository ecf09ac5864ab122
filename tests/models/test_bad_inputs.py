"""The bad-input matrix: every bad config, model input and checkpoint gives a clear error whose type is stated
and whose message names the field (or tensor, or file) and the value it got.

Three parts:
- configs of every family: sizes <= 0, hidden size not divisible by the heads, KV heads that do not divide the
  query heads, unknown activation / norm / position / rope types, inconsistent rope fields;
- inputs of every family's main heads: token ids out of range / negative / float, masks of the wrong shape, dtype
  or values, sequences past the position limit, empty batches and sequences, labels of the wrong shape, dtype or
  range;
- checkpoints through every converter, both by its Python API (ConversionError) and by the CLI
  (`python -m conversion ...`: exit code 1, one `error: ...` line on stderr): the wrong family, missing /
  unexpected tensors, a shape mismatch, a truncated safetensors file, a shard index pointing at a missing
  shard, a pickle that weights_only refuses (and whose payload never runs), and for llama a GGUF of another
  architecture or with an unsupported quantization. An existing destination is left untouched each time.

Cases already covered elsewhere are not repeated: rope_parameters in tests/models/test_rope.py, the encoder base
model's inputs in tests/models/test_encoder.py, core readers in tests/conversion/test_core.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conversion import ConversionError
from conversion import bart as bart_conversion
from conversion import bert as bert_conversion
from conversion import bert2seq as bert2seq_conversion
from conversion import llama as llama_conversion
from conversion import t5 as t5_conversion
from conversion.__main__ import main as conversion_main
from hf_tiny import (
    TinyCausalConfig,
    TinyCausalForCausalLM,
    TinyCausalForSequenceClassification,
    TinyEncoderConfig,
    TinyEncoderForMaskedLM,
    TinyEncoderForQuestionAnswering,
    TinyEncoderForSequenceClassification,
    TinyEncoderForTokenClassification,
    TinySeq2SeqConfig,
    TinySeq2SeqForConditionalGeneration,
)

VOCAB = 50
MAX_POSITIONS = 16
SIZES = dict(
    vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
    max_position_embeddings=MAX_POSITIONS,
)


def assert_names(error: BaseException, fragments) -> None:
    message = str(error)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in the message {message!r}"


# ================================================================================================================
# Configs
# ================================================================================================================

FAMILY_CONFIGS = {"encoder": TinyEncoderConfig, "causal": TinyCausalConfig, "seq2seq": TinySeq2SeqConfig}
POSITIVE_FIELDS = {
    "encoder": ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "embedding_size"],
    "causal": ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "max_position_embeddings", "head_dim", "sliding_window"],
    "seq2seq": ["vocab_size", "hidden_size", "num_hidden_layers", "num_decoder_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "max_position_embeddings", "head_dim",
                "relative_attention_num_buckets", "relative_attention_max_distance"],
}
# (family, field, value) already in tests/models/test_encoder.py
ALREADY_TESTED = {("encoder", "vocab_size", 0), ("encoder", "num_hidden_layers", -1)}


def config_cases():
    for family, fields in POSITIVE_FIELDS.items():
        for field in fields:
            for value in (0, -2, 8.0):
                if (family, field, value) not in ALREADY_TESTED:
                    yield pytest.param(family, {field: value}, ValueError, [field, repr(value)],
                                       id=f"{family}-{field}={value}")
    for value in (-1, 2.0):  # 0 is valid: no token types (DistilBERT)
        yield pytest.param("encoder", {"type_vocab_size": value}, ValueError, ["type_vocab_size", repr(value)],
                           id=f"encoder-type_vocab_size={value}")
    for family in FAMILY_CONFIGS:
        yield pytest.param(family, {"num_attention_heads": 3}, ValueError,
                           ["hidden_size (16)", "num_attention_heads (3)"], id=f"{family}-hidden-not-divisible")
        yield pytest.param(family, {"hidden_act": "swiglu_xl"}, ValueError, ["hidden_act", "'swiglu_xl'"],
                           id=f"{family}-unknown-activation")
    for family in ("causal", "seq2seq"):
        yield pytest.param(family, {"num_attention_heads": 4, "num_key_value_heads": 3}, ValueError,
                           ["num_attention_heads (4)", "num_key_value_heads (3)"], id=f"{family}-kv-not-dividing")
        yield pytest.param(family, {"num_attention_heads": 2, "num_key_value_heads": 4}, ValueError,
                           ["num_attention_heads (2)", "num_key_value_heads (4)"], id=f"{family}-more-kv-than-q")
    # norm / position types
    yield pytest.param("seq2seq", {"norm_type": "batchnorm"}, ValueError, ["norm_type", "'batchnorm'"],
                       id="seq2seq-unknown-norm-type")
    yield pytest.param("seq2seq", {"norm_placement": "sandwich"}, ValueError, ["norm_placement", "'sandwich'"],
                       id="seq2seq-unknown-norm-placement")
    yield pytest.param("seq2seq", {"position_embedding_type": "rotary"}, ValueError,
                       ["position_embedding_type", "'rotary'"], id="seq2seq-unknown-position-type")
    yield pytest.param("seq2seq", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, ValueError,
                       ["rope_parameters", "'yarn'", "position_embedding_type"], id="seq2seq-rope-not-supported")
    yield pytest.param("encoder", {"position_embedding_type": "relative_key"}, ValueError,
                       ["position_embedding_type", "'relative_key'"], id="encoder-unknown-position-type")
    yield pytest.param("encoder", {"rope_parameters": {"rope_type": "default"}}, ValueError,
                       ["rope_parameters", "'default'"], id="encoder-rope-not-supported")
    # rope types and inconsistent rope fields (the rest are in tests/models/test_rope.py)
    rope_cases = [
        ({"rope_type": "ntk-by-parts"}, ["rope_type", "'ntk-by-parts'"], "unknown-rope-type"),
        ({"rope_type": "yarn"}, ["rope_type 'yarn'", "'factor'"], "yarn-without-factor"),
        ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, ["rope_type 'llama3'", "'low_freq_factor'"],
         "llama3-without-low-freq-factor"),
        ({"rope_type": "dynamic"}, ["rope_type 'dynamic'", "'factor'"], "dynamic-without-factor"),
        ({"rope_type": "linear", "factor": 0.0}, ["rope_parameters['factor']", "0.0"], "linear-factor-zero"),
        ({"rope_type": "llama3", "factor": None, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
         ["rope_parameters['factor']", "None"], "llama3-factor-none"),
    ]
    for rope, fragments, name in rope_cases:
        yield pytest.param("causal", {"rope_parameters": rope}, ValueError, fragments, id=f"causal-{name}")
    yield pytest.param("causal", {"rope_scaling": {"type": "yarn"}}, ValueError, ["rope_type 'yarn'", "'factor'"],
                       id="causal-legacy-rope-scaling-without-factor")
    yield pytest.param("causal", {"rope_parameters": "yarn"}, TypeError, ["rope_parameters", "str"],
                       id="causal-rope-parameters-not-a-dict")
    yield pytest.param("causal", {"hidden_size": 18, "num_attention_heads": 2}, ValueError,
                       ["head_dim", "9"], id="causal-odd-head-dim")
    # per-layer attention kinds and the Gemma 3 / GPT-2 / Phi-3 parts of the causal block
    layers = SIZES["num_hidden_layers"]
    causal_cases = [
        ({"layer_types": ["full_attention"] * (layers + 1)}, ["layer_types has", f"num_hidden_layers={layers}"],
         "layer-types-length"),
        ({"layer_types": ["sliding_attention"] * layers}, ["'sliding_attention'", "sliding_window is None"],
         "sliding-layers-without-window"),
        ({"layer_types": ["global"] * layers, "sliding_window": 4}, ["layer_types[0]='global'"], "unknown-layer-type"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}, "local": {}}},
         ["rope_parameters keyed by layer type", "'local'"], "rope-keyed-by-unknown-type"),
        ({"position_embedding_type": "xpos"}, ["position_embedding_type", "'xpos'"], "unknown-position-type"),
        ({"norm_type": "batchnorm"}, ["norm_type", "'batchnorm'"], "unknown-norm-type"),
        ({"norm_type": "layernorm", "rms_norm_unit_offset": True}, ["rms_norm_unit_offset=True", "'layernorm'"],
         "unit-offset-on-layernorm"),
        ({"query_pre_attn_scalar": 0.0}, ["query_pre_attn_scalar", "0.0"], "query-scalar-zero"),
        ({"final_logit_softcapping": -30.0}, ["final_logit_softcapping", "-30.0"], "softcap-negative"),
        ({"attn_logit_softcapping": 50.0}, ["attn_logit_softcapping=50.0"], "attention-softcap"),
        ({"hidden_dropout": 1.0}, ["hidden_dropout", "1.0"], "hidden-dropout-one"),
        ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0]}}, ["rope_type 'longrope'", "'long_factor'"],
         "longrope-without-long-factor"),
    ]
    for changes, fragments, name in causal_cases:
        yield pytest.param("causal", changes, (ValueError, TypeError), fragments, id=f"causal-{name}")
    # NaN / inf in any float field (they pass `value <= 0` checks and give all-NaN outputs)
    float_fields = {
        "encoder": ["layer_norm_eps", "initializer_range", "hidden_dropout", "attention_dropout"],
        "causal": ["rms_norm_eps", "initializer_range", "attention_dropout"],
        "seq2seq": ["layer_norm_eps", "initializer_range", "dropout", "attention_dropout"],
    }
    for family, fields in float_fields.items():
        for field in fields:
            for value in (float("nan"), float("inf")):
                yield pytest.param(family, {field: value}, ValueError, [field, repr(value)],
                                   id=f"{family}-{field}={value}")
        yield pytest.param(family, {"some_new_field": float("nan")}, ValueError, ["some_new_field", "nan"],
                           id=f"{family}-unknown-float-field-nan")
    yield pytest.param("causal", {"rope_parameters": {"rope_type": "linear", "factor": float("nan")}}, ValueError,
                       ["rope_parameters['factor']", "nan"], id="causal-rope-factor-nan")
    # a hand-edited config.json's "false" is truthy: it built biases and tied the head (official refuses it)
    bool_fields = {"encoder": ["attention_bias", "tie_word_embeddings"],
                   "causal": ["attention_bias", "attention_output_bias", "mlp_bias", "tie_word_embeddings", "use_cache"]}
    for family, fields in bool_fields.items():
        for field in fields:
            yield pytest.param(family, {field: "false"}, TypeError, [field, "'false'"], id=f"{family}-{field}-string")
    for field in ("is_decoder", "add_cross_attention"):  # official BERT's decoder: ours would stay bidirectional
        yield pytest.param("encoder", {field: True}, ValueError, [f"{field}=True"], id=f"encoder-{field}")
    yield pytest.param("causal", {"mlp_layer_types": 0}, TypeError, ["mlp_layer_types", "got 0"],
                       id="causal-mlp-layer-types-not-a-list")
    yield pytest.param("causal", {"bos_token_id": [1, 2]}, ValueError, ["bos_token_id", "[1, 2]"],
                       id="causal-bos-token-id-list")  # a list is for eos_token_id only


@pytest.mark.parametrize("family, changes, error, fragments", list(config_cases()))
def test_bad_config_names_field_and_value(family, changes, error, fragments):
    config_class = FAMILY_CONFIGS[family]
    with pytest.raises(error) as info:
        config_class(**{**SIZES, **changes})
    assert_names(info.value, fragments)
    assert config_class.__name__ in str(info.value)  # which config complained


# ================================================================================================================
# Model inputs
# ================================================================================================================


def build(head: str):
    torch.manual_seed(0)
    if head.startswith("encoder"):
        config = TinyEncoderConfig(**SIZES, num_labels=2 if head == "encoder-qa" else 3)
        return {
            "encoder-mlm": TinyEncoderForMaskedLM,
            "encoder-seqcls": TinyEncoderForSequenceClassification,
            "encoder-tokcls": TinyEncoderForTokenClassification,
            "encoder-qa": TinyEncoderForQuestionAnswering,
        }[head](config).eval()
    if head.startswith("causal"):
        config = TinyCausalConfig(**SIZES, num_key_value_heads=1, pad_token_id=0, num_labels=3)
        return {"causal-lm": TinyCausalForCausalLM, "causal-seqcls": TinyCausalForSequenceClassification}[head](
            config
        ).eval()
    return TinySeq2SeqForConditionalGeneration(TinySeq2SeqConfig(**SIZES)).eval()


HEADS = ["encoder-mlm", "encoder-seqcls", "encoder-tokcls", "encoder-qa", "causal-lm", "causal-seqcls", "seq2seq-lm"]
IDS = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
MASK = torch.ones(2, 5, dtype=torch.long)


def with_decoder(head: str, kwargs: dict) -> dict:
    """seq2seq models need a decoder input besides the encoder input."""
    if head == "seq2seq-lm" and not {"decoder_input_ids", "labels"} & set(kwargs):
        kwargs = {**kwargs, "decoder_input_ids": IDS[:, :3]}
    return kwargs


# (name, kwargs, error, fragments) for every head's token-id input `input_ids` and its padding mask
COMMON_INPUT_CASES = [
    ("id-out-of-vocab", dict(input_ids=IDS.masked_fill(IDS == IDS[0, 1], VOCAB)), ValueError, ["input_ids", str(VOCAB)]),
    ("negative-id", dict(input_ids=IDS.masked_fill(IDS == IDS[1, 2], -7)), ValueError, ["input_ids", "-7"]),
    ("float-ids", dict(input_ids=IDS.float()), TypeError, ["input_ids", "torch.float32"]),
    ("ids-1d", dict(input_ids=IDS[0]), ValueError, ["input_ids", "(5,)"]),
    ("ids-a-list", dict(input_ids=IDS.tolist()), TypeError, ["input_ids", "list"]),
    ("mask-wrong-shape", dict(input_ids=IDS, attention_mask=MASK[:, :4]), ValueError, ["attention_mask", "(2, 4)"]),
    ("mask-complex", dict(input_ids=IDS, attention_mask=MASK.to(torch.complex64)), TypeError,
     ["attention_mask", "complex64"]),
    ("mask-not-0-1", dict(input_ids=IDS, attention_mask=MASK * 0.5), ValueError, ["attention_mask", "0.5"]),
    ("mask-a-list", dict(input_ids=IDS, attention_mask=MASK.tolist()), TypeError, ["attention_mask", "list"]),
    ("past-position-limit", dict(input_ids=torch.randint(3, VOCAB, (2, MAX_POSITIONS + 1))), ValueError,
     ["max_position_embeddings=16", str(MAX_POSITIONS + 1)]),
    ("empty-batch", dict(input_ids=IDS[:0]), ValueError, ["input_ids", "(0, 5)"]),
    ("empty-sequences", dict(input_ids=IDS[:, :0]), ValueError, ["input_ids", "(2, 0)"]),
    ("uint8-ids", dict(input_ids=IDS.to(torch.uint8)), TypeError, ["input_ids", "torch.uint8", "long()"]),
]

LABEL_CASES = {
    "encoder-mlm": [
        ("labels-wrong-shape", dict(labels=IDS[:, :4]), ValueError, ["labels", "(2, 4)", "(2, 5)"]),
        ("labels-out-of-vocab", dict(labels=IDS.masked_fill(IDS == IDS[0, 0], VOCAB + 3)), ValueError,
         ["labels", str(VOCAB + 3)]),
        ("labels-float", dict(labels=IDS.float()), TypeError, ["labels", "torch.float32"]),
    ],
    "encoder-tokcls": [
        ("labels-wrong-shape", dict(labels=torch.zeros(2, 6, dtype=torch.long)), ValueError, ["labels", "(2, 6)"]),
        ("labels-out-of-range", dict(labels=torch.full((2, 5), 3)), ValueError, ["labels", "3", "[0, 3)"]),
        ("labels-negative", dict(labels=torch.full((2, 5), -1)), ValueError, ["labels", "-1"]),
    ],
    "encoder-seqcls": [
        ("labels-wrong-batch", dict(labels=torch.tensor([0, 1, 2])), ValueError, ["labels", "(3,)", "(2,)"]),
        ("labels-out-of-range", dict(labels=torch.tensor([0, 5])), ValueError, ["labels", "5", "[0, 3)"]),
        ("multi-label-wrong-width", dict(labels=torch.ones(2, 2)), ValueError, ["labels", "(2, 2)", "(2, 3)"]),
    ],
    "encoder-qa": [
        ("start-positions-float", dict(start_positions=torch.tensor([1.0, 2.0]), end_positions=torch.tensor([2, 3])),
         TypeError, ["start_positions", "torch.float32"]),
        ("end-positions-wrong-batch", dict(start_positions=torch.tensor([1, 2]), end_positions=torch.tensor([2, 3, 4])),
         ValueError, ["end_positions", "(3,)"]),
    ],
    "causal-lm": [
        ("labels-wrong-shape", dict(labels=IDS[:, 1:]), ValueError, ["labels", "(2, 4)", "(2, 5)"]),
        ("labels-out-of-vocab", dict(labels=IDS.masked_fill(IDS == IDS[1, 1], VOCAB)), ValueError,
         ["labels", str(VOCAB)]),
        ("labels-float", dict(labels=IDS.double()), TypeError, ["labels", "torch.float64"]),
    ],
    "causal-seqcls": [
        ("labels-wrong-batch", dict(labels=torch.tensor([0, 1, 2])), ValueError, ["labels", "(3,)", "(2,)"]),
        ("labels-out-of-range", dict(labels=torch.tensor([3, 0])), ValueError, ["labels", "3", "[0, 3)"]),
        ("multi-label-wrong-width", dict(labels=torch.ones(2, 4)), ValueError, ["labels", "(2, 4)", "(2, 3)"]),
    ],
    "seq2seq-lm": [
        ("labels-wrong-batch", dict(labels=torch.zeros(3, 4, dtype=torch.long)), ValueError, ["labels", "3", "2"]),
        ("labels-out-of-vocab", dict(labels=IDS.masked_fill(IDS == IDS[0, 0], VOCAB)), ValueError,
         ["labels", str(VOCAB)]),
        ("labels-float", dict(labels=IDS.float()), TypeError, ["labels", "torch.float32"]),
        ("labels-vs-decoder-inputs", dict(decoder_input_ids=IDS[:, :3], labels=IDS[:, :4]), ValueError,
         ["labels", "(2, 4)", "(2, 3)"]),
        ("labels-1d", dict(labels=IDS[0]), ValueError, ["labels", "[5]"]),
    ],
}

# seq2seq decoder inputs carry their own names
DECODER_CASES = [
    ("decoder-id-out-of-vocab", dict(input_ids=IDS, decoder_input_ids=IDS.masked_fill(IDS == IDS[0, 0], VOCAB)),
     ValueError, ["decoder_input_ids", str(VOCAB)]),
    ("decoder-float-ids", dict(input_ids=IDS, decoder_input_ids=IDS.half()), TypeError,
     ["decoder_input_ids", "torch.float16"]),
    ("decoder-mask-wrong-shape", dict(input_ids=IDS, decoder_input_ids=IDS, decoder_attention_mask=MASK[:1]),
     ValueError, ["decoder_attention_mask", "(1, 5)"]),
    ("decoder-mask-not-0-1", dict(input_ids=IDS, decoder_input_ids=IDS, decoder_attention_mask=MASK * 3), ValueError,
     ["decoder_attention_mask", "3"]),
    ("decoder-past-position-limit", dict(input_ids=IDS, decoder_input_ids=torch.ones(2, MAX_POSITIONS + 2, dtype=torch.long)),
     ValueError, ["decoder", "max_position_embeddings=16", str(MAX_POSITIONS + 2)]),
    ("decoder-empty-batch", dict(input_ids=IDS[:0], decoder_input_ids=IDS[:0]), ValueError, ["input_ids", "(0, 5)"]),
]

POSITION_CASES = {
    "encoder-mlm": [("position-ids-past-limit", dict(input_ids=IDS, position_ids=torch.arange(5)[None] + 12),
                     ValueError, ["position_ids", "16", "max_position_embeddings"])],
    # rotary positions have no upper limit (official Llama runs past max_position_embeddings too)
    "causal-lm": [("position-ids-float", dict(input_ids=IDS, position_ids=torch.arange(5.0)[None]),
                   TypeError, ["position_ids", "torch.float32"]),
                  ("position-ids-wrong-shape", dict(input_ids=IDS, position_ids=torch.arange(4)[None]),
                   ValueError, ["position_ids", "(1, 4)", "[2, 5]"]),
                  ("position-ids-negative", dict(input_ids=IDS, position_ids=torch.arange(5)[None] - 1),
                   ValueError, ["position_ids", "-1"])],
}


INPUTS_EMBEDS_CASES = [
    ("integer-inputs-embeds", dict(inputs_embeds=torch.ones(2, 5, 16, dtype=torch.long)), TypeError,
     ["inputs_embeds", "torch.int64", "hidden_size=16"]),
    ("inputs-embeds-wrong-width", dict(inputs_embeds=torch.ones(2, 5, 15)), ValueError,
     ["inputs_embeds", "(2, 5, 15)", "hidden_size=16"]),
]


def input_cases():
    for head in HEADS:
        for name, kwargs, error, fragments in COMMON_INPUT_CASES:
            if head.startswith("causal") and name == "past-position-limit":
                continue  # rotary positions have no upper limit: see test_rope's past-the-table parity
            yield pytest.param(head, kwargs, error, fragments, id=f"{head}-{name}")
        for name, kwargs, error, fragments in LABEL_CASES.get(head, []):
            yield pytest.param(head, {"input_ids": IDS, **kwargs}, error, fragments, id=f"{head}-{name}")
        for name, kwargs, error, fragments in POSITION_CASES.get(head, []):
            yield pytest.param(head, kwargs, error, fragments, id=f"{head}-{name}")
        if head != "seq2seq-lm":
            for name, kwargs, error, fragments in INPUTS_EMBEDS_CASES:
                yield pytest.param(head, kwargs, error, fragments, id=f"{head}-{name}")
    for name, kwargs, error, fragments in DECODER_CASES:
        yield pytest.param("seq2seq-lm", kwargs, error, fragments, id=f"seq2seq-lm-{name}")


@pytest.fixture(scope="module")
def models():
    return {head: build(head) for head in HEADS}


@pytest.mark.parametrize("head, kwargs, error, fragments", list(input_cases()))
def test_bad_input_names_field_and_value(models, head, kwargs, error, fragments):
    with pytest.raises(error) as info:
        models[head](**with_decoder(head, kwargs))
    assert_names(info.value, fragments)


@pytest.mark.parametrize("head", HEADS)
def test_the_good_input_of_each_head_runs(models, head):
    """Control for the matrix above: the unspoiled inputs (with labels of the right kind) are accepted."""
    labels = {
        "encoder-mlm": dict(labels=IDS), "encoder-tokcls": dict(labels=torch.full((2, 5), 2)),
        "encoder-seqcls": dict(labels=torch.tensor([0, 2])),
        "encoder-qa": dict(start_positions=torch.tensor([1, 2]), end_positions=torch.tensor([2, 9])),
        "causal-lm": dict(labels=IDS.masked_fill(IDS == IDS[0, 0], -100)), "causal-seqcls": dict(labels=torch.tensor([2, 0])),
        "seq2seq-lm": dict(labels=IDS[:, :4]),
    }[head]
    mask = MASK.clone()
    mask[1, 3:] = 0  # float 0/1 and bool masks are accepted too
    output = models[head](input_ids=IDS, attention_mask=mask.float() if head.startswith("causal") else mask.bool(),
                          **labels)
    assert torch.isfinite(output.loss)


# ================================================================================================================
# Checkpoints through every converter
# ================================================================================================================

CONVERTERS = {
    "bert": bert_conversion, "llama": llama_conversion, "bart": bart_conversion, "t5": t5_conversion,
    "bert2seq": bert2seq_conversion,
}
# the official source each converter reads (bert2seq reads a BERT)
SOURCE_KIND = {"bert": "bert", "llama": "llama", "bart": "bart", "t5": "t5", "bert2seq": "bert"}
# a source of another family, and its model_type
OTHER_SOURCE = {"bert": "llama", "llama": "bert", "bart": "t5", "t5": "bart", "bert2seq": "bart"}
# a tensor every converter needs
NEEDED_TENSOR = {
    "bert": "bert.encoder.layer.0.attention.self.value.bias",
    "bert2seq": "bert.encoder.layer.0.output.dense.weight",
    "llama": "model.layers.0.mlp.up_proj.weight",
    "bart": "model.encoder.layers.0.fc2.weight",
    "t5": "encoder.block.0.layer.1.DenseReluDense.wo.weight",
}


def official_model(kind: str):
    small = dict(vocab_size=64, max_position_embeddings=32)
    if kind == "bert":
        config = transformers.BertConfig(**small, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32)
        return transformers.BertForMaskedLM(config)
    if kind == "llama":
        config = transformers.LlamaConfig(**small, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                          num_key_value_heads=1, intermediate_size=32)
        return transformers.LlamaForCausalLM(config)
    if kind == "bart":
        config = transformers.BartConfig(**small, d_model=16, encoder_layers=1, decoder_layers=1,
                                         encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                         decoder_ffn_dim=32)
        return transformers.BartForConditionalGeneration(config)
    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    return transformers.T5ForConditionalGeneration(config)


@pytest.fixture(scope="module")
def official_sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("official")
    torch.manual_seed(0)
    sources = {}
    for kind in ("bert", "llama", "bart", "t5"):
        official_model(kind).save_pretrained(root / kind)
        sources[kind] = root / kind
    return sources


def _edit_tensors(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _grow(tensors: dict, key: str) -> None:
    tensors[key] = torch.cat([tensors[key], tensors[key][:1]])


def _truncate(folder: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


def _shard_and_lose_one(folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, folder / shard, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "model.safetensors").unlink()
    (folder / "model-00002-of-00002.safetensors").unlink()


def leave_marker(path: str) -> None:
    Path(path).write_text("the payload ran")


class RunsCodeWhenUnpickled:
    """A pickle payload that would create a marker file if anything unpickled it without weights_only."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (leave_marker, (self.marker,))


def _pickle_with_code(folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    torch.save({**tensors, "payload": RunsCodeWhenUnpickled(folder.parent / "payload-ran")}, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()


def checkpoint_cases():
    for family in CONVERTERS:
        key = NEEDED_TENSOR[family]
        other = OTHER_SOURCE[family]
        cases = [
            ("wrong-family", None, [f"model_type={other!r}"]),
            ("missing-tensor", lambda f, k=key: _edit_tensors(f, lambda t: t.pop(k)), ["missing", key]),
            ("unexpected-tensor",
             lambda f: _edit_tensors(f, lambda t: t.update({"extra.adapter.weight": torch.zeros(2)})),
             ["unexpected", "extra.adapter.weight"]),
            ("shape-mismatch", lambda f, k=key: _edit_tensors(f, lambda t: _grow(t, k)), ["wrong shapes", "expected", "got"]),
            ("truncated-safetensors", _truncate, ["model.safetensors", "truncated or corrupt"]),
            ("index-points-at-missing-shard", _shard_and_lose_one,
             ["model.safetensors.index.json", "missing shard", "model-00002-of-00002.safetensors"]),
            ("pickle-refused", _pickle_with_code, ["refusing to load", "pytorch_model.bin", "weights_only"]),
        ]
        for name, spoil, fragments in cases:
            yield pytest.param(family, name, spoil, fragments, id=f"{family}-{name}")


def _expected_wrong_shape_value(family: str) -> str:
    """The grown tensor's row count, as the shape message prints it."""
    return {"bert": "(17,)", "bert2seq": "(17, 32)", "llama": "(33, 16)", "bart": "(17, 32)", "t5": "(17, 32)"}[family]


def prepare_source(family: str, case: str, spoil, official_sources, tmp_path: Path) -> Path:
    if case == "wrong-family":
        return official_sources[OTHER_SOURCE[family]]
    src = tmp_path / "src"
    shutil.copytree(official_sources[SOURCE_KIND[family]], src)
    spoil(src)
    return src


def existing_destination(tmp_path: Path) -> tuple[Path, dict]:
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("previous content")
    return dst, {"keep.txt": "previous content"}


def assert_untouched(dst: Path, before: dict) -> None:
    assert {p.name: p.read_text() for p in dst.iterdir()} == before
    leftovers = [p.name for p in dst.parent.iterdir() if p.name.startswith((".dst", "..dst"))]
    assert leftovers == [], leftovers


@pytest.mark.parametrize("mode", ["api", "cli"])
@pytest.mark.parametrize("family, case, spoil, fragments", list(checkpoint_cases()))
def test_bad_checkpoint_is_a_clear_error_and_dst_is_untouched(
    family, case, spoil, fragments, mode, official_sources, tmp_path, capsys
):
    src = prepare_source(family, case, spoil, official_sources, tmp_path)
    dst, before = existing_destination(tmp_path)
    if case == "shape-mismatch":
        fragments = [*fragments, _expected_wrong_shape_value(family)]
    if mode == "api":
        with pytest.raises(ConversionError) as info:
            CONVERTERS[family].convert(src, dst, force=True)
        message = str(info.value)
    else:
        capsys.readouterr()
        assert conversion_main([family, str(src), str(dst), "--force"]) == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
        assert "Traceback" not in lines[0] and "--debug" not in lines[0]  # an expected failure, not a crash
        message = lines[0]
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert_untouched(dst, before)
    assert not (tmp_path / "payload-ran").exists()  # the pickle's code never ran


def test_good_sources_convert(official_sources, tmp_path):
    """Control for the matrix above: every unspoiled source converts (so each failure is the spoiling's)."""
    for family, module in CONVERTERS.items():
        result = module.convert(official_sources[SOURCE_KIND[family]], tmp_path / family)
        assert (result["dst"] / "model.safetensors").is_file(), family


def write_gguf(path: Path, *, architecture: str, raw_type=None) -> None:
    """A minimal GGUF: the architecture field and one tensor (F32, or raw bytes of a quantization type)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    if raw_type is None:
        writer.add_tensor("token_embd.weight", np.ones((8, 4), np.float32))
    else:
        writer.add_tensor("token_embd.weight", np.ones((4, gguf.GGML_QUANT_SIZES[raw_type][1]), np.uint8),
                          raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("mode", ["api", "cli"])
@pytest.mark.parametrize("case", ["other-architecture", "unsupported-quantization"])
def test_bad_gguf_is_a_clear_error_and_dst_is_untouched(case, mode, tmp_path, capsys):
    import gguf

    path = tmp_path / "model.gguf"
    if case == "other-architecture":
        write_gguf(path, architecture="bloom")
        fragments = ["model.gguf", "architecture 'bloom'", "expected 'llama'"]
    else:
        write_gguf(path, architecture="llama", raw_type=gguf.GGMLQuantizationType.Q8_1)
        fragments = ["model.gguf", "token_embd.weight (Q8_1)", "unsupported quantization"]
    dst, before = existing_destination(tmp_path)
    if mode == "api":
        with pytest.raises(ConversionError) as info:
            llama_conversion.convert(path, dst, force=True)
        message = str(info.value)
    else:
        capsys.readouterr()
        assert conversion_main(["llama", str(path), str(dst), "--force"]) == 1
        message = capsys.readouterr().err.strip()
        assert message.startswith("error: ") and len(message.splitlines()) == 1
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert_untouched(dst, before)


@pytest.mark.parametrize(
    "other, ids, fragments",
    [
        (dict(num_key_value_heads=2), IDS, ["past_key_values", "key/value heads 2 (expected 1)"]),
        (dict(num_key_value_heads=1, head_dim=4), IDS, ["past_key_values", "head_dim 4 (expected 8)"]),
        (dict(num_key_value_heads=1), IDS[:1], ["past_key_values", "batch size 1 (expected 2)"]),
    ],
    ids=["other-kv-heads", "other-head-dim", "other-batch-size"],
)
def test_a_cache_from_another_model_or_batch_is_named(models, other, ids, fragments):
    """It used to fail deep in cache_utils with "Sizes of tensors must match"."""
    from transformers import DynamicCache

    config = TinyCausalConfig(**{**SIZES, **other})
    source = TinyCausalForCausalLM(config).eval()
    cache = DynamicCache(config=config)
    source(ids, past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError) as info:
        models["causal-lm"](IDS[:, :1], past_key_values=cache, use_cache=True)
    assert_names(info.value, fragments)
