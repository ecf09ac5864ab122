"""The families `python -m conversion` knows, and which one a source belongs to when none is named."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from .errors import ConversionError

# family name -> module defining FAMILY (a pipeline.Family), convert() and, where it exists, convert_back()
FAMILIES = {
    "bert": "conversion.bert",
    "roberta": "conversion.roberta",
    "distilbert": "conversion.distilbert",
    "electra": "conversion.electra",
    "albert": "conversion.albert",
    "modernbert": "conversion.modernbert",
    "llama": "conversion.llama",
    "gpt2": "conversion.gpt2",
    "mpt": "conversion.mpt",
    "phi3": "conversion.phi3",
    "bart": "conversion.bart",
    "t5": "conversion.t5",
    "bert2seq": "conversion.bert2seq",
}
# hf_tiny model_type -> the family that converts it back (encoder, seq2seq and causal: decided by variant fields)


def family_module(name: str):
    if name not in FAMILIES:
        raise KeyError(name)
    module_name = FAMILIES[name]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name == module_name:
            raise ConversionError(f"family {name!r} is registered but its converter module {module_name} is not available") from error
        raise


def family_for(name: str):
    """The Family object of a registered family name."""
    return family_module(name).FAMILY


def detect_family(src: str | os.PathLike, *, reverse: bool = False) -> tuple[str, str]:
    """(family name, why): from the GGUF header, Meta's layout, or config.json's model_type (an hf_tiny
    model_type with reverse=True names the family that converts it back)."""
    from .gguf_files import gguf_architecture
    from .readers import load_config_json

    src = Path(src)
    if not src.exists():
        raise ConversionError(f"source {src} does not exist")
    gguf = _lone_gguf(src)
    if gguf is not None:
        architecture = gguf_architecture(gguf)
        for name in FAMILIES:
            if architecture in family_for(name).gguf_architectures:
                return name, f"GGUF architecture {architecture!r}"
        known = sorted({a for name in FAMILIES for a in family_for(name).gguf_architectures})
        raise ConversionError(f"{gguf}: no converter reads GGUF architecture {architecture!r}; known: {', '.join(known)}")
    if src.is_dir() and (src / "params.json").is_file() and any(src.glob("consolidated.*.pth")):
        return "llama", "Meta consolidated layout (params.json + consolidated.*.pth)"
    from .gpt2 import nanogpt_checkpoint

    if nanogpt_checkpoint(src) is not None:
        return "gpt2", f"nanoGPT checkpoint {nanogpt_checkpoint(src).name}"
    raw = load_config_json(src)
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type.startswith("hf_tiny"):
        if not reverse:
            raise ConversionError(
                f"{src} is already an hf_tiny folder (model_type={model_type!r}); pass --reverse to convert it back"
            )
        if model_type == "hf_tiny_encoder":
            return _encoder_variant_of(raw, src)
        if model_type == "hf_tiny_seq2seq":
            name = "t5" if raw.get("position_embedding_type") == "relative" else "bart"
            return name, f"model_type {model_type!r} with position_embedding_type {raw.get('position_embedding_type')!r}"
        if model_type == "hf_tiny_causal":
            return _causal_variant_of(raw, src)
    elif reverse:
        raise ConversionError(f"--reverse converts an hf_tiny folder back; {src} has model_type={model_type!r}")
    if model_type is None:
        return _family_from_tensor_names(src)
    for name in FAMILIES:
        family = family_for(name)
        if family.detected and model_type in family.model_types:
            return name, f"model_type {model_type!r}"
    known = sorted({t for name in FAMILIES for t in family_for(name).model_types})
    raise ConversionError(
        f"{src}: no converter reads model_type={model_type!r} (config.json); known model types: {', '.join(known)}"
    )


def _encoder_variant_of(raw: dict, src: Path) -> tuple[str, str]:
    """The encoder family whose variant's fixed config fields (EncoderVariant.fixed_config) the hf_tiny encoder
    config holds, the variant fixing most fields first (BERT fixes none; fields that only name tensors,
    layout_fields, may differ: folders converted before them); the why names the fields that differ from the
    encoder's defaults."""
    from hf_tiny import TinyEncoderConfig

    from .readers import hf_tiny_config_from_dict

    config = hf_tiny_config_from_dict(raw, TinyEncoderConfig, src=src)
    defaults = TinyEncoderConfig()
    variants = [(name, family_for(name).variant) for name in FAMILIES if family_for(name).modality == "encoder"]
    fixed = {name: {k: v for k, v in variant.fixed_config.items() if k not in variant.layout_fields}
             for name, variant in variants}
    name = next(name for name, _ in sorted(variants, key=lambda item: -len(fixed[item[0]]))
                if all(getattr(config, field) == value for field, value in fixed[name].items()))
    # BERT fixes nothing, so one always matches
    fields = [f"{k}={v!r}" for k, v in fixed[name].items() if getattr(defaults, k) != v]
    return name, "model_type 'hf_tiny_encoder'" + (f" with {', '.join(fields)}" if fields else "")


def _causal_variant_of(raw: dict, src: Path) -> tuple[str, str]:
    """GPT-2 for learned positions, MPT for ALiBi, Phi-3 for what only Phi-3 holds (partial rotary, longrope that drops
    its cache: phi3.needs_phi3), else the Llama family (which picks Llama, Mistral, Qwen2, Qwen3 or Gemma 3 from the
    fields)."""
    from hf_tiny import TinyCausalConfig

    from .phi3 import needs_phi3
    from .readers import hf_tiny_config_from_dict

    config = hf_tiny_config_from_dict(raw, TinyCausalConfig, src=src)
    if config.position_embedding_type == "learned":
        return "gpt2", "model_type 'hf_tiny_causal' with position_embedding_type 'learned'"
    if config.position_embedding_type == "alibi":
        return "mpt", "model_type 'hf_tiny_causal' with position_embedding_type 'alibi'"
    if needs_phi3(config):
        rope = config.rope_parameters_for("full_attention")
        return "phi3", (f"model_type 'hf_tiny_causal' with rope_type {rope['rope_type']!r} and partial_rotary_factor "
                        f"{rope.get('partial_rotary_factor', 1.0)}")
    return "llama", "model_type 'hf_tiny_causal'"


def _family_from_tensor_names(src: Path) -> tuple[str, str]:
    """A config.json without model_type (old transformers versions wrote none): the family whose marker tensors
    the checkpoint holds."""
    from .readers import checkpoint_keys

    keys = set(checkpoint_keys(src))
    for name in FAMILIES:
        family = family_for(name)
        found = [marker for marker in family.tensor_markers if marker in keys]
        if family.detected and found:
            return name, f"config.json has no model_type; the checkpoint holds {found[0]}"
    raise ConversionError(
        f"{src}: config.json has no model_type and no tensor name tells the family (a bare encoder state dict has the "
        "same names in BERT and RoBERTa); name the family: python -m conversion FAMILY SRC DST"
    )


def _lone_gguf(src: Path) -> Path | None:
    if src.is_file():
        return src if src.suffix == ".gguf" else None
    if (src / "config.json").is_file():
        return None
    ggufs = sorted(src.glob("*.gguf"))
    if len(ggufs) > 1:
        raise ConversionError(f"{src} holds {len(ggufs)} GGUF files ({', '.join(p.name for p in ggufs)}); pass the one to convert")
    return ggufs[0] if ggufs else None
