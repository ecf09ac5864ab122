"""Cheap activations recomputed in backward instead of kept: the training step's activation memory.

A forward with gradients keeps, per layer, whatever each operator's backward needs. For a Llama block at
SmolLM2's width that is ~87 MiB per 2,048 tokens, and over a third of it is element-wise results that cost almost
nothing to compute again: the RMSNorm's normalized input, the activation act(gate) and the product act(gate) * up
that the down projection keeps as its input (each [tokens, intermediate]). Two autograd functions drop those:

- `recomputed_in_backward(fn, *inputs)`: fn(*inputs), keeping only the inputs; backward replays fn with autograd
  and differentiates it (used for RMSNorm, whose weight is one of the inputs).
- `linear_of_recomputed(fn, linear, *inputs)`: linear(fn(*inputs)) keeping only the inputs and the weight; the
  backward replays fn to get the linear's input for the weight gradient (used for down(act(gate) * up) and
  down(act(up))). The linear's three products are written out here, so `linear` must be a plain nn.Linear:
  a PEFT-wrapped, quantized or hooked one gets `recomputed_in_backward` for fn and its own forward.

fn is replayed under the forward's autocast state, on the saved inputs, so the gradients are those of exactly
the forward that ran (the tests compare them with the unrecomputed path). fn must be deterministic: no dropout.

A third mechanism drops the normed sublayer input h = norm(x) that the projections after it keep (q/k/v, gate/up:
one [tokens, hidden] per sublayer): `regenerable(norm, x)` marks h, and while the model runs, a saved-tensor hook
stores "norm(x)" instead of h (or of a view of h) wherever autograd saves it, and computes it again when backward
unpacks it (x is kept anyway, by the norm's own backward). It is left off when the caller has saved-tensor hooks of
its own (torch.autograd.graph.save_on_cpu: ours would replace theirs) and under torch.compile.

The model's forward turns this on (`lean_forward`) when gradients are being recorded and gradient
checkpointing is off (checkpointing already recomputes whole blocks, and its replay must save what its forward
saved). The modules ask `active()`: a plain bool, so tracing a module outside that loop (vLLM reads the norm's
and the feed-forward's structure with torch.fx) sees the ordinary code.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch
from torch.autograd.function import once_differentiable

from .linear import Linear


class _State:
    active = False
    disabled = False
    regenerating = False


def active() -> bool:
    return _State.active and not _State.disabled and torch.is_grad_enabled() and not torch.compiler.is_compiling()


@contextmanager
def lean_activations(enabled: bool) -> Iterator[None]:
    """Within this context (a model's forward, see lean_forward) the norms and feed-forwards recompute their cheap
    activations."""
    previous = _State.active
    _State.active = enabled
    try:
        yield
    finally:
        _State.active = previous


def lean_forward(forward: Callable) -> Callable:
    """Decorates a model's forward (its `layers` are its blocks): recomputation is on while gradients are recorded
    and no block is gradient-checkpointed."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(self, *args, **kwargs)
        checkpointed = self.training and any(getattr(layer, "gradient_checkpointing", False) for layer in self.layers)
        with lean_activations(not checkpointed), _regenerating_saved_inputs(not checkpointed):
            return forward(self, *args, **kwargs)

    return wrapper


class _Recipe:
    """How to compute a marked tensor again: module(input) under the forward's autocast, with the input unchanged."""

    __slots__ = ("module", "input", "version", "autocast")

    def __init__(self, module, input: torch.Tensor):
        self.module, self.input, self.version = module, input, input._version
        self.autocast = _autocast_state(input.device.type)

    def value(self) -> torch.Tensor:
        if self.input._version != self.version:
            raise RuntimeError(
                f"the input of {type(self.module).__name__} was modified in place after the forward (version "
                f"{self.version} -> {self.input._version}); backward cannot recompute its output"
            )
        device_type, autocast_on, autocast_dtype = self.autocast
        with torch.no_grad(), torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
            return self.module.forward(self.input).contiguous()  # hooked modules are never marked


class _Regenerated:
    """What the saved-tensor hook keeps instead of a marked tensor or a view of it: the recipe and the view."""

    __slots__ = ("recipe", "size", "stride", "offset")

    def __init__(self, recipe: _Recipe, view: torch.Tensor, base: torch.Tensor):
        self.recipe, self.size, self.stride = recipe, view.size(), view.stride()
        self.offset = view.storage_offset() - base.storage_offset()

    def tensor(self) -> torch.Tensor:
        return self.recipe.value().as_strided(self.size, self.stride, self.offset)


class _Kept:
    """A saved tensor kept as it is, with its version: autograd skips its in-place check for tensors that go
    through saved-tensor hooks, so the hook does it."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.version = tensor, tensor._version

    def checked(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"a {tuple(self.tensor.shape)} {self.tensor.dtype} tensor is at version {self.tensor._version}; "
                f"expected version {self.version} instead"
            )
        return self.tensor


def _pack(tensor: torch.Tensor):
    base = tensor if tensor._base is None else tensor._base
    recipe = getattr(base, "_hf_tiny_recipe", None)
    return _Kept(tensor) if recipe is None else _Regenerated(recipe, tensor, base)


def _unpack(packed):
    return packed.tensor() if isinstance(packed, _Regenerated) else packed.checked()


@contextmanager
def _regenerating_saved_inputs(enabled: bool) -> Iterator[None]:
    outer_hooks = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    if not enabled or outer_hooks or torch.compiler.is_compiling():
        yield
        return
    previous = _State.regenerating
    _State.regenerating = True
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _State.regenerating = previous


def regenerable(module, input: torch.Tensor) -> torch.Tensor:
    """module(input), marked so that autograd keeps "module(input)" instead of the result (see the module doc).
    module must be deterministic and its result contiguous."""
    output = module(input)
    if _State.regenerating and active() and not has_hooks(module) and output.is_contiguous() and (
        output.data_ptr() != input.data_ptr()
    ):
        output._hf_tiny_recipe = _Recipe(module, input)
    return output


def has_hooks(module) -> bool:
    """A hook of any kind, pre-hooks and global ones included, or a forward set on the instance (a wrapper, e.g.
    accelerate's offloading): the module must be called, and what it returns may be kept or changed by them. Its
    output is then kept, not recomputed, and never overwritten or computed without the call (overwrite.py)."""
    from torch.nn.modules import module as module_globals

    return bool(
        module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__
        or module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks
    )


@contextmanager
def keep_all_activations() -> Iterator[None]:
    """Switches recomputation off, whatever the model decides: the reference path of the tests, and a way out."""
    previous = _State.disabled
    _State.disabled = True
    try:
        yield
    finally:
        _State.disabled = previous


def plain_linear(module) -> bool:
    """True for an nn.Linear (or hf_tiny's, linear.py) whose forward is F.linear on ordinary tensors: not another
    subclass (PEFT, quantized), no hooks of its own or global ones (accelerate's device placement replaces forward on the
    instance), no DTensor / quantized parameters."""
    if type(module) not in (torch.nn.Linear, Linear) or has_hooks(module):
        return False
    return all(type(p) in (torch.Tensor, torch.nn.Parameter) for p in module.parameters(recurse=False))


def _autocast_state(device_type: str) -> tuple:
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _replay(ctx, inputs: Sequence[torch.Tensor], needs: Sequence[bool]):
    """fn re-run on detached copies of the saved inputs, with autograd recording, under the forward's autocast."""
    device_type, autocast_on, autocast_dtype = ctx.autocast
    with torch.enable_grad(), torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
        leaves = [t.detach().requires_grad_(need) for t, need in zip(inputs, needs)]
        return leaves, ctx.fn(*leaves)


def _grads_of(output: torch.Tensor, leaves, needs, grad: torch.Tensor) -> list:
    wanted = [leaf for leaf, need in zip(leaves, needs) if need]
    found = iter(torch.autograd.grad(output, wanted, grad) if wanted else ())
    return [next(found) if need else None for need in needs]


class _RecomputedInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn = fn
        ctx.autocast = _autocast_state(inputs[0].device.type)
        ctx.save_for_backward(*inputs)
        return fn(*inputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        needs = ctx.needs_input_grad[1:]
        leaves, output = _replay(ctx, ctx.saved_tensors, needs)
        return (None, *_grads_of(output, leaves, needs, grad))


class _LinearOfRecomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, weight, bias, *inputs):
        ctx.fn = fn
        ctx.autocast = _autocast_state(weight.device.type)
        ctx.save_for_backward(weight, *inputs)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return torch.nn.functional.linear(fn(*inputs), weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        weight, *inputs = ctx.saved_tensors
        need_weight, need_bias, *needs = ctx.needs_input_grad[1:]
        leaves, linear_input = _replay(ctx, inputs, needs)
        # The products autograd forms for F.linear, in the dtype the forward multiplied in (autocast's, if on).
        dtype = grad.dtype
        grad_2d = grad.reshape(-1, grad.shape[-1])
        input_2d = linear_input.detach().reshape(-1, linear_input.shape[-1]).to(dtype)
        grad_weight = input_2d.t().mm(grad_2d).t().to(weight.dtype) if need_weight else None
        grad_bias = grad_2d.sum(0).to(ctx.bias_dtype) if need_bias else None
        input_grads = [None] * len(needs)
        if any(needs):
            grad_input = grad_2d.mm(weight.to(dtype)).reshape(linear_input.shape).to(linear_input.dtype)
            input_grads = _grads_of(linear_input, leaves, needs, grad_input)
        return (None, grad_weight, grad_bias, *input_grads)


def recomputed_in_backward(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """fn(*inputs) keeping only the inputs for backward (fn replayed there). Every input must be a tensor."""
    return _RecomputedInBackward.apply(fn, *inputs)


def linear_of_recomputed(fn: Callable[..., torch.Tensor], linear: torch.nn.Linear, *inputs: torch.Tensor) -> torch.Tensor:
    """linear(fn(*inputs)) keeping only the inputs and linear's weight; for a non-plain linear, fn is recomputed
    and the linear runs its own forward (which then keeps fn's output, as it would anyway)."""
    if plain_linear(linear):
        return _LinearOfRecomputed.apply(fn, linear.weight, linear.bias, *inputs)
    return linear(recomputed_in_backward(fn, *inputs))
