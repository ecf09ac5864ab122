"""The runtime (hf_tiny/runtime.py, runtime_forms.py): the same math faster or leaner, declared on the forwards it may
run differently, each path on by default only on the devices where it was measured to win.

- On every family, outputs (inference at scale, in the in-place forms) and a training step's loss and gradients
  (layers recomputed in backward) are bit-identical with the runtime on and off, and the runtime really acted.
- Per device and per model: paths off by default off the CPU, named options there; nothing set on instances.
- It stays off wherever something could tell: hooks, autograd (for the in-place path), PEFT, wrapped forwards.
- Decoding's weight-first product for few fp32 rows: as close to the fp64 product as F.linear, taken exactly
  where it should be, greedy tokens unchanged; the projections stay plain nn.Linear for the tools that replace them.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from causal_helpers import weight_first_model
from hf_tiny import runtime, runtime_forms
from hf_tiny.transformers_api import enable_activation_checkpointing
from runtime_checks import assert_bit_identical_on_and_off, batch, logits, ops_of, training_step
from runtime_models import FAMILIES, causal_model, encoder_model

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture
def small_tensors_in_place(monkeypatch):
    """Tiny test models run in place as a large prefill does."""
    monkeypatch.setattr(runtime, "MIN_ELEMENTS", 1)


# ---- bit for bit, every family -------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_outputs_and_gradients_are_bit_identical_with_the_runtime_on_and_off(family, small_tensors_in_place):
    # the layers of the other families run in place: check that it happened
    assert_bit_identical_on_and_off(FAMILIES[family](), runs_in_place=not family.startswith("seq2seq"))


def test_switching_a_model_off_runs_its_modeling_files_math_only(small_tensors_in_place):
    model = causal_model()
    assert runtime.is_enabled(model)
    assert "add_" in ops_of(lambda: logits(model, batch(model)))
    model.set_runtime(False)
    assert not runtime.is_enabled(model)
    assert "add_" not in ops_of(lambda: logits(model, batch(model)))
    model.set_runtime(True)
    assert runtime.is_enabled(model) and "add_" in ops_of(lambda: logits(model, batch(model)))


def test_nothing_is_set_on_module_instances_and_a_copy_runs_its_own_modules():
    """The runtime is declared on the classes' forwards: a module's forward is its class's (a copy, a pickle or a
    DataParallel replica runs its own weights: tests/runtime/test_replicas.py)."""
    model = causal_model()
    assert not any("forward" in vars(module) for module in model.modules())
    assert all(type(m) is nn.Linear for name, m in model.named_modules() if name.endswith("_proj"))
    inputs = {k: v for k, v in batch(model).items() if k != "labels"}
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.model.layers[0].mlp.down_proj.weight.mul_(2)
    assert not torch.equal(logits(clone, inputs), logits(model, inputs))


def test_each_declared_forward_keeps_its_signature_and_names_its_declaration():
    """Tools read a forward's signature (transformers passes an encoder only the arguments its forward names)."""
    import inspect

    layer = causal_model().model.layers[0]
    assert runtime.declared(type(layer)) and runtime.declared(type(layer.mlp))
    assert "position_embeddings" in inspect.signature(type(layer).forward).parameters
    assert list(inspect.signature(type(layer.mlp).forward).parameters) == ["self", "x"]


def declared_methods():
    """(class, name, dispatcher) for every method of hf_tiny's classes that carries a runtime declaration."""
    import importlib
    import pkgutil

    import hf_tiny

    found = {}
    for info in pkgutil.iter_modules(hf_tiny.__path__):
        module = importlib.import_module(f"hf_tiny.{info.name}")
        for cls in vars(module).values():
            if isinstance(cls, type) and cls.__module__ == module.__name__:
                found.update({(cls, name): value for name, value in vars(cls).items()
                              if getattr(value, "runtime_declaration", None)})
    return [(cls, name, value) for (cls, name), value in found.items()]


