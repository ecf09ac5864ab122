"""How far apart two float computations of the same value may be: stated once, here.

Two computations that differ only in the order of their floating-point operations (another kernel or thread count,
activations recomputed in backward, official transformers' operation order against ours) agree to rounding, not to
the bit. Comparisons that are bit-identical by construction (the same kernels in the same order) stay
`torch.equal`; this module is for the others.

The bound. A sum of n terms evaluated in floating point is off by at most gamma_(n-1) * sum |terms|, with
gamma_k = k u / (1 - k u) and u = eps / 2 the unit roundoff (Higham, Accuracy and Stability of Numerical Algorithms,
2nd ed., section 4.2); two evaluations in different orders therefore differ by at most about n * eps times the size
of the terms. A model's output is such a sum taken stage after stage (each block's products, its norm, the head):
the roundings of the stages add up, as in one sum of stages * width terms. So the bound on the relative error,
max |actual - expected| / max |expected|, is

    reduction_length * eps(dtype),     reduction_length = stages * (longest sum of one stage)

`model_reduction_length` reads the stages and widths of a transformer's config. The bound is a worst case: what
these tests measure sits 10-30 times below it (the recompute [moe] gradients 1.4e-6 against 4.4e-5; DistilBERT's
MLM logits, 1.1e-5 absolute at max |logit| 7.4, relative 1.5e-6 against 3.1e-5; every encoder parity case at most
0.1 of its bound), while a real error (a wrong rotation, a dropped bias, a mis-recomputed activation) is relative
1e-3 to 1, which each comparison's negative control checks.
"""

from __future__ import annotations

import torch


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def rounding_bound(dtype: torch.dtype, reduction_length: int) -> float:
    """Bound on the relative error of two evaluations in `dtype` of one computation whose sums, stage after stage,
    add up to `reduction_length` terms."""
    if reduction_length < 1:
        raise ValueError(f"reduction_length must be at least 1, got {reduction_length}")
    return reduction_length * eps(dtype)


def stacked_reduction_length(stages: int, *widths: int) -> int:
    """`stages` computations in a row (blocks, a head; a backward pass doubles them), each summing at most
    max(widths) terms per output value."""
    return stages * max(widths)


def model_reduction_length(config, tokens: int, *, training_step: bool = False) -> int:
    """For a transformers or hf_tiny config: layers + 1 (the head) stages, each at most as long as the widest of
    hidden size, intermediate size, embedding size and `tokens` (attention sums over the keys). A training step
    (loss, then gradients) doubles the stages for the backward pass and adds the vocabulary (the loss's
    log-sum-exp sums over it; weight gradients sum over every token, which `tokens` then counts)."""
    layers = _first(config, "num_hidden_layers", "n_layers", "num_layers")
    widths = [tokens] + [value for value in (
        _first(config, "hidden_size", "dim", "d_model", default=0),
        _first(config, "intermediate_size", "hidden_dim", "d_ff", "ffn_dim", default=0),
        _first(config, "embedding_size", default=0),
        _first(config, "vocab_size", default=0) if training_step else 0,
    ) if value]
    stages = (layers + 1) * (2 if training_step else 1)
    return stacked_reduction_length(stages, *widths)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64 (all zeros expected: the absolute difference)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} and {tuple(expected.shape)}")
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    difference = float((actual - expected).abs().max()) if expected.numel() else 0.0
    return difference / scale if scale > 0 else difference


def worst_relative_error(actual: dict, expected: dict) -> float:
    """The largest relative_error over tensors of the same names (a model's gradients)."""
    if actual.keys() != expected.keys():
        raise ValueError(f"different tensors: {sorted(actual.keys() ^ expected.keys())}")
    return max(relative_error(actual[name], expected[name]) for name in expected)


def _first(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    if default is None:
        raise ValueError(f"{type(config).__name__} has none of {names}")
    return default
