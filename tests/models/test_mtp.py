"""Multi-Token Prediction (DeepSeek-V3): the MTP loss against a reference written from the report's eq. 21-25,
training under Trainer, self-speculative greedy decoding giving exactly plain greedy's tokens (random and trained
models, MLA + MoE too), and bad inputs."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from hf_tiny import TinyCausalConfig, TinyCausalForCausalLM
from hf_tiny.masks import AttentionMask

pytestmark = pytest.mark.usefixtures("single_torch_thread")

BASE = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_nextn_predict_layers=2, mtp_loss_weight=0.3, pad_token_id=0, bos_token_id=None, eos_token_id=None)
DEEPSEEK_LIKE = dict(num_local_experts=4, num_experts_per_tok=2, router_scoring="sigmoid", n_group=2, topk_group=1,
                     routed_scaling_factor=2.0, shared_expert_intermediate_size=16, first_k_dense_replace=1,
                     kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                     router_aux_loss_coef=0.0)


def model(seed=0, **overrides):
    torch.manual_seed(seed)
    return TinyCausalForCausalLM(TinyCausalConfig(**{**BASE, **overrides}))


def reference_mtp_loss(m, ids: torch.Tensor, concat_order=("embedding", "hidden"), labels=None) -> torch.Tensor:
    """Eq. 21-25 of the DeepSeek-V3 report, written out: h^0 the main model's output; for k = 1..D,
    h'^k_i = M_k[RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)] (eq. 21, in the checkpoint's concatenation order),
    h^k = TRM_k(h'^k) over positions 0..T-k-1 (eq. 22), P^k = softmax(OutHead(h^k)) (eq. 23),
    L^k = mean cross-entropy of P^k_i against t_{i+k+1} for i + k + 1 <= T - 1 (eq. 24),
    L_MTP = lambda / D * sum_k L^k (eq. 25). The blocks, norms and projections are the model's modules;
    the shifting, masking, concatenation and averaging are written here. labels (unshifted, as the model takes
    them; default ids): the targets t_{i+k+1} are labels[i+k+1], and the mean skips the -100 ones."""
    labels = ids if labels is None else labels
    length = ids.shape[1]
    depths = m.config.mtp_depth()
    previous = m.model(input_ids=ids).last_hidden_state
    total = 0.0
    for k, layer in enumerate(m.mtp, start=1):
        n = length - k
        embedded = layer.enorm(m.model.embed_tokens(ids[:, k:]))
        hidden = layer.hnorm(previous[:, :n])
        parts = {"embedding": embedded, "hidden": hidden}
        merged = layer.eh_proj(torch.cat([parts[name] for name in concat_order], dim=-1))
        cos, sin = m.model.rotary_emb(merged, torch.arange(n)[None])  # [B, S, R]: layers broadcast over heads
        previous = layer.block(merged, AttentionMask(None, True), (cos, sin))
        logits = m.lm_head(layer.norm(previous))[:, : n - 1]
        total = total + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, k + 1 :].reshape(-1), ignore_index=-100)
    return m.config.mtp_loss_weight / depths * total


@pytest.mark.parametrize("overrides", [{}, DEEPSEEK_LIKE], ids=["llama-like", "mla-moe"])
def test_mtp_loss_equals_the_reports_equations(overrides):
    m = model(**overrides).train()
    ids = torch.randint(1, 40, (3, 11), generator=torch.Generator().manual_seed(1))
    out = m(ids, labels=ids)
    with torch.no_grad():
        expected = reference_mtp_loss(m, ids)
        main = F.cross_entropy(m(ids).logits[:, :-1].reshape(-1, 40), ids[:, 1:].reshape(-1))
    assert float(out.mtp_loss.detach()) == pytest.approx(float(expected), rel=1e-5)
    assert float(out.loss.detach()) == pytest.approx(float(main + expected), rel=1e-5)
    # negative control: the report's printed order [h; Emb] is another function of the same weights
    with torch.no_grad():
        swapped = reference_mtp_loss(m, ids, concat_order=("hidden", "embedding"))
    assert abs(float(swapped) - float(expected)) > 1e-3


@pytest.mark.parametrize("overrides", [{}, DEEPSEEK_LIKE], ids=["llama-like", "mla-moe"])
def test_mtp_loss_with_labels_unlike_the_inputs_and_ignored_spans(overrides):
    """Labels that are not the input ids (as in instruction tuning) with -100 spans at the start, in the middle and
    at the end: every depth predicts labels k + 1 ahead and skips the ignored ones. Weights at std 0.3, so that the
    predictions are far from uniform and the targets matter. Negative control: the targets taken from input_ids
    instead, with the same ignored positions, are 100 times further off than the comparison allows."""
    m = model(**overrides, initializer_range=0.3).train()
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 40, (3, 12), generator=generator)
    labels = torch.randint(1, 40, (3, 12), generator=generator)
    labels[0, :5] = -100
    labels[1, 4:8] = -100
    labels[2, 9:] = -100
    assert (labels != ids).float().mean() > 0.8
    out = m(ids, labels=labels)
    with torch.no_grad():
        expected = reference_mtp_loss(m, ids, labels=labels)
        logits = m(ids).logits[:, :-1]
        main = F.cross_entropy(logits.reshape(-1, 40), labels[:, 1:].reshape(-1), ignore_index=-100)
        from_inputs = reference_mtp_loss(m, ids, labels=ids.masked_fill(labels == -100, -100))
    assert float(out.mtp_loss.detach()) == pytest.approx(float(expected), rel=1e-5)
    assert float(out.loss.detach()) == pytest.approx(float(main + expected), rel=1e-5)
    assert abs(float(from_inputs) - float(expected)) > 100 * 1e-5 * float(expected)


def test_mtp_loss_ignores_padding_labels_and_reaches_every_module():
    m = model().train()
    ids = torch.randint(1, 40, (2, 9), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[0, :4] = -100
    out = m(ids, labels=labels)
    out.loss.backward()
    for depth in range(2):
        assert m.mtp[depth].eh_proj.weight.grad.abs().sum() > 0
        assert m.mtp[depth].block.mlp.up_proj.weight.grad.abs().sum() > 0
    # eval mode: the next-token loss only (as official models report it)
    m.eval()
    with torch.no_grad():
        assert m(ids, labels=labels).mtp_loss is None


@pytest.mark.parametrize("overrides", [{}, DEEPSEEK_LIKE, {**DEEPSEEK_LIKE, "mla_absorb": True}],
                         ids=["llama-like", "mla-moe", "mla-absorbed"])
def test_speculative_greedy_equals_plain_greedy_on_a_random_model(overrides):
    m = model(seed=3, **overrides).eval()
    ids = torch.randint(1, 40, (3, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ids[1, :4] = 0
    settings = dict(attention_mask=mask, max_new_tokens=12, pad_token_id=0)
    expected = m.generate(ids, do_sample=False, **settings)
    assert torch.equal(m.generate(ids, use_mtp=True, **settings), expected)
    assert m.mtp_stats["drafted"] > 0


def cyclic_batches(vocab: int, rows: int, length: int, seed: int):
    """Rows of a fixed random permutation cycle t_{i+1} = perm[t_i] from random starts: learnable exactly, so a
    trained model's MTP modules draft correctly most of the time."""
    generator = torch.Generator().manual_seed(seed)
    successor = torch.randperm(vocab - 1, generator=generator) + 1
    starts = torch.randint(1, vocab, (rows,), generator=generator)
    ids = [starts]
    for _ in range(length - 1):
        ids.append(successor[ids[-1] - 1])
    return torch.stack(ids, dim=1), successor


def test_trained_under_trainer_drafts_are_accepted_and_tokens_identical(tmp_path):
    from transformers import Trainer, TrainingArguments

    ids, _ = cyclic_batches(40, 64, 16, seed=5)
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    m = model(seed=6, num_nextn_predict_layers=1, mtp_loss_weight=1.0)
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=16, max_steps=120, learning_rate=1e-2,
        logging_steps=10, save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
    )
    trainer = Trainer(model=m, args=args, train_dataset=dataset)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < 0.3 * losses[0], losses
    m.eval()
    prompts = ids[:4, :6]
    expected = m.generate(prompts, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(m.generate(prompts, max_new_tokens=20, use_mtp=True, pad_token_id=0), expected)
    stats = m.mtp_stats
    assert stats["accepted"] / stats["drafted"] > 0.5, stats
    assert stats["rounds"] < 4 * 20  # fewer main-model forwards than tokens
    m.save_pretrained(tmp_path / "saved")
    reloaded = TinyCausalForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert torch.equal(reloaded.mtp[0].eh_proj.weight, m.mtp[0].eh_proj.weight)


def test_mtp_generation_stops_at_eos():
    m = model(seed=3, eos_token_id=None).eval()
    ids = torch.randint(1, 40, (1, 8), generator=torch.Generator().manual_seed(4))
    plain = m.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0)
    eos = int(plain[0, 8 + 3])  # the fourth generated token
    expected = m.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0, eos_token_id=eos)
    produced = m.generate(ids, use_mtp=True, max_new_tokens=12, pad_token_id=0, eos_token_id=eos)
    first = expected[0, 8:].tolist().index(eos)
    assert produced[0, 8 : 8 + first + 1].tolist() == expected[0, 8 : 8 + first + 1].tolist()
    assert (produced[0, 8 + first + 1 :] == 0).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"do_sample": True}, "do_sample=False and num_beams=1"),
        ({"num_beams": 2}, "num_beams=2"),
        ({"temperature": 0.5}, "['temperature']"),
        ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
    ],
)
def test_bad_mtp_generate_arguments(kwargs, message):
    m = model().eval()
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError) as error:
        m.generate(ids, use_mtp=True, **{"max_new_tokens": 3, **kwargs})
    assert message in str(error.value)


