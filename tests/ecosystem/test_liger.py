"""Liger-Kernel through the ecosystem's switch (issue 42 item 4): `TrainingArguments(use_liger_kernel=True)` gives an
hf_tiny causal model what it gives official Llama (hf_tiny/liger.py). transformers' Trainer calls
`transformers.integrations.liger.apply_liger_kernel(model, liger_kernel_config)`; the tests call that function, so
they go through Liger's own table lookup exactly as Trainer does.

On the CPU, Liger's Triton kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) where
they can: its RoPE and fused linear cross-entropy do, its RMSNorm and SwiGLU do not. So the CPU checks what was
replaced (counts per config, against official models), the loss and gradients of RoPE + fused linear cross-entropy,
Trainer and TRL with those two, the failure where the kernels cannot run, and copying / saving / replicating a
patched model. The CUDA tests (marked `cuda`) check every kernel's outputs and gradients, Trainer and TRL.
"""

from __future__ import annotations

import copy
import importlib
import math
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
from transformers.dynamic_module_utils import get_class_from_dynamic_module

pytest.importorskip("liger_kernel", reason="Liger-Kernel is the optional `gpu` extra: pip install 'hf_tiny[gpu]'")

import hf_tiny  # noqa: E402, F401  (registers the Auto classes and the Liger table entry)
import deepseek_models  # noqa: E402
import gpt2_models  # noqa: E402
import gpt_oss_models  # noqa: E402
import llama4_models  # noqa: E402
import olmo2_models  # noqa: E402
import phi3_models  # noqa: E402
import smollm3_models  # noqa: E402
from causal_helpers import left_padded_batch, tiny_official  # noqa: E402
from causal_helpers import training_loss_and_grads as loss_and_grads  # noqa: E402
from conversion import gpt2, llama, phi3  # noqa: E402
from fresh_interpreter import clean_env, run_python  # noqa: E402
from markers import cuda_only  # noqa: E402
from tolerances import model_reduction_length, relative_error as relative, rounding_bound  # noqa: E402
from tolerances import worst_relative_error as worst  # noqa: E402
from transformers.integrations.liger import apply_liger_kernel  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_torch_thread", "official_modules_restored")

# The kernels that run under Triton's interpreter (its RMSNorm, SwiGLU and GEGLU kernels do not). The interpreter runs
# each kernel program in Python (its RoPE: ~50 ms per token and layer), so the CPU tests keep models and batches small.
CPU_KERNELS = {"rms_norm": False, "swiglu": False, "geglu": False}
LOSS_ONLY = {**CPU_KERNELS, "rope": False}
SHORT_ROWS = (8, 5, 3)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not torch.cuda.is_available() and not INTERPRETED,
                                       reason="Liger's kernels run on CUDA or under Triton's interpreter (TRITON_INTERPRET=1)")


