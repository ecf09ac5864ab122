"""Where the runtime must step aside or say no (an adversarial pass found each of these): second derivatives through
the chunked loss, torch.func transforms, forwards patched at class level, a wrapped LM head under the MTP loss, a
contradictory set_runtime, and modules of other code inside a recomputed layer (PEFT's in-place adapters). Each
compares with the runtime off, which computes the plain reading."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hf_tiny
from hf_tiny import runtime
from hf_tiny.layers import Attention, GatedFeedForward
from runtime_models import SIZES, causal_model

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def batch(rows: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(3, 97, (rows, length), generator=torch.Generator().manual_seed(0))


def test_a_second_derivative_through_the_chunked_loss_is_refused_with_the_way_out():
    """The chunked loss computes its gradients in forward, as constants: a gradient penalty (create_graph=True)
    silently lost every second-order term (lm_head's gradient 1.15 against 3.88). Now refused; with the chunked loss
    off the same code runs, the control."""
    model = causal_model().train()
    model.set_runtime(recompute=False)
    ids = batch()
    loss = model(input_ids=ids, labels=ids).loss
    with pytest.raises(RuntimeError, match=r"has no second derivative .*set_runtime\(chunked_loss=False\)"):
        torch.autograd.grad(loss, [model.lm_head.weight], create_graph=True)[0].pow(2).sum().backward()
    model.set_runtime(chunked_loss=False)
    loss = model(input_ids=ids, labels=ids).loss
    penalty = torch.autograd.grad(loss, [model.lm_head.weight], create_graph=True)[0].pow(2).sum()
    penalty.backward()
    assert model.lm_head.weight.grad.abs().max() > 0


def test_torch_func_grad_on_a_training_model_runs_as_with_the_runtime_off():
    """torch.func.grad failed with the runtime on ('don't yet support saved tensor hooks', then 'must override
    setup_context'): recompute and the chunked loss now step aside inside torch.func transforms."""
    model = causal_model().train()
    ids = batch()
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss_of(values):
        return torch.func.functional_call(model, values, (), {"input_ids": ids, "labels": ids}).loss

    with_runtime = torch.func.grad(loss_of)(params)["lm_head.weight"]
    model.set_runtime(False)
    without = torch.func.grad(loss_of)(params)["lm_head.weight"]
    assert torch.allclose(with_runtime, without, rtol=1e-5, atol=1e-7) and without.abs().max() > 0


@pytest.mark.parametrize("patched_class", [GatedFeedForward, Attention], ids=["feed-forward", "attention"])
def test_a_forward_patched_on_the_class_is_run_not_stood_in_for(patched_class, monkeypatch):
    """Kernel and steering libraries patch a modeling class's forward. The in-place path ran its own form of the
    feed-forward anyway (the patch ignored: 10.3 off) and added the residual into a patched attention's returned tensor
    (a stored activation overwritten). Now the patched forward runs and its tensor is left alone."""
    model = causal_model().eval()
    ids = batch(rows=8, length=128)  # 8 x 128 x 32 hidden-state elements: the in-place path's scale
    original = patched_class.forward
    stored = {}

    def patched(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if patched_class is GatedFeedForward:
            return out * 0.5
        stored.setdefault(self.layer_idx, out[0] * 0.5)  # a stored activation, kept across calls
        return stored[self.layer_idx], None

    monkeypatch.setattr(patched_class, "forward", patched)
    with torch.inference_mode():
        first = model(input_ids=ids).logits
        kept = {index: tensor.clone() for index, tensor in stored.items()}
        second = model(input_ids=ids).logits
        model.set_runtime(False)
        plain = model(input_ids=ids).logits
    assert torch.equal(first, plain) and torch.equal(second, plain)
    assert all(torch.equal(stored[index], tensor) for index, tensor in kept.items())
    monkeypatch.undo()
    with torch.inference_mode():
        assert not torch.equal(model(input_ids=ids).logits, plain)  # control: the patch changed the output


def test_the_mtp_loss_goes_through_a_wrapped_lm_head():
    """A LoRA adapter on lm_head took part in the main loss but not in the MTP loss, which multiplied the head's
    weight itself: now both go through the head as it is, so the adapter's MTP loss equals the merged model's."""
    peft = pytest.importorskip("peft")
    model = causal_model("deepseek").train()
    ids = batch(length=16)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False))
    adapted.train()
    output = adapted(input_ids=ids, labels=ids)
    assert output.mtp_loss.requires_grad
    merged = adapted.merge_and_unload().train()
    assert torch.allclose(output.mtp_loss, merged(input_ids=ids, labels=ids).mtp_loss, rtol=1e-5)


def test_set_runtime_off_with_a_path_on_is_an_error():
    model = causal_model()
    with pytest.raises(ValueError, match=r"set_runtime\(False, \.\.\.\) turns every path off; it cannot also turn "
                                         r"on \['recompute'\]: call set_runtime\(recompute=True\) instead"):
        model.set_runtime(False, recompute=True)


def _shared_layers_encoder():
    """ALBERT's sharing: three passes through one layer's weights."""
    torch.manual_seed(0)
    config = hf_tiny.TinyEncoderConfig(**{**SIZES, "num_hidden_layers": 3}, num_hidden_groups=1, hidden_dropout=0.0,
                                       attention_dropout=0.0)
    return hf_tiny.TinyEncoderForMaskedLM(config)


@pytest.mark.parametrize("case", ["two forwards, one backward", "shared layers"])
def test_recompute_under_autocast_with_a_weight_used_twice_equals_keeping_everything(case):
    """Under autocast a weight used twice in one block is cast once, then read from autocast's cache; the replay in
    backward cast it again, and backward failed ('aten._to_copy ... not found in storage'): a contrastive or a
    chosen/rejected pass under AMP, and every ALBERT step of Trainer(bf16=True) on the CPU. Now replayed without
    the cache: the gradients equal those of the step that keeps everything (recompute off)."""
    model = (causal_model() if case.startswith("two") else _shared_layers_encoder()).train()
    ids = batch()
    passes = 2 if case.startswith("two") else 1
    grads = []
    for recompute in (True, False):
        model.set_runtime(recompute=recompute)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = sum(model(input_ids=ids, labels=ids).loss for _ in range(passes))
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    with_recompute, kept = grads
    assert all(torch.equal(with_recompute[name], kept[name]) for name in kept)
    assert kept["lm_head.weight" if passes == 2 else "lm_head.dense.weight"].abs().max() > 0


class AddsIntoItsProduct(nn.Module):
    """A projection of other code that adds its update into the base product's output in place, as PEFT's AdaLoRA,
    C3A and GraLoRA layers do (`result += ...`)."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base_layer = base
        self.update = nn.Linear(base.in_features, base.out_features, bias=False)

    def forward(self, x):
        result = self.base_layer(x)
        result += self.update(x)
        return result


def _with_foreign_projections(bias: bool):
    model = causal_model(attention_bias=bias)
    for layer in model.model.layers:
        layer.self_attn.q_proj = AddsIntoItsProduct(layer.self_attn.q_proj)
        layer.self_attn.v_proj = AddsIntoItsProduct(layer.self_attn.v_proj)
    return model


def _gradients(model, ids) -> dict:
    model.zero_grad(set_to_none=True)
    model.train()(input_ids=ids, labels=ids).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
def test_a_layer_holding_modules_of_other_code_is_not_recomputed(bias):
    """The recompute keeps a layer's matrix products' outputs; a module that adds into one in place changed what
    backward read: without a bias, silently wrong gradients (AdaLoRA's off by 5e5 times the tensor's largest
    gradient); with one, backward raised 'Tensor cached during selective activation checkpoint has been mutated'.
    A layer holding a module that is not torch's or the model's own runs as written."""
    model, ids = _with_foreign_projections(bias).set_runtime(chunked_loss=False), batch()
    on = _gradients(model, ids)
    model.set_runtime(recompute=False)
    off = _gradients(model, ids)
    assert on.keys() == off.keys() and all(torch.equal(on[name], off[name]) for name in on)
    # the control: the same layers with only their own modules are still recomputed (a replay in backward)
    plain = causal_model(attention_bias=bias).set_runtime(chunked_loss=False)
    states = torch.zeros(1, 2, SIZES["hidden_size"])
    assert runtime._recomputes(plain.train().model.layers[0], states)
    model.set_runtime(recompute=True)  # asked for: still not for layers holding modules of other code
    assert not runtime._recomputes(model.train().model.layers[0], states)


def test_adalora_trains_with_the_gradients_of_the_runtime_off():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.AdaLoraConfig(init_r=4, total_step=10, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                task_type="CAUSAL_LM")
    model = peft.get_peft_model(causal_model().set_runtime(chunked_loss=False), config)
    for name, parameter in model.named_parameters():  # non-zero updates, as after some training
        if "lora_" in name:
            torch.nn.init.normal_(parameter, std=0.3, generator=torch.Generator().manual_seed(len(name)))
    ids = batch()
    on = _gradients(model, ids)
    model.base_model.model.set_runtime(recompute=False)
    off = _gradients(model, ids)
    assert any("lora_E" in name for name in on)
    assert all(torch.equal(on[name], off[name]) for name in on)
