"""Attention backends against an independent fp64 reference and against the naive backend.

Every backend that runs on the device is checked across mask kinds (none, padding left/right, causal,
causal+padding, cross, sliding window, decode step, chunked prefill, T5-style additive bias, raw bool masks)
and GQA ratios (H/Hkv = 1, 2, 4, MQA), forward and backward. The flash backend runs on CPU too: on PyTorch's real
CPU flash kernel, and with a fake flash-attn package standing in for the CUDA varlen kernels (see the flash
section).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hf_tiny import attention, flash
from hf_tiny.attention import check_backend_can_run, get_attention_backend, naive_attention, torch_attention
from hf_tiny.flash import check_flash_can_run, flash_attention
from hf_tiny.masks import MaskLayout, cross_attention_mask, self_attention_mask, with_position_bias, within_chunks
from fake_flash_attn import FakeFlashAttn, flash_on_cpu, causal_allowed

CPU = torch.device("cpu")
HAS_CUDA = torch.cuda.is_available()
CPU_BACKENDS = ["eager", "sdpa"]
DEVICE_BACKENDS = CPU_BACKENDS + (["flash_attention_2"] if HAS_CUDA else [])
FP32_ATOL = 1e-5  # fp32 on CPU, inputs ~N(0, 1): every backend vs the fp64 reference and vs naive
GRAD_ATOL = 1e-4
HYPO = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PER_KIND = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------------------------------------------
# An independent reference: fp64, explicit per-head KV sharing, explicit causal rule, zeros for empty rows.
# ----------------------------------------------------------------------------------------------------------------


def reference_attention(q, k, v, mask, *, scale, is_causal):
    batch, heads, sq, _ = q.shape
    sk = k.shape[2]
    kv_of_head = torch.tensor([h * k.shape[1] // heads for h in range(heads)])
    qd, kd, vd = q.double(), k.double()[:, kv_of_head], v.double()[:, kv_of_head]
    scores = torch.einsum("bhqd,bhkd->bhqk", qd, kd) * scale
    if mask is None:
        allowed = causal_allowed(sq, sk) if is_causal else torch.ones(sq, sk, dtype=torch.bool)
        bias = torch.zeros(())
    elif mask.dtype == torch.bool:
        allowed, bias = mask, torch.zeros(())
    else:
        allowed = mask > torch.finfo(mask.dtype).min / 2
        bias = torch.where(allowed, mask.double(), 0.0)
    allowed = allowed.expand(batch, heads, sq, sk)
    scores = torch.where(allowed, scores + bias, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    visible = allowed.any(dim=-1, keepdim=True)
    weights = torch.where(visible, weights, 0.0)
    return torch.einsum("bhqk,bhkd->bhqd", weights, vd), visible[..., 0]


# ----------------------------------------------------------------------------------------------------------------
# Cases: masks built through hf_tiny.step as the modules do, plus raw bool masks.
# ----------------------------------------------------------------------------------------------------------------

KINDS = [
    "none",
    "padding",
    "causal",
    "causal_padding",
    "cross",
    "sliding",
    "decode",
    "chunk",
    "additive",
    "raw_bool",
    "local_chunks",
]
FLASH_KINDS = {"none", "padding", "causal", "causal_padding", "cross", "decode", "chunk"}
FLASH_KINDS |= {"local_chunks"}  # Llama 4's chunked attention: each (row, chunk) a varlen segment


@dataclass
class Case:
    kind: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor]
    is_causal: bool
    scale: float
    # 2-D key padding mask [B, Sk] when the case has one (for the "padded query rows are zeros" check)
    key_padding: Optional[torch.Tensor] = None
    # the mask's declared layout, as its builder states it (flash kernels run it); None for raw and additive masks
    layout: Optional[MaskLayout] = None

    def __repr__(self) -> str:
        mask = None if self.mask is None else (tuple(self.mask.shape), self.mask.dtype)
        return (
            f"Case({self.kind}, q={tuple(self.q.shape)}, k={tuple(self.k.shape)}, mask={mask}, "
            f"is_causal={self.is_causal}, key_padding={self.key_padding})"
        )


def padding_mask(lengths: list[int], total: int, side: str) -> torch.Tensor:
    rows = []
    for length in lengths:
        pad = [0] * (total - length)
        real = [1] * length
        rows.append(pad + real if side == "left" else real + pad)
    return torch.tensor(rows, dtype=torch.long)


@st.composite
def attention_cases(draw, kinds=tuple(KINDS), dtype=torch.float32):
    kind = draw(st.sampled_from(kinds))
    batch = draw(st.integers(1, 3))
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([4, 8, 16]))
    side = draw(st.sampled_from(["left", "right"]))
    seed = draw(st.integers(0, 2**31 - 1))

    def lengths(total, low=0):
        return draw(st.lists(st.integers(low, total), min_size=batch, max_size=batch))

    mask, is_causal, key_padding, layout = None, False, None, None
    if kind == "none":
        sq, sk = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    elif kind in ("padding", "causal", "causal_padding", "sliding", "additive"):
        sq = sk = draw(st.integers(1, 10))
        causal = kind != "padding" and (kind != "additive" or draw(st.booleans()))
        if kind == "causal":  # no padding: absent or all ones
            key_padding = draw(st.sampled_from([None, torch.ones(batch, sk, dtype=torch.long)]))
        elif kind in ("padding", "causal_padding") or draw(st.booleans()):
            key_padding = padding_mask(lengths(sk), sk, side)
        window = draw(st.integers(1, sk)) if kind == "sliding" else None
        built = self_attention_mask(
            key_padding, batch_size=batch, query_length=sq, key_length=sk, causal=causal, sliding_window=window,
            device=CPU,
        )
        if kind == "causal":
            assert built.mask is None and built.is_causal == (sq > 1), built  # the fast path
        mask, is_causal, layout, _ = built
        if kind == "additive":
            gen = torch.Generator().manual_seed(seed + 1)
            bias = 2 * torch.randn(1, heads, sq, sk, generator=gen)
            mask, is_causal, layout, _ = with_position_bias(built, bias, torch.float32)
    elif kind == "cross":
        sq, sk = draw(st.integers(1, 9)), draw(st.integers(1, 9))
        if sq == sk:
            sk += 1
        encoder_padding = padding_mask(lengths(sk), sk, side)
        mask, is_causal, layout, _ = cross_attention_mask(encoder_padding, query_length=sq)
    elif kind in ("decode", "chunk"):
        sk = draw(st.integers(2 if kind == "decode" else 3, 10))
        sq = 1 if kind == "decode" else draw(st.integers(2, sk - 1))
        if draw(st.booleans()):
            key_padding = padding_mask(lengths(sk), sk, side)
        mask, is_causal, layout, _ = self_attention_mask(
            key_padding, batch_size=batch, query_length=sq, key_length=sk, causal=True, device=CPU
        )
    elif kind == "local_chunks":
        (mask, is_causal, layout, _), key_padding, sq, sk = draw(local_chunk_masks(batch, lengths, side))
    else:  # raw_bool: any pattern, including rows with no visible key
        sq, sk = draw(st.integers(1, 9)), draw(st.integers(1, 9))
        gen = torch.Generator().manual_seed(seed + 2)
        mask_batch = draw(st.sampled_from([1, batch]))
        mask = torch.rand(mask_batch, 1, sq, sk, generator=gen) < 0.6
        if draw(st.booleans()):
            mask[..., draw(st.integers(0, sq - 1)), :] = False

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, sq, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, kv_heads, sk, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, kv_heads, sk, head_dim, generator=gen).to(dtype)
    return Case(kind, q, k, v, mask, is_causal, head_dim**-0.5, key_padding, layout)


@st.composite
def local_chunk_masks(draw, batch: int, lengths, side: str):
    """(AttentionMask, key padding, Sq, Sk) of Llama 4's chunked attention (masks.within_chunks, as its layers
    build it): a prefill or a step of Sq new queries after Sk - Sq cached keys, chunks of C counted from each
    row's first real token, optionally padded (a mask of None: every key in its query's chunk, plain causal)."""
    sk = draw(st.integers(2, 12))
    sq = draw(st.sampled_from([sk, 1, draw(st.integers(1, sk))]))
    chunk = draw(st.integers(1, 5))
    key_padding = padding_mask(lengths(sk), sk, side) if draw(st.booleans()) else None
    causal = self_attention_mask(key_padding, batch_size=batch, query_length=sq, key_length=sk, causal=True,
                                 device=CPU)
    built = within_chunks(causal, key_padding, torch.arange(sk - sq, sk), torch.arange(sk), chunk)
    return built, key_padding, sq, sk


def run_backend(fn, case: Case, *, grad: bool = False):
    q, k, v = (t.clone().requires_grad_(grad) for t in (case.q, case.k, case.v))
    out, weights = fn(q, k, v, case.mask, scale=case.scale, is_causal=case.is_causal, layout=case.layout)
    assert weights is None
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    if not grad:
        return out.detach(), None
    if not out.requires_grad:
        # Every row fully masked: an output built from zeros alone carries no graph, i.e. zero gradients.
        assert torch.all(out == 0)
        return out, tuple(torch.zeros_like(t) for t in (q, k, v))
    # A loss that touches every output, fully masked rows included.
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), tuple(torch.zeros_like(t) if t.grad is None else t.grad for t in (q, k, v))


def check_padded_query_rows_see_earlier_real_keys(case: Case, out: torch.Tensor, visible: torch.Tensor) -> None:
    """Causal self-attention with padding: a padding query (the last Sq positions of the key mask) that sees a real
    key (at or before it, within its window) attends to it, as in official transformers' eager / sdpa; one that sees
    none gives zeros."""
    if case.key_padding is None or not case.is_causal:
        return
    sq, sk = case.q.shape[2], case.k.shape[2]
    query_is_padding = (case.key_padding[:, sk - sq :] == 0)[:, None, :].expand(visible.shape)  # [B, H, Sq]
    assert torch.all(out[query_is_padding & ~visible] == 0)
    assert torch.all(out[query_is_padding & visible].abs().amax(dim=-1) > 0)


# ----------------------------------------------------------------------------------------------------------------
# Backends on CPU against the reference and against naive, forward and backward.
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@PER_KIND
@given(data=st.data())
def test_backends_match_reference_and_naive(kind: str, data):
    case = data.draw(attention_cases(kinds=(kind,)), label="case")
    expected, visible = reference_attention(case.q, case.k, case.v, case.mask, scale=case.scale, is_causal=case.is_causal)
    naive_out, naive_grads = run_backend(naive_attention, case, grad=True)
    torch.testing.assert_close(naive_out.double(), expected, atol=FP32_ATOL, rtol=0)
    for name in CPU_BACKENDS:
        out, grads = run_backend(get_attention_backend(name), case, grad=True)
        assert torch.isfinite(out).all(), name
        torch.testing.assert_close(out.double(), expected, atol=FP32_ATOL, rtol=0, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(out, naive_out, atol=FP32_ATOL, rtol=0, msg=lambda m: f"{name} vs naive: {m}")
        # Fully masked query rows are exactly zero, never NaN, and gradients stay finite and match naive.
        assert torch.all(out[~visible] == 0), name
        check_padded_query_rows_see_earlier_real_keys(case, out, visible)
        for grad, naive_grad in zip(grads, naive_grads):
            assert torch.isfinite(grad).all(), name
            torch.testing.assert_close(grad, naive_grad, atol=GRAD_ATOL, rtol=0, msg=lambda m: f"{name} grad: {m}")


def test_reference_rejects_a_wrong_scale_and_a_wrong_kv_head_mapping():
    """Negative controls: the comparison above notices a wrong scale and a wrong GQA head mapping."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    expected, _ = reference_attention(q, k, v, None, scale=8**-0.5, is_causal=True)
    wrong_scale, _ = naive_attention(q, k, v, scale=1.0, is_causal=True)
    assert (wrong_scale.double() - expected).abs().max() > 100 * FP32_ATOL
    # Heads interleaved (h % Hkv) instead of grouped (h // n_rep) as transformers' repeat_kv does.
    interleaved = torch.cat([k, k], dim=1), torch.cat([v, v], dim=1)
    wrong_mapping, _ = naive_attention(q, *interleaved, scale=8**-0.5, is_causal=True)
    assert (wrong_mapping.double() - expected).abs().max() > 100 * FP32_ATOL


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["bool", "additive_min", "additive_inf"])
def test_fully_masked_rows_are_zero_with_finite_gradients(backend, dtype, mask_kind):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 5, 8, generator=gen).to(dtype)
    k, v = (torch.randn(2, 2, 6, 8, generator=gen).to(dtype) for _ in range(2))
    allowed = torch.rand(2, 1, 5, 6, generator=gen) < 0.5
    allowed[0, :, 1] = False
    allowed[1, :, 4] = False
    allowed[1, :, 0] = True
    if mask_kind == "bool":
        mask = allowed
    else:  # an fp32 mask whose minimum overflows to -inf once cast to half precision, or -inf itself
        fill = torch.finfo(torch.float32).min if mask_kind == "additive_min" else float("-inf")
        mask = torch.where(allowed, 0.0, fill)
    case = Case("raw", q, k, v, mask, False, 8**-0.5)
    out, grads = run_backend(get_attention_backend(backend), case, grad=True)
    assert torch.all(out[0, :, 1] == 0) and torch.all(out[1, :, 4] == 0)
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(g).all() for g in grads)
    # Masked rows send no gradient to q.
    assert torch.all(grads[0][0, :, 1] == 0) and torch.all(grads[0][1, :, 4] == 0)