def test_each_declared_method_and_its_math_pickle_as_themselves():
    """pickle saves a function as its module and qualified name (vLLM's compile cache pickles the forwards it traced:
    the model's, not the layers'): both the dispatcher (the class attribute) and the math it wraps must be found
    again by those names. A layer's forward is wrapped again by transformers' GradientCheckpointingLayer, as
    official's layers are, and pickles as theirs do not."""
    import pickle
    import sys

    from transformers.modeling_layers import GradientCheckpointingLayer

    methods = [method for method in declared_methods() if not issubclass(method[0], GradientCheckpointingLayer)]
    assert {cls.__name__ for cls, _, _ in methods} >= {"TinyCausalModel", "TinyCausalForCausalLM", "TinyEncoderModel"}
    for cls, name, dispatcher in methods:
        for function in (dispatcher, dispatcher.__wrapped__):
            found = sys.modules[function.__module__]
            for part in function.__qualname__.split("."):
                found = getattr(found, part)
            assert found is function, (cls.__name__, name, function.__qualname__)
            pickle.dumps(function)  # which checks the same: "Can't pickle ...: it's not the same object"


def test_negative_control_a_math_under_its_dispatchers_name_does_not_pickle(monkeypatch):
    """The math's qualified name as functools.wraps leaves it (the dispatcher's): pickle finds the dispatcher."""
    import pickle

    from hf_tiny.layers import FeedForward

    math = FeedForward.forward.__wrapped__
    monkeypatch.setattr(math, "__qualname__", FeedForward.forward.__qualname__)
    with pytest.raises(pickle.PicklingError, match="not the same object"):
        pickle.dumps(math)


def test_a_custom_code_models_forward_signature_is_read_cheaply():
    """generate() reads a custom-code model's forward signature at every step: the declared forward carries the
    math's signature precomputed (238 Python calls per read without it, measured 2026-11-27)."""
    import cProfile
    import inspect
    import pstats

    model = causal_model()
    assert type(model).is_remote_code()  # hf_tiny classes register for the Auto classes: generate's custom-code path
    forward = type(model).forward
    code_signature = inspect.signature(function_without_a_signature(inspect.unwrap(forward)))
    assert inspect.signature(forward) == code_signature
    bound = inspect.signature(model.forward)
    assert bound == code_signature.replace(parameters=list(code_signature.parameters.values())[1:])
    assert list(bound.parameters)[:2] == ["input_ids", "attention_mask"]
    profile = cProfile.Profile()
    profile.runcall(inspect.signature, model.forward)
    # binding the signature anew at each read took 66 calls (2026-11-28); its bound form is kept: 30
    assert sum(entry[1] for entry in pstats.Stats(profile).stats.values()) < 40


def function_without_a_signature(function):
    """A copy of `function` without __signature__: inspect reads its signature from its code."""
    import types

    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


def test_a_wrapper_of_the_bound_forward_has_the_bound_signature():
    """accelerate's hooks (device_map dispatch, offloading) replace model.forward by functools.update_wrapper of a
    partial over the bound forward, which copies the forward's __dict__: a precomputed signature there was read as
    the wrapper's own, self included."""
    import inspect

    from accelerate.hooks import ModelHook, add_hook_to_module

    model = causal_model()
    plain = inspect.signature(model.forward)
    add_hook_to_module(model, ModelHook())
    assert inspect.signature(model.forward) == plain and "self" not in plain.parameters


def test_a_copied_method_signature_keeps_its_bound_form():
    """copy and deepcopy rebuild a Signature as pickle does (__reduce__: __init__ without the return annotation, then
    __setstate__)."""
    import copy
    import inspect

    def forward(self, x, y=1) -> int:
        return x + y

    signature = runtime.MethodSignature.of(forward)
    for copied in (copy.copy(signature), copy.deepcopy(signature)):
        assert copied == signature
        bound = copied.replace(parameters=tuple(copied.parameters.values())[1:])
        assert bound == inspect.Signature(list(signature.parameters.values())[1:], return_annotation="int")


def test_a_declared_forwards_signature_replaces_as_any_signature():
    """Only inspect's binding request is answered from what was kept; every other replace builds anew."""
    import inspect

    signature = inspect.unwrap(type(causal_model()).forward).__signature__
    assert isinstance(signature, runtime.MethodSignature)
    parameters = list(signature.parameters.values())
    assert signature.replace(return_annotation=int).return_annotation is int
    assert list(signature.replace(parameters=parameters[:2]).parameters) == ["self", "input_ids"]
    fewer = signature.replace(parameters=tuple(parameters[2:]))
    assert list(fewer.parameters) == [p.name for p in parameters[2:]]
    assert signature.replace() == signature


