"""Masks: the one bool representation [B, 1, Sq, Sk] (True = attend) or (None, is_causal), checked against a
brute-force reference written as loops and against transformers' own mask functions."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.masking_utils import (
    causal_mask_function,
    eager_mask,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

from hf_tiny.masks import AttentionMask, cross_attention_mask, self_attention_mask, with_position_bias

CPU = torch.device("cpu")
HYPO = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def brute_force_mask(
    key_padding: Optional[list[list[int]]], batch: int, sq: int, sk: int, causal: bool, window: Optional[int]
) -> torch.Tensor:
    """The rules of masks.py's masks as loops: padding keys are never seen; causal query i sits at position i + sk - sq and
    sees keys at or before it, the last `window` of them with a sliding window; a query is never masked for being
    padding (a right-padded one sees the real tokens before it, as in official transformers)."""
    offset = sk - sq
    out = torch.zeros(batch, 1, sq, sk, dtype=torch.bool)
    for b in range(batch):
        for i in range(sq):
            for j in range(sk):
                key_real = key_padding is None or key_padding[b][j] == 1
                allowed = key_real
                if causal:
                    allowed = allowed and j <= i + offset and (window is None or (i + offset) - j < window)
                out[b, 0, i, j] = allowed
    return out


def as_tensor_mask(built: AttentionMask, batch: int, sq: int, sk: int) -> torch.Tensor:
    """What the backends read from (mask, is_causal): None + is_causal is the bottom-right causal rule."""
    if built.mask is not None:
        return built.mask.expand(batch, 1, sq, sk)
    rows = torch.arange(sq)[:, None] + (sk - sq)
    allowed = torch.arange(sk)[None, :] <= rows if built.is_causal else torch.ones(sq, sk, dtype=torch.bool)
    return allowed.expand(batch, 1, sq, sk)


@st.composite
def mask_inputs(draw):
    batch = draw(st.integers(1, 3))
    sk = draw(st.integers(1, 9))
    sq = draw(st.sampled_from([1, sk, draw(st.integers(1, sk))]))  # decode, prefill, chunk
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.integers(1, sk + 2))) if causal else None
    layout = draw(st.sampled_from(["none", "ones", "left", "right", "anywhere"]))
    if layout == "none":
        padding = None
    elif layout == "anywhere":  # holes anywhere, e.g. right-padded prompts followed by generated tokens
        padding = [draw(st.lists(st.integers(0, 1), min_size=sk, max_size=sk)) for _ in range(batch)]
    else:
        lengths = draw(st.lists(st.integers(0, sk), min_size=batch, max_size=batch))
        if layout == "ones":
            lengths = [sk] * batch
        padding = [([0] * (sk - n) + [1] * n) if layout == "left" else ([1] * n + [0] * (sk - n)) for n in lengths]
    dtype = draw(st.sampled_from([torch.long, torch.bool, torch.float32]))
    return batch, sq, sk, causal, window, padding, dtype


@HYPO
@given(inputs=mask_inputs())
def test_self_attention_mask_equals_brute_force(inputs):
    batch, sq, sk, causal, window, padding, dtype = inputs
    attention_mask = None if padding is None else torch.tensor(padding).to(dtype)
    built = self_attention_mask(
        attention_mask, batch_size=batch, query_length=sq, key_length=sk, causal=causal, sliding_window=window,
        device=CPU,
    )
    expected = brute_force_mask(padding, batch, sq, sk, causal, window)
    assert torch.equal(as_tensor_mask(built, batch, sq, sk), expected), built
    if built.mask is not None:
        assert built.mask.dtype == torch.bool and built.mask.shape == (batch, 1, sq, sk)
        assert built.is_causal == causal
    # The fast path is taken exactly when nothing is padded and the rule is plain causality (or none).
    no_padding = padding is None or all(all(row) for row in padding)
    window_cuts = causal and window is not None and sk > window
    plain = not causal or sq in (1, sk)
    assert (built.mask is None) == (no_padding and not window_cuts and plain), built


@pytest.mark.parametrize(
    "attention_mask, sq, sk, causal, expected",
    [
        (None, 5, 5, True, (None, True)),
        (torch.ones(2, 5, dtype=torch.long), 5, 5, True, (None, True)),
        (torch.ones(2, 5, dtype=torch.bool), 5, 5, False, (None, False)),
        (None, 5, 5, False, (None, False)),
        (torch.ones(2, 9), 1, 9, True, (None, False)),  # decode: the new token sees every key
        (None, 1, 1, True, (None, False)),
    ],
)
def test_fast_path_returns_none_and_the_causal_flag(attention_mask, sq, sk, causal, expected):
    built = self_attention_mask(attention_mask, batch_size=2, query_length=sq, key_length=sk, causal=causal, device=CPU)
    assert isinstance(built, AttentionMask) and (built.mask, built.is_causal) == expected


def test_chunked_prefill_without_padding_builds_the_bottom_right_causal_mask():
    # SDPA's own is_causal is top-left aligned, so 3 new queries over 7 keys need an explicit mask.
    built = self_attention_mask(None, batch_size=2, query_length=3, key_length=7, causal=True, device=CPU)
    assert built.is_causal and torch.equal(built.mask, brute_force_mask(None, 2, 3, 7, True, None))
    assert built.mask[0, 0].tolist() == [[True] * 5 + [False] * 2, [True] * 6 + [False], [True] * 7]


def test_sliding_window_wider_than_the_keys_is_plain_causal():
    built = self_attention_mask(None, batch_size=1, query_length=4, key_length=4, causal=True, sliding_window=4, device=CPU)
    assert built == (None, True, None, None)
    built = self_attention_mask(None, batch_size=1, query_length=4, key_length=4, causal=True, sliding_window=2, device=CPU)
    assert built.mask[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


@settings(max_examples=60, deadline=None)
@given(inputs=mask_inputs())
def test_masks_match_transformers_masks(inputs):
    """transformers' sdpa_mask (causal / sliding-window causal with padding, same offsets) equals ours, padding
    query rows included."""
    batch, sq, sk, causal, window, padding, _ = inputs
    if not causal:
        return
    attention_mask = None if padding is None else torch.tensor(padding, dtype=torch.bool)
    function = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    theirs = sdpa_mask(
        batch_size=batch, q_length=sq, kv_length=sk, q_offset=sk - sq, mask_function=function,
        attention_mask=attention_mask, allow_is_causal_skip=False,
    )
    ours = as_tensor_mask(
        self_attention_mask(
            attention_mask, batch_size=batch, query_length=sq, key_length=sk, causal=True, sliding_window=window,
            device=CPU,
        ),
        batch, sq, sk,
    )
    assert torch.equal(ours[:, 0], theirs.expand(batch, 1, sq, sk)[:, 0])


# ----------------------------------------------------------------------------------------------------------------
# Ready 4-D masks and bad shapes
# ----------------------------------------------------------------------------------------------------------------


def _transformers_padding_case():
    padding = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    expected = sdpa_mask(batch_size=2, q_length=5, kv_length=5, attention_mask=padding, allow_is_causal_skip=False)
    return padding, expected


def test_ready_4d_bool_mask_is_used_as_given():
    _, expected = _transformers_padding_case()
    built = self_attention_mask(expected, batch_size=2, query_length=5, key_length=5, causal=True, device=CPU)
    assert built.mask is expected and built.is_causal
    shared = expected[:1]  # one mask for the whole batch
    assert self_attention_mask(shared, batch_size=2, query_length=5, key_length=5, causal=True, device=CPU).mask is shared


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_ready_4d_float_mask_like_transformers_eager_is_accepted(dtype):
    padding, expected = _transformers_padding_case()
    additive = eager_mask(batch_size=2, q_length=5, kv_length=5, attention_mask=padding, dtype=dtype)
    assert additive.dtype == dtype and additive.min() == torch.finfo(dtype).min
    built = self_attention_mask(additive, batch_size=2, query_length=5, key_length=5, causal=True, device=CPU)
    assert built.mask.dtype == torch.bool and torch.equal(built.mask, expected)


@pytest.mark.parametrize("masked_value", [-10000.0, float("-inf"), -1e9])
def test_ready_4d_float_mask_legacy_values_are_masked(masked_value):
    """BERT's old extended masks used -10000.0; -inf and -1e9 are common too. All mean "masked"."""
    _, expected = _transformers_padding_case()
    additive = torch.where(expected, 0.0, masked_value)
    built = self_attention_mask(additive, batch_size=2, query_length=5, key_length=5, causal=True, device=CPU)
    assert torch.equal(built.mask, expected)


