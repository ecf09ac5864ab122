"""Writes a GGUF file from an official transformers model the way llama.cpp's convert_hf_to_gguf.py does (tensor
names from gguf-py's table, Llama's q/k rows interleaved, Gemma's norms stored as 1 + w), so tests can convert
GGUFs of every architecture without downloading one. transformers' own GGUF loader is what reads them back
(the official side of every parity test), so a writer mistake fails the official load, not only ours."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_stub_gguf(path: Path, architecture: str) -> Path:
    """A GGUF with only a header and one tensor: enough for architecture detection and its errors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


GPT2_CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _add_gpt2_metadata(writer, config) -> None:
    """transformers reads GPT-2's vocab_size from the token list (its GGUF map has no vocab_size key)."""
    writer.add_context_length(config.n_positions)
    writer.add_block_count(config.n_layer)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(config.n_inner or 4 * config.n_embd)
    writer.add_head_count(config.n_head)
    writer.add_layer_norm_eps(config.layer_norm_epsilon)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<token{i}>" for i in range(config.vocab_size)])


def write_gguf_from_official(model, path: Path, architecture: str, *, quantization: str | None = None) -> Path:
    """GGUF of `model` (an official *ForCausalLM). quantization: None (F32) or a gguf quantization type name
    (e.g. "Q8_0") applied to every 2-D weight whose rows fit its block size; 1-D tensors stay F32, as llama.cpp
    keeps norms."""
    import gguf

    config = model.config
    arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture)
    table = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), architecture)
    if architecture == "gpt2":
        _add_gpt2_metadata(writer, config)
    else:
        writer.add_context_length(config.max_position_embeddings)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_vocab_size(config.vocab_size)
        rope = config.rope_parameters.get("full_attention", config.rope_parameters)
        writer.add_rope_freq_base(rope["rope_theta"])
    if architecture == "llama":
        writer.add_rope_dimension_count(config.head_dim)
    if architecture == "gemma3":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_sliding_window(config.sliding_window)
    for name in ("bos", "eos", "pad"):  # transformers' GGUF configs otherwise get their class defaults
        token_id = getattr(config, f"{name}_token_id", None)
        if isinstance(token_id, int):
            getattr(writer, f"add_{name}_token_id")(token_id)
    quant = getattr(gguf.GGMLQuantizationType, quantization) if quantization else None
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings or name.endswith((".attn.bias", ".masked_bias")):
            continue
        stem, suffix = name.rsplit(".", 1)
        gguf_name = table.get_name(stem)
        assert gguf_name is not None, f"gguf has no name for {name}"
        array = tensor.detach().float().numpy()
        if architecture == "llama" and name.endswith("q_proj.weight"):
            array = _llama_cpp_permute(array, config.num_attention_heads)
        if architecture == "llama" and name.endswith("k_proj.weight"):
            array = _llama_cpp_permute(array, config.num_key_value_heads)
        if architecture == "gemma3" and name.endswith("norm.weight"):
            array = array + 1.0
        if architecture == "gpt2" and name.endswith(GPT2_CONV1D_WEIGHTS):
            array = array.T  # llama.cpp stores GPT-2's Conv1D weights as [out, in]
        if quant is not None and array.ndim == 2 and array.shape[-1] % gguf.GGML_QUANT_SIZES[quant][0] == 0:
            writer.add_tensor(f"{gguf_name}.{suffix}", gguf.quants.quantize(array, quant), raw_dtype=quant)
        else:
            writer.add_tensor(f"{gguf_name}.{suffix}", np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
