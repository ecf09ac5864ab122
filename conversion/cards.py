"""Model cards: model_cards/<template>.md filled in with the parity measured at conversion time."""

from __future__ import annotations

import json
import os
import string
from collections.abc import Mapping
from pathlib import Path

from hf_tiny.attention import ATTENTION_BACKENDS
from hf_tiny.transformers_api import tested_range_text, tested_torch_text

from .errors import list_names

MODEL_CARDS_DIR = Path(__file__).resolve().parents[1] / "model_cards"
PARITY_COLUMNS = ("backend", "dtype", "device", "max_abs_diff", "tolerance")
ALWAYS_TAGS = ("hf_tiny", "custom_code")
# Fields a card may omit, with their defaults.
CARD_DEFAULTS = {
    "license": "apache-2.0",
    "tags": (),
    "attention_backends": tuple(ATTENTION_BACKENDS),  # every backend the models take, ours included
    "extra": "",
}


def _yaml_str(value) -> str:
    return json.dumps(str(value))  # a JSON string is a valid YAML double-quoted scalar


def _format_number(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if value != 0 else "0"
    return str(value)


def within_tolerance(row: Mapping) -> bool:
    """A parity row's verdict (the card's "within tolerance" column): max_abs_diff <= tolerance (NaN is not)."""
    return float(row["max_abs_diff"]) <= float(row["tolerance"])


def _parity_table(rows) -> str:
    if not rows:
        raise ValueError("model card field 'parity_rows' must hold at least one measured row")
    lines = ["| backend | dtype | device | max abs diff | tolerance | within tolerance |", "|---|---|---|---|---|---|"]
    for number, row in enumerate(rows):
        if isinstance(row, (tuple, list)) and len(row) == len(PARITY_COLUMNS):
            row = dict(zip(PARITY_COLUMNS, row, strict=True))
        if not isinstance(row, Mapping) or any(column not in row for column in PARITY_COLUMNS):
            raise ValueError(f"parity_rows[{number}] must give {', '.join(PARITY_COLUMNS)}; got {rows[number]!r}")
        within = "yes" if within_tolerance(row) else "NO"
        cells = [_format_number(row[column]) for column in PARITY_COLUMNS] + [within]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# Placeholders computed from other fields: {placeholder: the field it is computed from}.
# Placeholders filled from hf_tiny itself, never from a field.
_VERSION_PLACEHOLDERS = ("tested_transformers", "tested_torch")
_DERIVED_CARD_FIELDS = {
    "tags_yaml": "tags",
    "parity_table": "parity_rows",
    "attention_backends_list": "attention_backends",
    "base_model_yaml": "base_model",
    "license_yaml": "license",
    "pipeline_tag_yaml": "pipeline_tag",
}


def render_model_card(template_name: str = "hf_tiny", **fields) -> str:
    """Fills model_cards/<template_name>.md ($placeholders) with fields; a missing or unknown field is an error.

    Fields of the hf_tiny template: model_name, model_id (what from_pretrained is given), base_model (the source's
    Hub id, or None where it has none: the metadata line is left out), source_name (how the text names the source),
    pipeline_tag, family, auto_class, description, parity_rows (rows of backend, dtype, device,
    max_abs_diff, tolerance, as dicts or 5-tuples); optional: license, tags, attention_backends, extra.
    """
    path = MODEL_CARDS_DIR / f"{template_name}.md"
    if not path.is_file():
        available = list_names(p.stem for p in MODEL_CARDS_DIR.glob("*.md")) or "none"
        raise ValueError(f"no model card template {template_name!r} in {MODEL_CARDS_DIR} (available: {available})")
    template = string.Template(path.read_text())
    placeholders = {
        match.group("named") or match.group("braced")
        for match in template.pattern.finditer(template.template)
        if match.group("named") or match.group("braced")
    }
    needed = {_DERIVED_CARD_FIELDS.get(name, name) for name in placeholders if name not in _VERSION_PLACEHOLDERS}
    values = {**CARD_DEFAULTS, **fields}
    missing = sorted(needed - values.keys())
    if missing:
        raise ValueError(f"model card template {template_name!r} needs field(s): {', '.join(missing)}")
    unknown = sorted(fields.keys() - needed - CARD_DEFAULTS.keys())
    if unknown:
        raise ValueError(f"model card template {template_name!r} has no field(s): {', '.join(unknown)}")
    if isinstance(values["tags"], str) or isinstance(values["attention_backends"], str):
        raise TypeError("model card fields 'tags' and 'attention_backends' must be lists of strings")
    tags = list(ALWAYS_TAGS) + [tag for tag in values["tags"] if tag not in ALWAYS_TAGS]
    derived = {
        "tested_transformers": tested_range_text(),
        "tested_torch": tested_torch_text(),
        "tags_yaml": "\n".join(f"  - {_yaml_str(tag)}" for tag in tags),
        "attention_backends_list": ", ".join(f"`{name}`" for name in values["attention_backends"]),
        "license_yaml": _yaml_str(values["license"]),
    }
    if "pipeline_tag" in values:
        derived["pipeline_tag_yaml"] = _yaml_str(values["pipeline_tag"])
    if "base_model" in values:  # a line of its own, left out where the source has no Hub id (None)
        base_model = values["base_model"]
        derived["base_model_yaml"] = "" if base_model is None else f"\nbase_model: {_yaml_str(base_model)}"
    if "parity_table" in placeholders:
        derived["parity_table"] = _parity_table(values["parity_rows"])
    return template.substitute({**values, **derived})


def write_model_card(dst_dir: str | os.PathLike, template_name: str = "hf_tiny", **fields) -> Path:
    """Renders the card and writes it as dst_dir/README.md; returns the path. A config.json already in dst_dir
    whose special token ids lie outside the vocabulary adds a note saying so (extra)."""
    path = Path(dst_dir) / "README.md"
    note = special_token_note(Path(dst_dir) / "config.json")
    if note:
        fields = {**fields, "extra": fields.get("extra", CARD_DEFAULTS["extra"]) + f"\n{note}\n"}
    path.write_text(render_model_card(template_name, **fields))
    return path


def special_token_note(config_path: Path) -> str:
    """What the card says about special token ids (fields *_token_id) outside [0, vocab_size): official
    transformers loads such configs with a warning (GPT-2's 50256 kept with a smaller vocabulary), and so does
    hf_tiny; the model can never produce those ids, so generate() does not stop on them."""
    if not config_path.is_file():
        return ""
    config = json.loads(config_path.read_text())
    vocab_size = config.get("vocab_size")
    if not isinstance(vocab_size, int):
        return ""
    outside = []
    for name, value in sorted(config.items()):
        values = value if isinstance(value, list) else [value]
        if name.endswith("_token_id") and any(
            isinstance(v, int) and not isinstance(v, bool) and not 0 <= v < vocab_size for v in values
        ):
            outside.append(f"`{name}` = {value}")
    if not outside:
        return ""
    return (
        f"Special tokens: {', '.join(outside)} lie outside the vocabulary (ids 0 .. {vocab_size - 1}), as in the "
        "source config. transformers loads it with a warning (\"must be `None` or an integer within the "
        "vocabulary\"), as it does the official model; the model never produces such an id, so `generate` does "
        "not stop on it (pass `eos_token_id=` / `pad_token_id=` within the vocabulary)."
    )


def source_license(src_dir: Path) -> str:
    """The `license:` of the source model card's YAML header, or "other" when it does not say."""
    card = Path(src_dir) / "README.md"
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
