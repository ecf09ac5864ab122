"""DataParallel replicas run their own weights (issue 41.1), with every runtime path on.

`nn.DataParallel` (which Trainer wraps a model in by itself on several GPUs without torchrun) copies each module with
`_replicate_for_data_parallel()` (a copy of its __dict__) and sets the copies of the parameters on the copies.
`torch.nn.parallel.replicate` itself needs CUDA devices, so `runtime_checks.replicate_on_cpu` wires the replicas the
way it does (torch/nn/parallel/replicate.py), with each parameter copy scaled by 0.5. The replica must compute what a
model holding those weights computes: a forward bound to the original module (what the runtime used to set on
instances) would run the original's weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hf_tiny import runtime
from runtime_checks import batch, logits, replicate_on_cpu

from runtime_models import FAMILIES

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SCALE = 0.5


def scaled(model: nn.Module, scale: float = SCALE) -> nn.Module:
    """A model holding the replica's weights as ordinary parameters: the reference."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for param in reference.parameters():
            param.mul_(scale)
    return reference


def inference_inputs(model, length: int) -> dict:
    return {k: v for k, v in batch(model, length=length).items() if k != "labels"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_replica_computes_with_its_own_weights_at_inference_scale(family, monkeypatch):
    monkeypatch.setattr(runtime, "MIN_ELEMENTS", 1)  # the in-place forms run, as on a large batch
    model = FAMILIES[family]()
    inputs = inference_inputs(model, length=12)
    want = logits(scaled(model), inputs)
    assert not torch.equal(logits(model, inputs), want)  # negative control: the original's differ
    assert torch.equal(logits(replicate_on_cpu(model), inputs), want)


@pytest.mark.parametrize("family", ["causal-llama", "seq2seq-bart"])
def test_a_replica_decodes_with_its_own_weights_in_the_few_rows_path(family, monkeypatch, threads):
    threads(2)
    monkeypatch.setattr(runtime, "MIN_WEIGHT_ELEMENTS", 1)
    monkeypatch.setattr(runtime, "MIN_SLICE", 16)
    taken = []
    original = runtime.few_rows_linear
    monkeypatch.setattr(runtime, "few_rows_linear", lambda *args: taken.append(args[-1]) or original(*args))
    model = FAMILIES[family]()
    inputs = inference_inputs(model, length=1)
    want = logits(scaled(model), inputs)
    got = logits(replicate_on_cpu(model), inputs)
    assert taken, "the decoding step did not take the weight-first products"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(logits(model, inputs), want, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("family", ["causal-llama", "causal-gpt2", "encoder"])
def test_a_replica_trains_with_its_own_weights_with_recompute(family):
    """Training: layers recomputed in backward replay the replica's own forward (the recompute path is on on the
    CPU); the loss and the gradients reaching the original parameters through the copies are the reference's times
    the copy's scale."""
    model = FAMILIES[family]().train()
    reference = scaled(model).train()
    inputs = batch(model, length=12)
    torch.manual_seed(5)
    want = reference(**inputs).loss
    want.backward()
    torch.manual_seed(5)
    got = replicate_on_cpu(model)(**inputs).loss
    got.backward()
    assert torch.equal(got, want)
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        if ref.grad is not None:
            torch.testing.assert_close(param.grad, ref.grad * SCALE, rtol=1e-5, atol=1e-7, msg=name)
