"""The parity checks of the 2025 causal families (tests/models/test_smollm3.py, test_olmo2.py, test_llama4_text.py): an
official model (small random config with odd shapes, every weight random at std 0.3) loaded into hf_tiny's causal
LM through the family's test-local key table (what conversion/ turns into a converter), then compared on a
left-padded batch: logits per backend, greedy tokens through the cache, loss and gradients. Run as a script, it
prints the logits errors of every variant per backend (docs/parity.md's rows): python tests/helpers/family_parity.py"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

if __name__ == "__main__":  # run as a script: the checkout's hf_tiny
    sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

import torch  # noqa: E402

from causal_helpers import left_padded_batch, max_diff, real_logits  # noqa: E402
from hf_tiny import TinyCausalConfig, TinyCausalForCausalLM  # noqa: E402

BACKENDS = ("eager", "sdpa", "flash_attention_2")
TOLERANCE = 1e-5  # relative to max(1, max |official logit|): the converter's fp32 rule (conversion/parity.py)
# A row of 24 tokens, one of 17 and one of 5 (the chunked-attention families get several chunks per row)
LENGTHS = (24, 17, 5)


def load_ours(official, fields: dict, rename: Callable[[str, torch.Tensor], dict]) -> TinyCausalForCausalLM:
    """hf_tiny's causal LM with `fields`, holding the official weights under the names `rename(name, tensor)`
    gives (a dict: fused tensors split into several); every tensor of ours is filled, none is left over."""
    ours = TinyCausalForCausalLM(TinyCausalConfig(**fields))
    state = {}
    for name, tensor in official.state_dict().items():
        state.update(rename(name, tensor))
    ours.load_state_dict(state, strict=True)
    if ours.config.tie_word_embeddings:
        assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    return ours.eval()


def logits_error(official, ours, backend: str, official_backend: str = "eager", batch=None) -> float:
    """max |ours - official| over the real tokens of the left-padded batch, relative to max(1, max |official|)."""
    batch = batch or left_padded_batch(official.config.vocab_size, LENGTHS)
    official.set_attn_implementation(official_backend)
    ours.set_attn_implementation(backend)
    expected, produced = real_logits(official, batch), real_logits(ours, batch)
    return max_diff(produced, expected) / max(1.0, float(expected.abs().max()))


def greedy_tokens(model, new_tokens: int = 8, lengths=LENGTHS, **settings) -> torch.Tensor:
    """generate() with the cache on the left-padded batch (no eos stop, so every step is compared)."""
    batch = left_padded_batch(model.config.vocab_size, lengths)
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                    use_cache=True, **settings)
    with torch.no_grad():
        return model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], **settings)


def assert_same_greedy_tokens(official, ours, backends=("sdpa", "flash_attention_2"), new_tokens: int = 8,
                              **settings) -> None:
    """Greedy tokens with the cache (generate `settings`, e.g. cache_implementation): ours, in each backend, equal
    official's (sdpa)."""
    official.set_attn_implementation("sdpa")
    expected = greedy_tokens(official, new_tokens, **settings)
    for backend in backends:
        ours.set_attn_implementation(backend)
        assert torch.equal(greedy_tokens(ours, new_tokens, **settings), expected), backend


def loss_and_gradients(model, names=None) -> tuple[float, dict]:
    """Training forward and backward on the left-padded batch with labels: (loss, {name: grad})."""
    batch = left_padded_batch(model.config.vocab_size, LENGTHS)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    model.train()
    model.zero_grad()
    loss = model(**batch, labels=labels).loss
    loss.backward()
    model.eval()
    grads = {name: param.grad for name, param in model.named_parameters() if names is None or name in names}
    return float(loss.detach()), grads


def gradient_errors(official, ours, rename) -> tuple[float, float]:
    """(relative loss error, worst gradient error over every official tensor) of one training step; a fused
    official tensor's gradient is renamed as its weight is and compared part by part. Each error is relative to
    the tensor's largest gradient, but to no less than 1e-2 of the model's: a gradient that is zero in exact
    arithmetic (a NoPE layer's key bias adds the same q.b to every score of a row) holds rounding noise only."""
    official_loss, official_grads = loss_and_gradients(official)
    our_loss, our_grads = loss_and_gradients(ours)
    official_grads = {name: grad for name, grad in official_grads.items() if grad is not None}
    floor = 1e-2 * max(float(grad.abs().max()) for grad in official_grads.values())
    worst = 0.0
    for name, grad in official_grads.items():
        for our_name, expected in rename(name, grad).items():
            if our_name == "lm_head.weight" and ours.config.tie_word_embeddings:
                continue  # the tied embedding's gradient holds both uses, checked under its own name
            difference = float((our_grads[our_name].double() - expected.double()).abs().max())
            worst = max(worst, difference / max(float(expected.abs().max()), floor))
    return abs(our_loss - official_loss) / official_loss, worst


def assert_runtime_bit_identical(model, monkeypatch) -> None:
    """hf_tiny/runtime.py's promise on this family (tests/runtime/test_runtime.py's check) on a tiny model run in place as a
    large prefill is."""
    from hf_tiny import runtime
    from runtime_checks import assert_bit_identical_on_and_off

    monkeypatch.setattr(runtime, "MIN_ELEMENTS", 1)
    assert_bit_identical_on_and_off(model)


def main() -> None:
    """Prints, per family variant and backend, the logits error the tests bound (docs/parity.md's rows):
    python tests/helpers/family_parity.py"""
    import llama4_models
    import olmo2_models
    import smollm3_models

    families = (("smollm3", smollm3_models, smollm3_models.tiny_smollm3), ("olmo2", olmo2_models, olmo2_models.tiny_olmo2),
                ("llama4_text", llama4_models, llama4_models.tiny_llama4))
    for name, module, build in families:
        for variant in sorted(module.VARIANTS):
            official = build(variant)
            cells = []
            for backend in BACKENDS:
                try:
                    cells.append(f"{backend} {logits_error(official, module.ours_for(official), backend):.2g}")
                except ValueError as error:  # a mechanism the backend cannot express, refused
                    cells.append(f"{backend} refused ({str(error)[:40]}...)")
            print(f"{name} {variant}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
