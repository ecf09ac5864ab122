"""What the families converting to hf_tiny's causal LM share (Llama, Phi-3, GPT-2, MPT): our classes, building
the config, finding the class a checkpoint names, the kind of source, and GGUF sources (read with transformers'
dequantization, the official side loaded with `gguf_file=`, the tokenizer rebuilt from it)."""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import ConversionError
from .gguf_files import gguf_special_token_ids, load_gguf
from .pipeline import Family, Plan, Source
from .readers import require_model_type

# hf_tiny class -> (Auto class, pipeline tag, prefix of the base model's tensors)
OUR_CLASSES = {
    "TinyCausalForCausalLM": ("AutoModelForCausalLM", "text-generation", "model."),
    "TinyCausalForSequenceClassification": ("AutoModelForSequenceClassification", "text-classification", "model."),
    "TinyCausalModel": ("AutoModel", "feature-extraction", ""),
}


# Old checkpoints carry the rotary buffers; the model recomputes them.
IGNORED_BUFFERS = (r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"(model\.)?rotary_emb\.inv_freq")


LABEL_FIELDS = ("id2label", "label2id", "problem_type")


def build_causal_config(values: dict, official, *, src):
    """TinyCausalConfig(**values) with the official config's label fields; invalid values are a ConversionError
    naming the source and its model type."""
    from hf_tiny import TinyCausalConfig

    values = dict(values)
    for label_field in LABEL_FIELDS:
        if getattr(official, label_field, None) is not None:
            values[label_field] = getattr(official, label_field)
    try:
        return TinyCausalConfig(**values)
    except (TypeError, ValueError) as error:
        raise ConversionError(f"{src}: this {official.model_type} config has no hf_tiny equivalent: {error}") from error


def check_layer_types(raw: dict, *, src) -> None:
    """config.json's layer_types against the ones hf_tiny knows, before transformers reads it (older versions fail
    on an unknown one with a bare KeyError)."""
    from hf_tiny.configuration_causal import LAYER_TYPES

    for index, kind in enumerate(raw.get("layer_types") or ()):
        if kind not in LAYER_TYPES:
            raise ConversionError(f"{src}: layer_types[{index}]={kind!r} is not a layer type hf_tiny knows; choose one "
                                  f"of {list(LAYER_TYPES)}")


def plain_dict(value):
    """rope_parameters as plain nested dicts (copied)."""
    return {k: plain_dict(v) for k, v in value.items()} if isinstance(value, dict) else value


def detect_source(src: Path) -> tuple[str, Path]:
    """("gguf", file) | ("meta", folder) | ("hf", folder)."""
    if not src.exists():
        raise ConversionError(f"source {src} does not exist")
    if src.is_file():
        if src.suffix == ".gguf":
            return "gguf", src
        raise ConversionError(f"source {src} is a file but not a .gguf; pass a checkpoint folder or a .gguf file")
    if (src / "params.json").is_file() and sorted(src.glob("consolidated.*.pth")):
        return "meta", src
    if (src / "config.json").is_file():
        return "hf", src
    ggufs = sorted(src.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf", ggufs[0]
    if len(ggufs) > 1:
        raise ConversionError(
            f"{src} holds {len(ggufs)} GGUF files ({', '.join(p.name for p in ggufs)}); pass the one to convert"
        )
    raise ConversionError(
        f"{src} is not a Llama checkpoint: expected config.json (Hugging Face), params.json + consolidated.*.pth "
        "(Meta), or a .gguf file"
    )


def class_for_architecture(architectures, official_classes: dict[str, str], default: str, *, src) -> str:
    """The hf_tiny class of config.json's `architectures[0]` (default when it names none)."""
    named = (architectures or [default])[0]
    for ours, official in official_classes.items():
        if named == official:
            return ours
    raise ConversionError(
        f"{src}: architecture {named!r} is not supported; supported: {', '.join(official_classes.values())}"
    )


class CausalFamily(Family):
    """What every family converting to the hf_tiny causal LM shares: its classes, and GGUF sources (read with
    transformers' dequantization, the official side loaded with `gguf_file=`, the tokenizer rebuilt from it)."""

    config_class = "TinyCausalConfig"
    classes = {name: (auto, tag) for name, (auto, tag, _prefix) in OUR_CLASSES.items()}
    default_class = "TinyCausalForCausalLM"
    modality = "causal"

    def read_gguf(self, path: Path) -> Source:
        raw, state = load_gguf(path, expected_architecture=self.gguf_architectures)
        require_model_type(raw, self.model_types, src=path)
        return Source(path, path.parent, "gguf", raw, state, f"the GGUF file `{path.name}` (dequantized to float32)")

    def official_model(self, source: Source, plan: Plan):
        if source.kind == "gguf":
            import transformers

            return transformers.AutoModelForCausalLM.from_pretrained(
                str(source.folder), gguf_file=source.path.name, dtype=torch.float32
            )
        return super().official_model(source, plan)

    def write_side_files(self, source: Source, plan: Plan, tmp: Path) -> str:
        if source.kind != "gguf":
            return super().write_side_files(source, plan, tmp)
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(source.folder), gguf_file=source.path.name)
        except Exception as error:  # the weights are still usable; say so on the card
            return f"the GGUF tokenizer could not be rebuilt ({type(error).__name__}: {error})"
        padding = gguf_special_token_ids(source.path).get("padding")
        if tokenizer.pad_token is None and padding is not None:
            # transformers before 5.2x leaves it unset when rebuilding from GGUF (the metadata names it)
            tokenizer.pad_token = tokenizer.convert_ids_to_tokens(padding)
        tokenizer.save_pretrained(str(tmp))
        return "rebuilt from the GGUF metadata"
