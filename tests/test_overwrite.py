"""Inference on many tokens overwrites its temporaries (hf_tiny/overwrite.py): the same numbers bit for bit (against
official transformers on real weights and against hf_tiny with the overwriting off), the overwriting really
happens, and it stays off wherever something could tell: hooks, autograd, PEFT, compilation."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.activations import ACT2FN

import hf_tiny
from causal_helpers import tiny_official
from hf_tiny import overwrite
from hf_tiny.linear import Linear, linear_into

pytestmark = pytest.mark.usefixtures("single_torch_thread")

ROWS = 2 * 80  # more than linear.MAX_FEW_ROWS, so the products are F.linear's


class OpNames(TorchDispatchMode):
    """The aten operators a call runs."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def ops_of(fn) -> list[str]:
    with OpNames() as mode:
        fn()
    return mode.names


@pytest.fixture
def small_tensors_overwrite(monkeypatch):
    """Tiny test models overwrite like a large prefill does."""
    monkeypatch.setattr(overwrite, "MIN_ELEMENTS", 1)


def never_overwrite(monkeypatch):
    monkeypatch.setattr(overwrite, "MIN_ELEMENTS", 1 << 62)


SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128)


def causal_model(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return hf_tiny.TinyCausalForCausalLM(hf_tiny.TinyCausalConfig(**SIZES, num_key_value_heads=2, **overrides)).eval()


def encoder_model(seed: int = 0):
    torch.manual_seed(seed)
    return hf_tiny.TinyEncoderModel(hf_tiny.TinyEncoderConfig(**SIZES)).eval()


def seq2seq_model(seed: int = 0):
    torch.manual_seed(seed)
    return hf_tiny.TinySeq2SeqForConditionalGeneration(hf_tiny.TinySeq2SeqConfig(**SIZES)).eval()


def ids(seed: int = 1, batch: int = 2, seq: int = ROWS // 2) -> torch.Tensor:
    return torch.randint(3, 97, (batch, seq), generator=torch.Generator().manual_seed(seed))


def run(model, **extra):
    tokens = ids()
    kwargs = dict(input_ids=tokens, attention_mask=torch.ones_like(tokens), **extra)
    if isinstance(model, hf_tiny.TinySeq2SeqForConditionalGeneration):
        kwargs["decoder_input_ids"] = tokens
    with torch.inference_mode():
        out = model(**kwargs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


# ---- bit for bit ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("build", [causal_model, encoder_model, seq2seq_model], ids=["causal", "encoder", "seq2seq"])
def test_outputs_are_bit_identical_with_and_without_overwriting(build, monkeypatch):
    model = build()
    never_overwrite(monkeypatch)
    plain_ops = ops_of(lambda: run(model))
    plain = run(model)
    monkeypatch.setattr(overwrite, "MIN_ELEMENTS", 1)
    overwriting_ops = ops_of(lambda: run(model))
    overwriting = run(model)
    assert torch.equal(overwriting, plain)
    # It happened: the activation and the residual sums in place, no out-of-place activation left.
    assert "add_" in overwriting_ops and "add_" not in plain_ops
    activation = {"silu", "gelu"} & set(plain_ops)
    assert activation and not activation & set(overwriting_ops)
    assert {name + "_" for name in activation} <= set(overwriting_ops)


def converted(kind: str, tmp_path, **overrides):
    from conversion import llama

    official = tiny_official(kind, max_position_embeddings=128, **overrides)
    official.save_pretrained(tmp_path / "src")
    llama.convert(tmp_path / "src", tmp_path / "ours")
    ours = hf_tiny.TinyCausalForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="sdpa").eval()
    official.set_attn_implementation("sdpa")
    return official, ours


VARIANTS = {
    "llama": {},
    "qwen3": dict(head_dim=8),  # q/k norms
    "gemma3_text": dict(head_dim=8),  # sandwich norms (overwritten by the residual sum), gelu-tanh
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),  # experts: FeedForwards on token subsets
}


@pytest.mark.parametrize("kind", sorted(VARIANTS))
def test_converted_variants_are_bit_identical_with_and_without_overwriting(kind, tmp_path, monkeypatch):
    official, ours = converted(kind, tmp_path, **VARIANTS[kind])
    tokens = ids()
    with torch.inference_mode():
        want = official(input_ids=tokens).logits
    never_overwrite(monkeypatch)
    plain = run_small(ours, tokens)
    monkeypatch.setattr(overwrite, "MIN_ELEMENTS", 1)
    overwriting = run_small(ours, tokens)
    assert torch.equal(overwriting, plain)
    assert float((overwriting - want).abs().max()) <= 1e-5


def test_llama_is_bit_identical_to_official_when_overwriting(tmp_path, small_tensors_overwrite):
    """Negative control: an in-place activation that computes something else is caught by the same comparison."""
    official, ours = converted("llama", tmp_path)
    tokens = ids()
    with torch.inference_mode():
        want = official(input_ids=tokens).logits
    assert torch.equal(run_small(ours, tokens), want)
    original = overwrite._silu_
    try:
        overwrite._silu_ = lambda t: torch.ops.aten.gelu_(t)
        wrong = run_small(ours, tokens)
    finally:
        overwrite._silu_ = original
    assert not torch.equal(wrong, want)


@pytest.mark.real_weights
def test_real_minilm_is_bit_identical_to_official_when_overwriting(real_minilm_dir, tmp_path):
    """A 4 x 128-token MiniLM batch, above the size where hf_tiny overwrites (no monkeypatching): bit for bit
    official BertModel's output. Negative control: the tanh-approximated GELU written in place instead is caught."""
    from conversion import bert as bert_conversion

    dst = tmp_path / "minilm"
    bert_conversion.convert(real_minilm_dir, dst)
    official = transformers.BertModel.from_pretrained(real_minilm_dir, attn_implementation="sdpa").eval()
    ours = hf_tiny.TinyEncoderModel.from_pretrained(dst, attn_implementation="sdpa").eval()
    tokens = torch.randint(1000, 20000, (4, 128), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens)
    assert tokens.numel() * ours.config.hidden_size >= overwrite.MIN_ELEMENTS
    with torch.inference_mode():
        want = official(input_ids=tokens, attention_mask=mask).last_hidden_state
        ops = ops_of(lambda: ours(input_ids=tokens, attention_mask=mask))
        got = ours(input_ids=tokens, attention_mask=mask).last_hidden_state
    assert "gelu_" in ops and "add_" in ops
    assert torch.equal(got, want), float((got - want).abs().max())

    original = overwrite._gelu_
    try:
        overwrite._gelu_ = overwrite._gelu_tanh_
        with torch.inference_mode():
            wrong = ours(input_ids=tokens, attention_mask=mask).last_hidden_state
    finally:
        overwrite._gelu_ = original
    assert not torch.equal(wrong, want)


# ---- where it must stay off -------------------------------------------------------------------------------------

HOOKED = {
    "gate projection output": ("mlp.gate_proj", "forward"),
    "up projection output": ("mlp.up_proj", "forward"),
    "down projection input": ("mlp.down_proj", "pre"),
    "attention output projection": ("self_attn.o_proj", "forward"),
    "feed-forward output": ("mlp", "forward"),
    "attention output": ("self_attn", "forward"),
}


@pytest.mark.parametrize("what", sorted(HOOKED))
def test_forward_hooks_see_their_tensors_unchanged(what, small_tensors_overwrite):
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
    run(model)
    assert len(kept) == 2
    for seen, copy in kept:
        assert torch.equal(seen, copy)


def test_a_global_forward_hook_turns_it_off(small_tensors_overwrite):
    model = causal_model()
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
    try:
        ops = ops_of(lambda: run(model))
    finally:
        handle.remove()
    assert "silu_" not in ops and "add_" not in ops


def test_a_global_forward_pre_hook_still_sees_every_activation_module(small_tensors_overwrite):
    """Applying the activation in place skips calling its module: not while a global pre-hook watches modules."""
    model = causal_model()
    called = []
    handle = nn.modules.module.register_module_forward_pre_hook(lambda module, args: called.append(module))
    try:
        run(model)
    finally:
        handle.remove()
    assert all(any(module is layer.mlp.act_fn for module in called) for layer in model.model.layers)


def test_no_overwriting_while_gradients_are_recorded(small_tensors_overwrite):
    model = causal_model()
    tokens = ids()
    ops = ops_of(lambda: model(input_ids=tokens).logits)
    assert "silu" in ops and "silu_" not in ops and "add_" not in ops


def test_peft_wrapped_projections_are_left_alone(small_tensors_overwrite, monkeypatch):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        causal_model(), LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj", "o_proj"], init_lora_weights=False)
    ).eval()
    with_overwriting = run(model)
    ops = ops_of(lambda: run(model))
    never_overwrite(monkeypatch)
    assert torch.equal(with_overwriting, run(model))
    assert "silu_" not in ops  # the gate projection is PEFT's module, not hf_tiny's Linear