# ---- training memory: layers recomputed in backward ------------------------------------------------------------


def backward_op_counts(model, names: tuple) -> dict:
    """{"on" / "off": {operator: calls in one training backward}} with the runtime on and off."""
    inputs = batch(model, length=12)
    model.set_runtime(chunked_loss=False)  # the same loss on both sides: its products are counted too
    counts = {}
    for name, context in (("on", runtime_on()), ("off", runtime.disabled())):
        model.train()
        with context:
            ops = ops_of(model(**inputs).loss.backward)
        counts[name] = {op: ops.count(op) for op in names}
    return counts


def test_backward_recomputes_only_elementwise_work():
    """With the runtime the backward pass replays the layers: the norms and activations run again, while no matrix
    product is recomputed (their outputs are kept)."""
    counts = backward_op_counts(causal_model(), ("mm", "addmm", "bmm", "rsqrt", "silu"))
    assert counts["on"]["rsqrt"] > counts["off"]["rsqrt"] and counts["on"]["silu"] > counts["off"]["silu"]
    for product in ("mm", "addmm", "bmm"):
        assert counts["on"][product] == counts["off"][product], counts


def test_a_second_backward_through_a_recomputed_layer_names_the_runtime_and_works_with_it_off():
    """The recompute (on by default on the CPU) replays each layer once, in the first backward; a second backward
    through the same forward (retain_graph=True, adversarial training's autograd.grad) gets an error naming the
    runtime and how to turn it off, not only torch's "selective activation checkpoint" one. Off, both backwards run
    and accumulate, as on official models."""
    model = causal_model().train()
    inputs = batch(model)
    loss = model(**inputs).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"hf_tiny's training recompute .* model\.set_runtime\(recompute=False\)"):
        loss.backward()
    model.set_runtime(recompute=False).zero_grad()
    loss = model(**inputs).loss
    loss.backward(retain_graph=True)
    once = {name: p.grad.clone() for name, p in model.named_parameters()}
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[name], rtol=1e-6, atol=1e-7, msg=name)
    assert any(float(g.abs().max()) > 0 for g in once.values())


def test_a_layer_with_dropout_recomputes_its_feed_forward_without_drawing_again():
    """Replaying a layer with dropout would draw its masks again (bernoulli_ costs more than the rest on a CPU): the
    layer keeps its activations, its feed-forward alone is replayed (the activation runs again, no mask is drawn)."""
    counts = backward_op_counts(encoder_model(), ("bernoulli_", "gelu", "native_layer_norm", "mm", "addmm"))
    assert counts["on"]["gelu"] == counts["off"]["gelu"] + 2, counts  # one replay per layer
    for op in ("bernoulli_", "native_layer_norm", "mm", "addmm"):
        assert counts["on"][op] == counts["off"][op], counts
    assert counts["off"]["bernoulli_"] == 0 and counts["off"]["gelu"] == 0


def test_negative_control_without_dropout_the_whole_layer_is_replayed():
    model = encoder_model()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        elif isinstance(getattr(module, "dropout", None), float):  # the attention's rate
            module.dropout = 0.0
    inputs = batch(model, length=12)
    model.train()
    ops = ops_of(model(**inputs).loss.backward)
    assert ops.count("native_layer_norm") >= 4  # both norms of both layers run again