def test_sdpa_never_hands_a_fully_masked_row_to_the_kernel(monkeypatch):
    """Some SDPA kernels (CUDA memory-efficient) return NaN for a row with no visible key; we must not send one."""
    seen = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        seen.append(attn_mask)
        return real_sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    q = torch.randn(1, 2, 3, 4)
    k = v = torch.randn(1, 2, 3, 4)
    allowed = torch.tensor([[True, False, False], [False, False, False], [True, True, False]])[None, None]
    for mask in (allowed, torch.where(allowed, 0.0, float("-inf")), torch.where(allowed, 0.0, torch.finfo(torch.float16).min).half()):
        seen.clear()
        out, _ = torch_attention(q, k, v, mask, scale=0.5)
        kernel_mask = seen[0]
        if kernel_mask.dtype == torch.bool:
            visible = kernel_mask
        else:
            visible = kernel_mask > torch.finfo(kernel_mask.dtype).min / 2
        assert visible.any(dim=-1).all(), kernel_mask
        assert torch.all(out[0, :, 1] == 0)


def test_sdpa_repeats_grouped_heads_where_the_fused_kernels_refuse_them(monkeypatch):
    """Off the CPU, SDPA gets grouped K/V heads (enable_gqa) only without a mask and with equal head dims <= 256:
    otherwise CUDA falls back to the math kernel, every score materialized (transformers' use_gqa_in_sdpa). The
    repeated heads give the grouped result; tiled heads (each query head on the wrong group) do not."""
    takes = attention.fused_kernels_take_grouped_heads
    meta = lambda *shape, dtype=torch.float32: torch.empty(*shape, device="meta", dtype=dtype)  # noqa: E731
    k = meta(1, 2, 3, 8)
    assert takes(k, k, None) and not takes(k, k, meta(1, 1, 3, 3, dtype=torch.bool))
    assert not takes(meta(1, 2, 3, 512), meta(1, 2, 3, 512), None)
    assert not takes(k, meta(1, 2, 3, 6), None)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=gen) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    mask = torch.rand(2, 1, 5, 5, generator=gen) > 0.3
    seen = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((k.shape[1], kwargs["enable_gqa"]))
        return real_sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    grouped, _ = torch_attention(q, k, v, mask, scale=0.3)  # the CPU's kernel takes a mask beside grouped heads
    meta_device = torch.device("meta")
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: meta_device))  # as an accelerator's tensors
    repeated, _ = torch_attention(q, k, v, mask, scale=0.3)
    monkeypatch.undo()
    assert seen == [(2, True), (4, False)]
    torch.testing.assert_close(repeated, grouped, rtol=0, atol=1e-6)
    tiled, _ = torch_attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), mask, scale=0.3)
    assert (tiled - grouped).abs().max() > 0.1


