"""The runtime's fit_memory path (hf_tiny/memory_fit.py): a training forward that would not fit the device's memory
chunks its loss, then replays whole the layers that do not fit; where everything fits nothing changes.

The CPU's memory is not counted by torch, so the device's counters are stood in for: `allocated_bytes` grows by
STEP at every read (about what a plain layer keeps between two reads), and `device_memory` gives the bytes free at the
start. The decisions below follow from those numbers by hand; what a replay computes is checked against the plain step
(bit for bit: it reruns the same kernels). On a GPU, benchmarks/gpu_check.py measures the real thing.
"""

from __future__ import annotations

import pytest
import torch

from hf_tiny import memory_fit, runtime
from hf_tiny.transformers_api import enable_activation_checkpointing
from runtime_checks import batch, replicate_on_cpu, training_step
from hf_tiny import TinyCausalConfig, TinyCausalForCausalLM
from runtime_models import CAUSAL_VARIANTS, SIZES, causal_model

pytestmark = pytest.mark.usefixtures("single_torch_thread")

STEP = 100
ONLY_FIT = dict(fit_memory=True, recompute=False, chunked_loss=False, in_place=False, few_rows=False)


@pytest.fixture
def counted_memory(monkeypatch):
    """The stand-in counters; returns the list of replayed layers (their checkpoint calls) and the plans' reads."""
    reads, replays = [], []
    state = {"allocated": 0, "available": 0}

    def allocated_bytes(device):
        reads.append(device)
        value = state["allocated"]
        state["allocated"] += STEP
        return value

    def device_memory(device):
        state["allocated"] = 0
        return 0, state["available"]

    real_checkpoint = memory_fit.checkpoint

    def counted_checkpoint(*args, **kwargs):
        replays.append(args[1])
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(runtime, "counts_memory", lambda device: True)
    monkeypatch.setattr(memory_fit, "allocated_bytes", allocated_bytes)
    monkeypatch.setattr(memory_fit, "device_memory", device_memory)
    real_census = memory_fit.census
    monkeypatch.setattr(memory_fit, "census", lambda model, is_layer: (real_census(model, is_layer)[0], 0))
    monkeypatch.setattr(memory_fit, "USABLE_SHARE", 1.0)
    monkeypatch.setattr(memory_fit, "checkpoint", counted_checkpoint)
    return state, replays, reads


def four_layers(variant: str = "llama"):
    torch.manual_seed(0)
    config = TinyCausalConfig(**{**SIZES, "num_hidden_layers": 4}, pad_token_id=0, **CAUSAL_VARIANTS[variant])
    return TinyCausalForCausalLM(config).eval()


def plain_and_fitted(model, inputs, *, available, state):
    state["available"] = available
    model.set_runtime(False)
    plain = training_step(model, inputs)
    model.set_runtime(True, **ONLY_FIT)
    fitted = training_step(model, inputs)
    return plain, fitted


def test_where_everything_fits_every_layer_runs_as_written(counted_memory):
    state, replays, reads = counted_memory
    model, inputs = four_layers(), batch(causal_model())
    plain, fitted = plain_and_fitted(model, inputs, available=10**12, state=state)
    assert replays == [] and len(reads) == 6  # the first layer's two reads, its loss decision, one for each other
    assert all(torch.equal(plain[name], fitted[name]) for name in plain)


def test_a_layer_that_does_not_fit_is_replayed_with_the_plain_steps_gradients(counted_memory):
    """Four layers, STEP bytes a layer, 16 * 97 bytes a token of logits (160 tokens: 248,320): the loss never fits,
    so it is chunked; then (reads at 200, 300, 400, 500) layer 1 needs 300 + 100 * (3 + 2) = 800, layer 2 400 + 400,
    layer 3 500 + 300: with 750 bytes free all three are replayed, with 800 none is."""
    state, replays, _ = counted_memory
    model, inputs = four_layers(), batch(causal_model())
    plain, fitted = plain_and_fitted(model, inputs, available=750, state=state)
    assert replays == list(model.model.layers[1:])
    assert torch.allclose(plain["loss"], fitted["loss"], rtol=1e-6, atol=0)  # chunked: another summation order
    for name in plain:
        assert torch.allclose(plain[name], fitted[name], rtol=1e-5, atol=1e-6), name
    replays.clear()
    state["available"] = 800
    assert torch.equal(training_step(model, inputs)["loss"], fitted["loss"]) and replays == []


def test_a_layer_that_may_not_be_replayed_runs_as_written(counted_memory):
    """A hook inside layer 2 keeps it from being replayed (the hook would run twice). With 750 bytes free (the test
    above) no layer after the first fits (each reads 800: 300 + 100 * 5 for layer 1, 400 + 100 * 4 for layer 2, ...):
    layers 1 and 3 are replayed, layer 2 runs as written."""
    state, replays, _ = counted_memory
    model, inputs = four_layers(), batch(causal_model())
    model.model.layers[2].self_attn.register_forward_hook(lambda *args: None)
    plain, fitted = plain_and_fitted(model, inputs, available=750, state=state)
    assert replays == [model.model.layers[1], model.model.layers[3]]
    for name in plain:
        assert torch.allclose(plain[name], fitted[name], rtol=1e-5, atol=1e-6), name