@pytest.fixture
def official_modules_restored():
    """Liger patches official modeling modules process-wide even when given a model instance (modeling_llama's
    LlamaRMSNorm, LlamaMLP and apply_rotary_pos_emb become Liger's): put them back after each test, so that later
    tests build official models as transformers defines them. Every modeling module Liger has an apply function
    for is imported first, so that its state before the test is known (transformers' top-level classes keep the
    module they were defined in, whatever sys.modules holds later)."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    from transformers.loss import loss_utils
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    for model_type in MODEL_TYPE_TO_APPLY_LIGER_FN:
        name = model_type_to_module_name(model_type)
        try:
            importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:  # a model this transformers does not have
            pass
    modules = [module for name, module in list(sys.modules.items())
               if name.startswith("transformers.models.") and name.rsplit(".", 1)[-1].startswith("modeling_")]
    saved = {module: dict(vars(module)) for module in modules}
    cross_entropy = loss_utils.nn.functional.cross_entropy
    yield
    for module, namespace in saved.items():
        for name in set(vars(module)) - set(namespace):
            delattr(module, name)
        vars(module).update(namespace)
    loss_utils.nn.functional.cross_entropy = cross_entropy


def swaps(model) -> dict:
    """What runs Liger's code in a model, read off its modules: the classes Liger names its patched modules after
    (`_get_name`), attention modules whose rotation is Liger's (ours: `_positioned`), and the loss (ours:
    `_chunked_loss`; official: the model's forward, Liger's lce_forward)."""
    found = Counter(module._get_name() for module in model.modules() if "_get_name" in vars(module))
    found["rope"] = sum("_positioned" in vars(module) for module in model.modules())
    found["loss"] = int("_chunked_loss" in vars(model) or "forward" in vars(model))
    return dict(+found)


def official_swaps(official) -> dict:
    """swaps() of an official model after the switch; Liger's RoPE for official models is a module-level function
    of the modeling file, counted for every layer when Liger replaced it."""
    modeling = sys.modules[type(official).__module__]
    rotation = getattr(modeling, "apply_rotary_pos_emb", None)
    apply_liger_kernel(official, None)
    found = swaps(official)
    if getattr(modeling, "apply_rotary_pos_emb", None) is not rotation:
        found["rope"] = official.config.num_hidden_layers
    return found


def converted(official, converter):
    folder = Path(tempfile.mkdtemp())
    official.save_pretrained(folder / "src")
    converter.convert(folder / "src", folder / "ours")
    return AutoModelForCausalLM.from_pretrained(folder / "ours")


# config -> (official model, ours from it, what the switch replaces in ours, what it replaces in official).
# Counted by hand from the configs' layers: L layers give 2 L + 1 norms with pre-norms only (Gemma 3 and OLMo 2 add
# output norms, Qwen3 / Gemma 3 / OLMo 2 q and k norms, DeepSeek's MLA two norms per layer), one feed-forward per
# layer or per expert, RoPE on each rotary layer.
CONFIGS = {
    "llama": (lambda: tiny_official("llama", num_hidden_layers=3), lambda o: converted(o, llama),
              {"LigerRMSNorm": 7, "LigerSwiGLUMLP": 3, "rope": 3, "loss": 1},
              {"LigerRMSNorm": 7, "LigerSwiGLUMLP": 3, "rope": 3, "loss": 1}),
    "qwen3": (lambda: tiny_official("qwen3", head_dim=16), lambda o: converted(o, llama),
              {"LigerRMSNorm": 9, "LigerSwiGLUMLP": 2, "rope": 2, "loss": 1},
              {"LigerRMSNorm": 9, "LigerSwiGLUMLP": 2, "rope": 2, "loss": 1}),
    "gemma3": (lambda: tiny_official("gemma3_text", head_dim=16, final_logit_softcapping=30.0),
               lambda o: converted(o, llama),
               {"LigerRMSNorm": 13, "LigerGEGLUMLP": 2, "rope": 2, "loss": 1},
               {"LigerRMSNorm": 13, "LigerGEGLUMLP": 2, "rope": 2, "loss": 1}),
    # official: one fused LigerExperts per layer; ours: each expert its own SwiGLU feed-forward
    "mixtral": (lambda: tiny_official("mixtral", num_local_experts=4, num_experts_per_tok=2),
                lambda o: converted(o, llama),
                {"LigerRMSNorm": 5, "LigerSwiGLUMLP": 8, "rope": 2, "loss": 1},
                {"LigerRMSNorm": 5, "LigerExperts": 2, "rope": 2, "loss": 1}),
    # official: Liger's instance patch leaves OLMo 2's q / k norms (over the whole projection) as they are
    "olmo2": (lambda: olmo2_models.tiny_olmo2("gqa"), olmo2_models.ours_for,
              {"LigerRMSNorm": 13, "LigerSwiGLUMLP": 3, "rope": 3, "loss": 1},
              {"LigerRMSNorm": 7, "LigerSwiGLUMLP": 3, "rope": 3, "loss": 1}),
    # official Phi-3 fuses gate and up into one projection (LigerPhi3SwiGLUMLP); ours keeps Llama's two
    "phi3": (phi3_models.tiny_phi3, lambda o: converted(o, phi3),
             {"LigerRMSNorm": 5, "LigerSwiGLUMLP": 2, "rope": 2, "loss": 1},
             {"LigerRMSNorm": 5, "LigerPhi3SwiGLUMLP": 2, "rope": 2, "loss": 1}),
    # every 4th SmolLM3 layer has no RoPE (official's module-level patch is counted on all 4 layers; 2 rotate)
    "smollm3": (lambda: smollm3_models.tiny_smollm3(next(iter(smollm3_models.VARIANTS))), smollm3_models.ours_for,
                {"LigerRMSNorm": 9, "LigerSwiGLUMLP": 4, "rope": 2, "loss": 1},
                {"LigerRMSNorm": 9, "LigerSwiGLUMLP": 4, "rope": 4, "loss": 1}),
    # GPT-OSS's clamped SwiGLU experts: no Liger kernel on either side
    "gpt_oss": (gpt_oss_models.tiny_official, gpt_oss_models.ours_from,
                {"LigerRMSNorm": 5, "rope": 2, "loss": 1}, {"LigerRMSNorm": 5, "rope": 2, "loss": 1}),
    # MLA keeps our rotation (its rope part is a slice of the head); 1 dense layer + 2 MoE layers of 8 experts and a
    # shared expert
    "deepseek_v3": (lambda: deepseek_models.tiny_deepseek("mla_moe"), lambda o: converted(o, llama),
                    {"LigerRMSNorm": 13, "LigerSwiGLUMLP": 19, "loss": 1},
                    {"LigerRMSNorm": 13, "LigerQwen3MoeSwiGLUMLP": 3, "LigerExperts": 2, "loss": 1}),
    # Llama 4: RoPE then a weightless norm (kept, with our rotation); official patches its class's forward for the
    # loss and its own complex RoPE, which the instance counts do not see
    "llama4_text": (lambda: llama4_models.tiny_llama4(next(iter(llama4_models.VARIANTS))), llama4_models.ours_for,
                    {"LigerRMSNorm": 9, "LigerSwiGLUMLP": 16, "loss": 1},
                    {"LigerRMSNorm": 9, "LigerSwiGLUMLP": 4}),
    # GPT-2 (LayerNorm, GELU, learned positions): Liger has no apply function for it; ours keeps all but the loss
    "gpt2": (gpt2_models.tiny_gpt2, lambda o: converted(o, gpt2), {"loss": 1}, {}),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_switch_replaces_what_it_replaces_on_official_models(name):
    make_official, make_ours, expected_ours, expected_official = CONFIGS[name]
    official = make_official()
    ours = make_ours(official)
    apply_liger_kernel(ours, None)
    assert swaps(ours) == expected_ours
    assert official_swaps(official) == expected_official


def test_the_apply_function_reports_what_it_replaced_and_refuses_what_liger_refuses():
    from hf_tiny.liger import apply_liger_kernel_to_hf_tiny

    ours = converted(tiny_official("llama", num_hidden_layers=3), llama)
    replaced = apply_liger_kernel_to_hf_tiny(model=ours)
    assert replaced == {"rms_norm": 7, "swiglu": 3, "rope": 3, "fused_linear_cross_entropy": 1}
    with pytest.raises(ValueError, match="cross_entropy and fused_linear_cross_entropy"):
        apply_liger_kernel_to_hf_tiny(cross_entropy=True, model=ours)
    # cross_entropy=True is Liger's process-wide swap of the cross-entropy transformers' losses call, as for Llama
    from liger_kernel.transformers.functional import liger_cross_entropy
    from transformers.loss import loss_utils

    assert loss_utils.nn.functional.cross_entropy is not liger_cross_entropy
    apply_liger_kernel(ours, {"cross_entropy": True, "fused_linear_cross_entropy": False})
    assert loss_utils.nn.functional.cross_entropy is liger_cross_entropy
    with pytest.raises(ValueError, match="model instance.*apply_liger_kernel_to_hf_tiny\\(model=model\\)"):
        apply_liger_kernel_to_hf_tiny()


# ---- the table entry ----------------------------------------------------------------------------------------------

REGISTERED = """
import sys
import hf_tiny
assert "liger_kernel" not in sys.modules, "importing hf_tiny imported Liger"
from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
import hf_tiny.liger
assert MODEL_TYPE_TO_APPLY_LIGER_FN["hf_tiny_causal"] is hf_tiny.liger.apply_liger_kernel_to_hf_tiny
"""


@pytest.mark.slow
def test_importing_hf_tiny_does_not_import_liger_and_liger_finds_hf_tiny_when_imported_later(tmp_path):
    """Importing hf_tiny does not import Liger (seconds of Triton kernels): the entry appears in Liger's table when
    Liger's table module is imported, later (a fresh interpreter)."""
    run_python(REGISTERED, cwd=tmp_path, env=clean_env({"TRITON_INTERPRET": "1"}), isolated=False)


