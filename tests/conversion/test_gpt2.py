"""GPT-2 <-> hf_tiny causal LM: learned positions, LayerNorm, plain GELU MLP, Conv1D weights and the fused c_attn,
against the official GPT2LMHeadModel (tiny random weights), from HF folders and from GGUF files, both ways."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_tiny  # noqa: F401
from causal_helpers import left_padded_batch, max_diff, real_logits
from conversion import ConversionError, detect_family, gpt2
from conversion.__main__ import main
from gguf_writer import write_gguf_from_official
from gpt2_models import tiny_gpt2

pytestmark = pytest.mark.usefixtures("single_torch_thread")

TOLERANCE = 1e-5
VARIANTS = {
    "tied": dict(),
    "untied": dict(tie_word_embeddings=False),
    "unscaled_attention_gelu_inner": dict(scale_attn_weights=False, activation_function="gelu", n_inner=40),
    "eight_heads_relu": dict(n_head=8, activation_function="relu", layer_norm_epsilon=1e-3),
    # official's eager scores in float32 (hf_tiny's always are): kept for the way back
    "reorder_and_upcast_eager": dict(reorder_and_upcast_attn=True),
}
GENERATE = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)


def convert(official, tmp_path):
    official.save_pretrained(tmp_path / "src")
    assert detect_family(tmp_path / "src") == ("gpt2", "model_type 'gpt2'")
    result = gpt2.convert(tmp_path / "src", tmp_path / "ours")
    return tmp_path / "ours", result


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parity_generation_and_reverse(variant, tmp_path):
    official = tiny_gpt2(**VARIANTS[variant])
    dst, result = convert(official, tmp_path)
    assert result["architecture"] == "GPT2LMHeadModel" and result["hf_tiny_class"] == "TinyCausalForCausalLM"
    batch = left_padded_batch(official.config.vocab_size)
    for backend in ("eager", "sdpa"):
        official.set_attn_implementation(backend)
        ours = AutoModelForCausalLM.from_pretrained(dst, attn_implementation=backend).eval()
        assert ours.config.position_embedding_type == "learned" and not ours.config.mlp_gated
        expected = real_logits(official, batch)
        diff = max_diff(real_logits(ours, batch), expected)
        assert diff <= TOLERANCE, f"{variant} {backend}: {diff}"
    for extra in ({}, {"num_beams": 3}):
        settings = dict(attention_mask=batch["attention_mask"], **GENERATE, **extra)
        assert torch.equal(ours.generate(batch["input_ids"], **settings), official.generate(batch["input_ids"], **settings))

    assert detect_family(dst, reverse=True)[0] == "gpt2"
    assert main([str(dst), str(tmp_path / "back"), "--reverse"]) == 0
    back, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    source, returned = load_file(tmp_path / "src" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert source.keys() == returned.keys() and all(torch.equal(source[k], returned[k]) for k in source)
    # the config reads as the source's (n_inner None where the width is GPT-2's 4x, reorder_and_upcast_attn kept)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads(
        (tmp_path / "src" / "config.json").read_text())


def test_token_type_ids_add_word_embedding_rows_as_official_gpt2_in_forward_generate_and_classification(tmp_path):
    """Official GPT-2 adds wte(token_type_ids) to the inputs (dialogue models mark speakers so); generate extends
    them with the last one. Negative control: the same batch without them is far off. A model without learned
    positions refuses them by name."""
    official = tiny_gpt2()
    dst, _ = convert(official, tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(dst).eval()
    batch = left_padded_batch(official.config.vocab_size)
    types = (torch.arange(batch["input_ids"].shape[1]) >= 4).long().expand_as(batch["input_ids"]) + 3
    with torch.no_grad():
        expected = official(**batch, token_type_ids=types).logits
        got = ours(**batch, token_type_ids=types).logits
        plain = ours(**batch).logits
    real = batch["attention_mask"].bool()
    assert max_diff(got[real], expected[real]) <= TOLERANCE
    assert max_diff(plain[real], expected[real]) > 100 * TOLERANCE
    settings = dict(attention_mask=batch["attention_mask"], token_type_ids=types, **GENERATE)
    assert torch.equal(ours.generate(batch["input_ids"], **settings), official.generate(batch["input_ids"], **settings))
    with pytest.raises(ValueError, match=r"token_type_ids of shape \(3, 2\) do not match"):
        ours(**batch, token_type_ids=types[:, :2])
    # a sequence classifier reads them too (official GPT2ForSequenceClassification's head is new: copied over)
    classifier = hf_tiny.TinyCausalForSequenceClassification.from_pretrained(dst, num_labels=3).eval()
    official_classifier = transformers.GPT2ForSequenceClassification.from_pretrained(tmp_path / "src", num_labels=3)
    classifier.score.load_state_dict(official_classifier.score.state_dict())
    with torch.no_grad():
        expected = official_classifier.eval()(**batch, token_type_ids=types).logits
        got = classifier(**batch, token_type_ids=types).logits
    assert max_diff(got, expected) <= TOLERANCE
    # a model without learned positions ignores them in forward and refuses them in generate, as official Llama
    rope = hf_tiny.TinyCausalForCausalLM(hf_tiny.TinyCausalConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                                                  num_attention_heads=2, intermediate_size=32)).eval()
    ids = torch.tensor([[1, 2]])
    with torch.no_grad():
        assert torch.equal(rope(ids, token_type_ids=torch.tensor([[0, 1]])).logits, rope(ids).logits)
    with pytest.raises(ValueError, match="generate\\(\\) got token_type_ids.*position_embedding_type='rope'"):
        rope.generate(ids, token_type_ids=torch.tensor([[0, 1]]), max_new_tokens=2)


def test_negative_control_q_and_k_swapped_in_the_fused_split_is_rejected(tmp_path):
    official = tiny_gpt2()
    dst, _ = convert(official, tmp_path)
    wrong = AutoModelForCausalLM.from_pretrained(dst).eval()
    with torch.no_grad():
        attention = wrong.model.layers[0].self_attn
        q, k = attention.q_proj.weight.clone(), attention.k_proj.weight.clone()
        attention.q_proj.weight.copy_(k)
        attention.k_proj.weight.copy_(q)
    batch = left_padded_batch(official.config.vocab_size)
    assert max_diff(real_logits(wrong, batch), real_logits(official, batch)) > 100 * TOLERANCE


@pytest.mark.parametrize(
    "model_class, ours", [(transformers.GPT2Model, "TinyCausalModel"),
                          (transformers.GPT2ForSequenceClassification, "TinyCausalForSequenceClassification")],
)
def test_base_model_and_sequence_classifier(model_class, ours, tmp_path):
    official = tiny_gpt2(model_class, num_labels=3)
    dst, result = convert(official, tmp_path)
    assert result["hf_tiny_class"] == ours
    converted = getattr(hf_tiny, ours).from_pretrained(dst).eval()
    batch = left_padded_batch(official.config.vocab_size)
    del batch["position_ids"]  # GPT-2's classifier is called like this by pipelines
    with torch.no_grad():
        field = "last_hidden_state" if ours == "TinyCausalModel" else "logits"
        expected, produced = getattr(official(**batch), field), getattr(converted(**batch), field)
    if ours == "TinyCausalModel":
        real = batch["attention_mask"].bool()
        expected, produced = expected[real], produced[real]
    assert max_diff(produced, expected) <= TOLERANCE


def test_a_head_checkpoint_stored_without_the_transformer_prefix_converts_as_official_loads_it(tmp_path):
    """openai-community/gpt2 and distilgpt2 name GPT2LMHeadModel in config.json but store the base model's names
    (h.0..., wte, wpe, ln_f; no lm_head, tied; attn.bias buffers): official from_pretrained reads them under its
    base_model_prefix, and so does the converter (with a card note), with parity and greedy tokens."""
    official = tiny_gpt2()
    official.config.architectures = ["GPT2LMHeadModel"]
    official.config.save_pretrained(tmp_path / "src")
    state = {key.removeprefix("transformer."): tensor.contiguous() for key, tensor in official.state_dict().items()
             if key != "lm_head.weight"}
    positions = official.config.n_positions
    for i in range(official.config.n_layer):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(positions, positions)).view(1, 1, positions, positions)
    save_file(state, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "src").eval()
    result = gpt2.convert(tmp_path / "src", tmp_path / "ours")
    assert result["architecture"] == "GPT2LMHeadModel" and "without the `transformer.` prefix" in (
        tmp_path / "ours" / "README.md").read_text()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    batch = left_padded_batch(official.config.vocab_size)
    assert max_diff(real_logits(ours, batch), real_logits(loaded, batch)) <= TOLERANCE
    settings = dict(attention_mask=batch["attention_mask"], **GENERATE)
    assert torch.equal(ours.generate(batch["input_ids"], **settings), loaded.generate(batch["input_ids"], **settings))


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_gpt2_converts_with_parity_against_official_gguf_loading(tied, tmp_path, capsys):
    # transformers reads a GPT-2 GGUF's context length into n_ctx and keeps n_positions at 1024
    official = tiny_gpt2(n_positions=1024, tie_word_embeddings=tied)
    path = write_gguf_from_official(official, tmp_path / "gpt2.gguf", "gpt2", quantization="Q8_0")
    assert detect_family(path) == ("gpt2", "GGUF architecture 'gpt2'")
    assert main([str(path), str(tmp_path / "ours")]) == 0
    capsys.readouterr()
    from_gguf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="gpt2.gguf", dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    batch = left_padded_batch(official.config.vocab_size)
    assert max_diff(real_logits(ours, batch), real_logits(from_gguf, batch)) <= TOLERANCE
    assert ours.config.tie_word_embeddings == tied


def test_config_without_model_type_is_detected_by_its_tensor_names(tmp_path):
    official = tiny_gpt2()
    official.save_pretrained(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    del config["model_type"]
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    family, why = detect_family(tmp_path / "src")
    assert family == "gpt2" and "c_attn" in why
    gpt2.convert(tmp_path / "src", tmp_path / "ours")


# ------------------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------------------


def test_c_attn_width_not_three_times_hidden_names_the_field_and_value(tmp_path):
    official = tiny_gpt2()
    official.save_pretrained(tmp_path / "src")
    state = load_file(tmp_path / "src" / "model.safetensors")
    state["transformer.h.1.attn.c_attn.weight"] = state["transformer.h.1.attn.c_attn.weight"][:, :80].contiguous()
    save_file(state, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"c_attn.weight has shape \(32, 80\): its fused q/k/v width 80 must be 3 x n_embd = 96"):
        gpt2.convert(tmp_path / "src", tmp_path / "ours")
    assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx=True"),
        (dict(add_cross_attention=True), "add_cross_attention=True"),
    ],
)
def test_unsupported_gpt2_options_are_named(overrides, message, tmp_path):
    tiny_gpt2(**overrides).save_pretrained(tmp_path / "src")
    with pytest.raises(ConversionError, match=message):
        gpt2.convert(tmp_path / "src", tmp_path / "ours")


def test_positions_past_the_learned_table_are_a_clear_error(tmp_path):
    dst, _ = convert(tiny_gpt2(), tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(dst).eval()
    with pytest.raises(ValueError, match=r"position_ids reach 64 but this model learned max_position_embeddings=64"):
        ours(torch.ones(1, 65, dtype=torch.long))


def test_reverse_refuses_a_config_gpt2_cannot_hold(tmp_path):
    config = hf_tiny.TinyCausalConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, position_embedding_type="learned")
    with pytest.raises(ConversionError, match="GPT-2 cannot hold this hf_tiny config.*norm_type"):
        gpt2.gpt2_config_from_causal(config, "GPT2LMHeadModel")


# ------------------------------------------------------------------------------------------------------------
# nanoGPT checkpoints
# ------------------------------------------------------------------------------------------------------------


def nanogpt_checkpoint(bias: bool, n_layer=2, n_head=4, n_embd=32, vocab=97, block=64, seed=0) -> dict:
    """A checkpoint as nanoGPT's train.py saves it (torch.compile'd: parameters under `_orig_mod.`)."""
    generator = torch.Generator().manual_seed(seed)

    def random(*shape, offset=0.0):
        return torch.randn(*shape, generator=generator) * 0.3 + offset

    state = {"transformer.wte.weight": random(vocab, n_embd), "transformer.wpe.weight": random(block, n_embd)}
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        shapes = {"attn.c_attn": (3 * n_embd, n_embd), "attn.c_proj": (n_embd, n_embd),
                  "mlp.c_fc": (4 * n_embd, n_embd), "mlp.c_proj": (n_embd, 4 * n_embd)}
        for name, shape in shapes.items():
            state[f"{p}{name}.weight"] = random(*shape)
            if bias:
                state[f"{p}{name}.bias"] = random(shape[0])
        for norm in ("ln_1", "ln_2"):
            state[f"{p}{norm}.weight"] = random(n_embd, offset=1.0)
            if bias:
                state[f"{p}{norm}.bias"] = random(n_embd)
    state["transformer.ln_f.weight"] = random(n_embd, offset=1.0)
    if bias:
        state["transformer.ln_f.bias"] = random(n_embd)
    state["lm_head.weight"] = state["transformer.wte.weight"]
    args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block, bias=bias, vocab_size=vocab, dropout=0.0)
    return {"model": {f"_orig_mod.{k}": v for k, v in state.items()}, "model_args": args, "iter_num": 100,
            "best_val_loss": torch.tensor(2.5), "config": {"learning_rate": 6e-4}}


def nanogpt_reference_logits(checkpoint: dict, ids: torch.Tensor) -> torch.Tensor:
    """nanoGPT's model.py forward, written from its equations (no transformers involved)."""
    import torch.nn.functional as F

    state = {k.removeprefix("_orig_mod."): v for k, v in checkpoint["model"].items()}
    args = checkpoint["model_args"]
    heads, width = args["n_head"], args["n_embd"]

    def linear(x, name):
        return F.linear(x, state[f"{name}.weight"], state.get(f"{name}.bias"))

    def layer_norm(x, name):
        return F.layer_norm(x, (width,), state[f"{name}.weight"], state.get(f"{name}.bias"), 1e-5)

    batch, length = ids.shape
    x = state["transformer.wte.weight"][ids] + state["transformer.wpe.weight"][:length]
    for i in range(args["n_layer"]):
        p = f"transformer.h.{i}."
        q, k, v = linear(layer_norm(x, p + "ln_1"), p + "attn.c_attn").split(width, dim=2)
        q, k, v = (t.view(batch, length, heads, width // heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, length, width)
        x = x + linear(y, p + "attn.c_proj")
        x = x + linear(F.gelu(linear(layer_norm(x, p + "ln_2"), p + "mlp.c_fc")), p + "mlp.c_proj")
    return F.linear(layer_norm(x, "transformer.ln_f"), state["lm_head.weight"])


@pytest.mark.parametrize("bias", [True, False])
def test_nanogpt_checkpoint_matches_nanogpts_own_forward(bias, tmp_path, capsys):
    checkpoint = nanogpt_checkpoint(bias)
    (tmp_path / "out").mkdir()
    torch.save(checkpoint, tmp_path / "out" / "ckpt.pt")
    assert detect_family(tmp_path / "out") == ("gpt2", "nanoGPT checkpoint ckpt.pt")
    assert main([str(tmp_path / "out"), str(tmp_path / "ours")]) == 0
    capsys.readouterr()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert ours.config.hidden_act == "gelu" and ours.config.max_position_embeddings == 64
    ids = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(1))
    expected = nanogpt_reference_logits(checkpoint, ids)
    with torch.no_grad():
        assert max_diff(ours(ids).logits, expected) <= TOLERANCE
    # negative control: GPT-2's tanh GELU instead of nanoGPT's exact one is rejected by the same comparison
    wrong = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", hidden_act="gelu_new").eval()
    with torch.no_grad():
        assert max_diff(wrong(ids).logits, expected) > 10 * TOLERANCE


def test_nanogpt_checkpoint_without_model_args_is_a_clear_error(tmp_path):
    checkpoint = nanogpt_checkpoint(True)
    del checkpoint["model_args"]["n_head"]
    torch.save(checkpoint, tmp_path / "ckpt.pt")
    with pytest.raises(ConversionError, match=r"model_args lacks \['n_head'\]"):
        gpt2.convert(tmp_path / "ckpt.pt", tmp_path / "ours")


def test_pad_token_row_trains_as_in_official_gpt2(tmp_path):
    """Official GPT-2's embedding has no padding row: with pad = a token that also occurs as a real one (GPT-2's
    usual pad = eos), that row gets its gradient. The converted model does the same (use_padding_idx=False);
    negative control: the same weights with a padding row give it no gradient."""
    official = tiny_gpt2(tie_word_embeddings=False)
    dst, _ = convert(official, tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(dst).eval()  # eval: no dropout; gradients are still recorded
    assert ours.config.use_padding_idx is False
    ids = torch.tensor([[0, 5, 7, 0, 9, 3, 0, 11]])  # token 0 (the pad id) as a real token

    def embedding_gradient(model, table):
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        return table.weight.grad[0].clone()

    expected = embedding_gradient(official, official.transformer.wte)
    assert expected.abs().max() > 1e-3
    torch.testing.assert_close(embedding_gradient(ours, ours.model.embed_tokens), expected, rtol=1e-4, atol=1e-6)
    padded = AutoModelForCausalLM.from_pretrained(dst, use_padding_idx=True).eval()
    assert torch.count_nonzero(embedding_gradient(padded, padded.model.embed_tokens)) == 0


def test_fresh_weights_scale_the_residual_projections_as_official_gpt2(tmp_path):
    """A GPT-2 trained from scratch starts as official's: each residual branch's output projection (official c_proj,
    ours o_proj / down_proj) drawn with initializer_range / sqrt(2 * layers), every other Linear with
    initializer_range. Measured as standard deviations of 65k draws (relative spread ~0.3%); loaded weights stay
    as stored. Negative control: the same config with rotary positions (not GPT-2) keeps initializer_range."""
    layers, width = 8, 256
    official = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=4, vocab_size=97, n_positions=64, bos_token_id=0, eos_token_id=0))
    dst, _ = convert(official, tmp_path)
    config = hf_tiny.TinyCausalConfig.from_pretrained(dst)
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(config)
    theirs = {"o_proj": official.transformer.h[3].attn.c_proj.weight, "down_proj": official.transformer.h[3].mlp.c_proj.weight,
              "q_proj": official.transformer.h[3].attn.c_attn.weight}
    layer = ours.model.layers[3]
    mine = {"o_proj": layer.self_attn.o_proj.weight, "down_proj": layer.mlp.down_proj.weight, "q_proj": layer.self_attn.q_proj.weight}
    scaled = 0.02 / (2 * layers) ** 0.5
    for name, expected_std in (("o_proj", scaled), ("down_proj", scaled), ("q_proj", 0.02)):
        assert abs(theirs[name].std().item() / expected_std - 1) < 0.02, name  # the reference's own spread
        assert abs(mine[name].std().item() / expected_std - 1) < 0.02, name
    loaded = AutoModelForCausalLM.from_pretrained(dst)
    stored = load_file(dst / "model.safetensors")
    assert torch.equal(loaded.model.layers[3].self_attn.o_proj.weight, stored["model.layers.3.self_attn.o_proj.weight"])
    config.position_embedding_type = "rope"
    rotary = AutoModelForCausalLM.from_config(config)
    assert abs(rotary.model.layers[3].self_attn.o_proj.weight.std().item() / 0.02 - 1) < 0.02
