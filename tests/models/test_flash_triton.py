"""Our Triton FlashAttention kernel (hf_tiny/flash_triton.py) against an fp64 reference written from the
definition, and the `hf_tiny_flash` backend against the naive one inside whole models.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py before triton is
first imported): the same kernel code, each program executed with numpy on CPU tensors. With a
GPU they run compiled on CUDA. Shapes are small so the interpreter keeps this file to about two minutes on two
cores, half of it the sliding-window cases at every tile boundary (one per tiling the launcher picks).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_tiny import flash

pytest.importorskip("triton")

HAS_CUDA = torch.cuda.is_available()
# max |kernel - fp64 reference| / max(1, max |reference|), forward output and each gradient. fp32 multiplies in
# IEEE fp32; fp16 / bf16 round P (and dS) to the input dtype before the second matrix product, as FlashAttention
# does, which is what these bounds allow for.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# derandomize: the same draws on every run (CI's included). On a GPU each draw compiles its own kernels (seconds
# each: the H200 runs of gpu_check.sh spent their 120 s on 14 of this file's tests), so a GPU runs fewer draws
# (EXAMPLES_ON_GPU) than CI's interpreter, which runs the same kernel code with every draw.
EXAMPLES, EXAMPLES_ON_GPU = 40, 12
KERNEL_SETTINGS = settings(max_examples=EXAMPLES_ON_GPU if HAS_CUDA else EXAMPLES, deadline=None, derandomize=True,
                           database=None,
                           suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def kernel():
    """(the flash_triton module, device): compiled on CUDA when there is a GPU, else interpreted on CPU (conftest.py
    sets TRITON_INTERPRET=1 before anything imports triton), its float32 -> bfloat16 casts rounding as a GPU's do."""
    from hf_tiny import flash_triton

    if HAS_CUDA:
        yield flash_triton, torch.device("cuda")
        return
    flash_triton.check_device_and_dtype(torch.device("cpu"), torch.float32)  # a clear error if not interpreted
    with pytest.MonkeyPatch.context() as patch:
        round_interpreted_bf16_casts_to_nearest_even(patch)
        yield flash_triton, torch.device("cpu")


def round_interpreted_bf16_casts_to_nearest_even(patch: pytest.MonkeyPatch) -> None:
    """Triton's interpreter (3.9) casts float32 -> bfloat16 by dropping the low mantissa bits (round toward zero:
    InterpreterBuilder.cast_impl passes no rounding mode to _convert_float, whose own "RTNE" rounds ties away from
    zero), where compiled kernels round to nearest even, as torch does. Truncation doubles the error of every bf16
    value the kernel writes and biases it: the output O then shifts delta = rowsum(dO * O), and dS = P * (dP -
    delta) cancels, which once put a bf16 dq 18x further from the fp64 reference (3.24e-2, head dim 4) than the same
    case rounded to nearest (1.8e-3). The casts are made torch's (a GPU's rounding);
    test_interpreted_bf16_casts_round_as_a_gpu_does checks it."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    truncating = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:  # the interpreter holds bf16 as uint16
            bits = torch.from_numpy(np.asarray(src.data)).to(torch.bfloat16).view(torch.int16).numpy()
            return interpreter.TensorHandle(bits.view(interpreter._get_np_dtype(dst_type)), dst_type.scalar)
        return truncating(self, src, dst_type)

    patch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)


# ----------------------------------------------------------------------------------------------------------------
# The reference: one sequence at a time in fp64, the visibility rule written out element by element.
# ----------------------------------------------------------------------------------------------------------------


def visible(q_len: int, k_len: int, causal: bool, window):
    """Query i (of q_len) sees key j (of k_len): causal aligned bottom-right (j <= i + k_len - q_len), and a
    window W keeps i + k_len - q_len - j < W (transformers' sliding-window rule)."""
    rule = [[(not causal or j <= i + k_len - q_len) and (window is None or i + k_len - q_len - j < window)
             for j in range(k_len)] for i in range(q_len)]
    return torch.tensor(rule, dtype=torch.bool).reshape(q_len, k_len)


def reference_varlen(q, k, v, cu_q, cu_k, *, scale, causal, window, sinks=None):
    """sinks: None or [Hq] attention-sink logits, one more softmax column per head attached to no value."""
    outs = []
    group = q.shape[1] // k.shape[1]
    for s in range(len(cu_q) - 1):
        qs = q[cu_q[s]:cu_q[s + 1]].double()
        ks = k[cu_k[s]:cu_k[s + 1]].double().repeat_interleave(group, dim=1)
        vs = v[cu_k[s]:cu_k[s + 1]].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        allowed = visible(qs.shape[0], ks.shape[0], causal, window).to(scores.device)
        scores = scores.masked_fill(~allowed, -math.inf)
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)], dim=-1)
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)[..., :ks.shape[0]]  # a row that sees no key: zeros
        outs.append(torch.einsum("hqk,khd->qhd", weights, vs))
    return torch.cat(outs)


