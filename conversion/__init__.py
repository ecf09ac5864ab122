"""Checkpoint conversion between official Hugging Face formats and hf_tiny.

Run `python -m conversion FAMILY SRC DST [--reverse] [--force] [--dtype ...]`; the shared machinery that every
family converter (conversion/<family>.py) builds on lives in conversion.core.
"""

from .core import (
    ConversionError,
    KeyMap,
    Rule,
    Transform,
    atomic_output_dir,
    cast_floating,
    check_shapes,
    copy_tokenizer_files,
    expected_shapes,
    load_checkpoint,
    load_config_json,
    load_gguf,
    max_abs_diff,
    parse_dtype,
    render_model_card,
    require_model_type,
    save_state_dict_safetensors,
    write_model_card,
)

__all__ = [
    "ConversionError",
    "KeyMap",
    "Rule",
    "Transform",
    "atomic_output_dir",
    "cast_floating",
    "check_shapes",
    "copy_tokenizer_files",
    "expected_shapes",
    "load_checkpoint",
    "load_config_json",
    "load_gguf",
    "max_abs_diff",
    "parse_dtype",
    "render_model_card",
    "require_model_type",
    "save_state_dict_safetensors",
    "write_model_card",
]