# ----------------------------------------------------------------------------------------------------------------
# Dropout, output_attentions, bad input, backend names.
# ----------------------------------------------------------------------------------------------------------------


def test_naive_dropout_changes_outputs_and_p0_equals_eval():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=gen) for _ in range(3))
    eval_out, eval_weights = naive_attention(q, k, v, scale=0.3, output_attentions=True)
    p0_out, _ = naive_attention(q, k, v, scale=0.3, dropout_p=0.0)
    assert torch.equal(p0_out, eval_out)
    torch.manual_seed(0)
    drop_out, drop_weights = naive_attention(q, k, v, scale=0.3, dropout_p=0.5, output_attentions=True)
    assert not torch.allclose(drop_out, eval_out)
    # Inverted dropout on the weights: each weight is dropped or scaled by 1 / (1 - p), and out = weights · V.
    kept = drop_weights != 0
    assert 0.3 < kept.float().mean() < 0.7
    torch.testing.assert_close(drop_weights[kept], eval_weights[kept] / 0.5)
    torch.testing.assert_close(drop_out, drop_weights @ v)


def test_sdpa_dropout_changes_outputs_and_p0_equals_eval():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=gen) for _ in range(3))
    eval_out, _ = torch_attention(q, k, v, scale=0.3)
    assert torch.equal(torch_attention(q, k, v, scale=0.3, dropout_p=0.0)[0], eval_out)
    torch.manual_seed(0)
    assert not torch.allclose(torch_attention(q, k, v, scale=0.3, dropout_p=0.5)[0], eval_out)


@HYPO
@given(case=attention_cases(kinds=("padding", "causal_padding", "cross", "sliding", "decode", "additive", "raw_bool")))
def test_naive_weights_sum_to_one_on_visible_rows(case: Case):
    out, weights = naive_attention(
        case.q, case.k, case.v, case.mask, scale=case.scale, is_causal=case.is_causal, output_attentions=True
    )
    _, visible = reference_attention(case.q, case.k, case.v, case.mask, scale=case.scale, is_causal=case.is_causal)
    batch, heads, sq, sk = case.q.shape[0], case.q.shape[1], case.q.shape[2], case.k.shape[2]
    assert weights.shape == (batch, heads, sq, sk)
    sums = weights.sum(-1)
    visible = visible.expand(batch, heads, sq)
    torch.testing.assert_close(sums[visible], torch.ones_like(sums[visible]))
    assert torch.all(weights[~visible] == 0)
    if case.mask is not None and case.mask.dtype == torch.bool:
        assert torch.all(weights[~case.mask.expand_as(weights)] == 0)


@pytest.mark.parametrize("backend", ["sdpa", "flash_attention_2"])
def test_output_attentions_needs_eager(backend):
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="output_attentions.*eager"):
        get_attention_backend(backend)(q, q, q, scale=0.5, output_attentions=True)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flash_attention_2"])
@pytest.mark.parametrize(
    "shapes, message",
    [
        (((1, 6, 3, 4), (1, 4, 3, 4), (1, 4, 3, 4)), r"query heads \(6\).*key/value heads \(4\)"),
        (((1, 4, 3, 4), (1, 2, 3, 4), (1, 2, 5, 4)), r"k and v must have the same \[batch, heads, seq\].*\(1, 2, 3, 4\).*\(1, 2, 5, 4\)"),
        (((4, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4)), r"4-D q, k, v.*\(4, 3, 4\)"),
    ],
)
def test_bad_shapes_raise_clear_errors(backend, shapes, message):
    q, k, v = (torch.randn(*shape) for shape in shapes)
    with pytest.raises(ValueError, match=message):
        get_attention_backend(backend)(q, k, v, scale=0.5)


