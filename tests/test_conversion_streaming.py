"""Streaming conversion: save_pretrained's shards and index under --max-shard-size (both directions), the per-layer
parity rows (where a mismatch starts), the CLI's last line, lazy reading of the source."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import hf_tiny  # noqa: F401
from causal_helpers import left_padded_batch, max_diff, real_logits, tiny_official
from conversion import llama
from conversion.__main__ import main
from conversion.parity import in_memory, measure, parity_batch
from conversion.readers import open_checkpoint


@pytest.fixture(scope="module")
def official_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("streaming") / "official"
    tiny_official("llama", num_hidden_layers=3).save_pretrained(folder)
    return folder


def shard_names(folder):
    return sorted(path.name for path in folder.glob("*.safetensors"))


def test_max_shard_size_writes_save_pretrained_shards_both_ways(official_folder, tmp_path):
    whole = llama.convert(official_folder, tmp_path / "whole")
    sharded = llama.convert(official_folder, tmp_path / "sharded", max_shard_size="20KB")
    assert shard_names(tmp_path / "whole") == ["model.safetensors"]
    names = shard_names(tmp_path / "sharded")
    assert len(names) > 2 and names[0] == f"model-00001-of-{len(names):05d}.safetensors", names
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    stored = {key: name for name in names for key in load_file(tmp_path / "sharded" / name)}
    assert index["weight_map"] == stored
    assert index["metadata"]["total_size"] == whole["bytes"] == sharded["bytes"]
    for name in names:  # each shard within the limit, except a single tensor larger than it
        tensors = load_file(tmp_path / "sharded" / name)
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= 20_000
    batch = left_padded_batch(97)
    ours = [AutoModelForCausalLM.from_pretrained(tmp_path / folder).eval() for folder in ("whole", "sharded")]
    assert max_diff(real_logits(ours[1], batch), real_logits(ours[0], batch)) == 0.0

    result = llama.convert_back(tmp_path / "sharded", tmp_path / "back", max_shard_size="20KB")
    assert len(result["files"]) > 2
    back, info = LlamaForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    original = LlamaForCausalLM.from_pretrained(official_folder).state_dict()
    assert all(torch.equal(back.state_dict()[key], value) for key, value in original.items())


@pytest.mark.parametrize("size", ["abc", "0", "-5GB", 0])
def test_bad_max_shard_size_names_the_value(official_folder, tmp_path, size):
    with pytest.raises(ValueError, match=rf"max_shard_size must be a positive size .* got {size!r}"):
        llama.convert(official_folder, tmp_path / "out", max_shard_size=size)
    assert not (tmp_path / "out").exists()


def test_cli_last_line_says_what_was_written_and_the_verdict(official_folder, tmp_path, capsys):
    assert main(["llama", str(official_folder), str(tmp_path / "out"), "--max-shard-size", "30KB"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    count = len(shard_names(tmp_path / "out"))
    assert last.startswith(f"converted llama: {official_folder} -> {tmp_path / 'out'} (")
    assert f"MiB of weights; {count} weights file(s); parity passed: " in last, last
    assert main(["llama", str(official_folder), str(tmp_path / "x"), "--max-shard-size", "big"]) == 1
    assert "max_shard_size must be a positive size" in capsys.readouterr().err


def test_card_has_a_row_per_layer(official_folder, tmp_path):
    result = llama.convert(official_folder, tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Each layer's output, max |ours - official|" in card
    for layer in range(3):
        assert f"| model.layers.{layer} |" in card
    assert set(result["parity_layers"]["cpu float32 eager"]) >= {f"model.layers.{i}" for i in range(3)}


def test_layer_rows_show_where_a_mismatch_starts(official_folder, tmp_path):
    """Negative control of the per-layer rows: a perturbed second layer leaves layer 0 exact and shows from layer 1."""
    llama.convert(official_folder, tmp_path / "out")
    official = LlamaForCausalLM.from_pretrained(official_folder).eval()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        ours.model.layers[1].mlp.down_proj.weight.mul_(1.01)
    batch = parity_batch("causal", ours.config)
    layers = measure(in_memory(official), in_memory(ours), batch, torch.float32, backends=("eager",)).layers
    rows = layers["cpu float32 eager"]
    assert rows["model.layers.0"] == 0.0
    assert rows["model.layers.1"] > 1e-4 and rows["model.layers.2"] > 1e-4


def test_source_is_read_lazily(official_folder, monkeypatch):
    """Opening a checkpoint reads headers only; a tensor is read when asked, each time afresh (nothing kept)."""
    reads = []
    state = open_checkpoint(official_folder)
    original = state._read
    monkeypatch.setattr(state, "_read", lambda key: reads.append(key) or original(key))
    assert len(state) == len(LlamaForCausalLM.from_pretrained(official_folder).state_dict()) and reads == []
    assert state.info("model.embed_tokens.weight").shape == (97, 32) and reads == []
    first = state["model.norm.weight"]
    assert reads == ["model.norm.weight"] and torch.equal(state["model.norm.weight"], first)
