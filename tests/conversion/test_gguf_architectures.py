"""GGUF files of every decoder architecture the causal family reads (llama, qwen2, qwen3, gemma3), F32 and in every
quantization gguf-py can write, converted by `python -m conversion` (family detected from the GGUF header) and
compared with the official `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` on the same file.

The GGUFs are written from tiny random official models the way llama.cpp writes them (tests/helpers/gguf_writer.py). The
K-quants (Q4_K, Q6_K), which gguf-py can read but not write, are covered by the real Gemma 3 GGUF
(models/test_gemma3_270m.py: Q4_K, Q5_0, Q6_K and Q8_0 tensors).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_tiny  # noqa: F401
from causal_helpers import left_padded_batch, max_diff, real_logits, tiny_official
from conversion import ConversionError, detect_family, llama
from conversion.__main__ import main
from conversion.gguf_files import open_gguf
from gguf_writer import write_gguf_from_official, write_stub_gguf

pytestmark = pytest.mark.usefixtures("single_torch_thread")

TOLERANCE = 1e-5
# GGUF architecture -> (official model type, tiny config overrides). transformers' GGUF loader reads no head_dim for
# qwen3 (Qwen3Config's default 128 applies) and no query_pre_attn_scalar or layer pattern for gemma3 (256 and 5
# sliding : 1 global apply), so the tiny models use those values.
ARCHITECTURES = {
    "llama": ("llama", dict()),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(head_dim=128)),
    "gemma3": (
        "gemma3_text",
        dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=256, num_hidden_layers=7,
             sliding_window=5),
    ),
}
OFFICIAL_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "gemma3": "Gemma3ForCausalLM"}


def official_from_gguf(path):
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("quantization", [None, "Q8_0"])
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_gguf_of_each_architecture_converts_with_parity(architecture, quantization, tmp_path, capsys):
    model_type, overrides = ARCHITECTURES[architecture]
    path = write_gguf_from_official(tiny_official(model_type, **overrides), tmp_path / "model.gguf", architecture,
                                    quantization=quantization)
    assert detect_family(path) == ("llama", f"GGUF architecture {architecture!r}")
    dst = tmp_path / "converted"
    assert main([str(path), str(dst)]) == 0  # python -m conversion SRC DST
    capsys.readouterr()
    official = official_from_gguf(path)
    assert type(official).__name__ == OFFICIAL_CLASS[architecture]
    batch = left_padded_batch(official.config.vocab_size)
    for backend in ("eager", "sdpa"):
        official.set_attn_implementation(backend)
        ours = AutoModelForCausalLM.from_pretrained(dst, attn_implementation=backend).eval()
        expected = real_logits(official, batch)
        assert expected.abs().max() > 1.0
        diff = max_diff(real_logits(ours, batch), expected)
        assert diff <= TOLERANCE, f"{architecture} {quantization} {backend}: {diff}"
    settings = dict(attention_mask=batch["attention_mask"], max_new_tokens=8, do_sample=False, pad_token_id=0,
                    eos_token_id=None)
    assert torch.equal(ours.generate(batch["input_ids"], **settings), official.generate(batch["input_ids"], **settings))


@pytest.mark.parametrize("quantization", ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_every_writable_quantization_dequantizes_as_official(quantization, tmp_path):
    path = write_gguf_from_official(tiny_official("qwen2", hidden_size=64, intermediate_size=64), tmp_path / "q.gguf",
                                    "qwen2", quantization=quantization)
    result = llama.convert(path, tmp_path / "converted")
    assert all(row["max_abs_diff"] <= row["tolerance"] for row in result["parity"])
    official = official_from_gguf(path)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "converted").eval()
    for name, tensor in official.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), f"{quantization}: {name}"
    # negative control: the quantization really changed the weights (else this test could not fail)
    reference = tiny_official("qwen2", hidden_size=64, intermediate_size=64)
    changed = not torch.equal(reference.model.layers[0].mlp.up_proj.weight, ours.model.layers[0].mlp.up_proj.weight)
    assert changed


# Llama 3.1 8B's RoPE scaling, as its config.json states it
META_LLAMA3_SCALING = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llamacpp_rope_factors(head_dim: int, scaling: dict):
    """rope_freqs.weight as llama.cpp's converter computes it from a llama3 rope scaling (convert_hf_to_gguf.py)."""
    import math

    import numpy as np

    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for frequency in 1.0 / (scaling["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)):
        wavelength = 2 * math.pi / frequency
        if wavelength < old / high:
            factors.append(1.0)
        elif wavelength > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_with_rope_freqs(official, values, path, monkeypatch):
    import gguf

    write_header = gguf.GGUFWriter.write_header_to_file

    def with_rope_freqs(writer, *args, **kwargs):
        writer.add_tensor("rope_freqs.weight", values)
        return write_header(writer, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "write_header_to_file", with_rope_freqs)
    written = write_gguf_from_official(official, path, "llama")
    monkeypatch.undo()
    assert "rope_freqs.weight" in [t.name for t in gguf.GGUFReader(written).tensors]
    return written


def test_llamacpp_rope_freqs_of_ones_are_dropped(tmp_path, monkeypatch):
    """All-ones rope_freqs (a Llama 3 GGUF without scaling) change nothing: the file converts with the logits of
    transformers' own GGUF load, which drops the tensor."""
    import numpy as np

    path = gguf_with_rope_freqs(tiny_official("llama"), np.ones(4, dtype=np.float32), tmp_path / "model.gguf",
                                monkeypatch)
    result = llama.convert(path, tmp_path / "converted")
    assert all(row["max_abs_diff"] <= row["tolerance"] for row in result["parity"])
    official = official_from_gguf(path)
    batch = left_padded_batch(official.config.vocab_size)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "converted").eval()
    assert max_diff(real_logits(ours, batch), real_logits(official, batch)) <= TOLERANCE


def test_llamacpp_rope_freqs_of_llama3_scaling_become_its_rope_parameters(tmp_path, monkeypatch):
    """Llama 3.1's scaling written the way llama.cpp writes it converts to Meta's own rope_parameters, and the model
    computes what the official Llama with those parameters computes on the same weights. Negative control: the
    official GGUF load, which drops the factors, differs at long positions."""
    official = tiny_official("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=131072,
                             rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    path = gguf_with_rope_freqs(official, llamacpp_rope_factors(64, META_LLAMA3_SCALING), tmp_path / "model.gguf",
                                monkeypatch)
    result = llama.convert(path, tmp_path / "converted")
    assert all(row["max_abs_diff"] <= row["tolerance"] for row in result["parity"])
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "converted").eval()
    assert ours.config.rope_parameters == META_LLAMA3_SCALING
    assert "rope_freqs.weight" in (tmp_path / "converted" / "README.md").read_text()

    scaled = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32,
                                                  rope_parameters=META_LLAMA3_SCALING).eval()
    batch = left_padded_batch(official.config.vocab_size)
    batch["position_ids"] = batch["position_ids"] + 20000  # where the low frequencies' scaling shows
    assert max_diff(real_logits(ours, batch), real_logits(scaled, batch)) <= TOLERANCE
    assert max_diff(real_logits(ours, batch), real_logits(official_from_gguf(path), batch)) > 100 * TOLERANCE


