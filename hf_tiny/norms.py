"""The two norms of the blocks: RMSNorm (Llama, T5, Gemma) and LayerNorm (BERT, BART, GPT-2)."""

from __future__ import annotations

import torch
from torch import nn

from .recompute import active as recomputing, recomputed_in_backward

NORM_TYPES = ("layernorm", "rmsnorm")


class RMSNorm(nn.Module):
    """Root-mean-square norm, statistics in fp32.

    Llama / T5: weight * x, the product in the input dtype (weights initialized to 1).
    unit_offset=True (Gemma): (1 + weight) * x, the product in fp32 and then cast (weights initialized to 0). The
    offset is applied here rather than folded into the stored weight, so checkpoints convert bit for bit.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, unit_offset: bool = False):
        super().__init__()
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(hidden_size) if unit_offset else torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if recomputing():  # training: keep the input only, not the normalized copy (recompute.py)
            return recomputed_in_backward(self._normalize, hidden_states, self.weight)
        return self._normalize(hidden_states, self.weight)

    def _normalize(self, hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.unit_offset:
            return (hidden_states * (1.0 + weight.float())).to(input_dtype)
        return weight * hidden_states.to(input_dtype)

    def reset_weight(self) -> None:
        self.weight.data.fill_(0.0 if self.unit_offset else 1.0)

    def extra_repr(self) -> str:
        offset = ", unit_offset=True" if self.unit_offset else ""
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}{offset}"


def build_norm(norm_type: str, hidden_size: int, eps: float, *, unit_offset: bool = False, bias: bool = True) -> nn.Module:
    """bias: the LayerNorm's additive bias (MPT's have none); RMSNorm has none anyway."""
    if norm_type == "layernorm":
        return nn.LayerNorm(hidden_size, eps=eps, bias=bias)
    if norm_type == "rmsnorm":
        return RMSNorm(hidden_size, eps=eps, unit_offset=unit_offset)
    raise ValueError(f"unknown norm_type {norm_type!r}; choose one of {list(NORM_TYPES)}")
