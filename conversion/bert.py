"""BERT (transformers `model_type: bert`) <-> hf_tiny encoder (`model_type: hf_tiny_encoder`).

    python -m conversion bert SRC DST              official BERT folder -> hf_tiny folder
    python -m conversion bert SRC DST --reverse    hf_tiny encoder folder -> official BERT folder

Supported official classes and their hf_tiny counterparts are in ARCHITECTURES. Head models prefix the encoder
with `bert.`; a bare BertModel has no prefix. The key map below is the whole story of the conversion: every
official tensor maps 1:1 to an hf_tiny tensor (no reshaping), except the MLM decoder, which is tied to the word
embeddings.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import torch

from .core import (
    ConversionError,
    KeyMap,
    Rule,
    atomic_output_dir,
    cast_floating,
    check_shapes,
    copy_tokenizer_files,
    expected_shapes,
    fail_on_parity,
    load_checkpoint,
    load_config_json,
    load_hf_tiny_config,
    max_abs_diff,
    parity_plans,
    parity_row,
    parse_dtype,
    require_model_type,
    write_model_card,
    write_official_folder,
)

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

# Per layer: official name -> hf_tiny name (weight and bias alike).
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
EMBEDDING_MODULES = {
    "embeddings.position_embeddings": "embed_positions",
    "embeddings.token_type_embeddings": "embed_token_types",
    "embeddings.LayerNorm": "embed_norm",
}
HEAD_MODULES = {
    "BertForMaskedLM": {"cls.predictions.transform.dense": "lm_head.dense", "cls.predictions.transform.LayerNorm": "lm_head.layer_norm"},
    "BertForSequenceClassification": {"classifier": "classifier"},
    "BertForTokenClassification": {"classifier": "classifier"},
    "BertForQuestionAnswering": {"qa_outputs": "qa_outputs"},
}
# Buffers some official checkpoints carry; the model recomputes them.
IGNORED_BUFFERS = (r"(bert\.)?embeddings\.position_ids", r"(bert\.)?embeddings\.token_type_ids")

# Parity is measured at conversion time; an fp32 row above its tolerance, or any non-finite row, fails the conversion.
SAMPLE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "A converted checkpoint holds the same numbers under different names.",
    "Hello!",
    "Attention backends must agree with each other on padded batches of sentences of different lengths.",
)


def key_map(architecture: str, *, tied: bool = True) -> KeyMap:
    """The declarative official <-> hf_tiny key map of one official class."""
    if architecture not in ARCHITECTURES:
        raise ConversionError(f"unsupported BERT architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    source = "" if architecture == "BertModel" else "bert."
    target = "" if architecture == "BertModel" else "model."
    has_pooler = ARCHITECTURES[architecture][3]

    def linear_or_norm(src: str, dst: str) -> list[tuple[str, str]]:
        return [(f"{src}.{p}", f"{dst}.{p}") for p in ("weight", "bias")]

    rules: list = []
    words = f"{source}embeddings.word_embeddings.weight"
    if architecture == "BertForMaskedLM" and tied:
        rules.append(Rule(words, (f"{target}embed_tokens.weight", "lm_head.decoder.weight")))
    else:
        rules.append((words, f"{target}embed_tokens.weight"))
    for official, ours in EMBEDDING_MODULES.items():
        if official.endswith("LayerNorm"):
            rules += linear_or_norm(source + official, target + ours)
        else:
            rules.append((f"{source}{official}.weight", f"{target}{ours}.weight"))
    for official, ours in LAYER_MODULES.items():
        rules += linear_or_norm(f"{source}encoder.layer.{{i}}.{official}", f"{target}layers.{{i}}.{ours}")
    if has_pooler:
        rules += linear_or_norm(f"{source}pooler.dense", f"{target}pooler.dense")
    for official, ours in HEAD_MODULES.get(architecture, {}).items():
        rules += linear_or_norm(official, ours)
    ignore = list(IGNORED_BUFFERS)
    if architecture == "BertForMaskedLM":
        if tied:
            # Official BERT ties decoder.bias to predictions.bias; tied copies are dropped in _drop_tied_copies.
            rules.append(("cls.predictions.bias", "lm_head.decoder.bias"))
        else:
            rules += linear_or_norm("cls.predictions.decoder", "lm_head.decoder")
            # Untied, the official forward uses decoder.bias and never reads predictions.bias.
            ignore.append(r"cls\.predictions\.bias")
    if not has_pooler:
        # The official class has no pooler either and ignores these tensors when loading.
        ignore.append(r"bert\.pooler\.dense\.(weight|bias)")
    return KeyMap(rules, ignore=ignore)


def _our_class(name: str):
    import hf_tiny

    return getattr(hf_tiny, name)


def _official_class(name: str):
    import transformers

    return getattr(transformers, name)


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
    from transformers import BertConfig

    from hf_tiny import TinyEncoderConfig

    fields = {k: v for k, v in bert_config.items() if k not in ("model_type", "architectures", "auto_map")}
    try:
        bert = BertConfig(**fields)
    except (TypeError, ValueError) as error:
        raise ConversionError(f"{src}: config.json is not a valid BERT config: {error}") from error
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


def bert_config_from_encoder(config, architecture: str, dtype: torch.dtype):
    from transformers import BertConfig

    values = {official: getattr(config, ours) for official, ours in CONFIG_FIELDS.items()}
    if values["id2label"] is None:
        values.pop("id2label")
        values.pop("label2id")
    return BertConfig(
        **values,
        architectures=[architecture],
        position_embedding_type="absolute",
        dtype=str(dtype).removeprefix("torch."),
    )


def _drop_tied_copies(state: dict, architecture: str, tied: bool) -> dict:
    """Official MLM checkpoints may store the tied decoder weight/bias as extra copies: verify and drop them."""
    if architecture != "BertForMaskedLM" or not tied:
        return state
    state = dict(state)
    for copy, original in (
        ("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"),
        ("cls.predictions.decoder.bias", "cls.predictions.bias"),
    ):
        if copy in state:
            if original in state and not torch.equal(state[copy], state[original]):
                raise ConversionError(
                    f"{copy} differs from {original}, but config.json says tie_word_embeddings=true; set it to false "
                    "if the checkpoint really has an untied decoder"
                )
            state.pop(copy)
    return state


def source_license(src: Path) -> str:
    """The `license:` of the source model card's YAML header, or "other" when it does not say."""
    card = src / "README.md"
    if not card.is_file():
        return "other"
    lines = card.read_text(errors="replace").splitlines()
    if not lines or lines[0].strip() != "---":
        return "other"
    for line in lines[1:]:
        if line.strip() == "---":
            break
        if line.startswith("license:"):
            return line.split(":", 1)[1].strip().strip("'\"") or "other"
    return "other"


