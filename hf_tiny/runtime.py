"""The runtime: the same math, run faster or leaner, beside the modeling files and switched as one.

The modeling files hold the math only. When a model is built, `install` gives some of its modules a forward of
this file's (set on the instance: the module's class, its parameters and what tools see are unchanged), which
runs the module's own forward unless one of these applies:

- Training memory (`_recomputed`): a layer run in training mode while gradients are recorded keeps only the
  outputs of its matrix products and attention kernels; everything element-wise (norms, activations, rotations,
  residual sums) is recomputed in backward. torch's selective activation checkpointing replays the layer's own
  forward, so losses and gradients are bit-identical to keeping everything. Off under gradient checkpointing
  (which recomputes whole layers already), torch.compile (whose partitioner makes this choice itself), for layers
  with hooks inside (a replay would run them twice) or a cache to fill. Like every selective checkpoint, it allows
  one backward per forward: a second one through the same graph (backward(retain_graph=True) twice) needs the
  runtime off for that forward (`with hf_tiny.runtime.disabled():`) or the model in eval mode.
  On an accelerator, only layers of at least MIN_RECOMPUTE_ELEMENTS of hidden states: there the kernels of a small
  layer take microseconds and the replay's per-operator Python cost dominates (an H100, TinyLlama-1.1B at 1x64
  tokens: 2.4x official's step time, for no memory saved next to AdamW's state). On a CPU the element-wise kernels
  themselves take about as long as that cost, and every size is replayed: even the 96-wide overhead model at 4x512
  keeps 0.6x the memory for 1.16x the time (benchmarks/runtime_ab.py).
  A layer that draws random numbers (dropout in training, BERT's fine-tuning) is not replayed whole: the replay
  would draw its dropout masks again, which costs more on a CPU than everything else recomputed (MiniLM's training
  step: 1.17x the time at 0.60x the memory). Its feed-forward, which draws none, is recomputed alone instead.
- Inference on many tokens (`_in_place`): with autograd off and at least MIN_ELEMENTS of hidden states, a
  layer writes each residual sum into its sublayer's fresh output and a feed-forward writes its activation and
  gated product into the first projection's output, with the gate / up products in a workspace all layers of one
  forward share. On a CPU every new multi-MiB tensor is memory mapped from the OS and faulted in page by page;
  the same kernels on the same operands (a + b and b + a are the same IEEE result) give bit-identical outputs.
- Decoding's few rows (`_few_rows_linear`): an nn.Linear of at least MIN_WEIGHT_ELEMENTS fp32 weights, on a CPU,
  without gradients, multiplies 1 to MAX_FEW_ROWS rows weight-first (W @ xᵀ), which reads the weight 1.0-4.2x
  faster than x @ Wᵀ there (benchmarks/few_rows.py). The result equals F.linear's up to the order of additions:
  the one part of the runtime that is not bit-identical (greedy tokens are unchanged in every test).

Nothing here runs where something could tell: under torch.compile or fx tracing, on modules with hooks (a hook may
keep an output this would overwrite, or expect a call this would skip), on modules whose forward someone else set
(accelerate's offloading, vLLM), on projections that are not plain nn.Linear (PEFT, quantizers, DTensor).

Switches: `disable(model)` / `enable(model)` (also `model.set_runtime(False)`), and `with disabled():` for all
models in the block. Off, every module runs the forward its modeling file defines.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import types
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_globals
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from transformers import activations

from .layers import FeedForward, GatedFeedForward, RMSNorm

# Inference in place: 128 KiB of fp32, glibc's smallest threshold for mapping an allocation from the OS (smaller
# tensors come from its free lists).
MIN_ELEMENTS = 1 << 15
# Training recompute on an accelerator: 2 MiB of fp32 hidden states per layer, 4x the one measured case that lost
# (TinyLlama at 1x64: 131K elements); a guess above it, not a measured crossover.
MIN_RECOMPUTE_ELEMENTS = 1 << 19
# Few rows (benchmarks/few_rows.py, SmolLM2's shapes, 2 threads): weight-first wins for 2 to 128 rows when the
# weight has at least 8 output rows per input row, and for one row when each thread's slice has at least 256 output
# rows; weights of fewer than 100,000 elements keep F.linear (their product is over before the extra operators pay).
MAX_FEW_ROWS = 128
MIN_OUTPUTS_PER_ROW = 8
MIN_SLICE = 256
MIN_WEIGHT_ELEMENTS = 100_000

_disabled: contextvars.ContextVar = contextvars.ContextVar("hf_tiny_runtime_disabled", default=False)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block, every hf_tiny module runs its modeling file's forward."""
    token = _disabled.set(True)
    try:
        yield
    finally:
        _disabled.reset(token)