def test_unknown_backend_names_the_valid_choices():
    with pytest.raises(ValueError, match="'nope'.*eager.*flash_attention_2.*sdpa"):
        get_attention_backend("nope")
    with pytest.raises(ValueError, match="'nope'"):
        check_backend_can_run("nope", CPU, torch.float32)
    for name in DEVICE_BACKENDS:
        assert callable(get_attention_backend(name))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_flash_runs_on_cpu_with_pytorchs_kernel_and_refuses_other_devices(dtype):
    """flash_attention_2 on CPU is PyTorch's FLASH_ATTENTION SDPA kernel (fp32, fp16, bf16), no fallback to
    another kernel: it is forced with sdpa_kernel, so a shape the kernel cannot take raises."""
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 4, 6, 16, generator=gen).to(dtype) for _ in range(2))
    out, _ = flash_attention(q, k, k, scale=0.25, is_causal=True)
    expected, _ = naive_attention(q.double(), k.double(), k.double(), scale=0.25, is_causal=True)
    tolerance = {torch.float32: FP32_ATOL, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=0)
    for name in ("flash_attention_2", "sdpa", "eager"):
        check_backend_can_run(name, CPU, dtype)
    with pytest.raises(ValueError, match="CUDA or CPU tensors, got device 'meta'.*sdpa.*eager"):
        check_backend_can_run("flash_attention_2", "meta", dtype)
    with pytest.raises(ValueError, match="float32 or float16 or bfloat16 on cpu, got dtype torch.float64"):
        check_flash_can_run(CPU, torch.float64)