def packed_inputs(q_lens, k_lens, heads, kv_heads, dim, dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)
    make = lambda rows, h: torch.randn(rows, h, dim, generator=generator).to(device, dtype).requires_grad_()
    q, k, v = make(sum(q_lens), heads), make(sum(k_lens), kv_heads), make(sum(k_lens), kv_heads)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    grad_out = torch.randn(sum(q_lens), heads, dim, generator=generator).to(device, dtype)
    return q, k, v, cu(q_lens), cu(k_lens), grad_out


def relative_errors(kernel_module, q, k, v, cu_q, cu_k, grad_out, *, causal, window, scale=None, sinks=None):
    """max |kernel - reference| / max(1, max |reference|) for out, dq, dk, dv (and dsinks with sinks)."""
    scale = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    out = kernel_module.flash_attn_varlen(q, k, v, cu_q.to(q.device), cu_k.to(q.device), int(torch.diff(cu_q).max()),
                                          int(torch.diff(cu_k).max()), scale=scale, causal=causal, window=window,
                                          sinks=sinks)
    out.backward(grad_out)
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
    leaves = [t.detach().cpu().double().requires_grad_() for t in inputs]
    expected = reference_varlen(*leaves[:3], cu_q, cu_k, scale=scale, causal=causal, window=window,
                                sinks=None if sinks is None else leaves[3])
    expected.backward(grad_out.cpu().double())
    pairs = [(out, expected)] + [(t.grad, leaf.grad) for t, leaf in zip(inputs, leaves)]
    return [float((a.detach().cpu().double() - b).abs().max()) / max(1.0, float(b.abs().max())) for a, b in pairs]


# ----------------------------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------------------------


