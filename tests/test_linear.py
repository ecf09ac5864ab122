"""hf_tiny.linear.Linear: nn.Linear whose fp32 CPU inference on few rows computes the product weight-first.

The results are checked against an fp64 product (each side's error must be of F.linear's size), the path is
checked to be taken exactly where it should (a spy on few_rows_linear), and a model decoding with it against the
same model with it switched off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hf_tiny.linear as linear_module
from hf_tiny.linear import MAX_FEW_ROWS, Linear, few_rows_linear
from hf_tiny.recompute import plain_linear

from causal_helpers import weight_first_model


@pytest.fixture
def spy(monkeypatch):
    calls = []

    def counting(*args):
        calls.append(args[-1])
        return few_rows_linear(*args)

    monkeypatch.setattr(linear_module, "few_rows_linear", counting)
    return calls


def _error_bound(layer: nn.Linear, x: torch.Tensor) -> tuple[float, float]:
    """(this layer's max error, F.linear's max error), both against the fp64 product."""
    exact = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    with torch.no_grad():
        ours = layer(x).double()
        official = F.linear(x, layer.weight, layer.bias).double()
    return (ours - exact).abs().max().item(), (official - exact).abs().max().item()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(576,), (1, 576), (1, 1, 576), (2, 3, 576), (8, 1, 576), (MAX_FEW_ROWS, 576)])
def test_equals_fp64_product_as_closely_as_f_linear(shape, bias, spy):
    torch.manual_seed(0)
    layer = Linear(576, 1536, bias=bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        out = layer(x)
    assert out.shape == (*shape[:-1], 1536)
    assert out.is_contiguous()
    assert spy, "the weight-first product was not used"
    ours, official = _error_bound(layer, x)
    assert ours <= 4 * official + 1e-6, (ours, official)


def test_comparison_catches_a_misplaced_slice():
    # Negative control: the same check fails for a one-row product whose per-thread slices come back swapped.
    torch.manual_seed(0)
    weight, x = torch.randn(1536, 576), torch.randn(1, 576)
    exact = F.linear(x.double(), weight.double())
    swapped = torch.bmm(weight.view(2, 768, 576), x.view(1, 576, 1).expand(2, 576, 1)).flip(0).reshape(1, 1536)
    official = F.linear(x, weight)
    assert (swapped.double() - exact).abs().max().item() > 4 * (official.double() - exact).abs().max().item() + 1e-6


@pytest.mark.parametrize(
    "num_threads,out_features,slices",
    [(1, 1536, 1), (2, 1536, 2), (3, 1536, 3), (4, 1536, 4), (4, 768, 3), (2, 513, 1), (2, 192, 1), (4, 49, 1)],
)
def test_one_row_slices_per_thread(threads, spy, num_threads, out_features, slices):
    threads(num_threads)
    assert linear_module._slices_per_thread(out_features) == slices
    torch.manual_seed(0)
    layer = Linear(256, out_features, bias=True)
    x = torch.randn(1, 256)
    ours, official = _error_bound(layer, x)
    assert ours <= 4 * official + 1e-6
    assert len(spy) == (slices > 1)  # one slice: F.linear itself


def test_taken_only_for_fp32_cpu_inference_on_few_rows(spy, threads):
    threads(2)
    layer = Linear(128, 1024)
    x = torch.randn(4, 128)
    layer(x)  # gradients recorded: training keeps F.linear, so gradients are official's
    layer.requires_grad_(False)
    layer(x)  # still recorded (frozen weights, as under PEFT): F.linear
    assert spy == []
    with torch.no_grad():
        layer(torch.randn(MAX_FEW_ROWS + 1, 128))  # compute-bound: F.linear
        Linear(576, 192)(torch.randn(32, 576))  # fewer than 8 outputs per row: F.linear
        Linear(96, 1024)(torch.randn(4, 96))  # a small weight: F.linear
        layer.to(torch.bfloat16)(x.bfloat16())  # no gain in bf16
        layer.float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x)
        layer.to("meta")(x.to("meta"))  # a tracer's meta run
        layer.to_empty(device="cpu")
        assert spy == []
        layer(x)
        layer(torch.randn(128))
    assert spy == [4, 1]


def test_wrong_input_width_raises_f_linears_error():
    with torch.no_grad(), pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        Linear(32, 48)(torch.randn(2, 31))


def test_is_an_nn_linear_to_tools():
    layer = Linear(8, 4)
    assert isinstance(layer, nn.Linear) and plain_linear(layer)
    assert set(layer.state_dict()) == {"weight", "bias"}
    layer.register_forward_hook(lambda *args: None)
    assert not plain_linear(layer)


@pytest.mark.parametrize("batch", [1, 3])
def test_decoding_with_it_matches_decoding_without(monkeypatch, spy, threads, batch):
    threads(2)
    model = weight_first_model()
    ids = torch.randint(3, 512, (batch, 5))
    kwargs = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        fast = model.generate(ids, **kwargs)
        assert batch in spy, "decoding steps did not take the weight-first product"
        monkeypatch.setattr(linear_module, "MAX_FEW_ROWS", 0)
        monkeypatch.setattr(linear_module, "MIN_SLICE", 10**9)
        spy.clear()
        plain = model.generate(ids, **kwargs)
        assert spy == []
    assert torch.equal(fast.sequences, plain.sequences)
    for a, b in zip(fast.scores, plain.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_torch_fx_traces_it():
    """A symbolic trace sees x and the weight as Proxies: the forward must not branch on them (testing the weight's
    size before the input's type did, and raised fx's TraceError)."""
    layer = Linear(576, 576)
    traced = torch.fx.symbolic_trace(layer)
    x = torch.randn(3, 576)
    with torch.no_grad():
        assert torch.equal(traced(x), F.linear(x, layer.weight, layer.bias))
