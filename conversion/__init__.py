"""Checkpoint conversion between official Hugging Face formats and hf_tiny.

Run `python -m conversion [FAMILY] SRC DST [--reverse] [--force] [--dtype ...] [--max-shard-size ...]` (the family
is detected from config.json or the GGUF header when left out). The package is one pipeline (pipeline.py) that every
family module (bert.py and its variant tables, llama.py, phi3.py, gpt2.py, mpt.py, bart.py, t5.py, bert2seq.py)
fills in with its tables. A conversion streams: the source is opened lazily, each key-map rule's tensors are read,
transformed and written to their place in save_pretrained's shards, and parity runs both models one module's
weights at a time, so peak memory is a few tensors, not the checkpoint. The modules it is built from:

    errors.py        ConversionError
    lazy.py          LazyTensors (name -> tensor read when asked), safetensors headers and positioned reads
    readers.py       open_checkpoint / load_checkpoint (safetensors, sharded, .bin/.pth with weights_only), configs
    gguf_files.py    load_gguf, gguf_architecture
    keymap.py        KeyMap, Rule, Transform (validated without reading; applied rule by rule), check_shapes
    tensors.py       parse_dtype, cast_floating
    shards.py        ShardWriter: save_pretrained's shards and index, written one tensor at a time
    writer.py        atomic_output_dir, the hf_tiny and official folders, tied copies
    streamed.py      a model built on the meta device whose modules load their weights while they run
    parity.py        parity_batch, measure (per-layer differences), fail_on_parity
    cards.py         render_model_card, write_model_card
    registry.py      FAMILIES, family_for, detect_family
    causal.py        what the causal families share (classes, GGUF sources); llama_configs.py, meta_llama.py
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