@st.composite
def varlen_cases(draw):
    causal = draw(st.booleans())
    window = draw(st.sampled_from([None, None, 1, 3, 8])) if causal else None
    batch = draw(st.integers(1, 3))
    q_lens = draw(st.lists(st.integers(0, 40), min_size=batch, max_size=batch))
    # keys: as many as queries (self-attention), more (after a cache) or fewer (rows that see nothing, causal)
    k_lens = [draw(st.sampled_from([n, n + draw(st.integers(1, 20)), max(0, n - 3)])) for n in q_lens]
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4]))  # MHA, GQA, and with kv_heads=1 MQA
    dim = draw(st.sampled_from([4, 16, 24, 32, 40, 64]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    return dict(q_lens=q_lens, k_lens=k_lens, heads=kv_heads * group, kv_heads=kv_heads, dim=dim, dtype=dtype,
                causal=causal, window=window, seed=draw(st.integers(0, 2**16)))


def case_inputs(case: dict, device):
    """packed_inputs for a varlen_cases() draw (one non-empty sequence at least)."""
    if sum(case["k_lens"]) == 0 or sum(case["q_lens"]) == 0:
        case["q_lens"][0] = case["k_lens"][0] = 5
    return packed_inputs(case["q_lens"], case["k_lens"], case["heads"], case["kv_heads"], case["dim"], case["dtype"],
                         device, case["seed"])


@KERNEL_SETTINGS
@given(case=varlen_cases())
def test_kernel_forward_and_gradients_match_fp64_reference(kernel, case):
    module, device = kernel
    q, k, v, cu_q, cu_k, grad_out = case_inputs(case, device)
    errors = relative_errors(module, q, k, v, cu_q, cu_k, grad_out, causal=case["causal"], window=case["window"])
    bound = TOLERANCE[case["dtype"]]
    assert max(errors) <= bound, f"out/dq/dk/dv errors {['%.2e' % e for e in errors]} > {bound}: {case}"


def _bf16_cast_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def cast(X, Y, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Y + offs, tl.load(X + offs).to(tl.bfloat16))

    return cast


def test_interpreted_bf16_casts_round_as_a_gpu_does(kernel):
    """A kernel's float32 -> bfloat16 cast gives torch's (round to nearest even), on values a quarter, a half, three
    quarters and one and a half bf16 steps past a bf16 value (the halves are ties, to even), of both signs."""
    _, device = kernel
    base = torch.randn(32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).float()
    step = torch.frexp(base)[1].float().sub(8).exp2()  # one bf16 step at each value (8 significant bits)
    x = torch.cat([base + step * f for f in (0.25, 0.5, 0.75, 1.5)]).to(device)  # 128 values: a power of 2
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    _bf16_cast_kernel()[(1,)](x, y, N=x.numel())
    assert torch.equal(y, x.to(torch.bfloat16))
    assert not torch.equal(x.to(torch.bfloat16), (x.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16))


@pytest.mark.parametrize("dim", [128, 256])
def test_kernel_wide_heads(kernel, dim):
    module, device = kernel
    q, k, v, cu_q, cu_k, grad_out = packed_inputs([9, 20], [9, 33], 2, 1, dim, torch.float16, device, seed=dim)
    errors = relative_errors(module, q, k, v, cu_q, cu_k, grad_out, causal=True, window=None)
    assert max(errors) <= TOLERANCE[torch.float16], errors


def test_kernel_rows_that_see_no_key_are_zero_with_zero_gradients(kernel):
    module, device = kernel
    # causal, 6 queries over 2 keys: the first 4 queries see nothing; an empty second sequence; a window of 1
    q, k, v, cu_q, cu_k, grad_out = packed_inputs([6, 0], [2, 4], 2, 2, 16, torch.float32, device, seed=3)
    out = module.flash_attn_varlen(q, k, v, cu_q, cu_k, 6, 4, causal=True)
    out.backward(grad_out)
    assert torch.equal(out[:4], torch.zeros_like(out[:4])) and torch.isfinite(out).all()
    assert torch.equal(q.grad[:4], torch.zeros_like(q.grad[:4])) and torch.isfinite(k.grad).all()
    assert torch.equal(k.grad[2:], torch.zeros_like(k.grad[2:]))  # keys of the empty query sequence get nothing
    assert float(out[4:].abs().sum()) > 0


def test_kernel_negative_control(kernel):
    """The comparison can fail: causal=False measured against the causal reference is far off."""
    module, device = kernel
    q, k, v, cu_q, cu_k, _ = packed_inputs([12], [12], 2, 2, 16, torch.float32, device, seed=5)
    scale = 0.25
    out = module.flash_attn_varlen(q, k, v, cu_q, cu_k, 12, 12, scale=scale, causal=False)
    expected = reference_varlen(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), cu_q, cu_k, scale=scale,
                                causal=True, window=None)
    assert float((out.detach().cpu().double() - expected).abs().max()) > 0.1


def test_kernel_bad_inputs_are_clear_errors(kernel):
    module, device = kernel
    q, k, v, cu_q, cu_k, _ = packed_inputs([4], [4], 2, 2, 16, torch.float32, device, seed=0)
    with pytest.raises(ValueError, match="head_dim 1..256.*got q 16, k 8"):
        module.flash_attn_varlen(q, k[..., :8], v[..., :8], cu_q, cu_k, 4, 4)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32.*float64"):
        module.flash_attn_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, 4, 4)
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of key/value heads \(2"):
        module.flash_attn_varlen(torch.cat([q, q[:, :1]], 1), k, v, cu_q, cu_k, 4, 4)
    with pytest.raises(ValueError, match="window=4 needs causal=True"):
        module.flash_attn_varlen(q, k, v, cu_q, cu_k, 4, 4, window=4)
    with pytest.raises(ValueError, match=r"cu_seqlens_q \(2,\) and cu_seqlens_k \(3,\)"):
        module.flash_attn_varlen(q, k, v, cu_q, torch.tensor([0, 2, 4]), 4, 4)
    with pytest.raises(ValueError, match="runs on CUDA tensors.*got device 'meta'"):
        module.check_device_and_dtype(torch.device("meta"), torch.float32)


# ----------------------------------------------------------------------------------------------------------------
# Attention sinks (GPT-OSS): the online softmax starts from one more logit per head; its gradient follows
# ----------------------------------------------------------------------------------------------------------------


def _sinks(heads: int, device, dtype, seed: int) -> torch.Tensor:
    """Sinks large enough to take a visible share of every row (official GPT-OSS's are of the order of the scores)."""
    generator = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(heads, generator=generator)).to(device, dtype).requires_grad_()


