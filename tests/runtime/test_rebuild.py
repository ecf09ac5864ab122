"""The runtime's rebuild path (runtime.rebuilt_in_backward): a gated feed-forward's product is not kept for the down
projection's backward but rebuilt there from what the product's own backward keeps; gradients are those of the plain
step bit for bit. A named option (off on every device by default) until the GPU check measures it.

That the product is kept as a recipe is seen from the rebuild calls: backward unpacks a saved tensor that autograd
kept as a recipe by calling rebuild(), once per saved view; a product kept whole is never rebuilt.
"""

from __future__ import annotations

import types

import pytest
import torch

from hf_tiny import liger, runtime, runtime_forms
from hf_tiny.transformers_api import enable_activation_checkpointing
from runtime_checks import batch, training_step
from runtime_models import causal_model

pytestmark = pytest.mark.usefixtures("single_torch_thread")

ONLY_REBUILD = dict(rebuild=True, recompute=False, in_place=False, few_rows=False, chunked_loss=False, fit_memory=False)


@pytest.fixture
def rebuilds(monkeypatch):
    """The rebuild calls backward makes, one entry per call."""
    calls = []
    real = runtime.rebuilt_in_backward

    def counted(module, tensor, rebuild):
        return real(module, tensor, lambda: calls.append(module) or rebuild())

    monkeypatch.setattr(runtime_forms, "rebuilt_in_backward", counted)
    monkeypatch.setattr(liger, "rebuilt_in_backward", counted)
    return calls


def plain_and_rebuilt(model) -> tuple[dict, dict]:
    """A training step's loss and gradients with the runtime off, then with only the rebuild path on."""
    inputs = batch(model)
    model.set_runtime(False)
    plain = training_step(model, inputs)
    model.set_runtime(True, **ONLY_REBUILD)
    return plain, training_step(model, inputs)


def test_gradients_are_the_plain_steps_and_each_product_is_rebuilt_once(rebuilds):
    model = causal_model()
    plain, rebuilt = plain_and_rebuilt(model)
    assert plain.keys() == rebuilt.keys() and all(torch.equal(plain[n], rebuilt[n]) for n in plain)
    assert rebuilds == [layer.mlp for layer in reversed(model.model.layers)]  # backward runs the layers in reverse


def test_negative_control_the_product_is_kept_whole_by_default_and_where_others_decide(rebuilds):
    """Off by default on every device; with it on, not in eval, not without gradients, not where saved-tensor hooks
    are open already (CPU offloading), not under gradient checkpointing (its own hooks)."""
    model = causal_model()
    inputs = batch(model)
    assert not any(runtime.ON_BY_DEFAULT["rebuild"])
    model.set_runtime(True, recompute=False)
    training_step(model, inputs)
    model.set_runtime(True, **ONLY_REBUILD)
    with torch.no_grad():
        model.train()(**inputs)
    model.eval()(**inputs)
    with torch.autograd.graph.save_on_cpu():
        training_step(model, inputs)
    enable_activation_checkpointing(model, {"use_reentrant": False})
    training_step(model, inputs)
    assert rebuilds == []


def test_a_wrong_rebuild_shows_in_the_gradients(monkeypatch):
    """The gradients above are the rebuilt product's: rebuilt wrong (the product doubled), the down projection's
    weight gradient is wrong, the others (computed from the product's own saved inputs) are not."""
    real = runtime.rebuilt_in_backward
    monkeypatch.setattr(runtime_forms, "rebuilt_in_backward", lambda m, t, rebuild: real(m, t, lambda: 2 * rebuild()))
    plain, wrong = plain_and_rebuilt(causal_model())
    down = [n for n in plain if n.endswith("down_proj.weight")]
    assert down and all(torch.allclose(2 * plain[n], wrong[n], rtol=1e-5, atol=1e-6) for n in down)
    assert torch.equal(plain["model.layers.0.mlp.up_proj.weight"], wrong["model.layers.0.mlp.up_proj.weight"])


class SiluMul(torch.autograd.Function):
    """A stand-in for Liger's LigerSiLUMulFunction (its Triton kernel does not run under the interpreter): the same
    contract, silu(a) * b, keeping a and b for backward."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.nn.functional.silu(a) * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        sig = torch.sigmoid(a)
        return grad * b * sig * (1 + a * (1 - sig)), grad * a * sig


def test_the_liger_feed_forward_rebuilds_its_product_with_the_same_function(monkeypatch, rebuilds):
    """The forward hf_tiny's Liger switch binds on gated feed-forwards: LigerSwiGLUMLP's, and with the rebuild path
    on, its product is rebuilt by the function that made it; gradients equal the kept product's bit for bit."""
    monkeypatch.setattr(liger, "_liger", lambda: types.SimpleNamespace(silu_mul=SiluMul.apply))
    model = causal_model()
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 5, model.config.hidden_size)

    def grads(**paths):
        model.set_runtime(True, **paths)
        mlp.train().zero_grad(set_to_none=True)
        liger._liger_swiglu_forward(mlp, x).square().sum().backward()
        return [p.grad.clone() for p in mlp.parameters()]

    kept = grads(rebuild=False)
    assert rebuilds == []
    assert all(torch.equal(a, b) for a, b in zip(kept, grads(rebuild=True)))
    assert rebuilds == [mlp]
