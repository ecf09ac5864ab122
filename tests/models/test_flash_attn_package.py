"""attn_implementation="flash_attention_2" with the flash-attn package (issue 42 item 4): the name is our flash backend,
which runs the package's kernels on CUDA when it is installed. On the CPU the wiring is checked with a stand-in package
(tests/helpers/fake_flash_attn.py: the package's entry points computed with CPU math): chosen at load time and at run
time, padded batches through the varlen entry point, generation and a training step, all equal to sdpa. The CUDA tests
(marked `cuda`, skipped without the package) run the real kernels in bf16 against sdpa.

transformers' own FlashAttention names (flash_attention_3, hub kernels) are transformers' functions: its package checks
and errors apply to them, as on official models.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_tiny  # noqa: F401  (registers the Auto classes)
from causal_helpers import left_padded_batch, official_and_converted, real_logits, tiny_official
from causal_helpers import training_loss_and_grads as loss_and_grads
from fake_flash_attn import FakeFlashAttn, flash_on_cpu
from markers import cuda_only
from tolerances import model_reduction_length, relative_error as relative, rounding_bound
from tolerances import worst_relative_error as worst

pytestmark = pytest.mark.usefixtures("single_torch_thread")

GREEDY = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return official_and_converted(tiny_official("llama"), tmp_path_factory.mktemp("flash_attn_package"))


# ---- transformers' flash names ---------------------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("flash_attn_interface") is not None, reason="FlashAttention 3 is installed")
def test_transformers_flash_attention_3_refuses_as_on_official_llama(folders):
    """Without its package, flash_attention_3 is refused when asked for (load or switch) with transformers' error, as
    for official Llama; not accepted and then failing at the first forward with a bare ModuleNotFoundError."""
    errors = []
    for side in ("official", "ours"):
        with pytest.raises(ImportError) as at_load:
            AutoModelForCausalLM.from_pretrained(folders / side, attn_implementation="flash_attention_3")
        model = AutoModelForCausalLM.from_pretrained(folders / side)
        with pytest.raises(ImportError) as at_switch:
            model.set_attn_implementation("flash_attention_3")
        errors.append((str(at_load.value), str(at_switch.value)))
    assert errors[0] == errors[1]
    assert "FlashAttention3" in errors[1][0] and "installed" in errors[1][0]


# ---- the package's entry points on the CPU (a stand-in) ---------------------------------------------------------


def test_flash_attention_2_at_load_time_runs_the_package_varlen_for_padding_and_dense_without(folders):
    batch = left_padded_batch(97)
    sdpa = AutoModelForCausalLM.from_pretrained(folders / "ours", attn_implementation="sdpa").eval()
    package = FakeFlashAttn()
    with pytest.MonkeyPatch.context() as patch:
        flash_on_cpu(patch, package=package)
        flash = AutoModelForCausalLM.from_pretrained(folders / "ours", attn_implementation="flash_attention_2").eval()
        assert flash.config._attn_implementation == "flash_attention_2"
        bound = rounding_bound(torch.float32, model_reduction_length(flash.config, batch["input_ids"].shape[1]))
        assert relative(real_logits(flash, batch), real_logits(sdpa, batch)) <= bound
        assert package.calls and set(package.calls) == {"varlen"}  # every layer of a padded batch: varlen
        package.calls.clear()
        ids = batch["input_ids"][:1]
        unpadded = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        assert relative(real_logits(flash, unpadded), real_logits(sdpa, unpadded)) <= bound
        assert set(package.calls) == {"dense"}
        # negative control: the comparison sees a change of one layer's keys
        with torch.no_grad():
            flash.model.layers[0].self_attn.k_proj.weight.mul_(1.01)
        assert relative(real_logits(flash, batch), real_logits(sdpa, batch)) > 10 * bound


def test_flash_attention_2_switched_at_run_time_generates_and_trains_as_sdpa(folders):
    batch = left_padded_batch(97, (9, 6, 3), seed=1)
    model = AutoModelForCausalLM.from_pretrained(folders / "ours", attn_implementation="sdpa").eval()
    expected_tokens = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], **GREEDY)
    expected_loss, expected_grads = loss_and_grads(model, batch)
    package = FakeFlashAttn()
    with pytest.MonkeyPatch.context() as patch:
        flash_on_cpu(patch, package=package)
        model.set_attn_implementation("flash_attention_2")
        tokens = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], **GREEDY)
        decoding_calls = len(package.calls)
        loss, grads = loss_and_grads(model, batch)
    assert torch.equal(tokens, expected_tokens)
    assert decoding_calls >= GREEDY["max_new_tokens"] * model.config.num_hidden_layers  # prefill and every step
    tokens_in_batch = batch["input_ids"].numel()
    bound = rounding_bound(torch.float32, model_reduction_length(model.config, tokens_in_batch, training_step=True))
    assert relative(loss, expected_loss) <= bound and worst(grads, expected_grads) <= bound


# ---- CUDA: the real package ------------------------------------------------------------------------------------


@pytest.fixture
def flash_attn_spy(monkeypatch):
    """The flash-attn package with its two entry points counted (the calls go on to the real kernels)."""
    flash_attn = pytest.importorskip("flash_attn", reason="the flash-attn package (the `gpu` extra) is not installed")
    calls = []
    for name in ("flash_attn_func", "flash_attn_varlen_func"):
        real = getattr(flash_attn, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(flash_attn, name, spy)
    return calls


def cuda_model(folder: Path, backend: str, dtype=torch.bfloat16):
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation=backend, dtype=dtype).cuda().eval()


def cuda_batch() -> dict:
    return {k: v.cuda() for k, v in left_padded_batch(97).items()}


@cuda_only
def test_cuda_flash_attn_package_logits_within_bf16_of_sdpa(folders, flash_attn_spy):
    """bf16, left-padded batch: |flash - fp32 reference| at most twice sdpa's bf16 error (+1e-3), through the
    package's varlen kernel; at load time and switched at run time."""
    batch = cuda_batch()
    reference = real_logits(cuda_model(folders / "ours", "sdpa", torch.float32), batch)
    budget = 2 * relative(real_logits(cuda_model(folders / "ours", "sdpa"), batch).float(), reference) + 1e-3
    loaded = cuda_model(folders / "ours", "flash_attention_2")
    assert relative(real_logits(loaded, batch).float(), reference) <= budget
    assert "flash_attn_varlen_func" in flash_attn_spy
    flash_attn_spy.clear()
    switched = cuda_model(folders / "ours", "sdpa")
    switched.set_attn_implementation("flash_attention_2")
    assert relative(real_logits(switched, batch).float(), reference) <= budget and flash_attn_spy