@settings(KERNEL_SETTINGS, max_examples=4 if HAS_CUDA else 8)
@given(case=varlen_cases())
def test_kernel_with_sinks_forward_and_gradients_match_fp64_reference(kernel, case):
    """Output, dq, dk, dv and the sinks' gradient, over causal / windowed / GQA / empty-row cases."""
    module, device = kernel
    q, k, v, cu_q, cu_k, grad_out = case_inputs(case, device)
    sinks = _sinks(case["heads"], device, case["dtype"], case["seed"])
    errors = relative_errors(module, q, k, v, cu_q, cu_k, grad_out, causal=case["causal"], window=case["window"],
                             sinks=sinks)
    bound = TOLERANCE[case["dtype"]]
    assert max(errors) <= bound, f"out/dq/dk/dv/dsinks errors {['%.2e' % e for e in errors]} > {bound}: {case}"


# a sink of -inf is clamped to -1e30: the backward's exp2(score + 1e30) of a row that sees no key overflows to inf
# before the visibility mask replaces it by 0 (numpy, under the interpreter, warns)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")
def test_kernel_with_sinks_rows_that_see_no_key_and_negative_control(kernel):
    """A row that sees no key puts all its weight on the sink: zeros, zero gradients. Sinks of -inf are no sinks.
    Negative control: the kernel with sinks, measured against the reference without them, is far off."""
    module, device = kernel
    q, k, v, cu_q, cu_k, grad_out = packed_inputs([6, 5], [2, 5], 4, 2, 16, torch.float32, device, seed=7)
    sinks = _sinks(4, device, torch.float32, seed=7)
    errors = relative_errors(module, q, k, v, cu_q, cu_k, grad_out, causal=True, window=None, sinks=sinks)
    assert max(errors) <= TOLERANCE[torch.float32], errors
    out = module.flash_attn_varlen(q, k, v, cu_q, cu_k, 6, 5, causal=True, sinks=sinks)
    assert torch.equal(out[:4], torch.zeros_like(out[:4])) and torch.equal(q.grad[:4], torch.zeros_like(q.grad[:4]))
    plain = module.flash_attn_varlen(q, k, v, cu_q, cu_k, 6, 5, causal=True)
    no_sinks = torch.full((4,), -math.inf, device=device, requires_grad=True)
    unsunk = module.flash_attn_varlen(q, k, v, cu_q, cu_k, 6, 5, causal=True, sinks=no_sinks)
    unsunk.backward(grad_out)
    assert torch.equal(unsunk, plain) and torch.isfinite(q.grad).all() and torch.equal(no_sinks.grad, torch.zeros_like(no_sinks))
    expected = reference_varlen(q.detach(), k.detach(), v.detach(), cu_q, cu_k, scale=0.25, causal=True, window=None)
    assert float((out.detach().double() - expected).abs().max()) > 0.1
    with pytest.raises(ValueError, match=r"sinks must be one logit per query head, shape \(4,\)"):
        module.flash_attn_varlen(q, k, v, cu_q, cu_k, 6, 5, causal=True, sinks=sinks[:2])