@pytest.mark.parametrize("value", [-1.5, 0.25, -100.0])
def test_ready_4d_float_mask_with_bias_values_is_refused(value):
    """A float mask holding biases cannot become a bool mask; silently dropping them would be wrong."""
    additive = torch.zeros(1, 1, 3, 3)
    additive[0, 0, 1, 2] = value
    with pytest.raises(ValueError, match=rf"0 \(attend\).*{value!r}.*with_position_bias"):
        self_attention_mask(additive, batch_size=1, query_length=3, key_length=3, causal=False, device=CPU)


def test_ready_4d_integer_mask_is_read_as_one_attend():
    _, expected = _transformers_padding_case()
    built = self_attention_mask(expected.long(), batch_size=2, query_length=5, key_length=5, causal=True, device=CPU)
    assert torch.equal(built.mask, expected)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(attention_mask=torch.ones(2, 6)), r"shape \(2, 6\).*batch_size=2 and key_length=5.*\[2, 5\]"),
        (dict(attention_mask=torch.ones(3, 5)), r"shape \(3, 5\).*batch_size=2.*\[2, 5\]"),
        (dict(attention_mask=torch.ones(2, 1, 5)), r"2-D.*4-D.*\(2, 1, 5\)"),
        (dict(attention_mask=torch.ones(2, 1, 4, 5, dtype=torch.bool)), r"\(2, 1, 4, 5\).*5 queries and 5 keys"),
        (dict(attention_mask=torch.ones(3, 1, 5, 5, dtype=torch.bool)), r"\(3, 1, 5, 5\).*batch_size=2"),
        (dict(query_length=6), r"query_length=6, key_length=5"),
        (dict(query_length=0), r"query_length=0"),
        (dict(sliding_window=0), r"sliding_window=0"),
        (dict(sliding_window=3, causal=False), r"sliding_window=3.*causal self-attention only"),
    ],
)
def test_bad_self_attention_inputs_raise_clear_errors(kwargs, message):
    arguments = dict(attention_mask=None, batch_size=2, query_length=5, key_length=5, causal=True, device=CPU)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        self_attention_mask(arguments.pop("attention_mask"), **arguments)


