"""Rotary position embeddings (RoPE): applying cos/sin to queries and keys.

The rotary tables themselves (inv_freq and the scaling variants) are added by the causal family.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Llama's convention: the two halves of the head dimension form the (real, imaginary) pairs."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, D]; cos, sin [B, S, D] (broadcast over heads). Returns x rotated, in x's dtype."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return ((x * cos) + (rotate_half(x) * sin)).to(x.dtype)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
