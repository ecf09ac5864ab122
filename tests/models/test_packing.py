"""Padding-free (packed) batches: several sequences in one row, boundaries from restarting position_ids or from
cu_seq_lens_q/k, as DataCollatorWithFlattening builds them for Trainer / TRL. No token may attend across a
boundary, in any backend; the loss and gradients equal those of the padded batch."""

from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

from causal_helpers import max_diff, tiny_official
from hf_tiny import TinyCausalConfig, TinyCausalForCausalLM
from hf_tiny.masks import packed_causal_mask, segment_ids_from_cu_seq_lens, segment_ids_from_position_ids

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SEQUENCES = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21]]
TOLERANCE = 1e-5


def ours_from(official, **overrides) -> TinyCausalForCausalLM:
    fields = official.config.to_dict()
    keep = set(TinyCausalConfig().to_dict()) - {"architectures", "transformers_version", "model_type"}
    config = TinyCausalConfig(**{**{k: v for k, v in fields.items() if k in keep}, **overrides})
    ours = TinyCausalForCausalLM(config).eval()
    ours.load_state_dict(official.state_dict(), strict=True)
    return ours


@pytest.fixture(scope="module")
def pair():
    official = tiny_official("llama")
    return official, ours_from(official)


def flattened(flash_kwargs: bool) -> dict:
    collator = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=flash_kwargs)
    return collator([{"input_ids": s} for s in SEQUENCES])


def alone(model) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(torch.tensor([s])).logits[0] for s in SEQUENCES])


