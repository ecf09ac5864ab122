"""Declared mask layouts (masks.MaskLayout): each mask builder states what its tensor holds, and flash kernels run
the layout, never reading the tensor. Checked here: the layout describes the tensor exactly (a rule written as loops,
for every builder); flash refuses masks without a layout; cases the layouts fixed (a static cache's empty slots,
packed rows with a sliding window) against the backends that read the tensor."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, StaticCache

from hf_tiny import TinyCausalConfig, TinyCausalForCausalLM
from hf_tiny.flash import flash_attention
from hf_tiny.masks import (
    AttentionMask, MaskLayout, cross_attention_mask, encoder_masks, packed_causal_mask, self_attention_mask,
    static_cache_mask, within_chunks,
)

CPU = torch.device("cpu")
HYPO = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def pattern_of(layout: MaskLayout, batch: int) -> torch.Tensor:
    """[B, 1, Sq, Sk] the pattern a layout declares, written as loops from its fields' definitions."""
    sq, sk = layout.query_length, layout.key_length
    offset = sk - sq if layout.query_offset is None else int(layout.query_offset)
    out = torch.zeros(batch, 1, sq, sk, dtype=torch.bool)
    for b in range(batch):
        for i in range(sq):
            for j in range(sk):
                seen = layout.key_valid is None or bool(layout.key_valid[b, j])
                if layout.causal:
                    own = offset + i
                    seen = seen and j <= own and (layout.window is None or own - j < layout.window)
                elif layout.window is not None:
                    seen = seen and abs(i - j) <= layout.window
                if layout.chunks is not None:
                    size, first, queries, keys = layout.chunks
                    start = int(first[b if first.shape[0] > 1 else 0])
                    seen = seen and (int(queries[i]) - start) // size == (int(keys[j]) - start) // size
                if layout.segment_ids is not None:
                    seen = seen and bool(layout.segment_ids[b, i] == layout.segment_ids[b, j])
                out[b, 0, i, j] = seen
    return out


def assert_layout_describes_mask(built: AttentionMask, batch: int) -> None:
    assert built.mask is not None and built.layout is not None, built
    assert built.mask.dtype == torch.bool and built.layout.causal == built.is_causal
    expected = pattern_of(built.layout, batch)
    assert torch.equal(built.mask.expand_as(expected), expected), (built.layout, built.mask)


def padding_rows(draw, batch: int, length: int, style: str) -> torch.Tensor:
    if style == "anywhere":
        return torch.tensor([draw(st.lists(st.integers(0, 1), min_size=length, max_size=length)) for _ in range(batch)])
    lengths = draw(st.lists(st.integers(0, length), min_size=batch, max_size=batch))
    rows = [([0] * (length - n) + [1] * n) if style == "left" else ([1] * n + [0] * (length - n)) for n in lengths]
    return torch.tensor(rows)


@HYPO
@given(data=st.data())
def test_self_attention_layouts_describe_their_masks(data):
    batch, sk = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 9))
    sq = data.draw(st.sampled_from([1, sk, data.draw(st.integers(1, sk))]))
    causal = data.draw(st.booleans())
    window = data.draw(st.one_of(st.none(), st.integers(1, sk + 1))) if causal else None
    padding = padding_rows(data.draw, batch, sk, data.draw(st.sampled_from(["left", "right", "anywhere"])))
    built = self_attention_mask(padding, batch_size=batch, query_length=sq, key_length=sk, causal=causal,
                                sliding_window=window, device=CPU)
    if built.mask is None:  # the fast path: plain causality or nothing, no layout to declare
        assert built.layout is None and bool(padding.all())
        return
    assert_layout_describes_mask(built, batch)


@HYPO
@given(data=st.data())
def test_cross_encoder_packed_and_chunked_layouts_describe_their_masks(data):
    batch, length = data.draw(st.integers(1, 3)), data.draw(st.integers(2, 9))
    style = data.draw(st.sampled_from(["left", "right", "anywhere"]))
    padding = padding_rows(data.draw, batch, length, style)
    cross = cross_attention_mask(padding, query_length=data.draw(st.integers(1, 5)))
    if cross.mask is not None:
        assert_layout_describes_mask(cross, batch)
    config = type("Config", (), {"sliding_window": data.draw(st.integers(1, length)),
                                 "attention_types": lambda self: ["full_attention", "sliding_attention"]})()
    for built in encoder_masks(config, padding, batch_size=batch, length=length, device=CPU).values():
        if built.mask is not None:
            assert_layout_describes_mask(built, batch)
    lengths = data.draw(st.lists(st.integers(1, 4), min_size=2, max_size=4))
    segment_ids = torch.tensor([[s for s, n in enumerate(lengths) for _ in range(n)]])
    window, chunk = data.draw(st.one_of(st.none(), st.integers(1, 4))), data.draw(st.one_of(st.none(), st.integers(1, 3)))
    assert_layout_describes_mask(packed_causal_mask(segment_ids, sliding_window=window, chunk_size=chunk), 1)
    sq = data.draw(st.sampled_from([1, length, data.draw(st.integers(1, length))]))
    left = padding_rows(data.draw, batch, length, "left") if data.draw(st.booleans()) else None
    causal = self_attention_mask(left, batch_size=batch, query_length=sq, key_length=length, causal=True, device=CPU)
    chunked = within_chunks(causal, left, torch.arange(length - sq, length), torch.arange(length), data.draw(st.integers(1, 4)))
    if chunked.mask is not None:
        assert_layout_describes_mask(chunked, batch)