def test_flash_on_cpu_runs_a_chunked_causal_step_bottom_right():
    """PyTorch's CPU flash kernel takes a mask, so a chunk of new queries after cached keys is aligned
    bottom-right as in every other backend (the CUDA kernel cannot: that case raises there)."""
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 2, 3, 8, generator=gen), torch.randn(1, 2, 7, 8, generator=gen)
    out, _ = flash_attention(q, k, k, scale=0.3, is_causal=True)
    torch.testing.assert_close(out, naive_attention(q, k, k, scale=0.3, is_causal=True)[0], atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_flash_in_full_precision_raises_naming_alternatives(dtype):
    with pytest.raises(ValueError, match=rf"float16 or bfloat16.*{dtype}.*sdpa.*eager"):
        check_flash_can_run(torch.device("cuda"), dtype)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        check_backend_can_run("flash_attention_2", "cuda", dtype)
    check_flash_can_run(torch.device("cuda"), torch.bfloat16)  # the one combination that may run


# ----------------------------------------------------------------------------------------------------------------
# Half-precision numerics: no overflow, and the softmax precision of the official eager.
# ----------------------------------------------------------------------------------------------------------------


def official_eager(q, k, v, mask, scale):
    """transformers' Llama eager attention on the same tensors ([B, H, Sq, D] out, weights)."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    module = types.SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False)
    out, weights = eager_attention_forward(module, q, k, v, mask, scaling=scale)
    return out.transpose(1, 2), weights


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_large_activations_do_not_overflow_in_half_precision(dtype, backend):
    # |Q Kᵀ| reaches ~2e5 before scaling: past fp16's 65504, the official eager formula overflows there.
    gen = torch.Generator().manual_seed(4)
    q0, k0 = (100 * torch.randn(2, 4, 7, 64, generator=gen) for _ in range(2))
    v0 = torch.randn(2, 2, 7, 64, generator=gen)
    k0 = k0[:, :2]
    padding = padding_mask([7, 4], 7, "left")
    mask, is_causal, _, _ = self_attention_mask(padding, batch_size=2, query_length=7, key_length=7, causal=True, device=CPU)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q0, k0, v0))
    expected, _ = reference_attention(q.detach(), k.detach(), v.detach(), mask, scale=64**-0.5, is_causal=is_causal)
    out, _ = get_attention_backend(backend)(q, k, v, mask, scale=64**-0.5, is_causal=is_causal)
    assert torch.isfinite(out).all()
    # Against fp64 on the same (rounded) inputs: one rounding of the weights and of the output.
    tolerance = {torch.float16: 5e-3, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=0)
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    if dtype == torch.float16:
        # Negative control: the official eager formula (scores in fp16) does overflow on these inputs.
        official, _ = official_eager(q.detach(), k.detach(), v.detach(), None, 64**-0.5)
        assert not torch.isfinite(official).all()


def test_bf16_softmax_precision_matches_official_eager_bit_for_bit():
    """On inputs whose scores are exact in bf16, ours and official eager differ only in the softmax precision:
    both run it in fp32 then cast to bf16, so weights and outputs are bit-identical."""
    gen = torch.Generator().manual_seed(5)
    # Integers in [-3, 3], head_dim 16, scale 1/4: every score is a multiple of 1/4 below 40, exact in bf16.
    q = torch.randint(-3, 4, (2, 4, 9, 16), generator=gen).to(torch.bfloat16)
    k = torch.randint(-3, 4, (2, 2, 9, 16), generator=gen).to(torch.bfloat16)
    v = torch.randn(2, 2, 9, 16, generator=gen).to(torch.bfloat16)
    padding = padding_mask([9, 5], 9, "left")
    mask, is_causal, _, _ = self_attention_mask(padding, batch_size=2, query_length=9, key_length=9, causal=True, device=CPU)
    official_mask = torch.where(mask, 0.0, torch.finfo(torch.bfloat16).min).to(torch.bfloat16)
    official_out, official_weights = official_eager(q, k, v, official_mask, 0.25)
    ours_out, ours_weights = naive_attention(q, k, v, mask, scale=0.25, is_causal=is_causal, output_attentions=True)
    real_rows = mask.any(-1).expand(2, 4, 9)  # official gives a uniform average on fully masked rows, we give zeros
    assert ours_weights.dtype == official_weights.dtype == torch.bfloat16
    assert torch.equal(ours_weights[real_rows], official_weights[real_rows])
    assert torch.equal(ours_out[real_rows], official_out[real_rows])
    # Negative control: a softmax carried out in bf16 (exp and sum in bf16) is visibly different.
    scores = (q.float() @ k.repeat_interleave(2, dim=1).float().transpose(-1, -2) * 0.25).masked_fill(~mask, -1e4)
    scores = scores.to(torch.bfloat16)
    exp = (scores - scores.amax(-1, keepdim=True)).exp()
    bf16_softmax = exp / exp.sum(-1, keepdim=True)
    assert not torch.equal(bf16_softmax[real_rows], official_weights[real_rows])


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 6e-2), (torch.float16, 8e-3)])
def test_half_precision_close_to_official_eager_and_at_least_as_accurate(dtype, tolerance):
    """Random inputs: ours computes scores in fp32 where official eager rounds them to the input dtype. The two
    agree within `tolerance` (max |Δ|, outputs ~N(0, 1)), and ours is closer to the fp64 truth on average."""
    gen = torch.Generator().manual_seed(6)
    q0 = 2 * torch.randn(4, 4, 16, 16, generator=gen)
    k0 = 2 * torch.randn(4, 2, 16, 16, generator=gen)
    v0 = torch.randn(4, 2, 16, 16, generator=gen)
    expected, _ = reference_attention(q0, k0, v0, None, scale=0.25, is_causal=False)
    q, k, v = (t.to(dtype) for t in (q0, k0, v0))
    official, _ = official_eager(q, k, v, None, 0.25)
    for backend in CPU_BACKENDS:
        ours, _ = get_attention_backend(backend)(q, k, v, scale=0.25)
        assert (ours.double() - official.double()).abs().max() <= tolerance, backend
        ours_error = (ours.double() - expected).abs().mean()
        official_error = (official.double() - expected).abs().mean()
        assert ours_error <= official_error, (backend, ours_error, official_error)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float16, 4e-3), (torch.bfloat16, 3e-2)])
@HYPO
@given(case=attention_cases(kinds=("padding", "causal_padding", "cross", "sliding", "decode", "chunk", "additive", "raw_bool")))
def test_sdpa_matches_naive_in_half_precision_on_cpu(dtype, tolerance, case: Case):
    q, k, v = (t.to(dtype) for t in (case.q, case.k, case.v))
    naive_out, _ = naive_attention(q, k, v, case.mask, scale=case.scale, is_causal=case.is_causal)
    sdpa_out, _ = torch_attention(q, k, v, case.mask, scale=case.scale, is_causal=case.is_causal)
    assert torch.isfinite(sdpa_out).all()
    # the bound in units of the outputs' scale: at |out| >= 4 one bf16 step is 0.031, over an absolute 3e-2 (a
    # hypothesis case failed there in the torch-newest end by exactly one step, 2026-11-28)
    scale = max(1.0, float(naive_out.float().abs().max()))
    torch.testing.assert_close(sdpa_out.float(), naive_out.float(), atol=tolerance * scale, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# The flash path on CPU: the varlen form of declared layouts (flash.varlen), the flash-attn varlen packing (fake
# package), and the per-sequence path on PyTorch's real CPU flash kernel.
# ----------------------------------------------------------------------------------------------------------------


def _varlen(built, batch, heads):
    """The varlen form flash derives from a mask's declared layout."""
    assert built.layout is not None, built
    q = torch.zeros(batch, heads, built.layout.query_length, 1)
    return flash.varlen(built.layout, q)


def test_varlen_of_left_and_right_padding_with_causality():
    for side in ("left", "right"):
        padding = padding_mask([5, 3, 0], 5, side)
        for causal in (True, False):
            built = self_attention_mask(padding, batch_size=3, query_length=5, key_length=5, causal=causal, device=CPU)
            found = _varlen(built, 3, 2)
            assert torch.equal(found.key_valid, padding.bool()) and found.per_row
            # Causal self-attention drops padding queries; encoder self-attention lets them see the real keys.
            expected_queries = padding.bool() if causal else (padding.sum(-1, keepdim=True) > 0).expand(3, 5)
            assert torch.equal(found.query_valid, expected_queries)
            assert found.causal == causal
            assert found.q_lens.tolist() == expected_queries.sum(-1).tolist() and found.k_lens.tolist() == [5, 3, 0]
            assert torch.equal(found.q_idx, expected_queries.flatten().nonzero().squeeze(-1))


def test_varlen_of_decode_and_chunk_steps():
    padding = padding_mask([6, 2], 6, "left")
    built = self_attention_mask(padding, batch_size=2, query_length=1, key_length=6, causal=True, device=CPU)
    found = _varlen(built, 2, 4)
    assert found.query_valid.tolist() == [[True], [True]] and torch.equal(found.key_valid, padding.bool())
    # Right padding while decoding: the new token is padding; its row sees the two real keys (eager and sdpa compute
    # it), flash drops the padding query (its own key is padding), as flash-attn's varlen path does.
    padding = padding_mask([6, 2], 6, "right")
    built = self_attention_mask(padding, batch_size=2, query_length=1, key_length=6, causal=True, device=CPU)
    found = _varlen(built, 2, 4)
    assert found.query_valid.tolist() == [[True], [False]] and found.key_valid[1].tolist() == [1, 1, 0, 0, 0, 0]
    # Chunked prefill: 3 new queries over 7 keys, causal within the real tokens.
    padding = padding_mask([7, 4], 7, "left")
    built = self_attention_mask(padding, batch_size=2, query_length=3, key_length=7, causal=True, device=CPU)
    found = _varlen(built, 2, 4)
    assert found.query_valid.all() and found.q_idx is None and torch.equal(found.key_valid, padding.bool())
    assert found.causal and found.k_lens.tolist() == [7, 4]


def test_a_causal_layout_without_padding_runs_the_plain_kernels():
    """3 queries after 4 cached keys, no padding: the mask holds bottom-right causality, the layout says so, and
    flash calls its dense kernel (no varlen) with the same result as naive."""
    built = self_attention_mask(None, batch_size=3, query_length=3, key_length=7, causal=True, device=CPU)
    found = _varlen(built, 3, 2)
    assert found.dense and found.causal and found.window is None
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(3, 2, 3, 8, generator=gen), torch.randn(3, 2, 7, 8, generator=gen)
    package = FakeFlashAttn()
    with pytest.MonkeyPatch.context() as patch:
        flash_on_cpu(patch, package=package)
        out, _ = flash_attention(q, k, k, built.mask, scale=0.3, is_causal=True, layout=built.layout)
    assert package.calls == ["dense"]
    torch.testing.assert_close(out, naive_attention(q, k, k, built.mask, scale=0.3)[0], atol=FP32_ATOL, rtol=0)


def test_flash_refuses_what_it_cannot_run_naming_the_alternatives():
    q = torch.zeros(1, 2, 6, 4)
    built = self_attention_mask(None, batch_size=1, query_length=6, key_length=6, causal=True, sliding_window=2, device=CPU)
    with pytest.raises(ValueError, match="padding and causal masks only.*sliding window of 2.*'sdpa' or 'eager'"):
        flash_attention(q, q, q, built.mask, scale=0.5, is_causal=True, layout=built.layout)
    with pytest.raises(ValueError, match="additive.*sdpa.*eager"):
        flash_attention(q, q, q, torch.zeros(1, 1, 6, 6), scale=0.5)
    per_head = torch.ones(1, 2, 6, 6, dtype=torch.bool)  # masks nobody declared, any pattern: refused, not read
    per_head[0, 1, 0, 0] = False
    checker = (torch.arange(6)[:, None] + torch.arange(6)[None, :]) % 2 == 0
    for undeclared in (per_head, checker):
        with pytest.raises(ValueError, match="layout.*'sdpa' or 'eager'"):
            flash_attention(q, q, q, undeclared, scale=0.5)
    with pytest.raises(ValueError, match=r"describes 6 queries over 6 keys; got q \(1, 2, 5, 4\)"):
        flash_attention(q[:, :, :5], q, q, built.mask[:, :, :5], scale=0.5, layout=built.layout)


def test_flash_runs_chunked_attention_as_segments():
    """A left-padded row of 7 real tokens in chunks of 3 (counted from its first real token) and a full row of 9:
    segments of 3, 3, 3 and 3, 3, 1 tokens. A step of 2 queries after 5 cached keys: query 5 sees keys 3-5 (its chunk),
    query 6 key 6; keys 0-2 form a segment without a query."""
    padding = padding_mask([9, 7], 9, "left")
    causal = self_attention_mask(padding, batch_size=2, query_length=9, key_length=9, causal=True, device=CPU)
    chunked = within_chunks(causal, padding, torch.arange(9), torch.arange(9), 3)
    found = _varlen(chunked, 2, 2)
    assert found.q_lens.tolist() == found.k_lens.tolist() == [3, 3, 3, 3, 3, 1]
    assert torch.equal(found.q_idx, padding.flatten().nonzero().squeeze(-1))
    step = self_attention_mask(None, batch_size=1, query_length=2, key_length=7, causal=True, device=CPU)
    step_chunks = within_chunks(step, None, torch.arange(5, 7), torch.arange(7), 3)
    found = _varlen(step_chunks, 1, 2)
    assert (found.q_lens.tolist(), found.k_lens.tolist()) == ([0, 1, 1], [3, 3, 1])
    gen = torch.Generator().manual_seed(9)
    q, k = torch.randn(1, 2, 2, 4, generator=gen), torch.randn(1, 2, 7, 4, generator=gen)
    out, _ = flash_attention(q, k, k, step_chunks.mask, scale=0.5, is_causal=True, layout=step_chunks.layout)
    torch.testing.assert_close(out, naive_attention(q, k, k, step_chunks.mask, scale=0.5)[0], atol=FP32_ATOL, rtol=0)
    unchunked, _ = naive_attention(q, k, k, step.mask, scale=0.5, is_causal=True)
    assert (out - unchunked).abs().max() > 1e-2  # negative control: the chunks matter on these inputs


def flash_semantics(case: Case) -> Case:
    """The case as flash computes it: in causal self-attention a padding query (its own key is padding) is dropped
    and gives zeros, as in flash-attn's varlen path and official transformers' flash_attention_2 (eager and sdpa
    let it see the real keys before it)."""
    if not case.is_causal or case.key_padding is None or case.mask is None or case.mask.dtype != torch.bool:
        return case  # flash refuses additive masks
    sq, sk = case.q.shape[2], case.k.shape[2]
    query_real = case.key_padding[:, sk - sq :].bool()[:, None, :, None]
    return Case(case.kind, case.q, case.k, case.v, case.mask & query_real, case.is_causal, case.scale, case.key_padding,
                case.layout)


def test_flash_drops_the_padding_queries_of_a_declared_causal_layout():
    """Key 1 is padding (a hole): every real query sees the real keys up to its own, the padding query (query 0, whose
    own key is key 1) is dropped by flash and gives zeros; the same pattern as a bare tensor is refused."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 1, 3, 4, generator=gen), torch.randn(1, 1, 4, 4, generator=gen), torch.randn(1, 1, 4, 4, generator=gen)
    built = self_attention_mask(torch.tensor([[1, 0, 1, 1]]), batch_size=1, query_length=3, key_length=4, causal=True,
                                device=CPU)
    with pytest.MonkeyPatch.context() as patch:
        flash_on_cpu(patch, package=None)
        out, _ = flash_attention(q, k, v, built.mask, scale=0.5, is_causal=True, layout=built.layout)
        with pytest.raises(ValueError, match="sdpa"):
            flash_attention(q, k, v, built.mask, scale=0.5, is_causal=True)
    assert torch.all(out[0, 0, 0] == 0)  # the padding query is dropped, as flash_attention_2 drops it
    expected, _ = naive_attention(q, k, v, built.mask, scale=0.5)
    torch.testing.assert_close(out[0, 0, 1:], expected[0, 0, 1:], atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("use_package", [True, False], ids=["flash_attn_varlen", "sdpa_flash_fallback"])
@PER_KIND
@given(data=st.data())
def test_flash_path_emulated_on_cpu_matches_naive(kind: str, use_package: bool, data):
    """The flash backend's layouts, packing and unpacking, with CPU math in place of the CUDA kernels: the
    flash-attn varlen path (fake package) and the per-sequence fallback on PyTorch's flash SDPA kernel (which also
    runs on CPU). Masks flash can express must match naive; any other mask (a window, a bias, a mask without a
    layout) must raise, naming the backends that take it."""
    case = data.draw(attention_cases(kinds=(kind,)), label="case")
    package = FakeFlashAttn() if use_package else None
    with pytest.MonkeyPatch.context() as patch:
        flash_on_cpu(patch, package=package)
        naive_out, naive_grads = run_backend(naive_attention, flash_semantics(case), grad=True)
        try:
            out, grads = run_backend(flash_attention, case, grad=True)
        except ValueError as error:
            message = str(error)
            if case.kind in FLASH_KINDS:
                raise AssertionError(f"flash refused a mask it can express: {case}: {message}")
            else:
                event("mask flash cannot express: refused")
                assert "sdpa" in message and "eager" in message, message
            return
    if case.kind not in FLASH_KINDS:
        assert case.kind == "sliding", case  # only a window that cuts nothing (no row longer than it) runs
        event("sliding window that cuts no row: run")
    torch.testing.assert_close(out, naive_out, atol=FP32_ATOL, rtol=0)
    if package is not None and case.mask is not None and not case.mask.all() and case.kind in FLASH_KINDS:
        assert package.calls and set(package.calls) <= {"varlen", "dense"}
    for grad, naive_grad in zip(grads, naive_grads):
        torch.testing.assert_close(grad, naive_grad, atol=GRAD_ATOL, rtol=0)


def test_flash_emulation_uses_varlen_for_padding_and_dense_without():
    package = FakeFlashAttn()
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=gen) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    with pytest.MonkeyPatch.context() as patch:
        flash_on_cpu(patch, package=package)
        mask, is_causal, layout, _ = self_attention_mask(padding_mask([5, 2], 5, "left"), batch_size=2, query_length=5,
                                                      key_length=5, causal=True, device=CPU)
        flash_attention(q, k, v, mask, scale=0.3, is_causal=is_causal, layout=layout)
        assert package.calls == ["varlen"]
        mask, is_causal, layout, _ = self_attention_mask(torch.ones(2, 5), batch_size=2, query_length=5, key_length=5,
                                                      causal=True, device=CPU)
        flash_attention(q, k, v, mask, scale=0.3, is_causal=is_causal, layout=layout)
        assert package.calls == ["varlen", "dense"]


# ----------------------------------------------------------------------------------------------------------------
# CUDA: every backend against naive in fp32 / bf16 / fp16, flash through both of its paths.
# ----------------------------------------------------------------------------------------------------------------

# max |Δ| vs naive for outputs ~N(0, 1): fp32 kernels may reorder sums; half precision rounds the weights (naive)
# or keeps them in fp32 registers (flash / memory-efficient kernels).
CUDA_TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU; torch.cuda.is_available() is False")


def _cuda_cases(device):
    """(kind, side, q, k, v, mask, is_causal, layout, padding): masks and their layouts built on `device`, as the
    step builds them on the inputs' device."""
    gen = torch.Generator().manual_seed(8)
    cases = []
    for kind, sq, sk, side in [
        ("causal_padding", 33, 33, "left"),
        ("causal_padding", 33, 33, "right"),
        ("padding", 40, 40, "right"),
        ("cross", 17, 29, "right"),
        ("decode", 1, 48, "left"),
        ("chunk", 8, 40, "left"),
        ("causal", 64, 64, None),
    ]:
        lengths = [sk, sk // 2, 3]
        padding = padding_mask(lengths, sk, side).to(device) if side else None
        if kind == "cross":
            mask, is_causal, layout, _ = cross_attention_mask(padding, query_length=sq)
        else:
            mask, is_causal, layout, _ = self_attention_mask(
                padding, batch_size=3, query_length=sq, key_length=sk, causal=kind != "padding", device=device
            )
        q = torch.randn(3, 8, sq, 64, generator=gen)
        k, v = (torch.randn(3, 2, sk, 64, generator=gen) for _ in range(2))
        cases.append((kind, side, q, k, v, mask, is_causal, layout, padding))
    return cases


def _flash_reference_mask(kind, mask, padding):
    """The mask naive attention needs to compute what flash computes: flash drops a causal self-attention query
    whose own key is padding (zeros, as flash-attn's varlen path), eager and sdpa let it see the real keys before it
    (flash_semantics above, for the CUDA cases)."""
    if mask is None or padding is None or kind in ("padding", "cross"):
        return mask
    query_length = mask.shape[-2]
    return mask & padding[:, padding.shape[1] - query_length :].bool()[:, None, :, None].to(mask.device)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend, flash_path", [("sdpa", "package_or_default"), ("flash_attention_2", "package_or_default"),
                                                 ("flash_attention_2", "sdpa_flash_fallback")])
