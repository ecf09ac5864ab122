"""transformers.Trainer on the three families, through the example scripts (examples/finetune_*.py) with --tiny
configs: the scripts run end to end; gradient accumulation equals one big batch (num_items_in_batch honoured, with
unequal sequence lengths for the causal LM); resume_from_checkpoint is bit-exact on CPU; the same seed gives the
same losses; gradient checkpointing gives the same gradients; a dataset without labels is a clear error."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

import trainer_runs as runs
from trainer_runs import grad_norm_curve, loss_curve
from hf_tiny.transformers_api import (
    disable_activation_checkpointing,
    enable_activation_checkpointing,
    is_activation_checkpointing,
)

FAMILIES = ("encoder", "causal", "seq2seq")

# Losses and gradient norms of 2 x 4 accumulated micro-batches vs one batch of 8: the same sums in another order,
# so equal to float32 rounding (measured: <= 2e-7 relative).
ACCUMULATION_RTOL = 1e-5

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def assert_curves_close(actual, expected, rtol, what):
    assert len(actual) == len(expected), f"{what}: {len(actual)} values vs {len(expected)}"
    for step, (a, e) in enumerate(zip(actual, expected), start=1):
        assert math.isclose(a, e, rel_tol=rtol), f"{what} differ at step {step}: {a!r} vs {e!r}\n{actual}\n{expected}"


# ------------------------------------------------------------------------------------------------------------------
# the example scripts, end to end
# ------------------------------------------------------------------------------------------------------------------


# The tiny post-LN encoder starts slower than the other two (measured 0.72 -> 0.23 mean loss over 80 steps)
EXAMPLE_STEPS = {"encoder": 30, "causal": 12, "seq2seq": 12}


@pytest.mark.parametrize("family", FAMILIES)
def test_example_script_trains_evaluates_saves_and_reloads(family, tmp_path, capsys):
    steps = EXAMPLE_STEPS[family]
    results = runs.EXAMPLES[family].main(["--tiny", "--max-steps", str(steps), "--output-dir", str(tmp_path)])

    losses = results["losses"]
    assert len(losses) == steps and all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.93 * first, f"{family}: the loss did not decrease: {losses}"
    before, after = results["eval_before"], results["eval_after"]
    assert after["eval_loss"] < before["eval_loss"], f"{family}: held-out loss {before} -> {after}"
    assert results["reload_max_abs_diff"] == 0.0
    assert (tmp_path / "final" / "config.json").is_file() and (tmp_path / "final" / "tokenizer.json").is_file()
    assert (tmp_path / "results.json").is_file()
    printed = capsys.readouterr().out
    assert "loss curve:" in printed and "max |logits difference| = 0.0" in printed
    metric = {"encoder": "eval accuracy", "causal": "perplexity", "seq2seq": "exact match"}[family]
    assert metric in printed


# ------------------------------------------------------------------------------------------------------------------
# gradient accumulation: 2 micro-batches x 4 steps == one batch of 8
# ------------------------------------------------------------------------------------------------------------------


def big_and_accumulated(family, tmp_path, configure_accumulated=None):
    flags = ("--max-steps", "4")
    big = runs.train(family, tmp_path / "big", *flags, "--batch-size", "8")
    accumulated = runs.train(
        family, tmp_path / "acc", *flags, "--batch-size", "2", "--grad-accum", "4", configure=configure_accumulated
    )
    return big, accumulated


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_accumulation_equals_one_big_batch(family, tmp_path):
    big, accumulated = big_and_accumulated(family, tmp_path)
    assert len(loss_curve(big)) == 4
    assert_curves_close(loss_curve(accumulated), loss_curve(big), ACCUMULATION_RTOL, "losses")
    assert_curves_close(grad_norm_curve(accumulated), grad_norm_curve(big), ACCUMULATION_RTOL, "gradient norms")


def test_causal_accumulation_sees_unequal_target_counts(tmp_path):
    """The precondition that makes the causal case meaningful: the micro-batches of one step carry different
    numbers of target tokens, so averaging per micro-batch would weight tokens unequally."""
    trainer = runs.make_trainer("causal", tmp_path, "--batch-size", "2")
    counts = [int((batch["labels"][:, 1:] != -100).sum()) for batch, _ in zip(trainer.get_train_dataloader(), range(4))]
    assert len(set(counts)) > 1, counts
    lengths = [len(row["input_ids"]) for row in trainer.train_dataset]
    assert len(set(lengths)) > 5


def test_accumulation_without_num_items_in_batch_differs(tmp_path):
    """Negative control: the same causal run with num_items_in_batch ignored (each micro-batch averaged on its
    own, what a model without loss kwargs gets) must fail the comparison above."""

    def ignore_num_items(trainer):
        trainer.model_accepts_loss_kwargs = False

    big, accumulated = big_and_accumulated("causal", tmp_path, configure_accumulated=ignore_num_items)
    with pytest.raises(AssertionError):
        assert_curves_close(loss_curve(accumulated), loss_curve(big), ACCUMULATION_RTOL, "losses")
    first_gap = abs(loss_curve(accumulated)[0] - loss_curve(big)[0]) / loss_curve(big)[0]
    assert first_gap > 100 * ACCUMULATION_RTOL


def test_models_declare_how_trainer_must_scale_their_loss(tmp_path):
    """Trainer passes num_items_in_batch only to models that accept loss kwargs; those must then sum and divide."""
    from hf_tiny import TinyCausalForCausalLM, TinyEncoderForSequenceClassification, TinySeq2SeqForConditionalGeneration

    for family, model_class in (
        ("causal", TinyCausalForCausalLM),
        ("seq2seq", TinySeq2SeqForConditionalGeneration),
    ):
        trainer = runs.make_trainer(family, tmp_path)
        assert type(trainer.model) is model_class and trainer.model_accepts_loss_kwargs, family
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
        model = trainer.model.eval()
        mean_loss = model(**batch).loss
        scored = batch["labels"][:, 1:] if family == "causal" else batch["labels"]  # the causal loss shifts
        targets = int((scored != -100).sum())
        summed = model(**batch, num_items_in_batch=torch.tensor(1)).loss
        assert torch.allclose(summed, mean_loss * targets, rtol=1e-5), (family, summed, mean_loss, targets)
    trainer = runs.make_trainer("encoder", tmp_path)
    assert type(trainer.model) is TinyEncoderForSequenceClassification and not trainer.model_accepts_loss_kwargs


def test_the_pretraining_head_names_the_labels_trainer_looks_for_as_official_bert():
    """Trainer computes an evaluation loss only when a batch holds every label the forward's signature names; ours
    also named ALBERT's sentence_order_label, which no BERT batch holds: evaluate() gave no eval_loss."""
    from transformers import BertForPreTraining
    from transformers.utils import find_labels

    from hf_tiny import TinyEncoderForPreTraining

    assert find_labels(TinyEncoderForPreTraining) == find_labels(BertForPreTraining) == ["labels", "next_sentence_label"]