@HYPO
@given(data=st.data())
def test_static_cache_layouts_describe_their_masks(data):
    """Key slot j holds position key_offset + j; slots after the newest token are empty."""
    batch, slots = data.draw(st.integers(1, 3)), data.draw(st.integers(2, 10))
    past = data.draw(st.integers(0, slots - 1))
    sq = data.draw(st.integers(1, slots - past))
    window = data.draw(st.one_of(st.none(), st.integers(1, slots)))
    padding = padding_rows(data.draw, batch, past + sq, "left") if data.draw(st.booleans()) else None
    built = static_cache_mask(padding, past, 0, slots, batch, sq, window, CPU)
    assert_layout_describes_mask(built, batch)


def test_the_loop_rule_notices_a_wrong_layout():
    """Negative control: a layout that misstates the window, the padding or the offset is caught."""
    padding = torch.tensor([[0, 1, 1, 1, 1]])
    built = self_attention_mask(padding, batch_size=1, query_length=5, key_length=5, causal=True, sliding_window=2,
                                device=CPU)
    assert_layout_describes_mask(built, 1)
    for wrong in ({"window": 3}, {"key_valid": torch.ones(1, 5, dtype=torch.bool)}, {"query_offset": 1}):
        fields = {**vars(built.layout), **wrong}
        with pytest.raises(AssertionError):
            assert_layout_describes_mask(built._replace(layout=MaskLayout(**fields)), 1)


def test_flash_refuses_masks_without_a_layout_naming_the_alternatives():
    q = torch.randn(1, 2, 4, 8)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="flash_attention_2.*layout.*4-D attention_mask.*2-D padding mask.*'sdpa' or 'eager'"):
        flash_attention(q, q, q, mask, scale=0.3, is_causal=True)
    with pytest.raises(ValueError, match="additive"):
        flash_attention(q, q, q, torch.zeros(1, 1, 4, 4), scale=0.3)
    built = self_attention_mask(torch.tensor([[0, 1, 1, 1]]), batch_size=1, query_length=4, key_length=4, causal=True,
                                device=CPU)
    with pytest.raises(ValueError, match="describes 4 queries over 4 keys in 1 rows; got q .1, 2, 3, 8."):
        flash_attention(q[:, :, :3], q, q, built.mask[:, :, :3], layout=built.layout, scale=0.3)


# ---- whole models: what the layouts made right ---------------------------------------------------------------------


def causal_model(**overrides) -> TinyCausalForCausalLM:
    torch.manual_seed(0)
    fields = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, max_position_embeddings=64, pad_token_id=0, initializer_range=0.1)
    return TinyCausalForCausalLM(TinyCausalConfig(**{**fields, **overrides})).eval()


def logits_with_cache(model, ids, mask, cache) -> torch.Tensor:
    """A prefill of all but the last token, then one decoding step."""
    with torch.no_grad():
        first = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], cache=cache).logits
        step = model(input_ids=ids[:, -1:], attention_mask=mask, cache=cache).logits
    return torch.cat([first, step], dim=1)


def test_flash_runs_a_static_cache_as_sdpa_does():
    """A static cache holds empty slots after the newest token: flash computes over the filled ones (the layout's
    query offset), prefill and decoding step, on a left-padded batch, as sdpa does with a dynamic cache."""
    model = causal_model()
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    model.set_attn_implementation("sdpa")
    expected = logits_with_cache(model, ids, mask, DynamicCache(config=model.config))
    model.set_attn_implementation("flash_attention_2")
    got = logits_with_cache(model, ids, mask, StaticCache(config=model.config, max_cache_len=16))
    real = mask.bool()
    assert float((got[real] - expected[real]).abs().max()) <= 1e-4


PACKED = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3, 4]])


def test_flash_refuses_a_sliding_window_over_packed_rows_on_pytorchs_kernel():
    """Packed sequences longer than the window: PyTorch's flash kernel takes no window, so flash_attention_2 on CPU
    refuses them (it used to attend past the window), naming the backends that apply it."""
    model = causal_model(sliding_window=3)
    ids = torch.randint(1, 64, PACKED.shape, generator=torch.Generator().manual_seed(5))
    model.set_attn_implementation("flash_attention_2")
    with pytest.raises(ValueError, match="sliding window of 3 needs attn_implementation='sdpa' or 'eager', or 'hf_tiny_flash'"):
        model(input_ids=ids, position_ids=PACKED)
    short = causal_model(sliding_window=8)  # no sequence longer than the window: nothing to cut
    short.set_attn_implementation("flash_attention_2")
    with torch.no_grad():
        got = short(input_ids=ids, position_ids=PACKED).logits
        short.set_attn_implementation("sdpa")
        expected = short(input_ids=ids, position_ids=PACKED).logits
    assert float((got - expected).abs().max()) <= 1e-4


def test_our_triton_kernel_applies_a_sliding_window_over_packed_rows():
    """hf_tiny_flash (compiled on a GPU, under Triton's interpreter without one) runs the window inside each packed
    sequence."""
    pytest.importorskip("triton")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = causal_model(sliding_window=3).to(device)
    ids = torch.randint(1, 64, PACKED.shape, generator=torch.Generator().manual_seed(5)).to(device)
    positions = PACKED.to(device)
    logits = {}
    with torch.no_grad():
        for backend in ("eager", "hf_tiny_flash"):
            model.set_attn_implementation(backend)
            logits[backend] = model(input_ids=ids, position_ids=positions).logits
        unwindowed = causal_model(sliding_window=16).to(device)
        unwindowed.set_attn_implementation("eager")
        without_window = unwindowed(input_ids=ids, position_ids=positions).logits
    assert float((logits["hf_tiny_flash"] - logits["eager"]).abs().max()) <= 1e-4
    assert float((without_window - logits["eager"]).abs().max()) > 1e-2  # negative control: the window matters