def test_the_workspace_is_closed_after_the_forward_and_after_an_error(small_tensors_overwrite, monkeypatch):
    model = causal_model()
    run(model)
    assert overwrite._workspace.get() is None

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(model.model.layers[1].mlp.down_proj, "forward", fail)
    with pytest.raises(RuntimeError, match="boom"):
        run(model)
    assert overwrite._workspace.get() is None


def test_decoding_steps_and_small_batches_do_not_overwrite():
    """At the real threshold a decoding step (8 rows) never reaches the checks."""
    model = causal_model()
    tokens = ids(batch=8, seq=1)
    ops = ops_of(lambda: run_small(model, tokens))
    assert "silu_" not in ops and "add_" not in ops


def run_small(model, tokens):
    with torch.inference_mode():
        return model(input_ids=tokens).logits


# ---- the pieces -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["silu", "swish", "gelu", "gelu_pytorch_tanh", "relu"])
def test_in_place_activations_equal_the_module_bit_for_bit(name):
    act = ACT2FN[name]
    activate_ = overwrite.in_place_activation(act)
    assert activate_ is not None
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)) * 4
    want = act(x)
    got = activate_(x.clone())
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["gelu_new", "gelu_python", "gelu_fast", "quick_gelu", "tanh", "sigmoid"])
def test_activations_without_an_exact_in_place_form_are_not_overwritten(name):
    assert overwrite.in_place_activation(ACT2FN[name]) is None