def test_hf_tiny_registers_at_once_when_liger_is_imported_already(monkeypatch):
    from liger_kernel.transformers import monkey_patch

    from hf_tiny.liger import apply_liger_kernel_to_hf_tiny, register_liger_kernels

    monkeypatch.delitem(monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN, "hf_tiny_causal", raising=False)
    register_liger_kernels()
    assert monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN["hf_tiny_causal"] is apply_liger_kernel_to_hf_tiny


WITHOUT_LIGER = """
import importlib.abc, sys

class NoLiger(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "liger_kernel":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoLiger())
import torch, hf_tiny
model = hf_tiny.TinyCausalForCausalLM(hf_tiny.TinyCausalConfig(vocab_size=97, hidden_size=32, intermediate_size=48,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).train()
ids = torch.randint(3, 97, (2, 6))
model(input_ids=ids, labels=ids).loss.backward()
model.save_pretrained(sys.argv[1])
reloaded = transformers_model = __import__("transformers").AutoModelForCausalLM.from_pretrained(sys.argv[1])
from transformers.integrations.liger import apply_liger_kernel
try:
    apply_liger_kernel(model, None)
except ImportError as error:
    print("IMPORT ERROR:", error)
"""


@pytest.mark.slow
def test_without_liger_hf_tiny_works_and_the_switch_fails_with_transformers_import_error(tmp_path):
    """Liger is optional: a machine without it imports, trains, saves and loads hf_tiny; the switch raises an
    ImportError there, as it does for official Llama (transformers' is_liger_kernel_available reads the installed
    metadata, so the import itself is what fails here)."""
    result = run_python(WITHOUT_LIGER, cwd=tmp_path, env=clean_env(), isolated=False, args=(str(tmp_path / "saved"),))
    assert "IMPORT ERROR: No module named 'liger_kernel" in result.stdout, result.stdout