def install(model: nn.Module) -> nn.Module:
    """Gives the model's modules their runtime forwards (idempotent; a module replaced later by a tool simply has
    none). Called by every hf_tiny model at the end of its __init__."""
    for module in model.modules():
        runtime = _runtime_class(module)
        if runtime is not None and "forward" not in vars(module):
            module.forward = types.MethodType(_specialized(runtime.forward, type(module)), module)
        if runtime is _Layer or module is getattr(model, "lm_head", None):
            install_few_rows(module)
    return model


def install_few_rows(part: nn.Module) -> None:
    """Decoding's few-row product on the projections of a layer, or on an LM head: what decoding multiplies by
    (other heads, poolers and classifiers keep nn.Linear's product)."""
    for linear in part.modules():
        if type(linear) is nn.Linear and "forward" not in vars(linear):
            linear.forward = types.MethodType(_specialized(_FewRowsLinear.forward, nn.Linear), linear)


_SPECIALIZED: dict = {}


def _specialized(runtime_forward: Callable, module_class: type) -> Callable:
    """A copy of runtime_forward presenting module_class.forward's signature and docstring: tools read a module's
    forward signature (transformers passes an encoder only the arguments its forward names). Named "forward", so a
    pickled module unpickles with its class's forward instead of failing. The signature comes through __wrapped__
    (what inspect.signature follows by default), not __signature__: torch.compile binds a compiled frame's
    arguments with inspect.signature(fn, follow_wrapped=False) and needs the copy's own (*args, **kwargs)."""
    key = (runtime_forward, module_class)
    if key not in _SPECIALIZED:
        code = runtime_forward.__code__
        copy = types.FunctionType(code, runtime_forward.__globals__, "forward", runtime_forward.__defaults__,
                                  runtime_forward.__closure__)
        copy.__wrapped__ = module_class.forward
        copy.__doc__ = module_class.forward.__doc__
        copy.hf_tiny_runtime = True
        _SPECIALIZED[key] = copy
    return _SPECIALIZED[key]


def disable(model: nn.Module) -> nn.Module:
    """Removes the runtime forwards: the model runs its modeling files' math only."""
    for module in model.modules():
        if _runs_runtime(module):
            del module.forward
    return model


def enable(model: nn.Module) -> nn.Module:
    return install(model)


def is_enabled(model: nn.Module) -> bool:
    return any(_runs_runtime(module) for module in model.modules())


def _runtime_class(module: nn.Module):
    if type(module) in (FeedForward, GatedFeedForward):
        return _FeedForwardInPlace
    if getattr(type(module), "residual_form", None) is not None:
        return _Layer
    if isinstance(getattr(module, "layers", None), nn.ModuleList) and any(_runtime_class(m) is _Layer for m in module.layers):
        return _Stack
    return None


def _runs_runtime(module: nn.Module) -> bool:
    method = vars(module).get("forward")
    return isinstance(method, types.MethodType) and getattr(method.__func__, "hf_tiny_runtime", False)


def _math(module: nn.Module) -> Callable:
    # A partial, not `forward.__get__(module)`: dynamo in torch 2.10 cannot trace a call of function.__get__.
    return functools.partial(type(module).forward, module)


# ---- when the runtime may act -------------------------------------------------------------------------------------