def test_cuda_backends_match_naive(dtype, backend, flash_path, monkeypatch):
    """flash_path (flash_attention_2 only): the flash-attn package when installed, else the default path; or the
    package hidden, as on a machine without it."""
    if backend == "flash_attention_2" and dtype == torch.float32:
        with pytest.raises(ValueError, match="float16 or bfloat16"):
            flash_attention(*(torch.randn(1, 2, 3, 64, device="cuda") for _ in range(3)), scale=0.125)
        return
    if flash_path == "sdpa_flash_fallback":
        monkeypatch.setattr(flash, "flash_attn_package_available", lambda device=None: False)
    fn = get_attention_backend(backend)
    for kind, side, q, k, v, mask, is_causal, layout, padding in _cuda_cases(torch.device("cuda")):
        q, k, v = (t.to("cuda", dtype) for t in (q, k, v))
        reference_mask = _flash_reference_mask(kind, mask, padding) if backend == "flash_attention_2" else mask
        expected, _ = naive_attention(q, k, v, reference_mask, scale=0.125, is_causal=is_causal)
        try:
            out, _ = fn(q, k, v, mask, scale=0.125, is_causal=is_causal, layout=layout)
        except ValueError as error:
            # The SDPA-flash fallback cannot align a causal chunk bottom-right; it must say so.
            assert backend == "flash_attention_2" and not flash.flash_attn_package_available()
            assert kind == "chunk" and "install flash-attn" in str(error)
            continue
        assert torch.isfinite(out).all(), (kind, side)
        diff = (out.float() - expected.float()).abs().max().item()
        assert diff <= CUDA_TOLERANCE[dtype], (backend, kind, side, dtype, diff)
        if mask is not None:
            empty_rows = ~reference_mask.any(-1)  # [B, 1, Sq]
            assert torch.all(out.masked_select(empty_rows[..., None].expand_as(out)) == 0)


