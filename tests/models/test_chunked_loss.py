"""The chunked LM loss (hf_tiny/chunked_loss.py): exact to the unchunked loss and gradients (F.cross_entropy on
the full logits; official transformers' loss), used by default while training with labels, logits returned
whenever asked for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from transformers import AutoModelForCausalLM

from causal_helpers import tiny_official
from conversion import llama
from hf_tiny.chunked_loss import chunk_tokens_for, linear_cross_entropy

FP32_RELATIVE = 1e-6


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def unchunked(hidden, weight, targets, *, bias=None, ignore_index=-100, num_items_in_batch=None, softcap=None):
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:  # in the head's dtype, as Gemma's LM head does before its loss upcasts
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.float()
    if num_items_in_batch is None:
        return F.cross_entropy(logits, targets, ignore_index=ignore_index)
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum") / num_items_in_batch


@pytest.mark.parametrize("tokens,chunk", [(37, 8), (37, 37), (37, 100), (1, 4), (64, 1)])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("num_items", [None, 29])
@pytest.mark.parametrize("with_bias", [False, True])
def test_function_equals_cross_entropy_on_full_logits(tokens, chunk, softcap, num_items, with_bias):
    generator = torch.Generator().manual_seed(tokens + chunk)
    hidden = torch.randn(tokens, 16, generator=generator, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, requires_grad=True)
    bias = torch.randn(50, generator=generator, requires_grad=True) if with_bias else None
    targets = torch.randint(0, 50, (tokens,), generator=generator)
    targets[1::5] = -100
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    expected = unchunked(hidden, weight, targets, bias=bias, num_items_in_batch=num_items, softcap=softcap)
    expected_grads = torch.autograd.grad(expected * 2.5, inputs)  # a scaled loss (accumulation): scales the grads
    produced = linear_cross_entropy(
        hidden, weight, targets, bias=bias, num_items_in_batch=num_items, softcap=softcap, chunk_tokens=chunk
    )
    produced_grads = torch.autograd.grad(produced * 2.5, inputs)
    assert relative(produced, expected) <= FP32_RELATIVE
    for mine, theirs in zip(produced_grads, expected_grads):
        assert relative(mine, theirs) <= FP32_RELATIVE


def test_function_against_float64_reference_and_a_wrong_target_negative_control():
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, 24, generator=generator, dtype=torch.float64)
    weight = torch.randn(70, 24, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 70, (40,), generator=generator)
    reference = F.cross_entropy(hidden @ weight.T, targets)  # fp64 logits all the way
    produced = linear_cross_entropy(hidden.float(), weight.float(), targets, chunk_tokens=7)
    assert relative(produced, reference) <= FP32_RELATIVE
    shifted = linear_cross_entropy(hidden.float(), weight.float(), targets.roll(1), chunk_tokens=7)
    assert relative(shifted, reference) > 1e-2


def test_bfloat16_head_accumulates_in_float32_and_stays_within_bf16_rounding():
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(300, 32, generator=generator).bfloat16().requires_grad_()
    weight = (torch.randn(90, 32, generator=generator) * 0.2).bfloat16().requires_grad_()
    targets = torch.randint(0, 90, (300,), generator=generator)
    expected = unchunked(hidden, weight, targets)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    produced = linear_cross_entropy(hidden, weight, targets, chunk_tokens=16)
    produced_grads = torch.autograd.grad(produced, (hidden, weight))
    assert produced.dtype == torch.float32
    assert relative(produced, expected) <= 1e-6  # the loss itself is fp32 in both
    for mine, theirs in zip(produced_grads, expected_grads):
        assert mine.dtype == torch.bfloat16
        assert relative(mine, theirs) <= 2e-2  # a few bf16 ulps: the unchunked side rounds its sum once


def test_bfloat16_softcap_is_applied_in_the_head_dtype_as_gemma_s_unchunked_logits():
    """Gemma caps its logits in the model's dtype and its loss upcasts them after; capping in fp32 instead moved a
    bf16 loss by ~1e-4 (negative control below)."""
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(300, 32, generator=generator).bfloat16()
    weight = torch.randn(90, 32, generator=generator).bfloat16()
    targets = torch.randint(0, 90, (300,), generator=generator)
    expected = unchunked(hidden, weight, targets, softcap=3.0)
    produced = linear_cross_entropy(hidden, weight, targets, softcap=3.0, chunk_tokens=16)
    capped_in_fp32 = F.cross_entropy(torch.tanh(F.linear(hidden, weight).float() / 3.0) * 3.0, targets)
    assert relative(produced, expected) <= 1e-6
    assert relative(capped_in_fp32, expected) > 1e-5


@pytest.mark.parametrize("num_items_in_batch", [None, 0])
def test_all_targets_ignored_gives_nan_loss_and_zero_gradients_like_cross_entropy(num_items_in_batch):
    """A batch with nothing to learn (labels all -100; Trainer's num_items_in_batch 0 when a whole accumulation
    window has none) has a nan loss but zero gradients, as transformers' loss has: before, the gradients were nan
    (0/0 on the ignored rows), and one such step turned every weight nan."""
    targets = torch.full((4,), -100)
    results = []
    for loss_of in (
        lambda h, w: F.cross_entropy(h @ w.T, targets) if num_items_in_batch is None
        else F.cross_entropy(h @ w.T, targets, reduction="sum") / num_items_in_batch,
        lambda h, w: linear_cross_entropy(h, w, targets, num_items_in_batch=num_items_in_batch),
    ):
        torch.manual_seed(0)
        hidden, weight = torch.randn(4, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
        loss = loss_of(hidden, weight)
        loss.backward()
        results.append((loss, hidden.grad, weight.grad))
    (expected_loss, *expected_grads), (loss, *grads) = results
    assert torch.isnan(expected_loss) and torch.isnan(loss)
    for expected, got in zip(expected_grads, grads):
        assert torch.equal(expected, torch.zeros_like(expected))  # what the reference gives
        assert torch.equal(got, expected)


def test_chunk_size_bounds_the_logits_held_at_once():
    assert chunk_tokens_for(49152) == 170  # SmolLM2: 170 tokens x 49,152 x 4 bytes = 32 MiB per chunk
    assert chunk_tokens_for(1 << 30) == 1


def test_target_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="targets cover 3 tokens but hidden states 4"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(3, dtype=torch.long))


def ours_from(official, tmp_path):
    official.save_pretrained(tmp_path / "official")
    llama.convert(tmp_path / "official", tmp_path / "ours")
    return AutoModelForCausalLM.from_pretrained(tmp_path / "ours")


def loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_training_loss_and_grads_equal_official_without_logits(kind, tmp_path):
    """Training with labels: the chunked path (logits None) gives official's loss and every parameter's
    gradient; official runs its own ForCausalLMLoss on full logits."""
    overrides = {"final_logit_softcapping": 5.0, "query_pre_attn_scalar": 8} if kind == "gemma3_text" else {}
    official = tiny_official(kind, **overrides)
    ours = ours_from(official, tmp_path)
    official.train()
    ours.train()
    ids = torch.randint(3, 97, (3, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[2, 8:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    expected, expected_grads = loss_and_grads(official, input_ids=ids, attention_mask=mask, labels=labels)
    produced, produced_grads = loss_and_grads(ours, input_ids=ids, attention_mask=mask, labels=labels)
    assert produced.logits is None and expected.logits is not None
    assert relative(produced.loss, expected.loss) <= FP32_RELATIVE
    expected_grads = llama.key_map(ours.config).to_target(expected_grads, num_layers=ours.config.num_hidden_layers)
    assert set(produced_grads) <= set(expected_grads) and len(produced_grads) == len(list(ours.parameters()))
    worst = max(relative(produced_grads[name], expected_grads[name]) for name in produced_grads)
    assert worst <= 1e-5  # the whole model's backward in fp32, summed in another order in the head


def test_chunked_equals_unchunked_loss_with_every_loss_kwarg(tmp_path):
    official = tiny_official("llama")
    model = ours_from(official, tmp_path).train()
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[0, :3] = 7  # a custom ignore index
    shift = torch.roll(ids, -2, dims=1)
    for kwargs in (
        {"labels": labels},
        {"labels": labels, "ignore_index": 7},
        {"labels": labels, "num_items_in_batch": torch.tensor(13)},
        {"labels": labels, "shift_labels": shift},
    ):
        chunked, chunked_grads = loss_and_grads(model, input_ids=ids, **kwargs)
        plain, plain_grads = loss_and_grads(model, input_ids=ids, skip_logits=False, **kwargs)
        assert chunked.logits is None and plain.logits.shape == (2, 9, 97)
        assert relative(chunked.loss, plain.loss) <= FP32_RELATIVE, kwargs
        for name in plain_grads:
            assert relative(chunked_grads[name], plain_grads[name]) <= 1e-5, (kwargs, name)
    # negative control: the loss kwargs do change the loss, so the comparison above can fail
    base = model(input_ids=ids, labels=labels).loss
    assert abs(float(model(input_ids=ids, labels=labels, ignore_index=7).loss.detach()) - float(base.detach())) > 1e-3


def test_a_global_module_hook_sees_the_head(tmp_path):
    """A hook registered for every module (torch.nn.modules.module.register_module_forward_hook) must see lm_head
    run: the chunked loss, which reads the head's weight without calling it, steps aside for it."""
    model = ours_from(tiny_official("llama"), tmp_path).train()
    ids = torch.randint(3, 97, (1, 6))
    assert model(input_ids=ids, labels=ids).logits is None  # control: chunked without the hook
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: seen.append(module) if module is model.lm_head else None
    )
    try:
        out = model(input_ids=ids, labels=ids)
    finally:
        handle.remove()
    assert seen and out.logits.shape == (1, 6, 97)