def _any_global_hooks() -> bool:
    return bool(module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks)


def _untouched(module: nn.Module) -> bool:
    """No hook of any kind on the module (nor a global one), and its forward is its class's or ours: its output may
    be overwritten and its work done without calling it."""
    if module._forward_hooks or module._forward_pre_hooks or _any_global_hooks():
        return False
    return "forward" not in vars(module) or _runs_runtime(module)


def _plain_linear(module: nn.Module) -> bool:
    """An nn.Linear (not a subclass: PEFT, quantized) on ordinary tensors, untouched."""
    if type(module) is not nn.Linear or not _untouched(module):
        return False
    return all(type(p) in (torch.Tensor, nn.Parameter) for p in module.parameters(recurse=False))


def plain_linear(module: nn.Module) -> bool:
    """Public for the chunked loss (chunked_loss.py), which multiplies a plain head's weight itself."""
    return _plain_linear(module)


def _inference_scale(tensor: torch.Tensor) -> bool:
    # Compilation first: under dynamo the size test would add a guard on the shape.
    return (
        not torch.compiler.is_compiling()
        and type(tensor) is torch.Tensor
        and tensor.numel() >= MIN_ELEMENTS
        and not torch.is_grad_enabled()
        and not _disabled.get()
    )


def _recomputed(layer: nn.Module, hidden_states) -> bool:
    return (
        layer.training
        and torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and type(hidden_states) is torch.Tensor
        and (hidden_states.is_cpu or hidden_states.numel() >= MIN_RECOMPUTE_ELEMENTS)
        and not (getattr(layer, "gradient_checkpointing", False) and layer.training)
        and not _disabled.get()
        and _replayable(layer)
    )


def _draws_random(module: nn.Module) -> bool:
    """Whether the module's training forward draws random numbers: a dropout, or an attention's dropout rate."""
    for part in module.modules():
        rate = part.p if isinstance(part, nn.modules.dropout._DropoutNd) else getattr(part, "dropout", 0.0)
        if isinstance(rate, float) and rate > 0.0:
            return True
    return False


def _replayable(layer: nn.Module) -> bool:
    """Whether replaying the layer's forward in backward would be invisible: no hook inside it (a hook would run
    twice), except the output recorders of step.LayerOutputs, which are removed before backward; no forward set on
    a submodule by someone else (accelerate's offloading)."""
    if _any_global_hooks():
        return False
    for module in layer.modules():
        hooks = list(module._forward_hooks.values()) + list(module._forward_pre_hooks.values())
        if any(not getattr(hook, "records_outputs", False) for hook in hooks):
            return False
        if "forward" in vars(module) and not _runs_runtime(module):
            return False
    return True


# ---- training memory: selective recomputation of a layer ------------------------------------------------------

_aten = torch.ops.aten
# What a layer keeps for backward: the outputs of its matrix products and attention kernels. Everything else in
# it is element-wise or a reduction over one row (norms, softmax of the eager path, activations, rotations).
_SAVED = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default, _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default, _aten._scaled_dot_product_cudnn_attention.default,
}


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE


_contexts = functools.partial(create_selective_checkpoint_contexts, _policy)


def _replayed(module: nn.Module, *args, **kwargs):
    return checkpoint(_math(module), *args, use_reentrant=False, context_fn=_contexts, **kwargs)


# Set while a layer that draws random numbers runs in training: its feed-forward is recomputed alone.
_parts_recomputed: contextvars.ContextVar = contextvars.ContextVar("hf_tiny_parts_recomputed", default=False)


# ---- inference in place ---------------------------------------------------------------------------------------

_workspace: contextvars.ContextVar = contextvars.ContextVar("hf_tiny_layer_workspace", default=None)