def test_each_path_is_on_by_default_only_on_the_cpu_and_a_named_option_elsewhere():
    """A path earns its place on the device where it runs: only the CPU has benchmarks showing each path winning
    (runtime.ON_BY_DEFAULT); elsewhere it is off unless the model asks for it. Meta tensors stand in for an
    accelerator's. fit_memory (memory_fit.py) acts on CUDA only, and is on by default there (the H200 runs measured
    both of its conditions); rebuild is a named option everywhere."""
    model = causal_model().train()
    layer, cpu, meta, cuda = model.model.layers[0], torch.device("cpu"), torch.device("meta"), torch.device("cuda")
    cpu_paths = ("recompute", "in_place", "few_rows", "chunked_loss")
    assert all(runtime.path_on(layer, path, cpu) and not runtime.path_on(layer, path, meta) for path in cpu_paths)
    assert not any(runtime.path_on(layer, path, cuda) for path in cpu_paths)
    assert not runtime.path_on(layer, "fit_memory", cpu) and not runtime.path_on(layer, "fit_memory", meta)
    assert runtime.path_on(layer, "fit_memory", cuda)  # a device object only: nothing runs on it here
    assert not any(runtime.path_on(layer, "rebuild", device) for device in (cpu, meta, cuda))
    model.set_runtime(recompute=True)
    assert runtime.path_on(layer, "recompute", meta) and not runtime.path_on(layer, "in_place", meta)
    assert runtime._recomputes(layer, torch.empty(2, 12, 32, device="meta"))
    model.set_runtime(in_place=False)  # added to the choice before
    assert runtime.path_on(layer, "recompute", meta) and not runtime.path_on(layer, "in_place", cpu)
    model.set_runtime(recompute=False)
    assert not runtime.path_on(layer, "recompute", cpu) and runtime.path_on(layer, "few_rows", cpu)
    assert runtime.is_enabled(model)
    model.set_runtime(True)
    assert runtime.path_on(layer, "recompute", cpu) and not runtime.path_on(layer, "recompute", meta)


def test_off_its_devices_a_path_is_answered_without_a_call_until_a_model_turns_one_on(monkeypatch):
    """On a GPU every path is off, and path_on is asked by every layer of every step: it answers from the device
    alone (no call: not even torch.compiler.is_compiling) until some model turns a path on; then that model's choice
    is read, and another model keeps its device default."""
    monkeypatch.setattr(runtime, "_path_chosen_on", False)
    calls = []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: calls.append(1) or False)
    chosen, default = causal_model(), causal_model()
    meta = torch.device("meta")
    assert not any(runtime.path_on(chosen.model.layers[0], path, meta) for path in runtime.PATHS) and calls == []
    assert runtime.path_on(chosen.model.layers[0], "in_place", torch.device("cpu")) and calls == [1]
    chosen.set_runtime(in_place=True)
    assert runtime.path_on(chosen.model.layers[0], "in_place", meta)
    assert not runtime.path_on(default.model.layers[0], "in_place", meta)
    assert not runtime.path_on(chosen.model.layers[0], "recompute", meta)


def test_with_no_step_scoped_path_open_a_feed_forward_asks_nothing(monkeypatch, spy, threads):
    """A GPU's decoding step opens no step-scoped path (few rows, recomputed parts): its feed-forwards then read
    neither torch.compiler.is_compiling nor a ContextVar. A few-rows step on the CPU opens one for its duration
    (its feed-forwards take their weight-first form), and the count is back to none after it, after an error too."""
    threads(2)
    model = weight_first_model()
    mlp = model.model.layers[0].mlp
    calls = []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: calls.append(1) or False)
    x = torch.randn(1, 1, model.config.hidden_size)
    with torch.no_grad():
        assert runtime._scoped_open == 0 and torch.equal(mlp(x), type(mlp).forward.__wrapped__(mlp, x))
        assert calls == [] and spy == []
        model(torch.randint(3, 512, (1, 1)))  # a few-rows decoding step
    assert spy and calls and runtime._scoped_open == 0
    with pytest.raises(RuntimeError, match="planted"), runtime._scoped(runtime._few_rows_step):
        assert runtime._scoped_open == 1 and runtime._few_rows_step.get()
        raise RuntimeError("planted")
    assert runtime._scoped_open == 0 and not runtime._few_rows_step.get()


def test_a_path_turned_off_on_the_cpu_is_off_there():
    """The backward of a training step runs the norms again only while the recompute path is on."""
    model = causal_model().train()
    inputs = batch(model, length=12)

    def norms_in_backward() -> int:
        return ops_of(model(**inputs).loss.backward).count("rsqrt")

    model.set_runtime(recompute=False)
    without = norms_in_backward()
    model.set_runtime(True)
    assert norms_in_backward() > without