# ----------------------------------------------------------------------------------------------------------------
# Sliding windows at every tile boundary, for every tiling the launcher picks
# ----------------------------------------------------------------------------------------------------------------
#
# A window's bounds are computed per tile: the forward (and dQ) kernel starts at the key tile holding the first key
# its tile's first query sees (start + diag - window + 1, rounded down to BLOCK_N), and the dK/dV kernel stops after
# the query tile holding the last query that sees its tile's last key ((tile + 1) * BLOCK_N - 1 - diag + window - 1).
# Off by one, either bound drops one (query, key) pair exactly when that position is the first of its tile, i.e. for
# one residue of window - diag modulo the block size (the random cases above draw it too rarely). The cases below
# meet every residue of every bound, for each tiling, in one varlen call (and a second one of longer sequences).

# (device whose choice it is, head_dim, dtype, window): one case per distinct (forward, backward) tiling of
# _block_sizes / _backward_block_sizes (test_tiling_cases_are_every_tiling_the_launcher_picks keeps the list
# complete). Half-precision windows are small, so that one dropped key of the window shows above the fp16 / bf16
# bounds; fp32 / fp16 windows reach past one key tile.
TILING_CASES = [
    ("cuda", 40, torch.float32, 37),    # fp32 head_dim <= 128, and half head_dim > 128: forward 64x32, backward 32x32
    ("cuda", 136, torch.float32, 37),   # fp32 head_dim > 128: forward 32x32, backward 16x16
    ("cuda", 24, torch.bfloat16, 3),    # half head_dim <= 64: forward 128x64, backward 64x64
    ("cuda", 72, torch.bfloat16, 3),    # half head_dim 65..128: forward 128x128, backward 64x64
    ("cpu", 48, torch.float16, 21),     # the interpreter: 16x16 both ways
]


def _tilings(device, head_dim, dtype):
    from hf_tiny import flash_triton

    device = torch.device(device)
    return (flash_triton._block_sizes(head_dim, dtype, device), flash_triton._backward_block_sizes(head_dim, dtype, device))


