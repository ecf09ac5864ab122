"""FlashAttention written in Triton: forward and backward over packed variable-length sequences, with GQA, causal
(bottom-right aligned) and sliding-window masks.

The algorithm (Dao et al., FlashAttention 1 and 2), step by step as the kernels below number them:
  F1. One program takes a tile of BLOCK_M queries of one sequence and one head; the tile stays in registers.
  F2. It walks the sequence's keys and values BLOCK_N at a time: S = Q K^T * scale for the tile only, never the
      whole [seq, seq] matrix.
  F3. Online softmax: a running row maximum m and row sum l. When a new tile raises the maximum, what was summed
      so far is rescaled by exp(m_old - m_new), so one pass over the keys is enough.
  F4. acc += P V for the tile; at the end out = acc / l, and the log-sum-exp m + log(l) of every row is saved.
  B1. The backward pass recomputes P = exp(S - lse) tile by tile from the saved log-sum-exp instead of storing the
      [seq, seq] probabilities, with delta = rowsum(dO * O) computed once beforehand.
  B2. dV += P^T dO and dK += dS^T Q, where dS = P * (dP - delta) and dP = dO V^T; one program per key tile, which
      also loops over the query heads sharing that key head (GQA), so nothing needs atomic adds.
  B3. dQ += dS K, one program per query tile, walking the key tiles as the forward does.
  S.  Attention sinks (GPT-OSS): one more logit per head in every row's softmax, attached to no value. The online
      softmax of F3 starts from it (m = sink, l = 1, acc = 0) instead of from nothing (m = -inf, l = 0), so the
      saved log-sum-exp includes it and B1-B3 are unchanged (its value is zero: dP has no sink column, and
      delta = rowsum(dO * O) is still the sum of P * dP). The sink's own gradient is -sum over the head's rows of
      P_sink * delta, with P_sink = exp(sink - lse), computed after the kernels.

Exponentials are taken base 2 (exp2 is one instruction): scores are scaled by scale * log2(e) and the saved
log-sum-exp is in base 2 too. A query row that sees no key (causal with more queries than keys, a window that
ends before the sequence starts) gets zeros and a log-sum-exp of +inf (with sinks: the sink's logit), which makes
its P, and so its gradients, exactly zero. Accumulation is float32 for every input dtype; float32 inputs multiply
in IEEE float32 (not TF32).

Triton is optional: this module is imported only when the kernel is asked for. Kernels run on CUDA tensors, and
on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 set before the first use), which is how CI checks
them on machines without a GPU.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

# Inside try: transformers' remote-code check (which skips try blocks) must not demand triton from every machine
# that loads a pushed model; this module is imported only when the kernel is asked for.
try:
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError(f"attn_implementation='hf_tiny_flash' needs the triton package (pip install triton): {error}") from error

LOG2_E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 1, 256  # tiles are at least 16 wide; narrower heads are masked


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# triton.jit reads TRITON_INTERPRET when a kernel is defined: the kernels below are interpreted (and take CPU
# tensors) when it was set at this module's import, and triton.language's own jit helpers (tl.zeros, tl.sum) when
# it was set at triton's first import. Set only for the former, the interpreter cannot run the kernels.
INTERPRETED = interpreter_enabled()
INTERPRETER_SET_TOO_LATE = INTERPRETED and type(tl.zeros).__name__ != "InterpretedFunction"


@triton.jit
def _mm(a, b, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """a @ b accumulated in float32. IEEE: float32 inputs multiply in full float32, not TF32. WIDEN: bfloat16 tiles
    widened to float32 first (exact: a bf16 product fits in float32), for Triton's interpreter, whose tl.dot gets
    bfloat16 operands wrong (measured with triton 3.9: errors of 1e10)."""
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _tile_scores(q, k_ptrs, offs_n, k_len, start_n, qk_scale, D_MASK, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """F2: S = Q K^T * scale * log2(e) in float32 for one key tile; keys past the sequence read as 0."""
    k = tl.load(k_ptrs, mask=((start_n + offs_n)[:, None] < k_len) & D_MASK[None, :], other=0.0)
    return _mm(q, tl.trans(k), IEEE, WIDEN) * qk_scale


@triton.jit
def _visible(offs_m, keys, k_len, diag, window, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr):
    """Which (query, key) pairs of a tile attend: real keys; with CAUSAL key <= query + diag (bottom-right
    alignment, diag = k_len - q_len); with USE_WINDOW also query + diag - key < window."""
    visible = keys[None, :] < k_len
    if CAUSAL:
        visible = visible & (keys[None, :] <= offs_m[:, None] + diag)
    if USE_WINDOW:
        visible = visible & (offs_m[:, None] + diag - keys[None, :] < window)
    return visible


@triton.jit
def _forward_tiles(acc, m_i, l_i, q, qk_scale, k_base, v_base, stride_kt, stride_vt, offs_m, offs_n, offs_d, D_MASK,
                   k_len, diag, window, lo, hi,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
                   BLOCK_N: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """F2-F4 over key tiles lo..hi. MASKED=False for tiles every query of the tile sees whole (no mask math)."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        keys = start_n + offs_n
        k_ptrs = k_base + keys[:, None].to(tl.int64) * stride_kt + offs_d[None, :]
        s = _tile_scores(q, k_ptrs, offs_n, k_len, start_n, qk_scale, D_MASK, IEEE, WIDEN)
        if MASKED:
            s = tl.where(_visible(offs_m, keys, k_len, diag, window, CAUSAL, USE_WINDOW), s, float("-inf"))
        # F3: online softmax. A row that has seen no visible key yet keeps m = -inf; subtracting 0 instead keeps
        # exp2(-inf - (-inf)) = NaN out of it.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_base[:, None])
        alpha = tl.exp2(m_i - m_base)
        l_i = l_i * alpha + tl.sum(p, 1)
        # F4
        v_ptrs = v_base + keys[:, None].to(tl.int64) * stride_vt + offs_d[None, :]
        v = tl.load(v_ptrs, mask=(keys[:, None] < k_len) & D_MASK[None, :], other=0.0)
        acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, IEEE, WIDEN)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _sequence(cu_seqlens_q, cu_seqlens_k, seq):
    """Where sequence `seq` lies in the packed rows: (q_start, q_len, k_start, k_len)."""
    q_start = tl.load(cu_seqlens_q + seq)
    k_start = tl.load(cu_seqlens_k + seq)
    return q_start, tl.load(cu_seqlens_q + seq + 1) - q_start, k_start, tl.load(cu_seqlens_k + seq + 1) - k_start