@pytest.mark.parametrize("arguments, error, message", [
    (dict(recompute="yes"), TypeError, "recompute must be True or False, got 'yes'"),
    (dict(checkpoint=True), ValueError, "unknown runtime path 'checkpoint'; the paths are"),
])
def test_bad_runtime_choices_are_clear_errors(arguments, error, message):
    with pytest.raises(error, match=message):
        causal_model().set_runtime(**arguments)
    with pytest.raises(TypeError, match="enabled must be True or False, got 'off'"):
        causal_model().set_runtime("off")


def runtime_on():
    import contextlib

    return contextlib.nullcontext()


def test_a_hook_inside_a_layer_runs_once_per_forward_in_training():
    """Replaying a layer would run a hook inside it a second time: such layers keep their activations instead."""
    model = causal_model().train()
    calls = []
    model.model.layers[0].post_attention_layernorm.register_forward_hook(lambda *args: calls.append(1))
    model(**batch(model, length=12)).loss.backward()
    assert calls == [1]


def test_gradient_checkpointing_keeps_working_and_matches():
    model = causal_model()
    inputs = batch(model, length=12)
    plain = training_step(model, inputs)
    enable_activation_checkpointing(model, {"use_reentrant": False})
    checkpointed = training_step(model, inputs)
    assert all(torch.equal(plain[name], checkpointed[name]) for name in plain)


def test_bf16_autocast_step_equals_the_runtime_off():
    model = causal_model().set_runtime(chunked_loss=False)  # up to the order of additions only
    inputs = batch(model, length=12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        on = training_step(model, inputs)
        with runtime.disabled():
            off = training_step(model, inputs)
    assert all(torch.equal(on[name], off[name]) for name in on)


def test_lora_and_frozen_layers_train_the_same_with_the_runtime():
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], init_lora_weights=False)
    model = get_peft_model(causal_model().set_runtime(chunked_loss=False), config)
    inputs = batch(model.base_model.model, length=12)
    on = training_step(model, inputs)
    with runtime.disabled():
        off = training_step(model, inputs)
    assert len(on) > 4 and all(torch.equal(on[name], off[name]) for name in on)


def test_a_given_cache_is_never_written_twice():
    """A training forward that fills a cache is not replayed (a replay would append its keys again)."""
    from transformers import DynamicCache

    model = causal_model().train()
    cache = DynamicCache(config=model.config)
    inputs = batch(model, length=12)
    model(**inputs, cache=cache, use_cache=True).loss.backward()
    assert cache.get_seq_length() == 12


def test_an_outer_saved_tensor_hook_still_gets_correct_gradients():
    model = causal_model()
    inputs = batch(model, length=12)
    plain = training_step(model, inputs)
    with torch.autograd.graph.save_on_cpu():
        offloaded = training_step(model, inputs)
    assert all(torch.equal(plain[name], offloaded[name]) for name in plain)


# ---- inference in place: where it must stay off -----------------------------------------------------------------

HOOKED = {
    "gate projection output": ("mlp.gate_proj", "forward"),
    "up projection output": ("mlp.up_proj", "forward"),
    "down projection input": ("mlp.down_proj", "pre"),
    "attention output projection": ("self_attn.o_proj", "forward"),
    "feed-forward output": ("mlp", "forward"),
    "attention output": ("self_attn", "forward"),
}


@pytest.mark.parametrize("what", sorted(HOOKED))
def test_forward_hooks_see_their_tensors_unchanged(what, small_tensors_in_place):
    """A hook that keeps what a module was handed or returned (recording activations, calibrating a quantizer)
    keeps it as it was then: nothing it saw is overwritten later in the forward."""
    model = causal_model()
    name, kind = HOOKED[what]
    kept = []

    def keep(tensor):
        tensor = tensor[0] if isinstance(tensor, tuple) else tensor
        kept.append((tensor, tensor.clone()))

    for layer in model.model.layers:
        module = layer.get_submodule(name)
        if kind == "pre":
            module.register_forward_pre_hook(lambda module, args: keep(args))
        else:
            module.register_forward_hook(lambda module, args, output: keep(output))
    logits(model, batch(model))
    assert len(kept) == 2
    for seen, copy_ in kept:
        assert torch.equal(seen, copy_)


