"""Distributed and big-model paths on CPU: the example fine-tunes under `torchrun --nproc_per_node=2` (gloo) with DDP
and with FSDP2 equal the single-process run with the same global batch; tensor parallelism (DistributedConfig
(tp_size=2)) gives the single-process logits; device_map="auto" with a CPU/disk split generates the same tokens;
the models' _no_split_modules and parallel plans name real modules.

One torchrun launch (tests/helpers/ddp_worker.py) serves all distributed checks. FSDP through accelerate (Trainer's
fsdp=True) only exists for GPU process groups in accelerate 1.15 (AcceleratorState enables FSDP for MULTI_GPU/NPU/
XPU/... but not MULTI_CPU, where it silently trains with DDP instead), so that path is a CUDA test; on CPU the
examples use transformers' own FSDP2 (from_pretrained(distributed_config=DistributedConfig(fsdp_size=2))).
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trainer_runs as runs
from markers import cuda_only
from trainer_runs import grad_norm_curve, loss_curve

import hf_tiny  # noqa: F401  (registers the Auto classes)
from hf_tiny import (
    TinyCausalConfig,
    TinyCausalForCausalLM,
    TinyCausalForSequenceClassification,
    TinyCausalModel,
    TinyEncoderConfig,
    TinyEncoderForMaskedLM,
    TinyEncoderForQuestionAnswering,
    TinyEncoderForSequenceClassification,
    TinyEncoderForTokenClassification,
    TinyEncoderModel,
    TinySeq2SeqConfig,
    TinySeq2SeqForConditionalGeneration,
    TinySeq2SeqModel,
)

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "ddp_worker.py"
STEPS, GLOBAL_BATCH, WORLD = 4, 8, 2
# Two processes x 4 examples vs one batch of 8: the same sums, reduced by gloo in another order (measured <= 2e-7)
DISTRIBUTED_RTOL = 1e-5
# Tensor parallelism splits the reductions of o_proj / down_proj in two: float32 rounding, relative to the logits'
# scale (init std 0.2 gives logits up to ~6; measured max |difference| 5.4e-6)
TP_RTOL = 1e-5

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def tiny_causal_config(**overrides) -> TinyCausalConfig:
    fields = dict(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )
    return TinyCausalConfig(**{**fields, **overrides})


def tiny_encoder_config(**overrides) -> TinyEncoderConfig:
    fields = dict(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, initializer_range=0.2, hidden_dropout=0.0, attention_dropout=0.0, num_labels=3,
    )
    return TinyEncoderConfig(**{**fields, **overrides})


def tiny_seq2seq_config(**overrides) -> TinySeq2SeqConfig:
    fields = dict(
        vocab_size=96, hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2,
        max_position_embeddings=64, initializer_range=0.2, hidden_dropout=0.0, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1,
    )
    return TinySeq2SeqConfig(**{**fields, **overrides})


# A right-padded batch (row 1 has two padding positions).
TP_BATCH = {"input_ids": [[5, 17, 33, 2, 9, 40], [7, 8, 9, 11, 0, 0]], "attention_mask": [[1] * 6, [1, 1, 1, 1, 0, 0]]}
TP_MODELS = {
    "causal_lm": (TinyCausalForCausalLM, tiny_causal_config, "AutoModelForCausalLM"),
    "encoder_classifier": (
        TinyEncoderForSequenceClassification, tiny_encoder_config, "AutoModelForSequenceClassification"
    ),
    "encoder_mlm": (TinyEncoderForMaskedLM, tiny_encoder_config, "AutoModelForMaskedLM"),
    "seq2seq": (TinySeq2SeqForConditionalGeneration, tiny_seq2seq_config, "AutoModelForSeq2SeqLM"),
}


def single_process_logits(name: str, model_dir: Path) -> torch.Tensor:
    model_class = TP_MODELS[name][0]
    model = model_class.from_pretrained(str(model_dir)).eval()
    batch = {key: torch.tensor(value) for key, value in TP_BATCH.items()}
    if name == "seq2seq":
        batch["decoder_input_ids"] = batch["input_ids"][:, :4]
    with torch.no_grad():
        return model(**batch).logits


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    """Launch tests/helpers/ddp_worker.py once under torchrun; returns {job name: results} and the folders used."""
    root = tmp_path_factory.mktemp("distributed")
    jobs, outputs = [], {}

    def example(name, family, *flags):
        out = root / name
        outputs[name] = out / "results.json"
        argv = ["--tiny", "--max-steps", str(STEPS), "--batch-size", str(GLOBAL_BATCH // WORLD),
                "--output-dir", str(out), *flags]
        jobs.append({"kind": "example", "family": family, "argv": argv})

    example("ddp_causal", "causal", "--skip-final")
    example("ddp_encoder", "encoder")  # the whole script: train, evaluate, save, reload
    example("fsdp_causal", "causal", "--fsdp", "native")
    example("fsdp_seq2seq", "seq2seq", "--fsdp", "native", "--skip-final")

    for name, (model_class, make_config, auto_class) in TP_MODELS.items():
        torch.manual_seed(0)
        model_dir = root / f"tp_{name}"
        model_class(make_config()).save_pretrained(str(model_dir))
        batch = dict(TP_BATCH)
        if name == "seq2seq":
            batch["decoder_input_ids"] = [row[:4] for row in TP_BATCH["input_ids"]]
        outputs[f"tp_{name}"] = root / f"tp_{name}.json"
        jobs.append({"kind": "tensor_parallel", "model_dir": str(model_dir), "auto_class": auto_class,
                     "batch": batch, "out": str(outputs[f"tp_{name}"])})

    jobs_file = root / "jobs.json"
    jobs_file.write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
               str(WORKER), str(jobs_file)]  # --standalone: a free rendezvous port on localhost
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=runs.REPO_ROOT)
    if completed.returncode != 0:
        output = f"{completed.stdout[-4000:]}\n{completed.stderr[-8000:]}"
        pytest.fail(f"torchrun failed ({completed.returncode}):\n{output}")
    return {name: json.loads(path.read_text()) for name, path in outputs.items()}, root


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The same example runs in one process with the same global batch (8 per step, no accumulation)."""
    root = tmp_path_factory.mktemp("single")
    flags = ("--max-steps", str(STEPS), "--batch-size", str(GLOBAL_BATCH))
    trainers = {family: runs.train(family, root / family, *flags) for family in ("causal", "encoder", "seq2seq")}
    for family in ("causal", "encoder"):
        trainers[family].metrics_after = trainers[family].evaluate()
    return trainers


