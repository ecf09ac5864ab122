"""Same seed -> the same training run, bit for bit, on CPU: a plain PyTorch loop (AdamW, dropout on, so the RNG
matters) for every family and CPU backend, and transformers' Trainer (through the example scripts, as a user runs
them) for the causal and seq2seq families. A different seed gives different losses (the control that the
comparison can fail). Trainer determinism for the encoder and resume_from_checkpoint bit-exactness are
tests/ecosystem/test_trainer.py's.
"""

from __future__ import annotations

import pytest
import torch

import trainer_runs as runs
from hf_tiny import (
    TinyCausalConfig,
    TinyCausalForCausalLM,
    TinyEncoderConfig,
    TinyEncoderForMaskedLM,
    TinySeq2SeqConfig,
    TinySeq2SeqForConditionalGeneration,
)
from trainer_runs import loss_curve

VOCAB = 64
SIZES = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
             max_position_embeddings=32, initializer_range=0.1)
FAMILIES = ["encoder", "causal", "bart-like", "t5-like"]
STEPS = 4

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def build(family: str):
    if family == "encoder":
        return TinyEncoderForMaskedLM(TinyEncoderConfig(**SIZES, hidden_dropout=0.1, attention_dropout=0.1))
    if family == "causal":
        return TinyCausalForCausalLM(
            TinyCausalConfig(**SIZES, num_key_value_heads=2, attention_dropout=0.1, pad_token_id=0)
        )
    extra = {}
    if family == "t5-like":
        extra = dict(norm_placement="pre", norm_type="rmsnorm", position_embedding_type="relative",
                     embedding_norm=False, final_norm=True, attention_scale=1.0, mlp_bias=False, attention_bias=False,
                     mlp_gated=True, hidden_act="gelu_new", pad_token_id=0, decoder_start_token_id=0,
                     use_padding_idx=False, final_logits_bias=False)
    return TinySeq2SeqForConditionalGeneration(
        TinySeq2SeqConfig(**SIZES, hidden_dropout=0.1, attention_dropout=0.1, activation_dropout=0.1, **extra)
    )


def batch(family: str, step: int) -> dict:
    """A right-padded batch (the data itself does not depend on the seed under test)."""
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(3, VOCAB, (4, 10), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[3, 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if family in ("bart-like", "t5-like"):
        return dict(input_ids=ids, attention_mask=mask, labels=labels[:, :6])
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def train(family: str, backend: str, seed: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """STEPS AdamW steps from a model initialised under `seed`; returns the losses and the final weights."""
    torch.manual_seed(seed)
    model = build(family)
    model.set_attn_implementation(backend)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        loss = model(**batch(family, step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_plain_loop_same_seed_same_losses_and_weights(family, backend):
    losses, weights = train(family, backend, seed=0)
    again, weights_again = train(family, backend, seed=0)
    assert losses == again  # exact float equality
    for name, tensor in weights.items():
        assert torch.equal(tensor, weights_again[name]), name
    other, _ = train(family, backend, seed=1)
    assert other != losses


@pytest.mark.parametrize("family", ["causal", "seq2seq"])
def test_trainer_same_seed_same_losses(family, tmp_path):
    flags = ("--max-steps", "3", "--batch-size", "4", "--dropout", "0.1")
    first = loss_curve(runs.train(family, tmp_path / "a", *flags))
    again = loss_curve(runs.train(family, tmp_path / "b", *flags))
    other = loss_curve(runs.train(family, tmp_path / "c", *flags, "--seed", "1"))
    assert len(first) == 3
    assert first == again
    assert first != other
