"""Activations recomputed in backward (hf_tiny/recompute.py): the same loss and gradients as keeping every
activation, for each block layout that uses it, and the intermediate tensors really gone after the forward."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import hf_tiny
from hf_tiny import recompute
from hf_tiny.configuration_causal import TinyCausalConfig
from hf_tiny.recompute import _LinearOfRecomputed, _RecomputedInBackward
from tolerances import model_reduction_length, relative_error, rounding_bound

pytestmark = pytest.mark.usefixtures("single_torch_thread")

CAUSAL = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3, pad_token_id=0)
CAUSAL_VARIANTS = {
    "llama": {},
    "gemma": dict(hidden_act="gelu_pytorch_tanh", rms_norm_unit_offset=True, sandwich_norms=True, qk_norm=True,
                  scale_embeddings=True),
    "gpt2_like": dict(norm_type="layernorm", mlp_gated=False, hidden_act="gelu_new", mlp_bias=True, attention_bias=True),
    "moe": dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=16),
}


relative = relative_error
TOKENS = 3 * 11  # batch(): weight gradients sum over every token


def rounding(model, dtype=torch.float32) -> float:
    """The relative bound (tests/tolerances.py) for a training step of `model` recomputed against kept: the same
    math, its sums in other orders."""
    return rounding_bound(dtype, model_reduction_length(model.config, TOKENS, training_step=True))


def causal_model(variant: str, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    model = hf_tiny.TinyCausalForCausalLM(TinyCausalConfig(**CAUSAL, **CAUSAL_VARIANTS[variant]))
    with torch.no_grad():  # norms away from 1 / 0 so that a wrong norm gradient shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    return model.to(dtype).train()


def batch(vocab: int = 61, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (3, 11), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def loss_and_grads(model, inputs, keep_all: bool):
    model.zero_grad(set_to_none=True)
    if keep_all:
        with recompute.keep_all_activations():
            loss = model(**inputs).loss
    else:
        loss = model(**inputs).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_same_training_step(model, inputs, bound: float = None):
    """Loss and every gradient within `bound` (default: the rounding bound of the model's training step)."""
    bound = rounding(model, next(model.parameters()).dtype) if bound is None else bound
    expected_loss, expected = loss_and_grads(model, inputs, keep_all=True)
    loss, grads = loss_and_grads(model, inputs, keep_all=False)
    assert relative(loss, expected_loss) <= bound
    assert grads.keys() == expected.keys() and len(grads) > 10
    worst = max(relative(grads[name], expected[name]) for name in grads)
    assert worst <= bound, worst


@pytest.mark.parametrize("variant", sorted(CAUSAL_VARIANTS))
def test_causal_loss_and_gradients_equal_keeping_every_activation(variant):
    model = causal_model(variant)
    assert_same_training_step(model, batch())


def test_float64_gradients_agree_to_rounding_and_a_wrong_step_is_rejected():
    model = causal_model("llama", torch.float64)
    inputs = batch()
    assert_same_training_step(model, inputs)
    # Negative control: the same comparison notices a one-token change of the labels, even with fp32's bound.
    _, expected = loss_and_grads(model, inputs, keep_all=True)
    changed = dict(inputs, labels=inputs["labels"].clone())
    changed["labels"][0, 5] = (changed["labels"][0, 5] + 1) % 61
    _, grads = loss_and_grads(model, changed, keep_all=False)
    assert max(relative(grads[name], expected[name]) for name in grads) > 100 * rounding(model, torch.float32)


def test_seq2seq_and_encoder_steps_equal_keeping_every_activation():
    torch.manual_seed(0)
    t5 = hf_tiny.TinySeq2SeqForConditionalGeneration(hf_tiny.TinySeq2SeqConfig(
        vocab_size=48, hidden_size=16, num_attention_heads=4, intermediate_size=32, max_position_embeddings=32,
        num_hidden_layers=2, num_decoder_layers=2, norm_placement="pre", norm_type="rmsnorm", mlp_gated=True,
        hidden_act="gelu_new", mlp_bias=False, attention_bias=False, position_embedding_type="relative",
        relative_attention_num_buckets=8, relative_attention_max_distance=16, embedding_norm=False, final_norm=True,
        hidden_dropout=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )).train()
    ids = torch.randint(3, 48, (2, 9))
    assert_same_training_step(t5, dict(input_ids=ids, labels=ids[:, :6]))

    torch.manual_seed(0)
    bert = hf_tiny.TinyEncoderForMaskedLM(hf_tiny.TinyEncoderConfig(
        vocab_size=40, hidden_size=24, num_hidden_layers=2, num_attention_heads=3, intermediate_size=40,
        max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
    )).train()
    ids = torch.randint(3, 40, (2, 10))
    assert_same_training_step(bert, dict(input_ids=ids, labels=ids))


def test_bf16_autocast_step_equals_keeping_every_activation():
    model = causal_model("llama")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_loss, expected = loss_and_grads(model, batch(), keep_all=True)
        loss, grads = loss_and_grads(model, batch(), keep_all=False)
    assert all(g.dtype == torch.float32 for g in grads.values())
    assert relative(loss, expected_loss) <= rounding(model)
    # bf16 products: both paths multiply the same bf16 operands; the sums may be ordered differently.
    assert max(relative(grads[name], expected[name]) for name in grads) <= 1e-2


def test_lora_frozen_base_and_hooked_projections_fall_back_and_agree():
    peft = pytest.importorskip("peft")
    model = causal_model("llama")
    lora = peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "down_proj", "gate_proj"], lora_dropout=0.0, init_lora_weights=False,
    ))
    assert_same_training_step(lora, batch(), rounding(model))
    plain = causal_model("llama", seed=1)
    calls = []
    plain.model.layers[0].mlp.down_proj.register_forward_hook(lambda *args: calls.append(1))
    for param in plain.model.layers[1].parameters():
        param.requires_grad_(False)
    assert_same_training_step(plain, batch())
    assert calls  # the hooked projection ran its own forward (the hook fired) instead of being bypassed