def _workspace_tensor(name: str, rows: int, cols: int, like: torch.Tensor) -> Optional[torch.Tensor]:
    """The open workspace's [rows, cols] tensor `name` (dtype and device of `like`), or None outside a workspace.
    Its contents are the caller's until the next call with the same name."""
    buffers = _workspace.get()
    if buffers is None:
        return None
    tensor = buffers.get(name)
    if tensor is None or tensor.shape != (rows, cols) or tensor.dtype != like.dtype or tensor.device != like.device:
        tensor = buffers[name] = torch.empty(rows, cols, dtype=like.dtype, device=like.device)
    return tensor


def _same_layout(out: torch.Tensor, other: torch.Tensor) -> bool:
    # Broadcasting or type promotion would make the in-place result differ from the out-of-place one.
    return out.shape == other.shape and out.dtype == other.dtype and out.device == other.device


def _add_into(residual: torch.Tensor, out: torch.Tensor, fresh: bool) -> torch.Tensor:
    """residual + out, written into `out` when it is a fresh tensor nothing else holds."""
    return out.add_(residual) if fresh and _same_layout(out, residual) else residual + out


def _fresh_output(last: Optional[nn.Module], *wrappers: nn.Module) -> bool:
    """Whether the tensor `wrappers` return is the new output of `last` (a plain projection or norm) that nobody
    else has seen: no hook on any of them."""
    if last is None:
        return False
    plain = _plain_linear(last) or (type(last) in (nn.LayerNorm, RMSNorm) and _untouched(last))
    return plain and all(_untouched(module) for module in wrappers)


def _output_of(sublayer: nn.Module, output_norm: nn.Module, dropout: nn.Module, last: str) -> bool:
    """Whether what `dropout(output_norm(sublayer(x)))` returns is fresh: the output norm's new tensor, or (no output
    norm) the sublayer's last projection's."""
    if not isinstance(output_norm, nn.Identity):
        return _fresh_output(output_norm, dropout)
    return _fresh_output(getattr(sublayer, last, None), sublayer, output_norm, dropout)


def _linear_into(x: torch.Tensor, linear: nn.Linear, out: torch.Tensor) -> torch.Tensor:
    """linear(x) written into `out` ([rows, out_features]): the addmm / mm F.linear itself runs on more than
    MAX_FEW_ROWS contiguous rows, so the same numbers."""
    flat = x.reshape(-1, x.shape[-1])
    if linear.bias is None:
        torch.mm(flat, linear.weight.t(), out=out)
    else:
        torch.addmm(linear.bias, flat, linear.weight.t(), out=out)
    return out.view(*x.shape[:-1], linear.out_features)


def _projected(linear: nn.Module, x: torch.Tensor, name: str) -> torch.Tensor:
    """linear(x), into the workspace's tensor `name` when one is open and the product is F.linear's own."""
    rows = x.numel() // x.shape[-1]
    weight = linear.weight
    if rows > MAX_FEW_ROWS and x.is_contiguous() and x.dtype == weight.dtype and x.device == weight.device:
        out = _workspace_tensor(name, rows, linear.out_features, x)
        if out is not None and not torch.is_autocast_enabled(x.device.type):
            return _linear_into(x, linear, out)
    return linear(x)