def test_switch_without_the_package_fails_as_on_official_llama(monkeypatch):
    monkeypatch.setattr(transformers.integrations.liger, "is_liger_kernel_available", lambda: False)
    errors = []
    for model in (tiny_official("llama"), converted(tiny_official("llama"), llama)):
        with pytest.raises(ImportError) as raised:
            apply_liger_kernel(model, None)
        errors.append(str(raised.value))
    assert errors[0] == errors[1] and "liger-kernel" in errors[0]


# ---- numerics on the CPU: RoPE and fused linear cross-entropy under Triton's interpreter ---------------------------


def pair(layers: int = 3, seed: int = 0, **overrides):
    """(official Llama, ours with its weights), training mode."""
    official = tiny_official("llama", num_hidden_layers=layers, seed=seed, **overrides).train()
    return official, converted(official, llama).train()


@needs_interpreter
@pytest.mark.parametrize("trainer_normalisation", [False, True], ids=["mean", "num_items_in_batch"])
def test_liger_rope_and_fused_cross_entropy_train_as_ours_and_as_official_llama_with_liger(trainer_normalisation):
    """fp32; loss and every gradient of ours with Liger's RoPE and fused linear cross-entropy equal ours without
    (the chunked loss) and official Llama with the same kernels, within the rounding bound of a training step
    (tolerances.py: sums in another order). The runtime's recompute stays off in the layers Liger runs in: replayed,
    a layer would rotate q and k twice (Liger's RoPE writes them in place), gradients off by 1e3 (measured)."""
    official, ours = pair(layers=2)
    batch = left_padded_batch(97, SHORT_ROWS)
    extra = {"num_items_in_batch": torch.tensor(11)} if trainer_normalisation else {}
    bound = rounding_bound(torch.float32, model_reduction_length(ours.config, batch["input_ids"].numel(), training_step=True))
    plain_loss, plain_grads = loss_and_grads(ours, batch, **extra)
    for model in (ours, official):
        apply_liger_kernel(model, CPU_KERNELS)
    assert swaps(ours) == {"rope": 2, "loss": 1}
    loss, grads = loss_and_grads(ours, batch, **extra)
    official_loss, official_grads = loss_and_grads(official, batch, **extra)
    assert relative(loss, plain_loss) <= bound and worst(grads, plain_grads) <= bound
    assert relative(loss, official_loss) <= bound and worst(grads, official_grads) <= bound
    # negative control: another RoPE base moves the gradients far past the bound
    _, other = pair(layers=2, rope_parameters={"rope_type": "default", "rope_theta": 100.0})
    assert worst(loss_and_grads(other, batch, **extra)[1], grads) > 1e3 * bound