def full_auto_map() -> dict:
    """auto_map naming every encoder class, so a converted folder loads with any Auto head and trust_remote_code."""
    import hf_tiny

    auto_map = {"AutoConfig": f"configuration_encoder.{hf_tiny.TinyEncoderConfig.__name__}"}
    for name, _auto, *_rest in ARCHITECTURES.values():
        cls = _our_class(name)
        auto_map[cls._auto_class] = f"modeling_encoder.{name}"
    return auto_map


# ----------------------------------------------------------------------------------------------------------------
# Parity at conversion time
# ----------------------------------------------------------------------------------------------------------------


def sample_inputs(src: Path, config) -> tuple[dict, str]:
    """A padded batch: the source tokenizer on SAMPLE_TEXTS when it loads, else seeded random ids."""
    # Without a vocabulary file transformers builds an empty BertTokenizer that maps every word to [UNK].
    if any((src / name).is_file() for name in ("tokenizer.json", "vocab.txt")):
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(src))
            batch = tokenizer(list(SAMPLE_TEXTS), padding=True, return_tensors="pt")
            if int(batch["input_ids"].max()) < config.vocab_size:
                return dict(batch), f"{len(SAMPLE_TEXTS)} sentences of different lengths through the source tokenizer"
        except Exception:  # an unusable tokenizer: random ids are as good a parity input
            pass
    generator = torch.Generator().manual_seed(0)
    seq_len = min(16, config.max_position_embeddings)
    lengths = [seq_len, max(1, seq_len - 5), max(1, seq_len // 4)]
    input_ids = torch.randint(0, config.vocab_size, (len(lengths), seq_len), generator=generator)
    token_type_ids = torch.randint(0, config.type_vocab_size, input_ids.shape, generator=generator)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        attention_mask[row, :length] = 1
    input_ids = input_ids.masked_fill(attention_mask == 0, config.pad_token_id or 0)
    inputs = {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": attention_mask}
    return inputs, f"seeded random token ids, padded batch of lengths {lengths}"


def compared_outputs(output, architecture: str, attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """The outputs parity is measured on; per-token outputs only at real (non-padding) tokens."""
    real = attention_mask.bool().to(output[0].device)
    if architecture == "BertModel":
        tensors = [output.last_hidden_state[real]]
        if output.pooler_output is not None:
            tensors.append(output.pooler_output)
        return tensors
    if architecture == "BertForSequenceClassification":
        return [output.logits]
    if architecture == "BertForQuestionAnswering":
        return [output.start_logits[real], output.end_logits[real]]
    return [output.logits[real]]


def _run(model, inputs: dict, device: str):
    with torch.no_grad():
        return model(**{k: v.to(device) for k, v in inputs.items()})


def measure_parity(src: Path, converted: Path, architecture: str, dtype: torch.dtype) -> tuple[list[dict], str]:
    """max |ours - official| per backend/device/dtype, with the official fp32 model as reference.

    Returns (rows for the model card, a description of the inputs)."""
    official = _official_class(architecture).from_pretrained(str(src), attn_implementation="eager", dtype=torch.float32)
    ours = _our_class(ARCHITECTURES[architecture][0]).from_pretrained(str(converted), attn_implementation="eager", dtype=dtype)
    official.eval()
    ours.eval()
    inputs, description = sample_inputs(src, ours.config)
    mask = inputs["attention_mask"]
    rows = []
    reference_device = None
    for device, run_dtype, backend in parity_plans(dtype):
        if device != reference_device:
            official.to(device)
            reference = compared_outputs(_run(official, inputs, device), architecture, mask)
            scale = max(1.0, max(float(t.abs().max()) for t in reference if t.numel()))
            reference_device = device
        ours.to(device=device, dtype=run_dtype)
        ours.set_attn_implementation(backend)
        produced = compared_outputs(_run(ours, inputs, device), architecture, mask)
        diff = max(max_abs_diff(a.float(), b.float()) for a, b in zip(produced, reference))
        rows.append(parity_row(backend, run_dtype, device, diff, scale))
    return rows, description


# ----------------------------------------------------------------------------------------------------------------
# The two directions
# ----------------------------------------------------------------------------------------------------------------


class _Stages:
    """A progress bar over the named steps of a conversion (the key map adds its own bar per tensor)."""

    def __init__(self, names: list[str]):
        from tqdm.auto import tqdm

        self.names = names
        # disable=None: a bar on a terminal only, so logs and captured stderr hold just the result or the error.
        self.bar = tqdm(total=len(names), desc=names[0], unit="step", file=sys.stderr, leave=False, disable=None)

    def next(self) -> None:
        self.bar.update(1)
        if self.bar.n < len(self.names):
            self.bar.set_description(self.names[self.bar.n])

    def close(self) -> None:
        self.bar.close()


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    force: bool = False,
    dtype: Optional[torch.dtype | str] = None,
    base_model: Optional[str] = None,
) -> dict:
    """Official BERT folder -> hf_tiny encoder folder (atomic: DST appears complete or not at all).

    Returns {"dst", "architecture", "hf_tiny_class", "parity" (rows measured now), "parity_inputs"}.
    """
    src, dst = Path(src), Path(dst)
    dtype = parse_dtype(dtype)
    bert_config = load_config_json(src)
    require_model_type(bert_config, "bert", src=src)
    config = encoder_config_from_bert(bert_config, src=src)

    stages = _Stages(["reading weights", "mapping names", "checking shapes", "saving", "measuring parity", "writing card"])
    try:
        return _convert_into(src, dst, force, dtype, base_model, bert_config, config, stages)
    finally:
        stages.close()


def _note_unused_pooler(state: dict, architecture: str) -> None:
    unused = sorted(k for k in state if k.startswith("bert.pooler.")) if not ARCHITECTURES[architecture][3] else []
    if unused:
        print(
            f"note: ignoring {', '.join(unused)}: {architecture} has no pooler (transformers ignores them too)",
            file=sys.stderr,
        )


def _convert_into(src, dst, force, dtype, base_model, bert_config, config, stages) -> dict:
    src_dir = src if src.is_dir() else src.parent
    with atomic_output_dir(dst, force=force, src=src) as tmp:
        state = load_checkpoint(src)
        architecture = detect_architecture(bert_config, state, src=src)
        ours_name, auto_class, pipeline_tag, _ = ARCHITECTURES[architecture]
        stages.next()

        _note_unused_pooler(state, architecture)
        state = _drop_tied_copies(state, architecture, config.tie_word_embeddings)
        mapping = key_map(architecture, tied=config.tie_word_embeddings)
        converted = mapping.to_target(state, num_layers=config.num_hidden_layers, progress=sys.stderr.isatty())
        converted = cast_floating(converted, dtype)
        stages.next()

        config.architectures = [ours_name]
        config.auto_map = full_auto_map()
        with torch.device("meta"):
            model = _our_class(ours_name)(config)
        check_shapes(converted, expected_shapes(model))
        stages.next()

        model.load_state_dict(converted, strict=True, assign=True)
        model.tie_weights()
        model.save_pretrained(tmp)
        copy_tokenizer_files(src_dir, tmp)
        stages.next()

        saved_dtype = dtype or next(iter(converted.values())).dtype
        parity, inputs_description = measure_parity(src_dir, tmp, architecture, saved_dtype)
        stages.next()

        write_model_card(
            tmp,
            model_name=dst.name,
            license=source_license(src_dir),
            model_id=str(dst),
            base_model=base_model or src.resolve().name,
            pipeline_tag=pipeline_tag,
            family="hf_tiny_encoder (BERT-style encoder)",
            auto_class=auto_class,
            description=f"`{ours_name}` converted from the official `{architecture}` checkpoint `{src.resolve().name}`.",
            parity_rows=parity,
            tags=["bert", "encoder"],
            extra=f"\nParity inputs: {inputs_description}. Per-token outputs are compared at real tokens only; "
            "the tolerance is the relative tolerance of the dtype times max(1, max |official output|).\n",
        )
        stages.next()
        fail_on_parity(parity, architecture, converted)
    return {
        "dst": dst,
        "architecture": architecture,
        "hf_tiny_class": ours_name,
        "parity": parity,
        "parity_inputs": inputs_description,
    }


def convert_back(src: str | os.PathLike, dst: str | os.PathLike, *, force: bool = False) -> dict:
    """hf_tiny encoder folder -> official BERT folder that transformers' Bert* classes load with no missing or
    unexpected keys. Returns {"dst", "architecture"}."""
    from hf_tiny import TinyEncoderConfig

    src, dst = Path(src), Path(dst)
    config, ours_name = load_hf_tiny_config(src, TinyEncoderConfig, supported=OFFICIAL_BY_OURS, default="TinyEncoderModel")
    architecture = OFFICIAL_BY_OURS[ours_name]
    tied = config.tie_word_embeddings

    with atomic_output_dir(dst, force=force, src=src) as tmp:
        state = dict(load_checkpoint(src))
        if architecture == "BertForMaskedLM" and tied and "lm_head.decoder.weight" not in state:
            # save_pretrained stores tied weights once.
            if "model.embed_tokens.weight" in state:
                state["lm_head.decoder.weight"] = state["model.embed_tokens.weight"]
        official = key_map(architecture, tied=tied).to_source(
            state, num_layers=config.num_hidden_layers, progress=sys.stderr.isatty()
        )
        if architecture == "BertForMaskedLM" and not tied:
            official["cls.predictions.bias"] = official["cls.predictions.decoder.bias"].clone()
        dtype = next(iter(official.values())).dtype
        bert_config = bert_config_from_encoder(config, architecture, dtype)
        write_official_folder(tmp, _official_class(architecture), bert_config, official, src)
    return {"dst": dst, "architecture": architecture}


__all__ = [
    "ARCHITECTURES",
    "convert",
    "convert_back",
    "key_map",
    "detect_architecture",
    "encoder_config_from_bert",
    "bert_config_from_encoder",
    "measure_parity",
]