def test_segment_ids_from_positions_and_from_cu_seq_lens_agree():
    batch = flattened(True)
    from_positions = segment_ids_from_position_ids(batch["position_ids"])
    from_cu = segment_ids_from_cu_seq_lens(batch["cu_seq_lens_q"], batch_size=1, length=batch["input_ids"].shape[1])
    expected = torch.tensor([[i for i, s in enumerate(SEQUENCES) for _ in s]])
    assert torch.equal(from_positions, expected) and torch.equal(from_cu, expected)
    assert segment_ids_from_position_ids(torch.arange(6)[None]) is None  # one sequence: no packing
    mask = packed_causal_mask(expected).mask[0, 0]
    assert not mask[5, 4] and mask[5, 5] and mask[6, 5] and not mask[5, 6]  # boundary between sequences 0 and 1


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_packed_row_equals_each_sequence_alone(pair, backend, flash_kwargs):
    official, ours = pair
    ours.set_attn_implementation(backend)
    batch = flattened(flash_kwargs)
    batch.pop("labels")
    with torch.no_grad():
        packed = ours(**batch).logits[0]
    expected = alone(ours)
    assert max_diff(packed, expected) <= TOLERANCE
    # the official model agrees on the packed row
    official.set_attn_implementation(backend)
    with torch.no_grad():
        reference = official(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
    assert max_diff(packed, reference) <= TOLERANCE
    # negative control: the same row as one sequence (positions 0..S-1) attends across the boundaries
    with torch.no_grad():
        leaky = ours(input_ids=batch["input_ids"]).logits[0]
    assert max_diff(leaky, expected) > 1e-2


def test_packed_row_with_sliding_window_equals_each_sequence_alone():
    official = tiny_official("mistral", sliding_window=3)
    ours = ours_from(official)
    batch = flattened(False)
    with torch.no_grad():
        packed = ours(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        reference = official(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
    assert max_diff(packed, alone(ours)) <= TOLERANCE and max_diff(packed, reference) <= TOLERANCE


def test_packed_row_longer_than_max_position_embeddings_runs(pair):
    official, _ = pair
    ours = ours_from(official, max_position_embeddings=8)  # every sequence fits, the row of 17 tokens does not
    batch = flattened(False)
    with torch.no_grad():
        packed = ours(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
    assert max_diff(packed, alone(ours)) <= TOLERANCE


def test_bad_cu_seq_lens_name_the_field_and_value(pair):
    _, ours = pair
    batch = flattened(True)
    ids = batch["input_ids"]
    with pytest.raises(ValueError, match=r"cu_seq_lens_q=\[0, 5, 4, 17\] must start at 0"):
        ours(input_ids=ids, cu_seq_lens_q=torch.tensor([0, 5, 4, 17], dtype=torch.int32))
    with pytest.raises(ValueError, match="end at the packed length 17"):
        ours(input_ids=ids, cu_seq_lens_q=torch.tensor([0, 5, 16], dtype=torch.int32))
    with pytest.raises(ValueError, match="batch_size=2"):
        ours(input_ids=ids.expand(2, -1), cu_seq_lens_q=batch["cu_seq_lens_q"])
    with pytest.raises(ValueError, match="attention_mask"):
        ours(input_ids=ids, attention_mask=torch.ones_like(ids), cu_seq_lens_q=batch["cu_seq_lens_q"])


def _loss_and_grads(model, batch: dict):
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_packed_loss_and_gradients_equal_the_padded_batch(pair, backend):
    """The flattening collator's labels mask the first token of each sequence, so the loss averages the same
    tokens as the padded batch's; loss and every gradient must agree."""
    official, _ = pair
    ours = ours_from(official)
    ours.set_attn_implementation(backend)
    ours.train()
    packed = flattened(True)
    padded = pad_collate([{"input_ids": s} for s in SEQUENCES])
    loss_packed, grads_packed = _loss_and_grads(ours, packed)
    loss_padded, grads_padded = _loss_and_grads(ours, padded)
    assert abs(float(loss_packed - loss_padded)) <= 1e-6 * abs(float(loss_padded))
    for name, grad in grads_padded.items():
        assert max_diff(grads_packed[name], grad) <= 1e-5 * max(1.0, float(grad.abs().max())), name


def pad_collate(features: list[dict]) -> dict:
    """Right padding with pad id 0, labels -100 at the padding."""
    length = max(len(f["input_ids"]) for f in features)
    ids = torch.tensor([list(f["input_ids"]) + [0] * (length - len(f["input_ids"])) for f in features])
    mask = torch.tensor([[1] * len(f["input_ids"]) + [0] * (length - len(f["input_ids"])) for f in features])
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _train(official, collator, output_dir) -> dict[str, torch.Tensor]:
    model = ours_from(official)
    generator = torch.Generator().manual_seed(5)
    rows = [{"input_ids": torch.randint(3, 97, (int(n),), generator=generator).tolist()}
            for n in torch.randint(2, 12, (16,), generator=generator)]
    args = TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=4, max_steps=4, learning_rate=0.05,
        optim="sgd", lr_scheduler_type="constant", report_to=[], save_strategy="no", logging_steps=1,
        use_cpu=True, seed=0, remove_unused_columns=False, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collator)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"losses": losses, "state": {n: p.detach().clone() for n, p in model.named_parameters()}}


def test_trainer_with_the_flattening_collator_equals_the_padded_run(tmp_path, pair):
    """Four SGD steps on packed rows give the losses and parameters of the same steps on padded batches."""
    official, _ = pair
    packed = _train(official, DataCollatorWithFlattening(return_tensors="pt"), tmp_path / "packed")
    padded = _train(official, pad_collate, tmp_path / "padded")
    assert len(packed["losses"]) == 4
    assert packed["losses"] == pytest.approx(padded["losses"], rel=1e-5)
    for name, value in padded["state"].items():
        assert max_diff(packed["state"][name], value) <= 1e-5, name
    # negative control: the same packed rows without position restarts (one long sequence each) train otherwise
    leaky = _train(official, lambda f: {k: v for k, v in DataCollatorWithFlattening(return_tensors="pt")(f).items()
                                        if k != "position_ids"}, tmp_path / "leaky")
    assert max(max_diff(leaky["state"][name], value) for name, value in padded["state"].items()) > 1e-3


@pytest.mark.parametrize("use_package", [True, False], ids=["flash_attn_varlen", "torch_flash_per_sequence"])
def test_flash_backend_runs_each_packed_sequence_alone(use_package):
    """The flash backend takes packed boundaries from the mask's declared layout (varlen cu_seqlens with the
    flash-attn package, one PyTorch flash kernel call per sequence without it); CPU math stands in for the CUDA
    kernels here."""
    from fake_flash_attn import FakeFlashAttn, flash_on_cpu

    from hf_tiny.attention import naive_attention
    from hf_tiny.flash import flash_attention

    segment_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1]])
    mask = packed_causal_mask(segment_ids)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 9, 8, generator=gen)
    k, v = (torch.randn(2, 2, 9, 8, generator=gen) for _ in range(2))
    expected, _ = naive_attention(q, k, v, mask.mask, scale=0.35, is_causal=True)
    package = FakeFlashAttn() if use_package else None
    with pytest.MonkeyPatch.context() as patch:
        flash_on_cpu(patch, package=package)
        produced, _ = flash_attention(q, k, v, mask.mask, scale=0.35, is_causal=True, layout=mask.layout)
        # negative control: the same mask without its layout may hold any pattern; flash does not guess, it says so
        with pytest.raises(ValueError, match="layout.*'sdpa' or 'eager'"):
            flash_attention(q, k, v, mask.mask, scale=0.35, is_causal=True)
    torch.testing.assert_close(produced, expected, atol=1e-5, rtol=0)
    whole_rows, _ = naive_attention(q, k, v, scale=0.35, is_causal=True)
    assert (produced - whole_rows).abs().max() > 1e-2  # the boundaries matter on these inputs
    if package is not None:
        assert package.calls == ["varlen"]