def test_label_smoothing_shifts_the_causal_labels_as_for_official_causal_lms(tmp_path):
    """Trainer's label smoother shifts the labels of the models named among transformers' causal LMs; ours was not
    among them, and each position was smoothed against its own token (first loss 5.17 against official's 4.56)."""
    from transformers.trainer_pt_utils import LabelSmoother

    trainer = runs.make_trainer("causal", tmp_path)
    trainer.label_smoother = LabelSmoother(epsilon=0.1)  # what label_smoothing_factor=0.1 sets up
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    model = trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(model, dict(batch))
        outputs = model(**{k: v for k, v in batch.items() if k != "labels"})
    shifted, unshifted = (LabelSmoother(0.1)(outputs, batch["labels"], shift_labels=shift) for shift in (True, False))
    assert torch.allclose(loss, shifted, rtol=1e-6) and not torch.allclose(loss, unshifted, rtol=1e-3)


# ------------------------------------------------------------------------------------------------------------------
# determinism and resume_from_checkpoint (dropout on, so the restored RNG state matters)
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_resume_from_checkpoint_is_bit_exact(family, tmp_path):
    flags = ("--max-steps", "6", "--batch-size", "4", "--dropout", "0.1", "--save-steps", "3")
    uninterrupted = runs.train(family, tmp_path / "full", *flags)
    expected = loss_curve(uninterrupted)
    checkpoint = tmp_path / "full" / "checkpoint-3"
    assert (checkpoint / "rng_state.pth").is_file() and (checkpoint / "optimizer.pt").is_file()

    resumed = runs.train(family, tmp_path / "resumed", *flags, resume=str(checkpoint))
    assert resumed.state.global_step == 6
    assert loss_curve(resumed) == expected  # steps 1-3 from the checkpoint's log, 4-6 computed again: bit-exact
    assert grad_norm_curve(resumed) == grad_norm_curve(uninterrupted)
    assert runs.max_state_difference(runs.final_state(resumed), runs.final_state(uninterrupted)) == 0.0

    # Negative control: the same resume without the saved RNG state draws other dropout masks.
    no_rng = tmp_path / "no_rng_checkpoint"
    shutil.copytree(checkpoint, no_rng)
    (no_rng / "rng_state.pth").unlink()
    torch.manual_seed(12345)
    other = runs.train(family, tmp_path / "resumed_without_rng", *flags, resume=str(no_rng))
    assert loss_curve(other)[:3] == expected[:3] and loss_curve(other)[3:] != expected[3:]