@pytest.mark.parametrize("setting", [{"repetition_penalty": 1.3}, {"do_sample": True, "top_k": 5},
                                     {"no_repeat_ngram_size": 2}], ids=["repetition_penalty", "do_sample", "no_repeat"])
def test_mtp_generate_refuses_what_the_generation_config_sets_and_it_cannot_honour(setting):
    """A generation_config.json may set what plain generate() applies: before, generate(use_mtp=True) dropped it and
    returned other tokens than generate() (repetition_penalty 1.3: two of eight differed). Control: generate() itself
    applies the setting, so its tokens differ from plain greedy's."""
    m = model(seed=3).eval()
    ids = torch.randint(1, 40, (1, 10), generator=torch.Generator().manual_seed(4))
    greedy = m.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    for name, value in setting.items():
        setattr(m.generation_config, name, value)
    with pytest.raises(ValueError, match=rf"the model's generation_config sets \{{'{next(iter(setting))}': "):
        m.generate(ids, use_mtp=True, max_new_tokens=12, pad_token_id=0)
    if "do_sample" not in setting:
        assert not torch.equal(m.generate(ids, max_new_tokens=12, pad_token_id=0), greedy)


def test_mtp_generate_without_modules_and_right_padding_are_errors():
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        model(num_nextn_predict_layers=0).generate(torch.tensor([[1, 2]]), use_mtp=True, max_new_tokens=2)
    m = model().eval()
    with pytest.raises(ValueError, match="left-padded rows"):
        m.generate(torch.tensor([[1, 2, 0]]), attention_mask=torch.tensor([[1, 1, 0]]), use_mtp=True, max_new_tokens=2)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers must be an integer >= 0"),
        ({"mtp_loss_weight": -0.5}, "mtp_loss_weight must be a number >= 0, got -0.5"),
        ({"sliding_window": 4}, "sliding_attention layers is not supported"),
    ],
)
def test_bad_mtp_config_is_a_clear_error(changes, message):
    with pytest.raises(ValueError) as error:
        TinyCausalConfig(**{**BASE, **changes})
    assert message in str(error.value)


def test_mtp_loss_needs_input_ids():
    m = model().train()
    embeds = torch.randn(1, 5, 32)
    with pytest.raises(ValueError, match="needs input_ids"):
        m(inputs_embeds=embeds, labels=torch.tensor([[1, 2, 3, 4, 5]]))