def test_gradient_checkpointing_and_outer_saved_tensor_hooks_keep_working():
    model = causal_model("llama")
    inputs = batch()
    expected_loss, expected = loss_and_grads(model, inputs, keep_all=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss, grads = loss_and_grads(model, inputs, keep_all=False)
    assert relative(loss, expected_loss) <= rounding(model)
    assert max(relative(grads[name], expected[name]) for name in grads) <= rounding(model)
    model.gradient_checkpointing_disable()
    with torch.autograd.graph.save_on_cpu():
        loss, grads = loss_and_grads(model, inputs, keep_all=False)
    assert max(relative(grads[name], expected[name]) for name in grads) <= rounding(model)


def _intermediates_alive_after_forward(keep_all: bool) -> dict:
    """Weak references to the first block's normed attention input and MLP activation, taken during a training
    forward; which of them are still alive while the graph (and so everything backward needs) is held."""
    model = causal_model("llama")
    block = model.model.layers[0]
    refs = {}
    block.self_attn.register_forward_pre_hook(lambda module, args: refs.__setitem__("normed", weakref.ref(args[0])))
    block.mlp.act_fn.register_forward_hook(lambda module, args, out: refs.__setitem__("activation", weakref.ref(out)))
    if keep_all:
        with recompute.keep_all_activations():
            loss = model(**batch()).loss
    else:
        loss = model(**batch()).loss
    gc.collect()
    alive = {name: ref() is not None for name, ref in refs.items()}
    loss.backward()  # and backward still works
    return alive


def test_normed_inputs_and_activations_are_freed_after_the_forward():
    assert _intermediates_alive_after_forward(keep_all=False) == {"normed": False, "activation": False}
    # Control: kept by autograd on the ordinary path, so the probe can see a live tensor.
    assert _intermediates_alive_after_forward(keep_all=True) == {"normed": True, "activation": True}


def test_functions_pass_gradcheck_in_float64():
    generator = torch.Generator().manual_seed(0)

    def tensor(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64, requires_grad=True)

    def glu(gate, up):
        return torch.nn.functional.silu(gate) * up

    gate, up, weight, bias = tensor(2, 3, 5), tensor(2, 3, 5), tensor(4, 5), tensor(4)
    assert torch.autograd.gradcheck(lambda *t: _LinearOfRecomputed.apply(glu, *t), (weight, bias, gate, up))
    assert torch.autograd.gradcheck(lambda *t: _LinearOfRecomputed.apply(torch.tanh, t[0], None, t[1]), (weight, gate))

    def rms_norm(x, weight):  # RMSNorm's formula without its fp32 statistics, which would hide gradcheck's steps
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    norm_weight = tensor(5)
    assert torch.autograd.gradcheck(lambda *t: _RecomputedInBackward.apply(rms_norm, *t), (gate, norm_weight))


def test_a_hooked_norm_keeps_its_output_and_the_hook_runs_once():
    model = causal_model("llama")
    inputs = batch()
    _, expected = loss_and_grads(model, inputs, keep_all=True)
    calls = []

    def scale(module, args, output):  # a hook that changes the output: recomputing without it would be wrong
        calls.append(1)
        return output * 1.5

    model.model.layers[0].input_layernorm.register_forward_hook(scale)
    _, reference = loss_and_grads(model, inputs, keep_all=True)
    calls.clear()
    _, grads = loss_and_grads(model, inputs, keep_all=False)
    assert len(calls) == 1
    assert max(relative(grads[name], reference[name]) for name in grads) <= rounding(model)
    assert max(relative(grads[name], expected[name]) for name in grads) > 100 * rounding(model)  # the hook matters


def test_an_input_changed_in_place_before_backward_is_an_error():
    model = causal_model("llama")
    captured = {}
    model.model.layers[1].register_forward_pre_hook(lambda module, args: captured.__setitem__("input", args[0]))
    loss = model(**batch()).loss
    with torch.no_grad():
        captured["input"].add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place|version"):
        loss.backward()


def test_an_in_place_change_of_any_saved_tensor_is_still_detected():
    """Autograd does not check versions of tensors that go through saved-tensor hooks; ours does (the attention
    output here is kept by o_proj and is not one of the recomputed tensors)."""
    model = causal_model("llama")
    captured = {}
    model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(
        lambda module, args: captured.__setitem__("attention", args[0])
    )
    loss = model(**batch()).loss
    with torch.no_grad():
        captured["attention"].mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_recomputation_is_off_without_gradients_and_outside_a_model_forward():
    model = causal_model("llama")
    seen = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda module, args: seen.append(recompute.active()))
    with torch.no_grad():
        model(**batch())
    model(**batch())
    assert seen == [False, True]
    assert not recompute.active()  # back off after the forward