# ----------------------------------------------------------------------------------------------------------------
# Attention sinks (GPT-OSS): one learned logit per head in every row's softmax denominator, attached to no value.
# ----------------------------------------------------------------------------------------------------------------

SINK_SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference_attention_with_sinks(q, k, v, mask, *, scale, is_causal, sinks):
    """From the definition, in fp64: weight_j = exp(s_j) / (exp(sink_h) + sum over visible keys of exp(s_i)), with
    s = q k · scale + bias; a row that sees no key puts all its weight on the sink and gives zeros."""
    batch, heads, sq, _ = q.shape
    sk = k.shape[2]
    kv_of_head = torch.tensor([h * k.shape[1] // heads for h in range(heads)])
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()[:, kv_of_head]) * scale
    if mask is None:
        allowed = causal_allowed(sq, sk) if is_causal else torch.ones(sq, sk, dtype=torch.bool)
    elif mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = mask > torch.finfo(mask.dtype).min / 2
        scores = scores + torch.where(allowed, mask.double(), 0.0)
    allowed = allowed.expand(batch, heads, sq, sk)
    sink = sinks.double()[None, :, None, None]
    top = torch.maximum(torch.where(allowed, scores, float("-inf")).amax(-1, keepdim=True), sink)
    numerators = torch.where(allowed, torch.exp(scores - top), 0.0)
    weights = numerators / (torch.exp(sink - top) + numerators.sum(-1, keepdim=True))
    return torch.einsum("bhqk,bhkd->bhqd", weights, v.double()[:, kv_of_head])


def run_with_sinks(fn, case: Case, sinks: torch.Tensor):
    """Output and the gradients of q, k, v and the sinks (zeros where none flows)."""
    leaves = [t.clone().requires_grad_(True) for t in (case.q, case.k, case.v, sinks)]
    out, _ = fn(*leaves[:3], case.mask, scale=case.scale, is_causal=case.is_causal, layout=case.layout, sinks=leaves[3])
    assert out.shape == case.q.shape and torch.isfinite(out).all()
    if out.requires_grad:
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]