def test_same_seed_same_losses_other_seed_other_losses(tmp_path):
    flags = ("--max-steps", "4", "--batch-size", "4", "--dropout", "0.1")
    first = loss_curve(runs.train("encoder", tmp_path / "a", *flags))
    again = loss_curve(runs.train("encoder", tmp_path / "b", *flags))
    other = loss_curve(runs.train("encoder", tmp_path / "c", *flags, "--seed", "1"))
    assert first == again
    assert first != other


# ------------------------------------------------------------------------------------------------------------------
# gradient checkpointing
# ------------------------------------------------------------------------------------------------------------------


def layer_call_counter(model):
    """Counts runs of every transformer block (a checkpointed block runs again in backward). transformers
    checkpoints the block's forward, not its __call__, so the hook sits on a submodule: self-attention, the first
    one (torch stops a non-reentrant recompute early, once the last saved tensor is back, so a hook on the last
    sublayer may not fire)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    calls = {"n": 0}
    blocks = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    for block in blocks:
        block.self_attn.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    return calls, len(blocks)


def gradients(model, batch, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    model(**batch).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_gives_the_same_gradients(family, use_reentrant, tmp_path):
    trainer = runs.make_trainer(family, tmp_path, "--dropout", "0.1")
    model = trainer.model.train()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    calls, num_blocks = layer_call_counter(model)

    plain = gradients(model, batch, seed=7)
    assert calls["n"] == num_blocks
    enable_activation_checkpointing(model, {"use_reentrant": use_reentrant})
    calls["n"] = 0
    checkpointed = gradients(model, batch, seed=7)
    assert calls["n"] == 2 * num_blocks, "the blocks were not recomputed in backward: checkpointing is not active"

    assert plain.keys() == checkpointed.keys() and len(plain) == len(list(model.parameters()))
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=0, atol=1e-7, msg=name)
    # dropout is on, so the comparison sees the RNG replay: another seed gives other gradients
    disable_activation_checkpointing(model)
    other = gradients(model, batch, seed=8)
    assert any(not torch.allclose(other[name], plain[name]) for name in plain)


def test_trainer_gradient_checkpointing_flag_keeps_the_loss_curve(tmp_path):
    flags = ("--max-steps", "3", "--batch-size", "4", "--dropout", "0.1")
    plain = runs.train("causal", tmp_path / "plain", *flags)
    checkpointed = runs.train("causal", tmp_path / "gc", *flags, "--gradient-checkpointing")
    model = checkpointed.accelerator.unwrap_model(checkpointed.model)
    assert is_activation_checkpointing(model)
    assert_curves_close(loss_curve(checkpointed), loss_curve(plain), 1e-6, "losses")
    assert_curves_close(grad_norm_curve(checkpointed), grad_norm_curve(plain), 1e-6, "gradient norms")


# ------------------------------------------------------------------------------------------------------------------
# bad input: a dataset without labels
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_dataset_without_labels_is_a_clear_error(family, tmp_path):
    """Without labels the model returns no loss, and Trainer's own message ("The model did not return a loss
    from the inputs, only the following keys: logits ...") never says `labels`; the examples' collators do."""
    unlabelled = [{"input_ids": [3, 4, 5, 6]}, {"input_ids": [3, 4, 5]}] * 8
    trainer = runs.make_trainer(family, tmp_path, "--max-steps", "1", "--batch-size", "2", train_rows=unlabelled)
    with pytest.raises(ValueError, match=r"has no 'labels' field; its fields are \['input_ids'\]"):
        trainer.train()


def test_encoder_collator_accepts_the_datasets_label_column(tmp_path):
    trainer = runs.make_trainer("encoder", tmp_path)
    batch = trainer.data_collator([{"input_ids": [2, 5, 3], "label": 1}, {"input_ids": [2, 3], "label": 0}])
    assert batch["labels"].tolist() == [1, 0]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]


# ------------------------------------------------------------------------------------------------------------------
# real weights: the converted all-MiniLM-L6-v2 through the encoder example (the other two real runs are in the
# examples only: converting SmolLM2 and warm-starting bert2seq take minutes on CPU)
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.real_weights
@pytest.mark.slow
def test_encoder_example_on_converted_minilm(real_minilm_dir, tmp_path):
    results = runs.EXAMPLES["encoder"].main(
        ["--max-steps", "10", "--learning-rate", "1e-4", "--output-dir", str(tmp_path)]
    )
    losses = results["losses"]
    assert len(losses) == 10 and sum(losses[-3:]) < sum(losses[:3]), losses
    assert results["eval_after"]["eval_loss"] < results["eval_before"]["eval_loss"]
    assert results["reload_max_abs_diff"] == 0.0
    converted = tmp_path / "converted" / "minilm"
    assert json.loads((converted / "config.json").read_text())["model_type"] == "hf_tiny_encoder"