def test_a_global_forward_hook_turns_it_off(small_tensors_in_place):
    model = causal_model()
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
    try:
        ops = ops_of(lambda: logits(model, batch(model)))
    finally:
        handle.remove()
    assert "silu_" not in ops and "add_" not in ops


def test_a_global_forward_pre_hook_still_sees_every_activation_module(small_tensors_in_place):
    model = causal_model()
    called = []
    handle = nn.modules.module.register_module_forward_pre_hook(lambda module, args: called.append(module))
    try:
        logits(model, batch(model))
    finally:
        handle.remove()
    assert all(any(module is layer.mlp.act_fn for module in called) for layer in model.model.layers)


def test_nothing_is_overwritten_while_gradients_are_recorded(small_tensors_in_place):
    model = causal_model()
    ids = batch(model)["input_ids"]
    ops = ops_of(lambda: model(input_ids=ids).logits)
    assert "silu" in ops and "silu_" not in ops and "add_" not in ops


def test_peft_wrapped_projections_are_left_alone(small_tensors_in_place):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj", "o_proj"], init_lora_weights=False)
    model = get_peft_model(causal_model(), config).eval()
    inputs = batch(model.base_model.model)
    on = logits(model, inputs)
    ops = ops_of(lambda: logits(model, inputs))
    with runtime.disabled():
        assert torch.equal(on, logits(model, inputs))
    assert "silu_" not in ops  # the gate projection is PEFT's module, not a plain nn.Linear


def test_the_workspace_is_closed_after_the_forward_and_after_an_error(small_tensors_in_place, monkeypatch):
    model = causal_model()
    logits(model, batch(model))
    assert runtime._workspace.get() is None

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(model.model.layers[1].mlp.down_proj, "forward", fail)
    with pytest.raises(RuntimeError, match="boom"):
        logits(model, batch(model))
    assert runtime._workspace.get() is None


def test_decoding_steps_do_not_run_in_place():
    """At the real threshold a decoding step (8 rows) never reaches the checks."""
    model = causal_model()
    ids = torch.randint(3, 97, (8, 1))
    with torch.inference_mode():
        ops = ops_of(lambda: model(input_ids=ids))
    assert "silu_" not in ops and "add_" not in ops


def test_a_projection_with_its_own_forward_is_called_not_bypassed(small_tensors_in_place):
    """accelerate's offloading wraps a module's forward on the instance to bring its weights in first: the
    workspace product must then go through the module."""
    model = causal_model()
    calls = []
    for layer in model.model.layers:
        projection = layer.mlp.up_proj
        original = projection.forward

        def wrapped(x, original=original):
            calls.append(1)
            return original(x)

        projection.forward = wrapped
    logits(model, batch(model))
    assert len(calls) == 2


def test_the_output_of_a_wrapped_projection_is_not_overwritten(small_tensors_in_place):
    """A forward set on the instance may hand out a tensor it keeps (here: a cache of the last output)."""
    model = causal_model()
    kept = []
    projection = model.model.layers[0].mlp.gate_proj
    original = projection.forward

    def caching(x):
        out = original(x)
        kept.append((out, out.clone()))
        return out

    projection.forward = caching
    logits(model, batch(model))
    (seen, copy_), = kept
    assert torch.equal(seen, copy_)


@pytest.mark.parametrize("name", ["silu", "swish", "gelu", "gelu_pytorch_tanh", "relu"])
def test_in_place_activations_equal_the_module_bit_for_bit(name):
    act = ACT2FN[name]
    activate_ = runtime_forms.in_place_activation(act)
    assert activate_ is not None
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)) * 4
    assert torch.equal(activate_(x.clone()), act(x))


def test_negative_control_a_wrong_in_place_activation_is_caught(small_tensors_in_place, monkeypatch):
    model = causal_model()
    inputs = batch(model)
    want = logits(model, inputs)
    monkeypatch.setattr(runtime_forms, "in_place_activation", lambda act: (lambda t: torch.ops.aten.gelu_(t)))
    assert not torch.equal(logits(model, inputs), want)


@pytest.mark.parametrize("name", ["gelu_new", "gelu_python", "gelu_fast", "quick_gelu", "tanh", "sigmoid"])
def test_activations_without_an_exact_in_place_form_are_not_overwritten(name):
    assert runtime_forms.in_place_activation(ACT2FN[name]) is None