def test_logits_are_returned_in_eval_and_when_asked(tmp_path):
    model = ours_from(tiny_official("llama"), tmp_path)
    ids = torch.randint(3, 97, (1, 6))
    model.eval()
    assert model(input_ids=ids, labels=ids).logits.shape == (1, 6, 97)
    model.train()
    assert model(input_ids=ids, labels=ids).logits is None
    assert model(input_ids=ids, labels=ids, skip_logits=False).logits.shape == (1, 6, 97)
    assert model(input_ids=ids).logits.shape == (1, 6, 97)  # no labels: the logits are the output
    with torch.no_grad():  # evaluation loss under no_grad in train mode: chunked, no gradient work
        assert model(input_ids=ids, labels=ids).loss.requires_grad is False
    model.eval()
    with pytest.raises(ValueError, match="skip_logits=True needs labels"):
        model(input_ids=ids, skip_logits=True)


def test_a_tuple_output_keeps_the_logits_in_their_place(tmp_path):
    """return_dict=False is read by position (`loss, logits = out[:2]`, as official's tuple gives them): the training
    forward then returns the logits, not the chunked loss's None, which the tuple would drop, shifting what follows."""
    official = tiny_official("llama")
    model = ours_from(official, tmp_path).train()
    official.train()
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(5))
    by_name = model(input_ids=ids, labels=ids, output_hidden_states=True)
    assert by_name.logits is None  # control: the same call read by name takes the chunked loss
    loss, logits, hidden_states = model(input_ids=ids, labels=ids, output_hidden_states=True, return_dict=False)
    expected_loss, expected_logits = official(input_ids=ids, labels=ids, return_dict=False)[:2]
    assert relative(loss, by_name.loss) <= FP32_RELATIVE and relative(loss, expected_loss) <= FP32_RELATIVE
    assert relative(logits, expected_logits) <= 1e-5
    assert len(hidden_states) == model.config.num_hidden_layers + 1
    assert relative(logits, model.eval()(input_ids=ids.flip(-1)).logits) > 1e-2  # negative control: other ids


