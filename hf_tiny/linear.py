"""nn.Linear with a faster CPU product for the few rows of a decoding step.

Decoding multiplies every weight by a handful of rows (one per sequence in the batch), so its speed is the rate
at which the products read the weights. On a CPU in fp32, `x @ Wᵀ` (F.linear) does that badly for few rows:
MKL runs one row on one thread, and 2 to ~100 rows through a skinny-GEMM path that reads weights at half the rate
or less. The same numbers computed as `W @ xᵀ` (the weight as the product's tall left operand) read it 1.0-4.2x
faster for 2-16 rows, and one row split into one product per thread (a batched `W_i @ x`) 1.2-2.0x faster.
Measured per SmolLM2 shape and row count by `python -m benchmarks.few_rows`; the last run is in
benchmarks/results/few-rows-cpu-*.md. bf16 gains nothing (oneDNN's kernels), so only fp32 takes this path.

The results equal F.linear's up to the order of the additions (as they do between F.linear's own kernels for
different row counts): greedy tokens are unchanged on every model in the tests and benchmarks.

Everything else is nn.Linear's: parameters, state dict, init, and what tools see. PEFT, quantizers and vLLM's
Transformers backend find it with isinstance(module, nn.Linear) and wrap or replace it as usual; a forward that
records gradients (training, or inference outside no_grad / inference_mode), other devices and dtypes, autocast,
small weights and torch.compile use F.linear.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

# Where the weight-first product wins (benchmarks/few_rows.py, SmolLM2's shapes, 2 threads): for 2 to 128 rows
# when the weight has at least 8 output rows per input row (k/v's 192-row weights lose from 32 rows on, and above
# ~128 rows both products are bound by arithmetic, not by reading the weight); for one row when each thread's
# slice has at least 256 output rows (192 rows in two slices lose). Small weights keep F.linear: their product is
# over before the extra operators pay (the benchmarks' "overhead" model, weights of at most 98,304 elements,
# decoded 0.85x as fast with it; SmolLM2's smallest weight has 110,592).
MAX_FEW_ROWS = 128
MIN_OUTPUTS_PER_ROW = 8
MIN_SLICE = 256
MIN_WEIGHT_ELEMENTS = 100_000


class Linear(nn.Linear):
    """nn.Linear; in fp32 CPU inference (no gradients recorded) on few rows it computes the same product
    weight-first (see above)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        # Cheap tests: this runs at every projection of every decoding step. The input's type first, so that a
        # torch.fx trace (x and the weight are Proxies) never branches on a Proxy; then the weight's size, so that
        # a model of small weights pays two tests (measured: 2-3 us less per call than testing the size last).
        if type(x) is torch.Tensor and weight.numel() >= MIN_WEIGHT_ELEMENTS and not (
            torch.is_grad_enabled() or x.dtype is not torch.float32 or not x.is_cpu or torch.compiler.is_compiling()
        ):
            rows = _few_rows(weight, x)
            if rows:
                return few_rows_linear(x, weight, self.bias, rows)
        return F.linear(x, weight, self.bias)


def weight_first(out_features: int, rows: int) -> bool:
    """Whether hf_tiny computes a product of `rows` rows with an [out_features, *] fp32 weight (of at least
    MIN_WEIGHT_ELEMENTS) weight-first."""
    if rows == 1:
        return _slices_per_thread(out_features) > 1
    return 1 < rows <= MAX_FEW_ROWS and rows * MIN_OUTPUTS_PER_ROW <= out_features


def _few_rows(weight: torch.Tensor, x: torch.Tensor) -> int:
    """For a float32 CPU x with no gradients recorded: the number of rows of x when the weight-first product
    applies, else 0."""
    if weight.dtype is not torch.float32 or type(weight) not in (torch.Tensor, nn.Parameter):  # DTensor, quantized
        return 0
    shape = x.shape
    if not shape or shape[-1] != weight.shape[1] or not weight.is_contiguous():
        return 0
    if torch.is_autocast_enabled("cpu"):
        return 0
    rows = x.numel() // shape[-1]
    return rows if weight_first(weight.shape[0], rows) else 0


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias, rows: int) -> torch.Tensor:
    """F.linear(x, weight, bias) as W @ xᵀ; one row as one product per thread over slices of W's output rows.
    weight must be contiguous."""
    out_features, in_features = weight.shape
    flat = x.reshape(rows, in_features)
    if rows == 1:
        slices = _slices_per_thread(out_features)
        sliced = weight.view(slices, out_features // slices, in_features)
        # x as the transposed view of its row: the strides with which bmm reads it at full speed (a [in, 1]
        # view of the row itself runs 3x slower)
        column = flat.t().expand(slices, in_features, 1)
        if bias is None:
            out = torch.bmm(sliced, column)
        else:
            out = torch.baddbmm(bias.reshape(slices, -1, 1), sliced, column)
        return out.view(*x.shape[:-1], out_features)
    if bias is None:
        out = torch.mm(weight, flat.t())
    else:
        out = torch.addmm(bias.unsqueeze(1), weight, flat.t())
    return out.t().contiguous().view(*x.shape[:-1], out_features)


def _slices_per_thread(out_features: int) -> int:
    """The most slices, up to one per intra-op thread, that divide the output rows evenly into slices of at least
    MIN_SLICE rows (1: no slicing)."""
    slices = min(torch.get_num_threads(), out_features // MIN_SLICE)
    while slices > 1 and out_features % slices:
        slices -= 1
    return max(slices, 1)


def linear_into(x: torch.Tensor, weight: torch.Tensor, bias, out: torch.Tensor) -> Optional[torch.Tensor]:
    """F.linear(x, weight, bias) written into `out` (contiguous, [rows, out_features]) and returned shaped like
    F.linear's result: for a contiguous x of more than MAX_FEW_ROWS rows, the addmm / mm that F.linear itself runs
    on it (so the same numbers as Linear.forward there). None where that is not the product Linear.forward takes:
    fewer rows, gradients recorded, autocast, a weight that is not a plain tensor."""
    rows = x.numel() // x.shape[-1]
    if (
        rows <= MAX_FEW_ROWS
        or not x.is_contiguous()
        or torch.is_grad_enabled()
        or torch.is_autocast_enabled(x.device.type)
        or type(weight) not in (torch.Tensor, nn.Parameter)
        or x.dtype != weight.dtype
        or x.device != weight.device
        or out.shape != (rows, weight.shape[0])
        or out.dtype != x.dtype
    ):
        return None
    flat = x.view(rows, x.shape[-1])
    if bias is None:
        torch.mm(flat, weight.t(), out=out)
    else:
        torch.addmm(bias, flat, weight.t(), out=out)
    return out.view(*x.shape[:-1], weight.shape[0])