@cuda_only
def test_cuda_liger_fused_cross_entropy_soft_caps_gemma_logits_as_our_chunked_loss():
    """fp32 on CUDA (the soft-capping branch of Liger's kernel does not run under Triton's interpreter)."""
    official = tiny_official("gemma3_text", head_dim=16, final_logit_softcapping=3.0).train()
    ours = converted(official, llama).cuda().train()
    batch = {k: v.cuda() for k, v in left_padded_batch(97).items()}
    bound = rounding_bound(torch.float32, model_reduction_length(ours.config, batch["input_ids"].numel(), training_step=True))
    plain_loss, plain_grads = loss_and_grads(ours, batch)
    apply_liger_kernel(ours, {"rms_norm": False, "swiglu": False, "geglu": False, "rope": False})
    assert swaps(ours) == {"loss": 1}
    loss, grads = loss_and_grads(ours, batch)
    assert relative(loss, plain_loss) <= bound and worst(grads, plain_grads) <= bound
    ours.config.final_logit_softcapping = 30.0  # negative control: the cap the loss reads
    assert relative(loss_and_grads(ours, batch)[0], plain_loss) > 1e3 * bound


class Rows(torch.utils.data.Dataset):
    def __init__(self, count: int = 4, length: int = 6):
        generator = torch.Generator().manual_seed(3)
        self.ids = torch.randint(3, 97, (count, length), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def trained_losses(model, output_dir, use_cpu: bool = True, **arguments) -> list[float]:
    args = TrainingArguments(output_dir=str(output_dir), use_cpu=use_cpu, max_steps=3, per_device_train_batch_size=2,
                             learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
                             seed=0, data_seed=0, **arguments)
    trainer = Trainer(model=model, args=args, train_dataset=Rows())
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@needs_interpreter
def test_trainer_use_liger_kernel_trains_ours_as_official_llama(tmp_path):
    """TrainingArguments(use_liger_kernel=True) with Liger's fused linear cross-entropy (RoPE: the test above and
    TRL's below): three steps of ours, of ours without Liger and of official Llama with Liger give the same losses
    (the logged losses are rounded to 4 digits)."""
    official, ours = pair()
    plain = copy.deepcopy(ours)
    switch = dict(use_liger_kernel=True, liger_kernel_config=LOSS_ONLY)
    with_liger = trained_losses(ours, tmp_path / "ours", **switch)
    assert swaps(ours) == {"loss": 1}
    assert with_liger == pytest.approx(trained_losses(official, tmp_path / "official", **switch), rel=1e-4)
    assert with_liger == pytest.approx(trained_losses(plain, tmp_path / "plain"), rel=1e-4)
    assert len(with_liger) == 3 and with_liger[-1] < with_liger[0]


def word_tokenizer():
    """"t3 t17" -> [3, 17] over the 97 ids of the tiny models (0 pad, 1 bos, 2 eos), without downloads."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, 97)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>")


def needs_trl() -> None:
    """Skips where TRL or datasets is missing (the GPU image has neither), before any pytest.warns block."""
    pytest.importorskip("trl", reason="TRL is not installed here")
    pytest.importorskip("datasets", reason="datasets (TRL's dataset type) is not installed here")


def sft_losses(model, output_dir, **arguments) -> list[float]:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    texts = [" ".join(f"t{int(i)}" for i in row) for row in Rows().ids]
    args = SFTConfig(output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=2, logging_steps=1,
                     report_to=[], save_strategy="no", disable_tqdm=True, **arguments)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list([{"text": t} for t in texts]),
                         processing_class=word_tokenizer())
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@needs_interpreter
def test_trl_sft_config_use_liger_kernel_trains_ours_as_official_llama(tmp_path):
    """TRL's SFTConfig(use_liger_kernel=True) passes the switch on, with fused_linear_cross_entropy=False (TRL puts
    its own fused LM head on the model): Liger's RoPE in ours, the losses of official Llama with the same switch."""
    needs_trl()
    official, ours = pair(layers=1)
    switch = dict(use_liger_kernel=True, liger_kernel_config=CPU_KERNELS, use_cpu=True, bf16=False)
    with pytest.warns(FutureWarning, match="use_liger_kernel"):
        ours_losses = sft_losses(ours, tmp_path / "ours", **switch)
    assert sum("_positioned" in vars(module) for module in ours.modules()) == 1
    assert "_chunked_loss" not in vars(ours)
    assert ours_losses == pytest.approx(sft_losses(official, tmp_path / "official", **switch), rel=1e-4)


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's error is what a CPU run without a GPU shows here")
def test_switch_fails_on_the_cpu_as_on_official_llama():
    """With every default kernel, Liger's RMSNorm cannot run on CPU tensors: ours fails at the first forward with
    the error official Llama fails with (Triton's; without the interpreter it is "0 active drivers")."""
    errors = []
    for model in pair():
        apply_liger_kernel(model, None)
        ids = torch.randint(3, 97, (2, 6))
        with pytest.raises(Exception) as raised:
            model(input_ids=ids, labels=ids)
        errors.append((type(raised.value), str(raised.value)))
    assert errors[0] == errors[1]
    assert errors[0][0].__module__.startswith("triton")