def tile_boundary_batches(forward, backward, window):
    """Two varlen batches, [(q_lens, k_lens)]. In the first, sequence s (s = 0 .. R-1, R the largest block size a
    window bound is rounded with: forward and backward BLOCK_N, backward BLOCK_M) has the diagonal offset
    diag = window - 1 + s, so that window - diag takes every residue modulo each of them (powers of two dividing R).
    The first backward-block-size sequences have backward-BLOCK_M queries, so that the last query seeing each key tile
    exists for every residue of the backward blocks; the others (forward residues only) one query. The second batch
    holds two sequences of three forward query tiles (self-attention, and after a cache): in a batch of their own,
    so that the first batch's launch grids stay one query tile long (the interpreter's time goes by programs)."""
    block_m, block_n = forward[:2]
    widest = max(forward[1], *backward[:2])
    q_lens = [backward[0] if s < max(backward[:2]) else 1 for s in range(widest)]
    boundaries = (q_lens, [q_len + window - 1 + s for s, q_len in enumerate(q_lens)])
    long = ([2 * block_m + 3] * 2, [2 * block_m + 3, 2 * block_m + 3 + block_n // 2 + 1])
    return [boundaries, long]


def tile_boundaries_met(q_lens, k_lens, window, forward, backward):
    """{bound: residues met}: for every tile, the position its window bound falls on (when that position exists and
    the bound is not clamped at the sequence start), modulo the block size the kernel rounds it with."""
    met = {"forward first key": set(), "dq first key": set(), "dkdv last query": set()}
    for q_len, k_len in zip(q_lens, k_lens):
        diag = k_len - q_len
        for name, (block_m, block_n) in (("forward first key", forward[:2]), ("dq first key", backward[:2])):
            for start in range(0, q_len, block_m):
                first = start + diag - window + 1
                if 0 <= first < k_len:
                    met[name].add(first % block_n)
        block_m, block_n = backward[:2]
        for start in range(0, k_len, block_n):
            last_key = start + block_n - 1
            last_query = last_key - diag + window - 1
            if last_key < k_len and 0 <= last_query < q_len:
                met["dkdv last query"].add(last_query % block_m)
    return met


def test_tiling_cases_are_every_tiling_the_launcher_picks():
    from hf_tiny import flash_triton

    picked = {(tuple(f[:2]), tuple(b[:2]))
              for device in ("cuda", "cpu")
              for dtype in flash_triton.SUPPORTED_DTYPES
              for head_dim in range(flash_triton.MIN_HEAD_DIM, flash_triton.MAX_HEAD_DIM + 1)
              for f, b in [_tilings(device, head_dim, dtype)]}
    cases = [_tilings(device, head_dim, dtype) for device, head_dim, dtype, _ in TILING_CASES]
    assert {(tuple(f[:2]), tuple(b[:2])) for f, b in cases} == picked
    assert len(cases) == len(picked)  # one case each


@pytest.mark.parametrize("device_choice, head_dim, dtype, window", TILING_CASES,
                         ids=[f"{d}-{h}-{str(t).removeprefix('torch.')}-w{w}" for d, h, t, w in TILING_CASES])
def test_sliding_window_forward_and_backward_at_every_tile_boundary(kernel, monkeypatch, device_choice, head_dim,
                                                                    dtype, window):
    """The kernel runs with the tiling `device_choice` selects for (head_dim, dtype) (on CPU, the CUDA tilings under
    the interpreter, where any tile size is valid), on sequences meeting every residue of every window bound."""
    module, device = kernel
    forward, backward = _tilings(device_choice, head_dim, dtype)
    monkeypatch.setattr(module, "_block_sizes", lambda *args: forward)
    monkeypatch.setattr(module, "_backward_block_sizes", lambda *args: backward)
    batches = tile_boundary_batches(forward, backward, window)
    met = tile_boundaries_met(*(sum(lens, []) for lens in zip(*batches)), window, forward, backward)
    assert met == {"forward first key": set(range(forward[1])), "dq first key": set(range(backward[1])),
                   "dkdv last query": set(range(backward[0]))}
    heads, kv_heads = (2, 1) if device_choice == "cpu" else (1, 1)  # GQA where the tiles are small
    for q_lens, k_lens in batches:
        q, k, v, cu_q, cu_k, grad_out = packed_inputs(q_lens, k_lens, heads, kv_heads, head_dim, dtype, device,
                                                      seed=head_dim)
        errors = relative_errors(module, q, k, v, cu_q, cu_k, grad_out, causal=True, window=window)
        bound = TOLERANCE[dtype]
        assert max(errors) <= bound, f"out/dq/dk/dv errors {['%.2e' % e for e in errors]} > {bound} ({len(q_lens)} sequences)"


# ----------------------------------------------------------------------------------------------------------------
# The backend inside models: hf_tiny_flash vs eager on padded, packed, windowed and cached batches
# ----------------------------------------------------------------------------------------------------------------


def _causal_model(device, dtype, **overrides):
    from hf_tiny import TinyCausalConfig, TinyCausalForCausalLM

    torch.manual_seed(0)
    fields = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, max_position_embeddings=64, pad_token_id=0, initializer_range=0.1)
    fields.update(overrides)
    return TinyCausalForCausalLM(TinyCausalConfig(**fields)).eval().to(device, dtype)


def _logits_both(model, batch):
    outs = {}
    for backend in ("eager", "hf_tiny_flash"):
        model.set_attn_implementation(backend)
        outs[backend] = model(**batch).logits.float()
    return outs["eager"], outs["hf_tiny_flash"]


@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 5}], ids=["full", "sliding-window-5"])
def test_backend_left_padded_causal_batch_matches_eager(kernel, overrides):
    _, device = kernel
    model = _causal_model(device, torch.float32, **overrides)
    ids = torch.randint(1, 64, (3, 14), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :13] = 0
    with torch.no_grad():
        eager, ours = _logits_both(model, dict(input_ids=ids, attention_mask=mask))
    real = mask.bool()
    assert float((eager[real] - ours[real]).abs().max()) <= 1e-4