def test_a_hooked_or_patched_activation_is_called_as_a_module():
    act = ACT2FN["silu"]
    handle = act.register_forward_hook(lambda module, args, output: None)
    assert runtime_forms.in_place_activation(act) is None
    handle.remove()
    assert runtime_forms.in_place_activation(act) is not None
    patched = copy.deepcopy(act)
    patched.forward = lambda x: x * 2  # e.g. a kernel swapped in on the instance
    assert runtime_forms.in_place_activation(patched) is None


# ---- decoding's few rows --------------------------------------------------------------------------------------


@pytest.fixture
def spy(monkeypatch):
    calls = []
    original = runtime.few_rows_linear

    def counting(*args):
        calls.append(args[-1])
        return original(*args)

    monkeypatch.setattr(runtime, "few_rows_linear", counting)
    return calls


def linear(in_features: int, out_features: int, bias: bool = True) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=bias)


def _errors(layer: nn.Linear, x: torch.Tensor) -> tuple[float, float]:
    """(the weight-first product's max error, F.linear's max error), both against the fp64 product."""
    exact = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    with torch.no_grad():
        with runtime.WeightFirstProducts():
            ours = layer(x).double()
        official = F.linear(x, layer.weight, layer.bias).double()
    return (ours - exact).abs().max().item(), (official - exact).abs().max().item()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(576,), (1, 576), (1, 1, 576), (2, 3, 576), (8, 1, 576), (runtime.MAX_FEW_ROWS, 576)])
def test_few_rows_equal_the_fp64_product_as_closely_as_f_linear(shape, bias, spy, threads):
    threads(2)
    torch.manual_seed(0)
    layer = linear(576, 1536, bias=bias)
    x = torch.randn(*shape)
    with torch.no_grad(), runtime.WeightFirstProducts():
        out = layer(x)
    assert out.shape == (*shape[:-1], 1536) and out.is_contiguous()
    assert spy, "the weight-first product was not used"
    ours, official = _errors(layer, x)
    assert ours <= 4 * official + 1e-6, (ours, official)


def test_negative_control_a_misplaced_slice_is_caught():
    torch.manual_seed(0)
    weight, x = torch.randn(1536, 576), torch.randn(1, 576)
    right = runtime.few_rows_linear(x, weight, None, 1)
    wrong = torch.cat((right[..., 768:], right[..., :768]), dim=-1)
    exact = F.linear(x.double(), weight.double())
    assert (right.double() - exact).abs().max() < 1e-3 < (wrong.double() - exact).abs().max()


def test_few_rows_are_taken_only_for_few_fp32_rows_and_large_weights(spy, threads):
    threads(2)
    layer = linear(128, 1024)
    x = torch.randn(4, 128)
    with torch.no_grad(), runtime.WeightFirstProducts():
        layer(torch.randn(runtime.MAX_FEW_ROWS + 1, 128))  # compute-bound: F.linear
        linear(576, 192)(torch.randn(32, 576))  # fewer than 8 outputs per row: F.linear
        linear(96, 1024)(torch.randn(4, 96))  # a small weight: F.linear
        layer.to(torch.bfloat16)(x.bfloat16())  # no gain in bf16
        layer.float()
        assert spy == []
        layer(x)
        layer(torch.randn(128))
    assert spy == [4, 1]


def test_a_model_takes_few_rows_only_in_fp32_cpu_inference_with_the_path_on(spy, threads):
    """The language model's declaration decides once per forward: no gradients, fp32, no autocast, few tokens, the
    path on; otherwise every product is F.linear's."""
    threads(2)
    model = weight_first_model()
    ids = torch.randint(3, 512, (1, 4))
    model(ids)  # gradients recorded: training keeps F.linear, so gradients are official's
    with torch.no_grad():
        model(torch.randint(3, 512, (1, runtime.MAX_FEW_ROWS + 1)))  # a prefill
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(ids)
        with runtime.disabled():
            model(ids)
        model.set_runtime(few_rows=False)
        model(ids)
        assert spy == []
        model.set_runtime(True)
        model(ids)
    assert 4 in spy