def _sinks(case: Case, scale: float = 2.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(case.q.shape[1] * 31 + case.k.shape[2])
    return scale * torch.randn(case.q.shape[1], generator=generator)


@SINK_SETTINGS
@given(case=attention_cases())
def test_sinks_in_every_cpu_backend_match_the_reference_and_naive(case: Case):
    sinks = _sinks(case)
    expected = reference_attention_with_sinks(case.q, case.k, case.v, case.mask, scale=case.scale,
                                              is_causal=case.is_causal, sinks=sinks)
    naive_out, naive_grads = run_with_sinks(naive_attention, case, sinks)
    torch.testing.assert_close(naive_out.double(), expected, atol=FP32_ATOL, rtol=0)
    for name in CPU_BACKENDS:
        out, grads = run_with_sinks(get_attention_backend(name), case, sinks)
        torch.testing.assert_close(out.double(), expected, atol=FP32_ATOL, rtol=0, msg=lambda m: f"{name}: {m}")
        for grad, naive_grad in zip(grads, naive_grads):
            torch.testing.assert_close(grad, naive_grad, atol=GRAD_ATOL, rtol=0, msg=lambda m: f"{name} grad: {m}")


@SINK_SETTINGS
@given(case=attention_cases(kinds=tuple(sorted(FLASH_KINDS | {"sliding"}))))
def test_sinks_on_the_cpu_flash_kernel_match_naive(case: Case):
    """flash_attention_2 on CPU (PyTorch's flash kernel, the sink as a first key) over the masks it can express;
    with the flash-attn package (faked), which has no sinks, it refuses."""
    sinks = _sinks(case)
    with pytest.MonkeyPatch.context() as patch:
        flash_on_cpu(patch, package=None)
        try:
            out, grads = run_with_sinks(flash_attention, case, sinks)
        except ValueError as error:
            assert case.kind == "sliding" and "sdpa" in str(error) and "eager" in str(error), (case, error)
            return
        flash_on_cpu(patch, package=FakeFlashAttn())
        with pytest.raises(ValueError, match="flash-attn package has no sinks.*'sdpa' or 'eager'"):
            flash_attention(case.q, case.k, case.v, case.mask, scale=case.scale, is_causal=case.is_causal,
                            layout=case.layout, dropout_p=0.1, sinks=sinks)
    naive_out, naive_grads = run_with_sinks(naive_attention, flash_semantics(case), sinks)
    torch.testing.assert_close(out, naive_out, atol=FP32_ATOL, rtol=0)
    for grad, naive_grad in zip(grads, naive_grads):
        torch.testing.assert_close(grad, naive_grad, atol=GRAD_ATOL, rtol=0)


def test_sinks_negative_control_and_rows_that_see_no_key():
    """Without the sinks the reference is far off; a row that sees no key gives zeros in every backend (the sink
    takes all its weight), and sinks of -inf are no sinks at all."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    sinks = torch.tensor([2.0, -1.0, 0.5, 3.0])
    mask = causal_allowed(5, 5)[None, None].expand(2, 1, 5, 5).clone()
    mask[1, :, 2] = False
    expected = reference_attention_with_sinks(q, k, v, mask, scale=8**-0.5, is_causal=True, sinks=sinks)
    without, _ = naive_attention(q, k, v, mask, scale=8**-0.5, is_causal=True)
    assert (without.double() - expected).abs().max() > 100 * FP32_ATOL
    for name in CPU_BACKENDS:
        out, _ = get_attention_backend(name)(q, k, v, mask, scale=8**-0.5, is_causal=True, sinks=sinks)
        assert torch.all(out[1, :, 2] == 0), name
        no_sinks, _ = get_attention_backend(name)(q, k, v, mask, scale=8**-0.5, sinks=torch.full((4,), float("-inf")))
        torch.testing.assert_close(no_sinks, without, atol=FP32_ATOL, rtol=0)


def test_sinks_reach_the_backends_as_transformers_s_aux_and_bad_sinks_are_clear_errors():
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(1, 4, 3, 8, generator=gen), torch.randn(1, 2, 3, 8, generator=gen), torch.randn(1, 2, 3, 8, generator=gen)
    sinks = torch.randn(4, generator=gen)
    module = SimpleNamespace(scaling=0.3, is_causal=True)
    for name, interface in attention.HF_TINY_INTERFACES.items():
        if name == "hf_tiny_flash":
            continue  # tests/models/test_flash_triton.py
        out, _ = interface(module, q, k, v, None, s_aux=sinks)
        expected, _ = naive_attention(q, k, v, scale=0.3, is_causal=True, sinks=sinks)
        torch.testing.assert_close(out, expected.transpose(1, 2), atol=FP32_ATOL, rtol=0, msg=lambda m: f"{name}: {m}")
    for bad in (torch.zeros(2), torch.zeros(1, 4)):
        with pytest.raises(ValueError, match=r"one logit per query head, shape \(4,\)"):
            get_attention_backend("sdpa")(q, k, v, scale=0.3, sinks=bad)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_flash_on_chunks_where_every_key_is_padding_gives_zeros(with_sinks):
    """A chunked layout with no real key has no sequence at all: flash computes nothing and every query is zero, as
    naive attention gives a query that sees no key (hypothesis found the empty case on torch 2.10: max() of no lengths)."""
    from hf_tiny.masks import ChunkLayout

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4)
    positions = torch.tensor([0, 1])
    layout = MaskLayout(query_length=2, key_length=2, causal=True, key_valid=torch.tensor([[False, False]]),
                        chunks=ChunkLayout(size=1, first=torch.tensor([2]), query_positions=positions, key_positions=positions))
    mask = torch.zeros(1, 1, 2, 2, dtype=torch.bool)
    sinks = torch.randn(1) if with_sinks else None
    out, _ = flash_attention(q, k, v, mask, scale=0.5, is_causal=True, layout=layout, sinks=sinks)
    expected, _ = naive_attention(q, k, v, mask, scale=0.5, sinks=sinks)
    assert out.shape == q.shape and torch.equal(out, torch.zeros_like(q))
    torch.testing.assert_close(out, expected)