# ----------------------------------------------------------------------------------------------------------------
# Cross-attention
# ----------------------------------------------------------------------------------------------------------------


def test_cross_attention_mask():
    assert cross_attention_mask(None, query_length=4) == (None, False, None, None)
    assert cross_attention_mask(torch.ones(2, 6), query_length=4) == (None, False, None, None)
    encoder_padding = [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]]
    built = cross_attention_mask(torch.tensor(encoder_padding), query_length=4)
    assert not built.is_causal and built.mask.dtype == torch.bool and built.mask.shape == (2, 1, 4, 6)
    # Never causal: every decoder query sees every real encoder token.
    expected = brute_force_mask(encoder_padding, 2, 4, 6, causal=False, window=None)
    assert torch.equal(built.mask, expected)
    ready = torch.where(expected, 0.0, torch.finfo(torch.float32).min)
    assert torch.equal(cross_attention_mask(ready, query_length=4).mask, expected)


def test_bad_cross_attention_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match=r"encoder_attention_mask.*2-D.*\(2, 1, 6\)"):
        cross_attention_mask(torch.ones(2, 1, 6), query_length=4)
    with pytest.raises(ValueError, match=r"\(2, 1, 3, 6\).*4 queries and 6 keys"):
        cross_attention_mask(torch.ones(2, 1, 3, 6, dtype=torch.bool), query_length=4)