def test_backend_gradients_match_eager_on_a_padded_batch(kernel):
    _, device = kernel
    model = _causal_model(device, torch.float32)
    ids = torch.randint(1, 64, (2, 10), generator=torch.Generator().manual_seed(1)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    grads = {}
    for backend in ("eager", "hf_tiny_flash"):
        model.zero_grad()
        model.set_attn_implementation(backend)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads[backend] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, grad in grads["eager"].items():
        assert float((grad - grads["hf_tiny_flash"][name]).abs().max()) <= 1e-4 * max(1.0, float(grad.abs().max())), name


def test_backend_packed_rows_match_eager(kernel):
    """Packed sequences (position ids restarting at 0): one varlen call over the segments."""
    _, device = kernel
    model = _causal_model(device, torch.float32)
    ids = torch.randint(1, 64, (1, 15), generator=torch.Generator().manual_seed(2)).to(device)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6]], device=device)
    with torch.no_grad():
        eager, ours = _logits_both(model, dict(input_ids=ids, position_ids=position_ids))
        separate = torch.cat([model(input_ids=ids[:, a:b]).logits.float() for a, b in ((0, 5), (5, 8), (8, 15))], 1)
    assert float((eager - ours).abs().max()) <= 1e-4
    assert float((separate - ours).abs().max()) <= 1e-4


def test_backend_generate_matches_eager_tokens(kernel):
    """Greedy decoding with a KV cache (one query over many keys, bottom-right causal) on a left-padded batch."""
    _, device = kernel
    model = _causal_model(device, torch.float32)
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(4)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    tokens = {}
    for backend in ("eager", "hf_tiny_flash"):
        model.set_attn_implementation(backend)
        tokens[backend] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                         pad_token_id=0)
    assert torch.equal(tokens["eager"], tokens["hf_tiny_flash"])


CHUNKED = dict(num_hidden_layers=2, layer_types=["chunked_attention", "full_attention"], attention_chunk_size=4,
               nope_layers=[1])  # Llama 4's layout: chunked RoPE layers, full NoPE ones