def assert_curves_close(actual, expected, what):
    assert len(actual) == len(expected) == STEPS, (actual, expected)
    for step, (a, e) in enumerate(zip(actual, expected), start=1):
        assert math.isclose(a, e, rel_tol=DISTRIBUTED_RTOL), f"{what} differ at step {step}: {actual} vs {expected}"


# ------------------------------------------------------------------------------------------------------------------
# data parallel: DDP and FSDP2 == one process with the same global batch
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", ["causal", "encoder"])
def test_ddp_matches_single_process(distributed, single_process, family):
    results, _ = distributed
    ddp = results[f"ddp_{family}"]
    assert ddp["world_size"] == WORLD and ddp["global_step"] == STEPS
    assert ddp["model_class"] == type(single_process[family].model).__name__  # DDP wraps, the model stays ours
    assert_curves_close(ddp["losses"], loss_curve(single_process[family]), "losses")
    assert_curves_close(ddp["grad_norms"], grad_norm_curve(single_process[family]), "gradient norms")


@pytest.mark.slow
def test_ddp_example_evaluates_saves_and_reloads(distributed, single_process):
    results, root = distributed
    encoder = results["ddp_encoder"]
    assert encoder["reload_max_abs_diff"] == 0.0
    assert encoder["eval_before"] is None  # skipped with several processes (see evaluate_before_training)
    # predictions gathered from both processes score like the single-process model's
    assert encoder["eval_after"]["eval_accuracy"] == single_process["encoder"].metrics_after["eval_accuracy"]
    assert (root / "ddp_encoder" / "final" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["causal", "seq2seq"])
def test_fsdp2_matches_single_process(distributed, single_process, family):
    results, _ = distributed
    fsdp = results[f"fsdp_{family}"]
    assert fsdp["world_size"] == WORLD
    # sharded by transformers: FSDP2 turns the class into FSDP<class>
    assert fsdp["model_class"] == "FSDP" + type(single_process[family].model).__name__
    assert_curves_close(fsdp["losses"], loss_curve(single_process[family]), "losses")
    assert_curves_close(fsdp["grad_norms"], grad_norm_curve(single_process[family]), "gradient norms")