def test_a_wrapped_head_falls_back_to_full_logits(tmp_path):
    """PEFT (or quantization) replaces lm_head by a module whose own forward must run: no chunking then."""
    model = ours_from(tiny_official("llama"), tmp_path).train()
    ids = torch.randint(3, 97, (1, 6))
    expected = model(input_ids=ids, labels=ids).loss
    inner = model.lm_head
    model.lm_head = torch.nn.Sequential(inner)
    produced = model(input_ids=ids, labels=ids)
    assert produced.logits is not None
    assert relative(produced.loss, expected) <= FP32_RELATIVE


def bart_in_training(tmp_path):
    """(official BART, ours converted from it, both in train mode, a padded batch without decoder ids, its labels)."""
    from transformers import AutoModelForSeq2SeqLM

    from conversion import bart
    from bart_models import make_official_bart, padded_batch

    src = make_official_bart(tmp_path / "official")
    bart.convert(src, tmp_path / "ours")
    official = AutoModelForSeq2SeqLM.from_pretrained(src).train()
    ours = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ours").train()
    batch = padded_batch(official.config)
    labels = batch.pop("decoder_input_ids").masked_fill(batch["decoder_attention_mask"] == 0, -100)
    return official, ours, batch, labels


def test_seq2seq_training_loss_and_grads_equal_official_bart(tmp_path):
    """BART: the decoder's labels are not shifted, and final_logits_bias joins the head's bias."""
    official, ours, batch, labels = bart_in_training(tmp_path)
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(11)}):
        produced, produced_grads = loss_and_grads(ours, **batch, labels=labels, **kwargs)
        plain, plain_grads = loss_and_grads(ours, **batch, labels=labels, skip_logits=False, **kwargs)
        assert produced.logits is None and plain.logits is not None
        if not kwargs:  # official BART takes no num_items_in_batch (it always averages)
            expected, _ = loss_and_grads(official, **batch, labels=labels)
            assert relative(produced.loss, expected.loss) <= FP32_RELATIVE
        assert relative(produced.loss, plain.loss) <= FP32_RELATIVE
        for name in plain_grads:
            if name.endswith("k_proj.bias"):  # its true gradient is 0 (softmax ignores a per-query constant): noise
                continue
            assert relative(produced_grads[name], plain_grads[name]) <= 1e-5, name