def test_backend_chunked_attention_matches_eager(kernel):
    """Llama 4's chunked attention (chunks of 4 counted from each row's first real token): each (row, chunk) is a
    varlen segment of the one kernel call, on a left-padded batch, on packed rows (chunks per sequence) and while
    decoding with the cache across a chunk boundary (the chunked layer's cache keeps 3 keys)."""
    _, device = kernel
    model = _causal_model(device, torch.float32, **CHUNKED)
    ids = torch.randint(1, 64, (2, 11), generator=torch.Generator().manual_seed(6)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]], device=device)
    with torch.no_grad():
        eager, ours = _logits_both(model, dict(input_ids=ids, attention_mask=mask))
        eager_packed, ours_packed = _logits_both(model, dict(input_ids=ids[:1], position_ids=position_ids))
    assert float((eager[mask.bool()] - ours[mask.bool()]).abs().max()) <= 1e-4
    assert float((eager_packed - ours_packed).abs().max()) <= 1e-4
    model.config.attention_chunk_size = 5  # negative control: other chunks, other logits
    with torch.no_grad():
        model.set_attn_implementation("hf_tiny_flash")
        other = model(input_ids=ids, attention_mask=mask).logits.float()
    assert float((eager[mask.bool()] - other[mask.bool()]).abs().max()) > 1e-2
    model.config.attention_chunk_size = 4
    tokens = {}
    for backend in ("eager", "hf_tiny_flash"):
        model.set_attn_implementation(backend)
        tokens[backend] = model.generate(input_ids=ids[:, :6], attention_mask=mask[:, :6], max_new_tokens=3,
                                         do_sample=False, pad_token_id=0)
    assert torch.equal(tokens["eager"], tokens["hf_tiny_flash"])


def test_backend_encoder_right_padding_matches_eager(kernel):
    from hf_tiny import TinyEncoderConfig, TinyEncoderModel

    _, device = kernel
    torch.manual_seed(0)
    model = TinyEncoderModel(TinyEncoderConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                               intermediate_size=96, max_position_embeddings=32, hidden_dropout=0.0,
                                               attention_dropout=0.0)).eval().to(device)
    ids = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(5)).to(device)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    outs = {}
    with torch.no_grad():
        for backend in ("eager", "hf_tiny_flash"):
            model.set_attn_implementation(backend)
            outs[backend] = model(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    assert float((outs["eager"][real] - outs["hf_tiny_flash"][real]).abs().max()) <= 1e-4


def test_backend_refuses_what_it_cannot_do(kernel):
    _, device = kernel
    q = torch.randn(1, 2, 4, 16, device=device)
    with pytest.raises(ValueError, match="no attention dropout, got dropout_p=0.1"):
        flash.hf_tiny_flash_attention(q, q, q, scale=0.25, dropout_p=0.1)
    with pytest.raises(ValueError, match="output_attentions=True.*'eager'"):
        flash.hf_tiny_flash_attention(q, q, q, scale=0.25, output_attentions=True)
    with pytest.raises(ValueError, match="additive"):
        flash.hf_tiny_flash_attention(q, q, q, torch.zeros(1, 1, 4, 4, device=device), scale=0.25)


def test_sliding_windows_over_real_tokens_run_in_the_kernel_only():
    """A causal sliding window over left-padded rows, as the step declares it: our kernel gets (causal, W) over the
    real tokens; flash_attention_2 without it (PyTorch's flash kernel) refuses the window; padding between real
    tokens (the window would count positions, the kernel counts real tokens) is refused by both."""
    from hf_tiny.masks import self_attention_mask

    padding = torch.tensor([[1] * 8, [0, 0, 0] + [1] * 5])
    built = self_attention_mask(padding, batch_size=2, query_length=8, key_length=8, causal=True, sliding_window=3,
                                device=torch.device("cpu"))
    q = torch.zeros(2, 2, 8, 16)
    found = flash.varlen(built.layout, q)
    assert found.causal and found.window == 3 and torch.equal(found.key_valid, padding.bool())
    with pytest.raises(ValueError, match="padding and causal masks only.*sliding window of 3"):
        flash.flash_attention(q, q, q, built.mask, scale=0.25, is_causal=True, layout=built.layout)
    holes = torch.tensor([[1] * 8, [1, 0, 1, 1, 0, 1, 1, 1]])
    built = self_attention_mask(holes, batch_size=2, query_length=8, key_length=8, causal=True, sliding_window=3,
                                device=torch.device("cpu"))
    with pytest.raises(ValueError, match="not contiguous.*'sdpa' or 'eager'"):
        flash.varlen(built.layout, q)
