"""The one conversion pipeline: family detection (`python -m conversion SRC DST`), the same result shape for every
family, and the GGUF header reader detection relies on."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from transformers import BertConfig, BertModel, MarianConfig, MarianMTModel, T5Config, T5ForConditionalGeneration

from causal_helpers import tiny_official
from gguf_writer import write_stub_gguf
from conversion import ConversionError, detect_family, gguf_architecture
from conversion.__main__ import main

RESULT_KEYS = {"dst", "family", "source_kind", "architecture", "hf_tiny_class", "config", "parity", "parity_layers",
               "parity_inputs", "card", "bytes", "files"}


write_gguf = write_stub_gguf


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=32)).save_pretrained(root / "bert")
    tiny_official("mistral").save_pretrained(root / "mistral")
    T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_heads=4, num_layers=1,
                                        decoder_start_token_id=0)).save_pretrained(root / "t5")
    MarianMTModel(MarianConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                               decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                               max_position_embeddings=32, pad_token_id=1, decoder_start_token_id=1)).save_pretrained(root / "marian")
    return root


@pytest.mark.parametrize("name,family", [("bert", "bert"), ("mistral", "llama"), ("t5", "t5"), ("marian", "bart")])
def test_family_is_detected_from_config_model_type(sources, name, family):
    detected, why = detect_family(sources / name)
    assert detected == family
    assert "model_type" in why


def test_gguf_and_meta_sources_are_detected(tmp_path):
    write_gguf(tmp_path / "model.gguf", "llama")
    assert detect_family(tmp_path / "model.gguf") == ("llama", "GGUF architecture 'llama'")
    assert detect_family(tmp_path)[0] == "llama"  # a folder holding exactly one .gguf and no config.json
    write_gguf(tmp_path / "other.gguf", "bloom")
    with pytest.raises(ConversionError, match="holds 2 GGUF files"):
        detect_family(tmp_path)
    with pytest.raises(ConversionError, match="no converter reads GGUF architecture 'bloom'.*known: .*gpt2, llama"):
        detect_family(tmp_path / "other.gguf")
    meta = tmp_path / "meta"
    meta.mkdir()
    (meta / "params.json").write_text("{}")
    (meta / "consolidated.00.pth").write_bytes(b"")
    assert detect_family(meta)[0] == "llama"


def test_detection_refuses_unknown_and_hf_tiny_sources_with_the_reason(sources, tmp_path):
    (tmp_path / "bloom").mkdir()
    (tmp_path / "bloom" / "config.json").write_text(json.dumps({"model_type": "bloom"}))
    with pytest.raises(ConversionError, match=r"no converter reads model_type='bloom'.*known model types: albert, bart, bert"):
        detect_family(tmp_path / "bloom")
    with pytest.raises(ConversionError, match="--reverse converts an hf_tiny folder back; .* model_type='bert'"):
        detect_family(sources / "bert", reverse=True)
    with pytest.raises(ConversionError, match="does not exist"):
        detect_family(tmp_path / "missing")
    with pytest.raises(ConversionError, match="no config.json"):
        detect_family(tmp_path)


@pytest.mark.parametrize("name,family", [("bert", "bert"), ("mistral", "llama"), ("t5", "t5"), ("marian", "bart")])
def test_cli_without_family_converts_and_converts_back(sources, tmp_path, capsys, name, family):
    assert main([str(sources / name), str(tmp_path / "ours")]) == 0
    captured = capsys.readouterr()
    assert f"detected family {family} (model_type" in captured.err
    assert f"converted {family}:" in captured.out
    with pytest.raises(ConversionError, match="already an hf_tiny folder .* pass --reverse"):
        detect_family(tmp_path / "ours")
    assert main([str(tmp_path / "ours"), str(tmp_path / "back"), "--reverse"]) == 0
    assert f"detected family {family}" in capsys.readouterr().err
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    original = json.loads((sources / name / "config.json").read_text())
    assert back["model_type"] == original["model_type"]


def test_every_family_returns_the_same_result_shape(sources, tmp_path):
    from conversion import bart, bert, llama, t5

    for module, name in ((bert, "bert"), (llama, "mistral"), (t5, "t5"), (bart, "marian")):
        result = module.convert(sources / name, tmp_path / name)
        assert set(result) == RESULT_KEYS, module.__name__
        assert result["family"] == module.FAMILY.name and result["parity"]
        assert result["card"] == tmp_path / name / "README.md" and result["card"].is_file()
        reverse = module.convert_back(tmp_path / name, tmp_path / f"{name}_back")
        assert set(reverse) == {"dst", "family", "architecture", "bytes", "files"}


def test_gguf_header_reader(tmp_path):
    path = write_gguf(tmp_path / "x.gguf", "qwen3")
    assert gguf_architecture(path) == "qwen3"
    (tmp_path / "bad.gguf").write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ConversionError, match="bad.gguf is not a valid GGUF file"):
        gguf_architecture(tmp_path / "bad.gguf")
    header = path.read_bytes()[:30]  # magic, version, counts, and half of the first key
    (tmp_path / "cut.gguf").write_bytes(header)
    with pytest.raises(ConversionError, match="cut.gguf is not a valid GGUF file"):
        gguf_architecture(tmp_path / "cut.gguf")
    no_architecture = bytearray(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))
    (tmp_path / "empty.gguf").write_bytes(bytes(no_architecture))
    with pytest.raises(ConversionError, match="no general.architecture"):
        gguf_architecture(tmp_path / "empty.gguf")


@pytest.mark.parametrize("family", ["llama", "bert", "t5"])
def test_output_switches_of_a_config_travel_both_ways(family, tmp_path):
    """use_cache=False (mosaicml/mpt-* configs say so) and output_hidden_states=True: a plain forward of the converted
    model returns what official's returns (hidden states, no cache), and the way back keeps both."""
    import importlib

    from transformers import AutoConfig, AutoModel

    from bert_models import official_model
    from t5_models import make_official_t5

    source = tmp_path / "src"
    if family == "t5":
        make_official_t5(source)
    else:
        (tiny_official("llama") if family == "llama" else official_model("BertModel")).save_pretrained(source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "use_cache": False, "output_hidden_states": True}))
    module = importlib.import_module(f"conversion.{family}")
    module.convert(source, tmp_path / "ours")
    inputs = {"input_ids": torch.tensor([[3, 4, 5, 6]])}
    if family == "t5":
        inputs["decoder_input_ids"] = torch.tensor([[0, 3]])
    outputs = {}
    for side in ("src", "ours"):
        with torch.no_grad():
            output = AutoModel.from_pretrained(tmp_path / side).eval()(**inputs)
        outputs[side] = sorted(key for key, value in output.items() if value is not None)
    assert outputs["ours"] == outputs["src"] and any("hidden_states" in key for key in outputs["src"])
    module.convert_back(tmp_path / "ours", tmp_path / "back")
    back = AutoConfig.from_pretrained(tmp_path / "back")
    assert (back.use_cache, back.output_hidden_states) == (False, True)