def test_a_seq2seq_tuple_output_keeps_the_logits_in_their_place(tmp_path):
    """BART trained with return_dict=False: (loss, logits, ...) as official's, not the chunked loss's None dropped."""
    official, ours, batch, labels = bart_in_training(tmp_path)
    assert ours(**batch, labels=labels).logits is None  # control: read by name, the chunked loss
    loss, logits = ours(**batch, labels=labels, return_dict=False)[:2]
    expected_loss, expected_logits = official(**batch, labels=labels, return_dict=False)[:2]
    assert relative(loss, expected_loss) <= FP32_RELATIVE
    assert logits.shape == expected_logits.shape and relative(logits, expected_logits) <= 1e-5
    assert relative(logits, ours(**batch, labels=labels.flip(-1), return_dict=False)[1]) > 1e-2  # negative control


def test_a_model_in_train_mode_under_no_grad_gives_official_s_tuple(tmp_path):
    """train() with gradients off (an evaluation loop that forgot eval()) builds the cache as official does, so the
    tuple's slots mean what official's mean: (logits, cache, encoder states) for BART; before, the cache slot was
    missing and out[1] was the encoder's states. With gradients recorded no cache is built (the documented
    divergence), the negative control."""
    official, ours, batch, labels = bart_in_training(tmp_path)
    batch["decoder_input_ids"] = labels.masked_fill(labels == -100, official.config.pad_token_id)
    with torch.no_grad():
        expected, got = official(**batch, return_dict=False), ours(**batch, return_dict=False)
    kinds = [[type(slot).__name__ if not torch.is_tensor(slot) else "tensor" for slot in out] for out in (expected, got)]
    assert kinds[0] == kinds[1] == ["tensor", "EncoderDecoderCache", "tensor"]
    assert relative(got[0], expected[0]) <= 1e-5 and relative(got[2], expected[2]) <= 1e-5
    assert [type(slot).__name__ for slot in ours(**batch, return_dict=False)] == ["Tensor", "Tensor"]
