"""What the families converting to hf_tiny's causal LM share (Llama, Phi-3, GPT-2, MPT): our classes, building
the config, finding the class a checkpoint names, the kind of source, GGUF sources (read with transformers'
dequantization, the official side loaded with `gguf_file=`, the tokenizer rebuilt from it), and the reading,
planning and reverse plan of a family of one official model type."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from .errors import ConversionError
from .gguf_files import gguf_special_token_ids, official_meta_model, open_gguf
from .keymap import KeyMap, Rule
from .pipeline import LABEL_FIELDS, Family, Plan, ReversePlan, Source
from .readers import hub_id_of, official_config, require_model_type, source_name
from .streamed import Streamed
from .writer import drop_tied_copies

# hf_tiny class -> (Auto class, pipeline tag, prefix of the base model's tensors)
OUR_CLASSES = {
    "TinyCausalForCausalLM": ("AutoModelForCausalLM", "text-generation", "model."),
    "TinyCausalForSequenceClassification": ("AutoModelForSequenceClassification", "text-classification", "model."),
    "TinyCausalModel": ("AutoModel", "feature-extraction", ""),
}


# Old checkpoints carry the rotary buffers; the model recomputes them.
IGNORED_BUFFERS = (r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"(model\.)?rotary_emb\.inv_freq")


# Fields with the same name and meaning in TinyCausalConfig and every Llama-style official config (the Llama
# family's types, Phi-3).
SHARED_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "max_position_embeddings", "initializer_range", "rms_norm_eps", "attention_dropout",
    "tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id",
)


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


def label_fields(config) -> dict:
    """The label fields of an hf_tiny config, for the official config of any class (pipeline.LABEL_FIELDS)."""
    return {name: getattr(config, name) for name in LABEL_FIELDS}


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


def require_class(class_name: str, official_classes: dict) -> None:
    """An hf_tiny class the family converts (official_classes: hf_tiny class -> its official class)."""
    if class_name not in official_classes:
        raise ConversionError(f"unsupported hf_tiny class {class_name!r}; supported: {', '.join(official_classes)}")


def embedding_rule(config, class_name: str, official: str) -> Rule:
    """The official word embeddings (`official`) -> ours, and the LM head too where it is tied to them."""
    ours = f"{OUR_CLASSES[class_name][2]}embed_tokens.weight"
    tied = class_name == "TinyCausalForCausalLM" and config.tie_word_embeddings
    return Rule(official, (ours, "lm_head.weight") if tied else ours)


def head_rules(config, class_name: str) -> list:
    """The untied LM head's rule or the sequence classifier's (none for the base model and a tied head)."""
    if class_name == "TinyCausalForCausalLM" and not config.tie_word_embeddings:
        return [("lm_head.weight", "lm_head.weight")]
    if class_name == "TinyCausalForSequenceClassification":
        return [("score.weight", "score.weight")]
    return []


def class_for_architecture(architectures, official_classes: dict[str, str], default: str, *, src) -> str:
    """The hf_tiny class of config.json's `architectures[0]` (default when it names none)."""
    named = (architectures or [default])[0]
    for ours, official in official_classes.items():
        if named == official:
            return ours
    raise ConversionError(
        f"{src}: architecture {named!r} is not supported; supported: {', '.join(official_classes.values())}"
    )


def _of_repo(path: Path) -> str:
    repo = hub_id_of(path)
    return f" of `{repo}`" if repo else ""