def test_a_layer_that_may_not_be_replayed_is_counted_and_asked_only_where_it_does_not_fit(counted_memory):
    """It still counts as a layer the step keeps (the layers after it plan for one fewer). Whether a layer may be
    replayed (a walk over its modules) is asked only of a layer that does not fit."""
    state, replays, _ = counted_memory
    asked = []

    def run(plan, name, replayable):
        return plan.run_layer(lambda layer, hidden: hidden, name, torch.zeros(1, 2, 4), (), {},
                              replayable=lambda: asked.append(name) or replayable)

    roomy = memory_fit.MemoryPlan(torch.device("cpu"), 3, None, 0, (0, 10**6))
    for name in ("first", "second", "third"):
        run(roomy, name, replayable=False)
    assert roomy.layers_left == 0 and asked == [] and replays == []
    tight = memory_fit.MemoryPlan(torch.device("cpu"), 3, None, 0, (0, 10))
    run(tight, "first", replayable=True)
    run(tight, "kept", replayable=False)
    run(tight, "replayed", replayable=True)
    assert tight.layers_left == 0 and asked == ["kept", "replayed"] and replays == ["replayed"]


def test_the_gradients_a_replica_will_hold_are_reserved():
    """A DataParallel replica holds its weights as plain attributes (parameters() gives none): the plan reserves their
    gradients' bytes all the same, as for the model it copies."""
    model = four_layers()
    whole = memory_fit.census(model, runtime._is_runtime_layer)[1]
    assert whole == sum(p.numel() * p.element_size() for p in model.parameters())
    replica = replicate_on_cpu(model)
    assert list(replica.parameters()) == [] and memory_fit.census(replica, runtime._is_runtime_layer) == (4, whole)


def test_where_memory_is_not_counted_the_step_counts_no_layers(monkeypatch):
    """On the CPU with fit_memory on, a training forward asks the device first and walks no module."""
    walked = []
    model = four_layers().set_runtime(True, **ONLY_FIT)
    inputs = batch(model)
    monkeypatch.setattr(runtime, "_declaration", lambda cls: walked.append(cls))
    training_step(model, inputs)
    assert walked == []


def test_replayed_layers_alone_give_bit_identical_gradients_even_with_dropout(counted_memory):
    """No loss in the plan (labels None, the loss summed outside): the replays are the only change, and a replay
    draws the dropout masks the forward drew (checkpoint keeps the random state)."""
    state, replays, _ = counted_memory
    model = four_layers("gpt2")
    inputs = {k: v for k, v in batch(model).items() if k != "labels"}
    state["available"] = 750

    def summed_step():
        model.train()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        model(**inputs).logits.float().square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.set_runtime(False)
    plain = summed_step()
    model.set_runtime(True, **ONLY_FIT)
    fitted = summed_step()
    assert len(replays) == 3
    assert plain.keys() == fitted.keys() and all(torch.equal(plain[n], fitted[n]) for n in plain)


def test_the_chunked_loss_is_the_first_saving_and_gives_no_logits(counted_memory):
    """Free memory for every layer but not for the logits (160 tokens x 97 x 16 bytes = 248,320): the loss is chunked
    and no layer replayed."""
    state, replays, _ = counted_memory
    model, inputs = four_layers(), batch(causal_model())
    model.set_runtime(True, **ONLY_FIT)
    state["available"] = 10_000
    model.train()
    output = model(**inputs)
    assert output.logits is None and replays == []
    state["available"] = 10**6
    assert model(**inputs).logits is not None


def test_the_plan_stays_off_by_default_under_checkpointing_in_eval_and_where_memory_is_not_counted(counted_memory):
    state, replays, reads = counted_memory
    model, inputs = four_layers(), batch(causal_model())
    state["available"] = 0
    assert runtime.ON_BY_DEFAULT["fit_memory"] == {"cuda"}
    model.set_runtime(True)  # the device defaults: on CUDA only, and these tensors are on the CPU
    training_step(model, inputs)
    assert reads == [] and replays == []
    model.set_runtime(True, **ONLY_FIT)
    with torch.no_grad():
        model.train()(**inputs)
    enable_activation_checkpointing(model, {"use_reentrant": False})
    training_step(model, inputs)
    assert reads == [] and replays == []


def test_on_by_default_on_its_device_the_plan_is_made_before_any_model_chooses_a_path(counted_memory, monkeypatch):
    """The device default alone opens the plan (no set_runtime call in this process: no path chosen), and the CPU's
    stand-in counters play CUDA's; a model that turns the path off keeps every layer as written."""
    state, replays, reads = counted_memory
    monkeypatch.setattr(runtime, "_path_chosen_on", False)
    monkeypatch.setitem(runtime.ON_BY_DEFAULT, "fit_memory", frozenset({"cpu"}))
    monkeypatch.setitem(runtime.ON_BY_DEFAULT, "recompute", frozenset())  # as on CUDA: the layers run as written
    model, inputs = four_layers(), batch(causal_model())
    state["available"] = 0
    training_step(model, inputs)
    assert reads and replays  # nothing fits: every layer but the first is replayed
    reads.clear(), replays.clear()
    model.set_runtime(fit_memory=False)
    training_step(model, inputs)
    assert reads == [] and replays == []
    monkeypatch.setitem(runtime.ON_BY_DEFAULT, "fit_memory", frozenset())  # the negative control: on nowhere
    monkeypatch.setattr(runtime, "_path_chosen_on", False)
    model.set_runtime(True)  # back to the device defaults (this turns no path on)
    training_step(model, inputs)
    assert reads == [] and replays == []