# ---- copying, saving and replicating a patched model -------------------------------------------------------------


def test_patched_model_deep_copies_saves_and_replicates_no_worse_than_official_llama(tmp_path):
    official, ours = pair()
    apply_liger_kernel(official, None)
    apply_liger_kernel(ours, None)
    # deepcopy: the copy's Liger forwards are bound to the copy's modules, as official Llama's
    for model, patched in ((official, official.model.norm), (ours, ours.model.norm)):
        clone = copy.deepcopy(model)
        assert clone.model.norm.forward.__self__ is clone.model.norm and patched.forward.__self__ is patched
    clone = copy.deepcopy(ours)
    assert clone._chunked_loss.__self__ is clone and clone.model.layers[0].mlp.forward.__self__ is clone.model.layers[0].mlp
    # save_pretrained writes the weights under their names; a reload is an unpatched model with the same weights
    ours.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert swaps(reloaded) == {}
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in ours.state_dict().items())
    # DataParallel's replicas copy each module's __dict__: a Liger forward bound to the original module runs the
    # original's parameters. Official Llama has every patched module (and the model) so; ours no more modules
    # (our RoPE is a plain function, bound to nothing).
    assert bound_to_original(ours) <= bound_to_original(official)


def bound_to_original(model) -> int:
    """Methods a DataParallel replica would run on the original module, Liger's (the runtime's are runtime.py's)."""
    count = 0
    for module in model.modules():
        replica = module._replicate_for_data_parallel()
        count += sum(getattr(value, "__self__", None) is module
                     and not getattr(value.__func__, "hf_tiny_runtime", False) for value in vars(replica).values())
    return count