class CausalFamily(Family):
    """What every family converting to the hf_tiny causal LM shares: its classes, and GGUF sources (read with
    transformers' dequantization, the official side loaded with `gguf_file=`, the tokenizer rebuilt from it)."""

    config_class = "TinyCausalConfig"
    classes = {name: (auto, tag) for name, (auto, tag, _prefix) in OUR_CLASSES.items()}
    default_class = "TinyCausalForCausalLM"
    modality = "causal"

    def read_gguf(self, path: Path) -> Source:
        raw, state = open_gguf(path, expected_architecture=self.gguf_architectures)
        require_model_type(raw, self.model_types, src=path)
        notes = [] if "rope_parameters" not in raw else [
            f"Its `rope_freqs.weight` (llama.cpp's per-frequency RoPE factors) is read as rope_parameters="
            f"{raw['rope_parameters']}, which reproduce every factor; transformers' GGUF loader drops the tensor, so "
            "the official side is loaded with these rope_parameters."
        ]
        description = f"the GGUF file `{path.name}`{_of_repo(path)} (dequantized to float32)"
        return Source(path, path.parent, "gguf", raw, state, description, notes=notes)

    def official_stream(self, source: Source, plan: Plan):
        """A GGUF's official side: the class and config `from_pretrained(dir, gguf_file=...)` builds, over the same
        dequantized tensors (gguf's dequantize and transformers' processor, one tensor at a time)."""
        if source.kind != "gguf":
            return super().official_stream(source, plan)
        model = official_meta_model(source.raw_config)
        return Streamed(type(model), model.config, source.state)

    def official_model(self, source: Source, plan: Plan):
        if source.kind == "gguf":
            import transformers

            raw = source.raw_config
            scaling = {"rope_parameters": raw["rope_parameters"]} if "rope_parameters" in raw else {}
            return transformers.AutoModelForCausalLM.from_pretrained(
                str(source.folder), gguf_file=source.path.name, dtype=torch.float32, **scaling
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


class SingleTypeFamily(CausalFamily):
    """A causal family of one official model type (GPT-2, MPT, Phi-3) whose classes match ours one to one. Its
    module names the official classes, the tensor a tied head copies, the config both ways and the key map;
    reading, planning and the reverse plan are the same for each."""

    official_classes: dict[str, str] = {}  # hf_tiny class -> official class
    word_embeddings = ""  # the official tensor a tied LM head copies
    config_from_official: Callable  # (official config, *, src) -> TinyCausalConfig
    official_config_of: Callable  # (hf_tiny config, official class) -> the transformers config
    key_map: Callable[..., KeyMap]  # (hf_tiny config, hf_tiny class) -> KeyMap

    def __init__(self, model_type: str, title: str, card_family: str, *, gguf: bool, tags=(), markers=()):
        """title: the family in an error message, with its article ("a GPT-2"); gguf: the family reads GGUF files
        of general.architecture model_type; tags: the card's tags between the model type and causal-lm."""
        self.name, self.model_types, self.title = model_type, (model_type,), title
        self.gguf_architectures = (model_type,) if gguf else ()
        self.card_family = card_family
        self.tags = (model_type, *tags, "causal-lm", "text-generation")
        self.tensor_markers = markers

    def read(self, src: Path, *, allow_missing_model_type: bool = False) -> Source:
        """A Hugging Face folder of the model type, or a GGUF file where the family reads GGUF."""
        kind, path = detect_source(src)
        if kind == "gguf" and self.gguf_architectures:
            return self.read_gguf(path)
        if kind != "hf":
            gguf = f" or a {self.name} GGUF" if self.gguf_architectures else ""
            raise ConversionError(f"{src} is not {self.title} checkpoint: expected a Hugging Face folder{gguf}")
        source = self.read_hf_folder(path, allow_missing_model_type=allow_missing_model_type)
        source.description = f"the Hugging Face {self.name} folder `{source_name(path)}`"
        return source

    def plan_notes(self, source: Source, official) -> list[str]:
        """Card lines beside the source's own notes (default: none)."""
        return []

    def plan(self, source: Source) -> Plan:
        official = official_config(source.raw_config, src=source.path)
        config = self.config_from_official(official, src=source.path)
        class_name = "TinyCausalForCausalLM" if source.kind == "gguf" else class_for_architecture(
            source.raw_config.get("architectures"), self.official_classes,
            self.official_classes["TinyCausalForCausalLM"], src=source.path)
        state = source.state
        if class_name == "TinyCausalForCausalLM" and config.tie_word_embeddings:
            state = drop_tied_copies(state, self.word_embeddings, ["lm_head.weight"], src=source.path)
        return Plan(config, class_name, self.official_classes[class_name], self.key_map(config, class_name),
                    config.num_hidden_layers, state, notes=[*source.notes, *self.plan_notes(source, official)])

    def reverse(self, config, our_class: str, src: Path) -> ReversePlan:
        official_class = self.official_classes[our_class]
        return ReversePlan(official_class, self.official_config_of(config, official_class),
                           self.key_map(config, our_class), config.num_hidden_layers)