def _gelu_(t: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return torch.ops.aten.gelu_(t, approximate=approximate)


def _exact_classes(*names: str) -> tuple:
    """transformers' activation classes by name (which exist depends on its version), with their forward as
    defined, so a class whose forward was swapped later (a hub kernel) is not mistaken for the torch function."""
    found = (getattr(activations, name, None) for name in names)
    return tuple((cls, cls.forward) for cls in found if cls is not None)


_IN_PLACE = (
    (_exact_classes("SiLUActivation") + ((nn.SiLU, nn.SiLU.forward),), lambda act: functools.partial(F.silu, inplace=True)),
    (((nn.ReLU, nn.ReLU.forward),), lambda act: functools.partial(F.relu, inplace=True)),
    (_exact_classes("GELUActivation"), lambda act: _gelu_ if getattr(act, "act", None) is F.gelu else None),
    (_exact_classes("GELUTanh", "PytorchGELUTanh"),
     lambda act: functools.partial(_gelu_, approximate="tanh") if _is_tanh_gelu(getattr(act, "act", None)) else None),
    (((nn.GELU, nn.GELU.forward),), lambda act: functools.partial(_gelu_, approximate=act.approximate)),
)


def _is_tanh_gelu(function) -> bool:
    return (isinstance(function, functools.partial) and function.func is F.gelu and not function.args
            and function.keywords == {"approximate": "tanh"})


def in_place_activation(act_fn: nn.Module) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """The in-place form of `act_fn` when it computes exactly a torch activation and calling it can be skipped;
    None otherwise."""
    if not _untouched(act_fn):
        return None
    kind = type(act_fn)
    for classes, make in _IN_PLACE:
        if any(kind is cls and kind.forward is forward for cls, forward in classes):
            return make(act_fn)
    return None


# ---- the runtime forwards ---------------------------------------------------------------------------------------
# Each is a class's `forward`, installed as a bound method named "forward" (so a pickled module unpickles with its
# class's forward instead of failing).


class _Stack:
    def forward(self, *args, **kwargs):
        """A model's stack of layers: the forward of its modeling file, with the layer workspace open when inference
        runs at scale (freed on exit)."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or _disabled.get() or _workspace.get() is not None:
            return _math(self)(*args, **kwargs)
        token = _workspace.set({})
        try:
            return _math(self)(*args, **kwargs)
        finally:
            _workspace.reset(token)


class _Layer:
    def forward(self, hidden_states, *args, **kwargs):
        if not _untouched(self):
            return _math(self)(hidden_states, *args, **kwargs)
        if _recomputed(self, hidden_states) and kwargs.get("cache") is None:  # a replay would write the cache again
            if not _draws_random(self):
                return _replayed(self, hidden_states, *args, **kwargs)
            token = _parts_recomputed.set(True)
            try:
                return _math(self)(hidden_states, *args, **kwargs)
            finally:
                _parts_recomputed.reset(token)
        if self.residual_form == "pre-norm" and _inference_scale(hidden_states):
            return _pre_norm_in_place(self, hidden_states, *args, **kwargs)
        if self.residual_form == "post-norm" and _inference_scale(hidden_states):
            return _post_norm_in_place(self, hidden_states, *args, **kwargs)
        return _math(self)(hidden_states, *args, **kwargs)


def _pre_norm_in_place(layer, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
    """The pre-norm layer's forward (modeling_causal.TinyCausalDecoderLayer) with each residual sum written into
    its sublayer's fresh output."""
    attended, _ = layer.self_attn(layer.input_layernorm(hidden_states), attention_mask, position_embeddings, **kwargs)
    fresh = _output_of(layer.self_attn, layer.attn_output_layernorm, layer.dropout, "o_proj")
    hidden_states = _add_into(hidden_states, layer.dropout(layer.attn_output_layernorm(attended)), fresh)
    transformed = layer.mlp(layer.post_attention_layernorm(hidden_states))
    fresh = _output_of(layer.mlp, layer.mlp_output_layernorm, layer.dropout, "down_proj")
    return _add_into(hidden_states, layer.dropout(layer.mlp_output_layernorm(transformed)), fresh)


def _post_norm_in_place(layer, hidden_states, attention_mask=None, **kwargs):
    """The post-norm layer's forward (modeling_encoder.TinyEncoderLayer): norm(x + sublayer(x)), each sum written
    into the sublayer's fresh output."""
    attended, _ = layer.self_attn(hidden_states, attention_mask, **kwargs)
    fresh = _fresh_output(layer.self_attn.o_proj, layer.self_attn, layer.dropout)
    hidden_states = layer.input_layernorm(_add_into(hidden_states, layer.dropout(attended), fresh))
    transformed = layer.mlp(hidden_states)
    fresh = _fresh_output(getattr(layer.mlp, "down_proj", None), layer.mlp, layer.dropout)
    return layer.post_attention_layernorm(_add_into(hidden_states, layer.dropout(transformed), fresh))


class _FeedForwardInPlace:
    def forward(self, x):
        """The feed-forward (layers.FeedForward / GatedFeedForward) with its activation and gated product written
        into the first projection's output (in the layer workspace when one is open)."""
        # Compilation first: dynamo cannot read a ContextVar without a graph break.
        if not torch.compiler.is_compiling() and _parts_recomputed.get() and not _draws_random(self) and _untouched(self):
            return _replayed(self, x)
        gated = type(self) is GatedFeedForward
        first = self.gate_proj if gated else self.up_proj
        projections = (first, self.up_proj, self.down_proj)
        activate_ = in_place_activation(self.act_fn) if _inference_scale(x) else None
        if activate_ is None or not all(_plain_linear(p) for p in projections) or not _untouched(self.dropout):
            return _math(self)(x)
        hidden = activate_(_projected(first, x, "first"))
        if gated:
            up = _projected(self.up_proj, x, "up")
            hidden = hidden.mul_(up) if _same_layout(hidden, up) else hidden * up
        return self.down_proj(self.dropout(hidden))


class _FewRowsLinear:
    def forward(self, input):
        """nn.Linear's product; weight-first for decoding's few fp32 rows on a CPU without gradients."""
        weight = self.weight
        # Cheap tests first (this runs at every projection of every decoding step): the input's type, so that an fx
        # trace (a Proxy input) never branches on a Proxy; then the weight's size.
        if type(input) is torch.Tensor and weight.numel() >= MIN_WEIGHT_ELEMENTS and not (
            torch.is_grad_enabled() or input.dtype is not torch.float32 or not input.is_cpu
            or torch.compiler.is_compiling() or _disabled.get()
        ):
            rows = _few_rows(weight, input)
            if rows:
                return few_rows_linear(input, weight, self.bias, rows)
        return F.linear(input, weight, self.bias)


def weight_first(out_features: int, rows: int) -> bool:
    """Whether the runtime computes a product of `rows` rows with an [out_features, *] fp32 weight (of at least
    MIN_WEIGHT_ELEMENTS) weight-first."""
    if rows == 1:
        return _slices_per_thread(out_features) > 1
    return 1 < rows <= MAX_FEW_ROWS and rows * MIN_OUTPUTS_PER_ROW <= out_features


def _few_rows(weight: torch.Tensor, x: torch.Tensor) -> int:
    """The number of rows of x when the weight-first product applies, else 0."""
    if weight.dtype is not torch.float32 or type(weight) not in (torch.Tensor, nn.Parameter):  # DTensor, quantized
        return 0
    shape = x.shape
    if not shape or shape[-1] != weight.shape[1] or not weight.is_contiguous() or torch.is_autocast_enabled("cpu"):
        return 0
    rows = x.numel() // shape[-1]
    return rows if weight_first(weight.shape[0], rows) else 0


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias, rows: int) -> torch.Tensor:
    """F.linear(x, weight, bias) as W @ xᵀ; one row as one product per thread over slices of W's output rows.
    weight must be contiguous."""
    out_features, in_features = weight.shape
    flat = x.reshape(rows, in_features)
    if rows == 1:
        slices = _slices_per_thread(out_features)
        sliced = weight.view(slices, out_features // slices, in_features)
        # x as the transposed view of its row: the strides with which bmm reads it at full speed
        column = flat.t().expand(slices, in_features, 1)
        out = torch.bmm(sliced, column) if bias is None else torch.baddbmm(bias.reshape(slices, -1, 1), sliced, column)
        return out.view(*x.shape[:-1], out_features)
    out = torch.mm(weight, flat.t()) if bias is None else torch.addmm(bias.unsqueeze(1), weight, flat.t())
    return out.t().contiguous().view(*x.shape[:-1], out_features)


def _slices_per_thread(out_features: int) -> int:
    """The most slices, up to one per intra-op thread, that divide the output rows evenly into slices of at least
    MIN_SLICE rows (1: no slicing)."""
    slices = min(torch.get_num_threads(), out_features // MIN_SLICE)
    while slices > 1 and out_features % slices:
        slices -= 1
    return max(slices, 1)
