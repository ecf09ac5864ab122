"""What the seq2seq families (bart.py, t5.py, bert2seq.py) share: the hf_tiny side of the map, the style presets
of TinySeq2SeqConfig, generation_config.json, and the reverse checks.

Encoder layers use the placeholder {i} and decoder layers {j}, so stacks of different depths map with
num_layers={"i": encoder depth, "j": decoder depth}.
"""

from __future__ import annotations

from pathlib import Path

from .errors import ConversionError
from .pipeline import LABEL_FIELDS, Family, Plan, Source
from .writer import write_generation_config

# The label fields (pipeline.LABEL_FIELDS) in the families' official field -> hf_tiny field tables
SAME_LABEL_FIELDS = {name: name for name in LABEL_FIELDS}


def stack_depths(config) -> dict[str, int]:
    """num_layers for a seq2seq KeyMap: {i} runs over encoder layers, {j} over decoder layers."""
    return {"i": config.num_hidden_layers, "j": config.num_decoder_layers}


def styled_config(style: str, src, **fields):
    """TinySeq2SeqConfig.from_style(style, **fields); a checkpoint it cannot express is a ConversionError."""
    from hf_tiny import TinySeq2SeqConfig

    try:
        return TinySeq2SeqConfig.from_style(style, **fields)
    except (TypeError, ValueError) as error:
        raise ConversionError(f"{src}: this checkpoint has no hf_tiny seq2seq equivalent: {error}") from error


def require_style(config, style: str, src, **expected) -> None:
    """The config must be of `style` (and have the `expected` values) to be written in that official format."""
    mismatches = config.style_mismatches(style) + [
        f"{k}={getattr(config, k)!r} (it needs {v!r})" for k, v in expected.items() if getattr(config, k) != v
    ]
    if mismatches:
        raise ConversionError(f"{src}: cannot be expressed as {style}: {', '.join(mismatches)}")


class Seq2SeqFamily(Family):
    config_class = "TinySeq2SeqConfig"
    classes = {"TinySeq2SeqForConditionalGeneration": ("AutoModelForSeq2SeqLM", "text2text-generation")}
    default_class = "TinySeq2SeqForConditionalGeneration"
    modality = "seq2seq"
    card_family = "hf_tiny_seq2seq (encoder-decoder)"
    keep_stored_tied_copies = True  # transformers 5 unties e.g. a T5 head whose stored copy differs
    keep_source_generation_config = True

    def write_side_files(self, source: Source, plan: Plan, tmp: Path) -> str:
        note = super().write_side_files(source, plan, tmp)
        if not self.keep_source_generation_config:
            (tmp / "generation_config.json").unlink(missing_ok=True)
        write_generation_config(tmp, plan.config, plan.official_config)
        return note