def test_a_remote_code_copy_is_patched_by_its_own_code(tmp_path):
    """A folder loaded with trust_remote_code=True runs its shipped copy of hf_tiny (other classes than the
    installed package's): the switch still reaches its modules (the table's function hands the model to its copy)."""
    ours = converted(tiny_official("llama", num_hidden_layers=3), llama)
    ours.save_pretrained(tmp_path / "saved")
    # the class trust_remote_code=True loads where hf_tiny is not registered (here the Auto classes know hf_tiny's)
    shipped_class = get_class_from_dynamic_module("modeling_causal.TinyCausalForCausalLM", tmp_path / "saved")
    shipped = shipped_class.from_pretrained(tmp_path / "saved")
    assert type(shipped).__module__ != type(ours).__module__ and type(shipped).__module__.endswith("modeling_causal")
    apply_liger_kernel(shipped, None)
    apply_liger_kernel(ours, None)
    assert swaps(shipped) == swaps(ours) == {"LigerRMSNorm": 7, "LigerSwiGLUMLP": 3, "rope": 3, "loss": 1}


# ---- CUDA: every kernel ----------------------------------------------------------------------------------------


def cuda_pair(name: str, dtype: torch.dtype):
    make_official, make_ours, _, _ = CONFIGS[name]
    official = make_official()
    ours = make_ours(official)
    return official.to("cuda", dtype).train(), ours.to("cuda", dtype).train()


def logits_and_training(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    with torch.no_grad():
        logits = model(**batch).logits[batch["attention_mask"].bool()].float()
    loss, grads = loss_and_grads(model, batch)
    return logits, loss.float(), {name: grad.float() for name, grad in grads.items()}


def liger_error(model, batch) -> tuple[float, float, float]:
    """(logits, loss, worst gradient) relative error of the model with Liger against the same model without."""
    plain = logits_and_training(model, batch)
    apply_liger_kernel(model, None)
    patched = logits_and_training(model, batch)
    return relative(patched[0], plain[0]), relative(patched[1], plain[1]), worst(patched[2], plain[2])


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3", "mixtral", "olmo2"])
def test_cuda_liger_changes_ours_no_more_than_it_changes_official(name, dtype):
    """Logits, loss and gradients with Liger against without, for ours and for official on the same weights: ours
    moves at most twice as far as official does (+ one rounding step of the dtype), and every kernel ran (counts)."""
    official, ours = cuda_pair(name, dtype)
    batch = {k: v.cuda() for k, v in left_padded_batch(97).items()}
    for model in (official, ours):
        model.set_attn_implementation("sdpa")
    official_errors = liger_error(official, batch)
    errors = liger_error(ours, batch)
    assert swaps(ours) == CONFIGS[name][2]
    slack = torch.finfo(dtype).eps * 8
    for what, error, reference in zip(("logits", "loss", "gradients"), errors, official_errors):
        assert error <= 2 * reference + slack, (what, error, reference)


@cuda_only
def test_cuda_trainer_use_liger_kernel_bf16_trains_as_official(tmp_path):
    official, ours = (model.cuda() for model in pair())
    switch = dict(use_liger_kernel=True, bf16=True, use_cpu=False)
    ours_losses = trained_losses(ours, tmp_path / "ours", **switch)
    official_losses = trained_losses(official, tmp_path / "official", **switch)
    assert swaps(ours) == {"LigerRMSNorm": 7, "LigerSwiGLUMLP": 3, "rope": 3, "loss": 1}
    assert all(math.isfinite(loss) for loss in ours_losses) and len(ours_losses) == 3
    assert ours_losses == pytest.approx(official_losses, rel=2e-2)


@cuda_only
def test_cuda_trl_sft_config_use_liger_kernel_trains_as_official(tmp_path):
    """TRL's default bf16 SFT with use_liger_kernel=True: Liger's RMSNorm, SwiGLU and RoPE in ours (TRL turns the
    fused linear cross-entropy off for its own fused LM head), first loss as official Llama's with the same switch."""
    needs_trl()
    official, ours = pair()
    with pytest.warns(FutureWarning, match="use_liger_kernel"):
        ours_losses = sft_losses(ours, tmp_path / "ours", use_liger_kernel=True)
    found = swaps(ours)
    assert (found["LigerRMSNorm"], found["LigerSwiGLUMLP"], found["rope"]) == (7, 3, 3)
    assert "_chunked_loss" not in vars(ours)
    official_losses = sft_losses(official, tmp_path / "official", use_liger_kernel=True)
    assert all(math.isfinite(loss) for loss in ours_losses)
    assert ours_losses[0] == pytest.approx(official_losses[0], rel=2e-2)
