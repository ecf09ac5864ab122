"""Off the CPU no runtime path is on by default (runtime.ON_BY_DEFAULT), and hf_tiny runs its math: a training step
and a prefill keep no more memory than official Llama's. Counted on the CPU in bfloat16 as the most bytes of storage
a call allocates and holds at once (runtime_checks.LiveBytes: what torch.cuda.max_memory_allocated measures, without
the allocator's rounding); the GPU check measures the device itself."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_tiny  # noqa: F401  (registers the Auto classes)
from causal_helpers import official_and_converted, tiny_official
from runtime_checks import LiveBytes, peak_bytes

pytestmark = pytest.mark.usefixtures("single_torch_thread")

BATCH, LENGTH = 2, 96


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    folder = official_and_converted(tiny_official("llama"), tmp_path_factory.mktemp("memory_off_the_cpu"))
    official = AutoModelForCausalLM.from_pretrained(folder / "official", dtype=torch.bfloat16)
    ours = AutoModelForCausalLM.from_pretrained(folder / "ours", dtype=torch.bfloat16)
    ours.set_runtime(False)  # every path off, as on a GPU
    return {"official": official, "ours": ours}


def ids_for(model) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (BATCH, LENGTH), generator=torch.Generator().manual_seed(0))


def training_step(model):
    ids = ids_for(model)

    def step():
        model.train()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def prefill(model):
    ids = ids_for(model)

    @torch.no_grad()
    def forward():
        model.eval()
        return model(input_ids=ids, use_cache=False, logits_to_keep=1).logits

    return forward


@pytest.mark.parametrize("call", [training_step, prefill])
def test_no_more_memory_than_official_with_a_gpus_paths(sides, call):
    peaks = {name: peak_bytes(call(model)) for name, model in sides.items()}
    assert 0 < peaks["ours"] <= peaks["official"], peaks


def test_negative_control_the_count_sees_what_a_call_keeps(sides):
    """A hook that keeps a copy of one layer's output raises the peak by that copy's bytes at least."""
    model, kept = sides["ours"], []
    plain = peak_bytes(training_step(model))
    layer = model.model.layers[0]
    handle = layer.register_forward_hook(lambda module, args, output: kept.append(output.detach().clone()))
    try:
        with LiveBytes() as mode:
            training_step(model)()
    finally:
        handle.remove()
    copy_bytes = kept[0].untyped_storage().nbytes()
    assert copy_bytes == BATCH * LENGTH * model.config.hidden_size * 2  # bfloat16
    assert mode.peak >= plain + copy_bytes and mode.current >= copy_bytes  # the copy outlives the step