def test_a_hooked_or_patched_activation_is_called_as_a_module():
    act = ACT2FN["silu"]
    handle = act.register_forward_hook(lambda module, args, output: None)
    assert overwrite.in_place_activation(act) is None
    handle.remove()
    assert overwrite.in_place_activation(act) is not None
    act.forward = lambda x: x * 2  # e.g. a kernel swapped in on the instance
    assert overwrite.in_place_activation(act) is None


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(ROWS, 32), (2, ROWS // 2, 32)])
def test_linear_into_is_bit_identical_to_linear(bias, shape):
    layer = Linear(32, 48, bias=bias)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    out = torch.empty(ROWS, 48)
    with torch.inference_mode():
        want = layer(x)
        got = linear_into(x, layer.weight, layer.bias, out)
    assert got.shape == want.shape and torch.equal(got, want)
    assert got.data_ptr() == out.data_ptr()


def test_linear_into_declines_what_linear_computes_otherwise():
    layer = Linear(32, 48)
    with torch.inference_mode():
        few = torch.randn(8, 32)
        assert linear_into(few, layer.weight, layer.bias, torch.empty(8, 48)) is None  # the few-rows product
        strided = torch.randn(32, ROWS).t()
        assert linear_into(strided, layer.weight, layer.bias, torch.empty(ROWS, 48)) is None
        assert linear_into(torch.randn(ROWS, 32), layer.weight, layer.bias, torch.empty(ROWS, 47)) is None
    assert linear_into(torch.randn(ROWS, 32), layer.weight, layer.bias, torch.empty(ROWS, 48)) is None  # grad mode


def test_add_and_mul_into_fall_back_where_in_place_would_change_the_result():
    low = torch.ones(4, 3, dtype=torch.bfloat16)
    high = torch.full((4, 3), 1e-3, dtype=torch.float32)
    assert overwrite.add_into(low, high).dtype == torch.float32  # promoted, as `high + low`
    row = torch.ones(1, 3)
    assert overwrite.mul_into(row, torch.ones(4, 3)).shape == (4, 3)  # broadcast, as `row * other`
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    want = b + a
    assert overwrite.add_into(a, b) is a and torch.equal(a, want)


def test_a_projection_with_its_own_forward_is_called_not_bypassed(small_tensors_overwrite):
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
    run(model)
    assert len(calls) == 2


def test_the_output_of_a_wrapped_projection_is_not_overwritten(small_tensors_overwrite):
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
    run(model)
    (seen, copy), = kept
    assert torch.equal(seen, copy)