@cuda_only
def test_cuda_flash_attn_package_generates_sdpa_tokens(folders, flash_attn_spy):
    batch = cuda_batch()
    tokens = {}
    for backend in ("sdpa", "flash_attention_2"):
        model = cuda_model(folders / "ours", backend)
        tokens[backend] = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], **GREEDY)
    assert flash_attn_spy and torch.equal(tokens["flash_attention_2"], tokens["sdpa"])


@cuda_only
def test_cuda_flash_attn_package_training_step_within_bf16_of_sdpa(folders, flash_attn_spy):
    """Loss and gradients in bf16 against fp32 sdpa: flash's error at most twice bf16 sdpa's (+1e-2 for gradients,
    which bf16 rounds at every layer)."""
    batch = cuda_batch()
    reference_loss, reference_grads = loss_and_grads(cuda_model(folders / "ours", "sdpa", torch.float32), batch)
    sdpa_loss, sdpa_grads = loss_and_grads(cuda_model(folders / "ours", "sdpa"), batch)
    flash_loss, flash_grads = loss_and_grads(cuda_model(folders / "ours", "flash_attention_2"), batch)
    assert flash_attn_spy
    assert relative(flash_loss.float(), reference_loss) <= 2 * relative(sdpa_loss.float(), reference_loss) + 1e-3
    as_float = lambda grads: {name: grad.float() for name, grad in grads.items()}  # noqa: E731
    assert worst(as_float(flash_grads), reference_grads) <= 2 * worst(as_float(sdpa_grads), reference_grads) + 1e-2