@triton.jit
def _flash_forward_kernel(
    Q, K, V, O, LSE, SINKS, cu_seqlens_q, cu_seqlens_k, qk_scale, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lse_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    WIDEN: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    # F1: this program's query tile: sequence `seq`, query head `head`, rows tile*BLOCK_M ...
    tile, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, q_len, k_start, k_len = _sequence(cu_seqlens_q, cu_seqlens_k, seq)
    if tile * BLOCK_M >= q_len:
        return
    diag = k_len - q_len
    kv_head = head // GROUP  # GQA: GROUP query heads read one key/value head, never a repeated copy

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    D_MASK = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=(offs_m[:, None] < q_len) & D_MASK[None, :], other=0.0)
    k_base = K + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    v_base = V + k_start.to(tl.int64) * stride_vt + kv_head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # S: the softmax starts from the sink (SINKS holds sink * log2(e)): m = sink, l = exp2(0) = 1
        m_i, l_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(SINKS + head), tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Key range this tile can see, and its prefix that every query of the tile sees whole (no mask needed).
    hi, lo = k_len, 0
    if CAUSAL:
        hi = tl.minimum(k_len, (tile + 1) * BLOCK_M + diag)
    if USE_WINDOW:
        lo = tl.maximum(0, tile * BLOCK_M + diag - window + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
        whole = lo  # windows: every tile is masked
    else:
        whole = k_len
        if CAUSAL:
            whole = tl.minimum(k_len, tile * BLOCK_M + diag + 1)
        whole = (tl.maximum(whole, 0) // BLOCK_N) * BLOCK_N
    acc, m_i, l_i = _forward_tiles(acc, m_i, l_i, q, qk_scale, k_base, v_base, stride_kt, stride_vt, offs_m, offs_n,
                                   offs_d, D_MASK, k_len, diag, window, lo, whole, False, CAUSAL, USE_WINDOW,
                                   BLOCK_N, IEEE, WIDEN)
    acc, m_i, l_i = _forward_tiles(acc, m_i, l_i, q, qk_scale, k_base, v_base, stride_kt, stride_vt, offs_m, offs_n,
                                   offs_d, D_MASK, k_len, diag, window, tl.maximum(whole, lo), hi, True, CAUSAL,
                                   USE_WINDOW, BLOCK_N, IEEE, WIDEN)

    # F4: normalise; rows that saw no key give 0 and lse = +inf (so the backward's P is 0 for them).
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("inf"))
    row_ok = offs_m < q_len
    tl.store(O + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & D_MASK[None, :])
    tl.store(LSE + head * stride_lse_h + rows, lse, mask=row_ok)


@triton.jit
def _flash_backward_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, cu_seqlens_q, cu_seqlens_k, qk_scale, sm_scale, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lse_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    WIDEN: tl.constexpr,
):
    # B2: one key tile of one key head; every query head of its GQA group and every query tile that sees it.
    tile, seq, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, q_len, k_start, k_len = _sequence(cu_seqlens_q, cu_seqlens_k, seq)
    if tile * BLOCK_N >= k_len:
        return
    diag = k_len - q_len

    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    D_MASK = offs_d < HEAD_DIM
    key_rows = (k_start + offs_n).to(tl.int64)
    kv_mask = (offs_n[:, None] < k_len) & D_MASK[None, :]
    k = tl.load(K + key_rows[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + key_rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    # Query tiles that can see this key tile: causal starts at the first query whose diagonal reaches the tile,
    # a window ends at the last query whose window still covers it.
    lo = 0
    hi = q_len
    if CAUSAL:
        lo = (tl.maximum(0, tile * BLOCK_N - diag) // BLOCK_M) * BLOCK_M
    if USE_WINDOW:
        hi = tl.minimum(q_len, (tile + 1) * BLOCK_N - diag + window - 1)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + offs_m0
            rows = (q_start + offs_m).to(tl.int64)
            row_ok = offs_m < q_len
            q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                        mask=row_ok[:, None] & D_MASK[None, :], other=0.0)
            do = tl.load(DO + rows[:, None] * stride_dot + head * stride_doh + offs_d[None, :],
                         mask=row_ok[:, None] & D_MASK[None, :], other=0.0)
            lse = tl.load(LSE + head * stride_lse_h + rows, mask=row_ok, other=float("inf"))
            delta = tl.load(DELTA + head * stride_lse_h + rows, mask=row_ok, other=0.0)
            # B1: P recomputed from the saved log-sum-exp
            s = _mm(q, tl.trans(k), IEEE, WIDEN) * qk_scale
            p = tl.exp2(s - lse[:, None])
            p = tl.where(_visible(offs_m, offs_n, k_len, diag, window, CAUSAL, USE_WINDOW), p, 0.0)
            dv += _mm(tl.trans(p.to(do.dtype)), do, IEEE, WIDEN)
            dp = _mm(do, tl.trans(v), IEEE, WIDEN)
            ds = p * (dp - delta[:, None])
            dk += _mm(tl.trans(ds.to(q.dtype)), q, IEEE, WIDEN)
    tl.store(DK + key_rows[:, None] * stride_dkt + kv_head * stride_dkh + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + key_rows[:, None] * stride_dvt + kv_head * stride_dvh + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _flash_backward_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, cu_seqlens_q, cu_seqlens_k, qk_scale, sm_scale, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_lse_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    WIDEN: tl.constexpr,
):
    # B3: one query tile of one query head walks the key tiles it sees, as the forward pass does.
    tile, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, q_len, k_start, k_len = _sequence(cu_seqlens_q, cu_seqlens_k, seq)
    if tile * BLOCK_M >= q_len:
        return
    diag = k_len - q_len
    kv_head = head // GROUP

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    D_MASK = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    row_ok = offs_m < q_len
    q_mask = row_ok[:, None] & D_MASK[None, :]
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_dot + head * stride_doh + offs_d[None, :], mask=q_mask, other=0.0)
    lse = tl.load(LSE + head * stride_lse_h + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + head * stride_lse_h + rows, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    hi, lo = k_len, 0
    if CAUSAL:
        hi = tl.minimum(k_len, (tile + 1) * BLOCK_M + diag)
    if USE_WINDOW:
        lo = (tl.maximum(0, tile * BLOCK_M + diag - window + 1) // BLOCK_N) * BLOCK_N
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        key_rows = (k_start + offs_n).to(tl.int64)
        kv_mask = (offs_n[:, None] < k_len) & D_MASK[None, :]
        k = tl.load(K + key_rows[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + key_rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _mm(q, tl.trans(k), IEEE, WIDEN) * qk_scale
        p = tl.exp2(s - lse[:, None])
        p = tl.where(_visible(offs_m, offs_n, k_len, diag, window, CAUSAL, USE_WINDOW), p, 0.0)
        dp = _mm(do, tl.trans(v), IEEE, WIDEN)
        dq += _mm((p * (dp - delta[:, None])).to(k.dtype), k, IEEE, WIDEN)
    tl.store(DQ + rows[:, None] * stride_dqt + head * stride_dqh + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


# ----------------------------------------------------------------------------------------------------------------
# Launching
# ----------------------------------------------------------------------------------------------------------------

def _block_sizes(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    """Forward (BLOCK_M, BLOCK_N, num_warps, num_stages). On CUDA the best of the tile configurations measured on an
    H100 by `python -m benchmarks.flash_kernel` (bf16; benchmarks/results/flash-kernel-*.md), smaller for heads
    wider than 128 and for 4-byte inputs so the tiles fit shared memory. The interpreter runs tiles as numpy
    arrays, where any size is correct; small ones keep the padding waste low on the tiny shapes CI uses."""
    if device.type != "cuda":
        return 16, 16, 1, 1
    if dtype == torch.float32:
        return (64, 32, 4, 2) if head_dim <= 128 else (32, 32, 4, 1)
    if head_dim <= 64:
        return 128, 64, 8, 3
    if head_dim <= 128:
        return 128, 128, 8, 3
    return 64, 32, 4, 2


def _backward_block_sizes(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    """Backward tiles: the dK/dV program holds a key tile of K, V, dK, dV and streams Q and dO tiles, about twice the
    forward's shared memory, so its tiles are smaller (an H100 has 227 KiB per block)."""
    if device.type != "cuda":
        return 16, 16, 1, 1
    wide = head_dim > 128 or dtype == torch.float32
    if head_dim > 128 and dtype == torch.float32:
        return 16, 16, 4, 1
    if wide:
        return 32, 32, 4, 1
    if head_dim <= 64:
        return 64, 64, 4, 2
    return 64, 64, 8, 2


def check_device_and_dtype(device: torch.device, dtype: torch.dtype) -> None:
    if INTERPRETER_SET_TOO_LATE:
        raise ValueError(
            "attn_implementation='hf_tiny_flash': TRITON_INTERPRET=1 was set after triton was imported; set it before "
            "the process imports triton (e.g. in the environment)"
        )
    if device.type != "cuda" and not (device.type == "cpu" and INTERPRETED):
        raise ValueError(
            f"attn_implementation='hf_tiny_flash' runs on CUDA tensors (or on CPU tensors under Triton's interpreter, "
            f"TRITON_INTERPRET=1 set before first use), got device '{device}'"
        )
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"attn_implementation='hf_tiny_flash' runs in float16, bfloat16 or float32, got dtype {dtype}")


def check_kernel_can_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Clear errors for what the kernel does not take (device, dtype, head size, head counts); [..., heads, seq,
    head_dim] tensors."""
    check_device_and_dtype(q.device, q.dtype)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"attn_implementation='hf_tiny_flash' takes q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    head_dim = q.shape[-1]
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM or k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        raise ValueError(
            f"attn_implementation='hf_tiny_flash' takes head_dim {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, the same for q, k "
            f"and v; got q {q.shape[-1]}, k {k.shape[-1]}, v {v.shape[-1]}"
        )
    if q.shape[-3] % k.shape[-3] or k.shape[-3] != v.shape[-3]:
        raise ValueError(
            f"query heads ({q.shape[-3]}) must be a multiple of key/value heads ({k.shape[-3]}, {v.shape[-3]})"
        )


def _common_args(q, k, v, cu_q, cu_k, scale, window, causal, blocks=None):
    head_dim = q.shape[-1]
    block_m, block_n, warps, stages = blocks or _block_sizes(head_dim, q.dtype, q.device)
    meta = dict(
        GROUP=q.shape[1] // k.shape[1], HEAD_DIM=head_dim, CAUSAL=bool(causal), USE_WINDOW=window is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        IEEE=q.dtype == torch.float32, WIDEN=q.dtype == torch.bfloat16 and INTERPRETED,
    )
    launch = dict(num_warps=warps, num_stages=stages)
    return meta, launch, scale * LOG2_E, window if window is not None else 0


def _sinks_base2(sinks: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The sinks as the kernels read them: float32, times log2(e) (the kernels exponentiate base 2). A sink of -inf
    (no sink) is clamped to a finite -1e30: a row that then sees no key keeps a finite log-sum-exp, so its
    backward P is exp2(-inf - lse) = 0, never NaN."""
    return None if sinks is None else (sinks.detach().float() * LOG2_E).clamp(min=-1e30).contiguous()


def flash_forward(q, k, v, cu_q, cu_k, max_q, *, scale, causal, window=None, blocks=None, sinks=None):
    """q [Tq, Hq, D], k/v [Tk, Hkv, D] packed (sequence s is rows cu[s]..cu[s+1]); sinks None or [Hq]. Returns
    (out [Tq, Hq, D], lse [Hq, Tq] float32 in base 2). blocks: (BLOCK_M, BLOCK_N, num_warps, num_stages) instead of
    the defaults (benchmarks try others)."""
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), math.inf, device=q.device, dtype=torch.float32)
    if max_q == 0:  # every sequence is empty: nothing to launch
        return out, lse
    meta, launch, qk_scale, window_ = _common_args(q, k, v, cu_q, cu_k, scale, window, causal, blocks)
    grid = (triton.cdiv(max_q, meta["BLOCK_M"]), cu_q.numel() - 1, q.shape[1])
    sinks2 = _sinks_base2(sinks)
    _flash_forward_kernel[grid](
        q, k, v, out, lse, lse if sinks2 is None else sinks2, cu_q, cu_k, qk_scale, window_,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        lse.stride(0), **meta, **launch, HAS_SINKS=sinks2 is not None,
    )
    return out, lse


def sink_gradient(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """S: d loss / d sinks[h] = -sum over head h's rows of P_sink * delta, P_sink = exp(sink - lse) (base 2 here;
    rows that were never computed have lse = +inf, so P_sink = 0). lse, delta: [Hq, Tq] float32."""
    p_sink = torch.exp2(_sinks_base2(sinks)[:, None] - lse)
    return -(p_sink * delta).sum(dim=-1).to(sinks.dtype)


def flash_backward(do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, scale, causal, window=None,
                   return_delta=False):
    """(dq, dk, dv), and delta = rowsum(dO * O) [Hq, Tq] when return_delta (the sinks' gradient needs it)."""
    do = do.contiguous()
    delta = (do.float() * out.float()).sum(-1).transpose(0, 1).contiguous()  # B1: rowsum(dO * O), [Hq, Tq]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if max_q == 0 or max_k == 0:  # no query sees a key: every gradient is zero
        return (dq, dk, dv, delta) if return_delta else (dq, dk, dv)
    blocks = _backward_block_sizes(q.shape[-1], q.dtype, q.device)
    meta, launch, qk_scale, window_ = _common_args(q, k, v, cu_q, cu_k, scale, window, causal, blocks)
    batch = cu_q.numel() - 1
    _flash_backward_dkdv_kernel[(triton.cdiv(max_k, meta["BLOCK_N"]), batch, k.shape[1])](
        q, k, v, do, lse, delta, dk, dv, cu_q, cu_k, qk_scale, scale, window_,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), lse.stride(0), **meta, **launch,
    )
    _flash_backward_dq_kernel[(triton.cdiv(max_q, meta["BLOCK_M"]), batch, q.shape[1])](
        q, k, v, do, lse, delta, dq, cu_q, cu_k, qk_scale, scale, window_,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dq.stride(0), dq.stride(1), lse.stride(0), **meta, **launch,
    )
    return (dq, dk, dv, delta) if return_delta else (dq, dk, dv)


class _FlashVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, sinks):
        out, lse = flash_forward(q, k, v, cu_q, cu_k, max_q, scale=scale, causal=causal, window=window, sinks=sinks)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, sinks)
        ctx.args = (max_q, max_k, scale, causal, window)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, cu_q, cu_k, sinks = ctx.saved_tensors
        max_q, max_k, scale, causal, window = ctx.args
        dq, dk, dv, delta = flash_backward(do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale=scale,
                                           causal=causal, window=window, return_delta=True)
        dsinks = sink_gradient(sinks, lse, delta) if sinks is not None and ctx.needs_input_grad[10] else None
        return dq, dk, dv, None, None, None, None, None, None, None, dsinks


def flash_attn_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, *, scale: Optional[float] = None, causal: bool = False,
    window: Optional[int] = None, sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention over packed sequences, differentiable. q [Tq, Hq, D]; k, v [Tk, Hkv, D] with Hq a multiple of
    Hkv; cu_seqlens_* int32 [batch + 1] offsets of each sequence's rows. causal aligns bottom-right (the last
    query sees the last key, as after a KV cache); window (sliding, as transformers: query - key < window) needs
    causal; sinks: None or [Hq] attention-sink logits (S above; differentiable too). Returns [Tq, Hq, D] in q's
    dtype."""
    check_kernel_can_run(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    if sinks is not None and (tuple(sinks.shape) != (q.shape[1],) or sinks.device != q.device):
        raise ValueError(f"sinks must be one logit per query head, shape ({q.shape[1]},) on {q.device}; got "
                         f"{tuple(sinks.shape)} on {sinks.device}")
    if window is not None and (not causal or window < 1):
        raise ValueError(f"window={window} needs causal=True and window >= 1")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.dim() != 1:
        raise ValueError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} must both be "
            "[batch + 1]"
        )
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _FlashVarlen.apply(q, k, v, cu_q, cu_k, int(max_seqlen_q), int(max_seqlen_k), float(scale), bool(causal),
                              window, sinks)