@pytest.mark.parametrize("family", ["llama", "gpt2", "mpt"])
def test_return_dict_false_is_refused_where_official_fails_with_it(family, tmp_path):
    """Official LlamaForCausalLM's and GPT2LMHeadModel's forwards fail with return_dict=False in their config
    (transformers 5): refused, named; official MptForCausalLM runs with it: converted, returning tuples as official."""
    import importlib

    from gpt2_models import tiny_gpt2
    from mpt_models import tiny_mpt

    source = tmp_path / "src"
    {"llama": lambda: tiny_official("llama"), "gpt2": tiny_gpt2, "mpt": tiny_mpt}[family]().save_pretrained(source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "return_dict": False}))
    module = importlib.import_module(f"conversion.{family}")
    if family == "mpt":
        module.convert(source, tmp_path / "ours")
        from transformers import AutoModelForCausalLM

        ids = torch.tensor([[3, 4, 5]])
        with torch.no_grad():
            expected = AutoModelForCausalLM.from_pretrained(source).eval()(ids)
            got = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()(ids)
        assert isinstance(got, tuple) and isinstance(expected, tuple)
        torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
        return
    with pytest.raises(ConversionError, match="return_dict=False is not supported for .*official's own forward fails"):
        module.convert(source, tmp_path / "ours")
    assert not (tmp_path / "ours").exists()
