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
    causal_variant.py  CausalVariant: one official type of the llama family (dense.py, moe.py, deepseek.py,
                     smollm3.py, olmo2.py, llama4.py, gpt_oss.py fill one in each)
"""

import importlib

# What `from conversion import NAME` gives, and the module defining it. Imported when first asked for, so that
# `python -m conversion` reaches its own signal handling before torch and transformers load (a Ctrl-C while they
# load is then one line, not a traceback).
_EXPORTS = {
    "render_model_card": "cards", "write_model_card": "cards",
    "ConversionError": "errors",
    "gguf_architecture": "gguf_files", "load_gguf": "gguf_files",
    "KeyMap": "keymap", "Rule": "keymap", "Transform": "keymap", "check_shapes": "keymap",
    "expected_shapes": "keymap", "layer_rules": "keymap",
    "max_abs_diff": "parity",
    "load_checkpoint": "readers", "load_config_json": "readers", "require_model_type": "readers",
    "FAMILIES": "registry", "detect_family": "registry", "family_for": "registry",
    "cast_floating": "tensors", "parse_dtype": "tensors",
    "atomic_output_dir": "writer", "copy_tokenizer_files": "writer", "save_state_dict_safetensors": "writer",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = sorted(_EXPORTS)