@pytest.mark.slow
def test_fsdp2_example_evaluates_saves_and_reloads(distributed, single_process):
    results, root = distributed
    fsdp = results["fsdp_causal"]
    assert fsdp["reload_max_abs_diff"] == 0.0
    expected = single_process["causal"].metrics_after["eval_response_token_accuracy"]
    assert fsdp["eval_after"]["eval_response_token_accuracy"] == expected
    saved = TinyCausalForCausalLM.from_pretrained(str(root / "fsdp_causal" / "final"))
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in saved.parameters())
    reference = runs.final_state(single_process["causal"])
    # the saved (gathered) weights are the single-process weights up to float32 reduction order (measured 1.2e-6)
    assert runs.max_state_difference(dict(saved.state_dict()), reference) < 1e-5


def test_fsdp_through_accelerate_on_cpu_is_a_clear_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the error is for machines without CUDA")
    args = runs.tiny_args("causal", tmp_path, "--fsdp", "accelerate")
    with pytest.raises(ValueError, match="--fsdp accelerate needs CUDA GPUs"):
        runs.EXAMPLES["causal"].make_trainer(args)


def test_fsdp_native_without_torchrun_is_a_clear_error(tmp_path):
    args = runs.tiny_args("causal", tmp_path, "--fsdp", "native")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=1; launch with torchrun"):
        runs.EXAMPLES["causal"].make_trainer(args)


@cuda_only
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP through accelerate needs 2 GPUs (one process each)")
def test_fsdp_through_accelerate_on_gpus_matches_single_process(tmp_path, single_process):
    out = tmp_path / "fsdp_accelerate"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
               str(runs.EXAMPLES_DIR / "finetune_causal.py"), "--tiny", "--skip-final", "--fsdp", "accelerate",
               "--max-steps", str(STEPS), "--batch-size", str(GLOBAL_BATCH // WORLD), "--output-dir", str(out)]
    subprocess.run(command, check=True, timeout=600, cwd=runs.REPO_ROOT)
    results = json.loads((out / "results.json").read_text())
    # GPU matmuls differ from the CPU reference by more than float32 reduction order
    for a, e in zip(results["losses"], loss_curve(single_process["causal"])):
        assert math.isclose(a, e, rel_tol=1e-4), (results["losses"], loss_curve(single_process["causal"]))


# ------------------------------------------------------------------------------------------------------------------
# tensor parallelism
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["causal_lm", "encoder_classifier", "encoder_mlm"])
def test_tensor_parallel_matches_single_process(distributed, name):
    results, root = distributed
    result = results[f"tp_{name}"]
    assert "error" not in result, result.get("error")
    expected = single_process_logits(name, root / f"tp_{name}")
    actual = torch.tensor(result["logits"])
    assert actual.shape == expected.shape
    difference = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert difference <= TP_RTOL * max(1.0, scale), f"{name}: tensor-parallel logits differ by {difference:.3g}"
    assert scale > 1.0  # the init is large enough that a wrong split could not hide
    config = TP_MODELS[name][1]()
    local = result["local_shapes"]
    q_proj = next(k for k in local if k.endswith("layers.0.self_attn.q_proj.weight"))
    assert local[q_proj] == [config.hidden_size // WORLD, config.hidden_size], "q_proj was not split by head"


@pytest.mark.slow
def test_tensor_parallel_request_for_seq2seq_is_a_clear_error(distributed):
    """The seq2seq family has no tensor-parallel plan (see configuration_seq2seq.py): asking for one must fail
    loudly instead of running replicated or with a wrong split."""
    results, _ = distributed
    assert "has no `tp_plan`" in results["tp_seq2seq"]["error"]


# ------------------------------------------------------------------------------------------------------------------
# device_map="auto" with CPU/disk offload
# ------------------------------------------------------------------------------------------------------------------


def test_device_map_auto_with_disk_offload_generates_the_same_tokens(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_causal_config(num_hidden_layers=4, vocab_size=256, tie_word_embeddings=False)
    model = TinyCausalForCausalLM(config).eval()
    model.save_pretrained(str(tmp_path / "model"))
    sizes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    layer = sum(v for k, v in sizes.items() if k.startswith("model.layers.0."))
    # room for the embeddings and about two blocks in "RAM"; the rest must go to disk
    budget = sizes["model.embed_tokens.weight"] + 2 * layer + layer // 2
    offloaded = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "model"),
        device_map="auto",
        max_memory={"cpu": budget},
        offload_folder=str(tmp_path / "offload"),
    ).eval()
    placements = offloaded.hf_device_map
    assert "cpu" in placements.values() and "disk" in placements.values(), placements
    assert placements.get("model.layers.0") == "cpu" and placements.get("model.layers.3") == "disk", placements
    # disk-offloaded weights live on the meta device; accelerate's hooks bring them in for each forward
    assert offloaded.model.layers[3].mlp.up_proj.weight.device.type == "meta"

    prompts = torch.tensor([[5, 17, 33, 2, 9], [0, 0, 7, 8, 9]])  # the second row left-padded
    attention_mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    settings = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = model.generate(input_ids=prompts, attention_mask=attention_mask, **settings)
    actual = offloaded.generate(input_ids=prompts, attention_mask=attention_mask, **settings)
    assert expected.shape == (2, 15)
    assert torch.equal(actual, expected)
    with torch.no_grad():
        expected_logits = model(prompts, attention_mask=attention_mask).logits
        actual_logits = offloaded(prompts, attention_mask=attention_mask).logits
    assert torch.equal(actual_logits, expected_logits)