def test_llamacpp_rope_freqs_of_another_scaling_are_refused(tmp_path, monkeypatch):
    """Factors no llama3 scaling gives (a step from 1 to 8 with nothing between) would be lost: refused, naming
    the tensor and why, with nothing written."""
    import numpy as np

    values = np.ones(4, dtype=np.float32)
    values[2:] = 8.0
    path = gguf_with_rope_freqs(tiny_official("llama"), values, tmp_path / "model.gguf", monkeypatch)
    with pytest.raises(ConversionError, match=r"rope_freqs\.weight holds llama\.cpp's per-frequency RoPE scaling "
                       r"factors \(1 \.\. 8\) that are not Llama 3\.1's scaling \(0 factors between"):
        llama.convert(path, tmp_path / "converted")
    assert not (tmp_path / "converted").exists()


def test_gguf_of_an_unsupported_architecture_names_it_and_lists_the_supported(tmp_path):
    path = write_stub_gguf(tmp_path / "bloom.gguf", "bloom")
    with pytest.raises(ConversionError, match=r"no converter reads GGUF architecture 'bloom'; known: .*gemma3.*llama.*qwen2.*qwen3"):
        detect_family(path)
    with pytest.raises(ConversionError, match=r"architecture 'bloom', expected 'llama' or 'mistral' or 'qwen2' or 'qwen3' or 'gemma3'"):
        llama.convert(path, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])  # transformers' q/k un-permutation, Gemma's norm offset
def test_gguf_streams_one_tensor_at_a_time_on_both_sides(architecture, tmp_path, monkeypatch):
    """Opening a GGUF dequantizes nothing; the official reference streams the dequantized tensors (the whole-model
    loader, which would hold the file in float32, is not called); the converted model computes what transformers'
    own GGUF loader gives."""
    import gguf

    model_type, overrides = ARCHITECTURES[architecture]
    path = write_gguf_from_official(tiny_official(model_type, **overrides), tmp_path / "model.gguf", architecture,
                                    quantization="Q8_0")
    dequantize = gguf.dequantize
    monkeypatch.setattr(gguf, "dequantize", _refused("dequantize while opening"))
    _config, state = open_gguf(path, expected_architecture=architecture)
    assert "model.embed_tokens.weight" in state
    monkeypatch.setattr(gguf, "dequantize", dequantize)
    monkeypatch.setattr(type(llama.FAMILY), "official_model", _refused("the whole official model"))
    result = llama.convert(path, tmp_path / "converted")
    assert all(row["max_abs_diff"] <= row["tolerance"] for row in result["parity"])
    official = official_from_gguf(path)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "converted", attn_implementation="sdpa").eval()
    batch = left_padded_batch(official.config.vocab_size)
    assert max_diff(real_logits(ours, batch), real_logits(official, batch)) <= TOLERANCE


def _refused(what: str):
    def refused(*args, **kwargs):
        raise AssertionError(f"{what} was called")

    return refused
