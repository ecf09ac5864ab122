"""A stand-in for the flash-attn package on CPU (its varlen and padded entry points computed by the naive backend)."""

from __future__ import annotations

import sys
import types
from typing import Optional
import torch
from hf_tiny import flash


def causal_allowed(sq: int, sk: int) -> torch.Tensor:
    """Bottom-right aligned causal rule written as loops: query i sees key j when j <= i + sk - sq."""
    return torch.tensor([[j <= i + sk - sq for j in range(sk)] for i in range(sq)], dtype=torch.bool)


def _fake_flash_one(q, k, v, scale, causal):
    """One sequence in flash-attn's layout: q [Sq, H, D], k/v [Sk, Hkv, D]; causal aligned bottom-right (flash-attn
    >= 2.1), a query row with no key gives zeros."""
    sq, heads, _ = q.shape
    sk, kv_heads, _ = k.shape
    if sq == 0:
        return q.new_zeros(q.shape)
    k = k.repeat_interleave(heads // kv_heads, dim=1).float()
    v = v.repeat_interleave(heads // kv_heads, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    allowed = causal_allowed(sq, sk) if causal else torch.ones(sq, sk, dtype=torch.bool)
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.nan_to_num(torch.softmax(scores, -1), nan=0.0)
    return torch.einsum("hqk,khd->qhd", weights, v).to(q.dtype)


class FakeFlashAttn(types.ModuleType):
    """Stands in for the flash-attn package with CPU math, checking the arguments flash-attn requires."""

    def __init__(self):
        super().__init__("flash_attn")
        self.calls = []

    def flash_attn_func(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
        self.calls.append("dense")
        assert q.dim() == 4 and q.shape[0] == k.shape[0]
        return torch.stack([_fake_flash_one(q[b], k[b], v[b], softmax_scale, causal) for b in range(q.shape[0])])

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False):
        self.calls.append("varlen")
        for cu, total, longest in ((cu_seqlens_q, q.shape[0], max_seqlen_q), (cu_seqlens_k, k.shape[0], max_seqlen_k)):
            assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == total
            assert torch.all(cu[1:] >= cu[:-1]) and isinstance(longest, int) and longest == int((cu[1:] - cu[:-1]).max())
        assert len(cu_seqlens_q) == len(cu_seqlens_k)
        out = torch.empty_like(q)
        for i in range(len(cu_seqlens_q) - 1):
            qs, qe, ks, ke = (int(x) for x in (cu_seqlens_q[i], cu_seqlens_q[i + 1], cu_seqlens_k[i], cu_seqlens_k[i + 1]))
            out[qs:qe] = _fake_flash_one(q[qs:qe], k[ks:ke], v[ks:ke], softmax_scale, causal)
        return out


def flash_on_cpu(monkeypatch_context, *, package: Optional[FakeFlashAttn]):
    """The flash backend on CPU: PyTorch's real CPU flash kernel (package=None), or the fake flash-attn package."""
    monkeypatch_context.setattr(flash, "flash_attn_package_available", lambda device=None: package is not None)
    if package is not None:
        monkeypatch_context.setitem(sys.modules, "flash_attn", package)