# ----------------------------------------------------------------------------------------------------------------
# Position bias (T5)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_with_position_bias_folds_bias_and_mask(dtype):
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(1, 3, 4, 4, generator=gen)
    lowest = torch.finfo(dtype).min
    # Encoder without padding: the bias alone.
    folded = with_position_bias(AttentionMask(None, False), bias, dtype)
    assert folded.mask.dtype == dtype and torch.equal(folded.mask, bias.to(dtype)) and not folded.is_causal
    # Causal fast path (None, True): causality must be folded in, since a float mask disables is_causal.
    folded = with_position_bias(AttentionMask(None, True), bias, dtype)
    causal = brute_force_mask(None, 1, 4, 4, True, None)
    assert folded.is_causal
    assert torch.equal(folded.mask, torch.where(causal, bias.to(dtype), lowest))
    # Padding (and causality) from a built mask.
    padding = [[0, 1, 1, 1], [1, 1, 1, 1]]
    built = self_attention_mask(torch.tensor(padding), batch_size=2, query_length=4, key_length=4, causal=True, device=CPU)
    folded = with_position_bias(built, bias, dtype)
    expected_allowed = brute_force_mask(padding, 2, 4, 4, True, None)
    assert folded.mask.shape == (2, 3, 4, 4)
    assert torch.equal(folded.mask, torch.where(expected_allowed, bias.to(dtype), lowest))


def test_with_position_bias_decode_step_and_gradient():
    bias = torch.randn(1, 2, 1, 5, requires_grad=True)
    folded = with_position_bias(AttentionMask(None, False), bias, torch.float32)  # a decode step: (None, False)
    assert torch.equal(folded.mask, bias)
    built = self_attention_mask(torch.tensor([[0, 0, 1, 1, 1]]), batch_size=1, query_length=1, key_length=5, causal=True, device=CPU)
    folded = with_position_bias(built, bias, torch.float32)
    folded.mask.sum().backward()
    # The learned bias gets gradient only where attention is allowed.
    assert torch.equal(bias.grad, torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0]).expand(1, 2, 1, 5))


def test_with_position_bias_rejects_bad_shapes():
    built = self_attention_mask(torch.tensor([[0, 1, 1]]), batch_size=1, query_length=3, key_length=3, causal=False, device=CPU)
    with pytest.raises(ValueError, match=r"position bias of shape \(1, 2, 3, 4\).*mask of shape \(1, 1, 3, 3\)"):
        with_position_bias(built, torch.zeros(1, 2, 3, 4), torch.float32)
    with pytest.raises(ValueError, match=r"position bias of shape \(2, 3, 3\)"):
        with_position_bias(AttentionMask(None, False), torch.zeros(2, 3, 3), torch.float32)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_rows_that_see_no_key_are_derived_once_per_forward_not_by_every_layer(implementation, monkeypatch):
    """Left padding: the pad positions' queries see no key. The kernels that apply the mask zero those rows; the rows
    are derived once per layer type (masks.with_hidden_rows), not by each of the 4 layers, and the logits are those
    of layers that derive them each (negative control: with_hidden_rows left out, 3 more derivations)."""
    from runtime_checks import ops_of

    import hf_tiny
    from hf_tiny import step

    torch.manual_seed(0)
    config = hf_tiny.TinyCausalConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                      attn_implementation=implementation)
    model = hf_tiny.TinyCausalForCausalLM(config).eval().set_runtime(False)
    ids = torch.randint(3, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0

    def run():
        with torch.no_grad():
            return ops_of(lambda: model(input_ids=ids, attention_mask=mask)).count("any"), model(
                input_ids=ids, attention_mask=mask).logits

    once, derived_once = run()
    monkeypatch.setattr(step, "with_hidden_rows", lambda built: built)  # every layer derives the rows itself
    per_layer, derived_per_layer = run()
    assert per_layer - once == 3
    assert torch.equal(derived_once[mask.bool()], derived_per_layer[mask.bool()])
