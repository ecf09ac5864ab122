"""Checkpoint conversion between official Hugging Face formats and hf_tiny.

Run `python -m conversion [FAMILY] SRC DST [--reverse] [--force] [--dtype ...]` (the family is detected from
config.json or the GGUF header when left out). The package is one pipeline (pipeline.py) that every family
module (bert.py and its variant tables, llama.py, phi3.py, gpt2.py, bart.py, t5.py, bert2seq.py) fills in with its tables; the modules it is built from:

    errors.py     ConversionError
    readers.py    load_checkpoint (safetensors, sharded, .bin/.pth with weights_only), load_config_json, ...
    gguf_files.py load_gguf, gguf_architecture
    keymap.py     KeyMap, Rule, Transform, check_shapes, expected_shapes, layer_rules
    tensors.py    parse_dtype, cast_floating
    writer.py     atomic_output_dir, save_state_dict_safetensors, copy_tokenizer_files, tied copies, folders
    parity.py     parity_batch, measure_parity, fail_on_parity, max_abs_diff
    cards.py      render_model_card, write_model_card
    registry.py   FAMILIES, family_for, detect_family
"""

from .cards import render_model_card, write_model_card
from .errors import ConversionError
from .gguf_files import gguf_architecture, load_gguf
from .keymap import KeyMap, Rule, Transform, check_shapes, expected_shapes, layer_rules
from .parity import max_abs_diff
from .readers import load_checkpoint, load_config_json, require_model_type
from .registry import FAMILIES, detect_family, family_for
from .tensors import cast_floating, parse_dtype
from .writer import atomic_output_dir, copy_tokenizer_files, save_state_dict_safetensors

__all__ = [
    "FAMILIES",
    "ConversionError",
    "KeyMap",
    "Rule",
    "Transform",
    "atomic_output_dir",
    "cast_floating",
    "check_shapes",
    "copy_tokenizer_files",
    "detect_family",
    "expected_shapes",
    "family_for",
    "gguf_architecture",
    "layer_rules",
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