def test_on_a_device_whose_memory_is_not_counted_the_plan_is_not_made(monkeypatch):
    opened = []
    monkeypatch.setattr(memory_fit, "MemoryPlan", lambda *a, **k: opened.append(a))
    assert memory_fit.device_memory(torch.device("cpu")) is None
    model = four_layers().set_runtime(True, **ONLY_FIT)
    training_step(model, batch(model))
    assert opened == []


def test_the_device_counters_are_read_once_each_in_their_nested_form(monkeypatch):
    """The allocator's counters as torch.cuda.memory_stats_as_nested_dict gives them ("allocated_bytes.all.current"
    in torch.cuda.memory_stats' flat names); torch.cuda.memory_allocated / memory_reserved, which flatten and sort
    every counter in Python, are not called."""
    def counters(current):
        return {"all": {"current": current, "peak": 10**9}, "large_pool": {"current": 1}, "small_pool": {"current": 2}}

    reads = []
    nested = {"allocated_bytes": counters(300), "reserved_bytes": counters(1000), "active_bytes": counters(7)}
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: reads.append(device) or nested)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5000, 10**6))
    for flattening in ("memory_allocated", "memory_reserved", "memory_stats"):
        monkeypatch.setattr(torch.cuda, flattening, lambda *a, **k: pytest.fail("a flattening read"))
    device = torch.device("cuda", 0)
    assert memory_fit.device_memory(device) == (300, 5000 + 1000 - 300) and memory_fit.allocated_bytes(device) == 300
    assert reads == [device, device]


@pytest.mark.cuda
@pytest.mark.usefixtures("no_tf32")
def test_on_cuda_the_real_counters_plan_a_step_and_replays_give_the_plain_steps_gradients(monkeypatch):
    """The device's own counters (torch.cuda.mem_get_info / memory_allocated): a small step fits and replays nothing;
    told that nothing more fits (the free memory read as 0), every layer after the first is replayed and the loss is
    chunked, with the plain step's loss and gradients (fp32; the chunked loss sums in another order)."""
    replays, real_checkpoint = [], memory_fit.checkpoint
    monkeypatch.setattr(memory_fit, "checkpoint", lambda *a, **k: replays.append(a[1]) or real_checkpoint(*a, **k))
    model = four_layers().cuda()
    inputs = {name: value.cuda() for name, value in batch(causal_model()).items()}
    model.set_runtime(False)
    plain = training_step(model, inputs)
    model.set_runtime(True, **ONLY_FIT)
    fitting = training_step(model, inputs)
    assert replays == [] and torch.equal(plain["loss"], fitting["loss"])
    real_memory = memory_fit.device_memory
    monkeypatch.setattr(memory_fit, "device_memory", lambda device: (real_memory(device)[0], 0))
    short = training_step(model, inputs)
    assert replays == list(model.model.layers[1:])
    assert torch.allclose(plain["loss"], short["loss"], rtol=1e-6, atol=0)
    for name in plain:
        assert torch.allclose(plain[name], short[name], rtol=1e-4, atol=1e-6), name


def test_logits_the_loss_must_keep_are_counted_and_never_dropped(counted_memory):
    """skip_logits=False: the loss keeps its logits, so the plan counts their 248,320 bytes and replays the three
    layers (with 10,000 bytes free, where a step that may drop them replays none: the test above)."""
    state, replays, _ = counted_memory
    model, inputs = four_layers(), batch(causal_model())
    model.set_runtime(True, **ONLY_FIT)
    state["available"] = 10_000
    model.train()
    output = model(**inputs, skip_logits=False)
    assert output.logits is not None and replays == list(model.model.layers[1:])


def test_a_seq2seq_plan_counts_the_logits_of_the_decoder_side(counted_memory, monkeypatch):
    """A 7-token source and a 40-token target: the first planned layer is the encoder's, the logits are the
    target's (2 x 40 x 97 x 16 bytes)."""
    from runtime_models import seq2seq_model

    state, _, _ = counted_memory
    plans = []

    class Recorded(memory_fit.MemoryPlan):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            plans.append(self)

    monkeypatch.setattr(memory_fit, "MemoryPlan", Recorded)
    model = seq2seq_model().set_runtime(True, **ONLY_FIT).train()
    state["available"] = 10**12
    source, target = torch.randint(3, 97, (2, 7)), torch.randint(3, 97, (2, 40))
    model(input_ids=source, attention_mask=torch.ones_like(source), labels=target).loss.backward()
    assert len(plans) == 1 and plans[0].logit_bytes == 2 * 40 * 97 * 16
