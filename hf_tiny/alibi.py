"""ALiBi (Press et al. 2022, "Train Short, Test Long"): no position embeddings; each head h adds -m_h * (i - j) to
the score of query i and key j, a linear penalty on distance with a head-specific slope.

Slopes as BLOOM and MPT compute them: for n heads with p = the largest power of two <= n, the geometric sequence
m_k = 2^(-max_bias * k / p), k = 1 .. p, then (n > p) the n - p slopes halfway between those, 2^(-max_bias * (2k - 1)
/ (2p)), k = 1 .. n - p. (MPT writes the same with the next power of two and its odd / even slopes; max_bias is
MPT's alibi_bias_max, 8 in BLOOM and in every released MPT.)
"""

from __future__ import annotations

import math

import torch


def alibi_slopes(num_heads: int, max_bias: float = 8.0) -> torch.Tensor:
    """[num_heads] float32 slopes."""
    power = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-max_bias * k / power) for k in range(1, power + 1)]
    slopes += [2.0 ** (-max_bias * (2 * k - 1) / (2 * power)) for k in range(1, num_heads - power + 1)]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """[1, H, Sq, Sk] bias -m_h * (query position - key position), in float32 (masked entries are set by the mask)."""
    distance = (query_positions[:, None] - key_positions[None, :]).to(torch.float32)
    return -(slopes.to(distance.device)[:, None, None] * distance)[None]


__all__ = ["alibi_slopes", "alibi_bias"]
