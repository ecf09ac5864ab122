"""A checkpoint that lacks some of a model's tensors (a config that asks for biases the file does not hold, a head
saved without its bias): from_pretrained reports them missing and initializes them, and every tensor the file holds
is loaded as stored, as official transformers does. Before, hf_tiny's init wrote with tensor methods (.normal_(),
.fill_()), which transformers cannot stop, so a Linear missing its bias had its loaded weight drawn again at random."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM

import hf_tiny  # noqa: F401  (registers the Auto classes)
from bart_models import make_official_bart
from bert_models import convert_official, official_model
from causal_helpers import official_and_converted, tiny_official
from conversion import bart


def _causal(tmp_path):
    return official_and_converted(tiny_official("qwen2"), tmp_path) / "ours", AutoModelForCausalLM


def _encoder(tmp_path):
    return convert_official(official_model("BertForMaskedLM"), tmp_path)[1], AutoModelForMaskedLM


def _seq2seq(tmp_path):
    bart.convert(make_official_bart(tmp_path / "official"), tmp_path / "ours")
    return tmp_path / "ours", AutoModelForSeq2SeqLM


# family -> (converted folder maker, Auto class, tensors to drop: each the bias of a module whose weight stays)
CASES = {
    "causal": (_causal, ("model.layers.0.self_attn.q_proj.bias", "model.layers.1.mlp.down_proj.bias")),
    "encoder": (_encoder, ("lm_head.dense.bias", "model.layers.0.input_layernorm.bias")),
    "seq2seq": (_seq2seq, ("model.decoder.layers.1.cross_attn.v_proj.bias", "model.encoder.layers.0.post_attention_layernorm.bias")),
}


def _without(folder, dropped, dst):
    shutil.copytree(folder, dst)
    state = load_file(dst / "model.safetensors")
    assert set(dropped) <= state.keys(), sorted(state)
    save_file({k: v for k, v in state.items() if k not in dropped}, dst / "model.safetensors", metadata={"format": "pt"})
    return {k: v for k, v in state.items() if k not in dropped}


@pytest.mark.parametrize("family", sorted(CASES))
def test_missing_tensors_are_initialized_and_loaded_ones_kept(family, tmp_path):
    make, dropped = CASES[family]
    folder, auto_class = make(tmp_path)
    if family == "causal":  # ask for biases the file lacks only in part: the MLP's are missing altogether
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "mlp_bias": True}))
        dropped = dropped[:1]
    kept = _without(folder, dropped, tmp_path / "partial")
    model, info = auto_class.from_pretrained(tmp_path / "partial", output_loading_info=True)
    state = model.state_dict()
    assert set(dropped) <= set(info["missing_keys"])
    changed = [k for k, v in kept.items() if not torch.equal(state[k], v)]
    assert changed == []  # the old init drew the weights beside each missing bias again
    for key in info["missing_keys"]:
        if key.endswith("bias"):
            assert torch.count_nonzero(state[key]) == 0, key  # initialized as official: zero biases