def test_decoding_with_few_rows_gives_the_same_tokens(spy, threads):
    threads(2)
    model = weight_first_model()
    ids = torch.randint(3, 512, (3, 5))
    kwargs = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        fast = model.generate(ids, **kwargs)
        assert 3 in spy, "decoding steps did not take the weight-first product"
        with runtime.disabled():
            plain = model.generate(ids, **kwargs)
    assert torch.equal(fast.sequences, plain.sequences)
    for a, b in zip(fast.scores, plain.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _declared_feed_forwards() -> set:
    """The classes of hf_tiny's modules whose own forward carries @runtime_feed_forward."""
    import inspect

    import hf_tiny

    modules = [m for name, m in vars(hf_tiny).items() if not name.startswith("_") and inspect.ismodule(m)]
    return {cls for module in modules for cls in vars(module).values()
            if inspect.isclass(cls) and getattr(vars(cls).get("forward"), "runtime_declaration", None) == "runtime_feed_forward"}


def test_every_declared_feed_forward_has_its_few_rows_form():
    declared = _declared_feed_forwards()
    assert declared >= {runtime_forms.GatedFeedForward, runtime_forms.FeedForward}
    assert declared == set(runtime_forms.FEW_ROWS_FEED_FORWARDS)


def _feed_forward(kind: str) -> nn.Module:
    from hf_tiny.layers import FeedForward, GatedFeedForward

    torch.manual_seed(0)
    if kind == "gated":
        return GatedFeedForward(256, 1024, "silu", bias=False).eval()
    return FeedForward(256, 1024, "gelu", bias=True, activation_dropout=0.1).eval()


@pytest.mark.parametrize("kind", ["gated", "plain"])
def test_a_feed_forwards_few_rows_form_is_its_forward_with_weight_first_products(kind, spy, threads, monkeypatch):
    """runtime_forms' form of each feed-forward, as a decoding step runs it, equals its forward (to the fp32 rounding of
    a sum in another order); a hooked projection is called as a module, its hook honoured."""
    threads(2)
    monkeypatch.setattr(runtime, "MIN_SLICE", 64)
    feed_forward = _feed_forward(kind)
    form = runtime_forms.FEW_ROWS_FEED_FORWARDS[type(feed_forward)]
    x = torch.randn(1, 1, 256)
    with torch.no_grad():
        want = feed_forward(x)
        got = form(feed_forward, x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert len(spy) == (3 if kind == "gated" else 2)
        spy.clear()
        handle = feed_forward.up_proj.register_forward_hook(lambda module, args, output: output * 2)
        hooked = feed_forward(x)
        assert not torch.allclose(hooked, want, rtol=1e-3, atol=1e-3)  # negative control: the hook changes the output
        torch.testing.assert_close(form(feed_forward, x), hooked, rtol=1e-5, atol=1e-5)
        handle.remove()
    assert len(spy) == (2 if kind == "gated" else 1)  # every product but the hooked one weight-first


def test_a_decoding_step_runs_the_feed_forwards_few_rows_form_not_a_torch_function_mode(spy, threads, monkeypatch):
    threads(2)
    model = weight_first_model()
    modes = []
    monkeypatch.setattr(runtime.WeightFirstProducts, "__enter__", lambda self: modes.append(self) or self)
    monkeypatch.setattr(runtime.WeightFirstProducts, "__exit__", lambda self, *exc: None)
    with torch.no_grad():
        model(torch.randint(3, 512, (1, 1)))
    assert spy, "the decoding step did not take the weight-first products"
    assert len(modes) == 1  # the output projection's alone (runtime_products)


def test_projections_are_plain_linear_modules_for_quantizers_and_fx():
    """bitsandbytes replaces modules whose type is exactly nn.Linear; an fx trace calls nn.Linear as a leaf."""
    model = causal_model()
    projections = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in ("q_proj", "o_proj", "up_proj", "lm_head")]
    assert projections and all(type(m) is nn.Linear for m in projections)
    traced = torch.fx.symbolic_trace(model.model.layers[0].mlp)  # a declared forward traces as its math
    x = torch.randn(3, 32)
    with torch.no_grad():
        assert torch.equal(traced(x), model.model.layers[0].mlp(x))