# ------------------------------------------------------------------------------------------------------------------
# declared plans name real modules
# ------------------------------------------------------------------------------------------------------------------

ALL_MODELS = [
    (TinyCausalModel, tiny_causal_config),
    (TinyCausalForCausalLM, tiny_causal_config),
    (TinyCausalForSequenceClassification, tiny_causal_config),
    (TinyEncoderModel, tiny_encoder_config),
    (TinyEncoderForMaskedLM, tiny_encoder_config),
    (TinyEncoderForSequenceClassification, tiny_encoder_config),
    (TinyEncoderForTokenClassification, tiny_encoder_config),
    (TinyEncoderForQuestionAnswering, lambda: tiny_encoder_config(num_labels=2)),
    (TinySeq2SeqModel, tiny_seq2seq_config),
    (TinySeq2SeqForConditionalGeneration, tiny_seq2seq_config),
]


def module_paths_matching(model, rule: str) -> list[str]:
    """transformers' plan syntax: `*` stands for a layer index."""
    return [name for name, _ in model.named_modules() if name and fnmatch.fnmatchcase(name, rule)]


@pytest.mark.parametrize("model_class, make_config", ALL_MODELS, ids=[c.__name__ for c, _ in ALL_MODELS])
def test_no_split_modules_name_the_blocks(model_class, make_config):
    model = model_class(make_config())
    declared = model._no_split_modules
    assert declared, f"{model_class.__name__} declares no _no_split_modules (device_map='auto' could split a block)"
    present = {type(module).__name__ for module in model.modules()}
    for class_name in declared:
        assert class_name in present, f"{model_class.__name__}._no_split_modules names {class_name!r}, not in the model"


@pytest.mark.parametrize("model_class, make_config", ALL_MODELS, ids=[c.__name__ for c, _ in ALL_MODELS])
def test_parallel_plans_name_real_modules(model_class, make_config):
    model = model_class(make_config())
    has_tp = model_class not in (TinySeq2SeqModel, TinySeq2SeqForConditionalGeneration)
    assert bool(model.tp_plan) == has_tp, f"{model_class.__name__}.tp_plan = {model.tp_plan}"
    for rule in model.tp_plan:
        assert module_paths_matching(model, rule), f"{model_class.__name__}: tp_plan rule {rule!r} matches no module"
    assert model.fsdp_plan, f"{model_class.__name__} has no fsdp_plan"
    for rule in model.fsdp_plan:
        assert module_paths_matching(model, rule), f"{model_class.__name__}: fsdp_plan rule {rule!r} matches no module"
    blocks = {name for name, module in model.named_modules() if type(module).__name__ in model._no_split_modules}
    wrapped = {name for rule in model.fsdp_plan for name in module_paths_matching(model, rule)}
    assert blocks <= wrapped, f"{model_class.__name__}: blocks without their own FSDP unit: {sorted(blocks - wrapped)}"
