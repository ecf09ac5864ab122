"""Inference on many tokens writes element-wise results into temporaries instead of into new tensors.

Why: on a CPU a new tensor of a few MiB is memory that glibc maps from the OS for it (and unmaps when it is freed),
which the kernel then faults in one 4 KiB page at a time. Measured on the benchmarks' 2-core EPYC VM: official
transformers takes 89k-175k page faults per SmolLM2 4x256 prefill and 37k-61k per MiniLM 32x128 one, ~1.8 us each,
10-16 % of the prefill's time. Each activation, gated product and residual sum written into a temporary that
nothing else holds is one new tensor fewer. The arithmetic is the same kernels on the same operands (a + b and
b + a, a * b and b * a are the same IEEE results), so outputs stay bit-identical; on a GPU it lowers peak memory.

Only where nothing can tell the difference:
- `inference_scale(t)`: autograd off (no_grad / inference_mode: an overwritten tensor might be saved for backward
  otherwise), not while torch.compile traces (its graphs stay as they were), a plain tensor (not a DTensor,
  another subclass or a torch.fx Proxy), and at least MIN_ELEMENTS (smaller tensors come from glibc's free lists,
  so decoding steps skip the checks below);
- `private_output(module)`: a module's output is overwritten only when the module is hf_tiny's own `Linear` (a new
  tensor; PEFT's and vLLM's replacements and a forward set on the instance are left alone) and no forward hook, the
  module's own or a global one, has been handed it (it might keep it, e.g. to record activations);
- where a module's work is done without calling it (a projection into the layer workspace below, an activation
  applied in place), `recompute.has_hooks` is false for it: no hook of any kind, pre-hooks included, and no
  forward set on the instance.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_globals
from transformers import activations

from .linear import Linear
from .recompute import has_hooks

# 128 KiB of fp32, glibc's smallest threshold for mapping an allocation from the OS.
MIN_ELEMENTS = 1 << 15


def inference_scale(tensor: torch.Tensor) -> bool:
    # Compilation first: under dynamo the size test would add a guard on the shape.
    return (
        not torch.compiler.is_compiling()
        and type(tensor) is torch.Tensor
        and tensor.numel() >= MIN_ELEMENTS
        and not torch.is_grad_enabled()
    )


def unhooked(module: nn.Module) -> bool:
    """No forward hook of the module (nor a global one) sees its output."""
    return not module._forward_hooks and not module_globals._global_forward_hooks


def private_output(module: nn.Module) -> bool:
    # A forward set on the instance (a wrapper) may return a tensor it keeps.
    return type(module) is Linear and "forward" not in vars(module) and unhooked(module)


# ---- the layer workspace ---------------------------------------------------------------------------------------
# Overwriting saves the activation's and the product's tensors, but each layer's feed-forward still needs new
# tensors for its gate and up products (the largest of a layer). A workspace, open while a stack of layers runs,
# holds one tensor per name that every layer's feed-forward writes its products into, so a forward maps them once.

_workspace: contextvars.ContextVar = contextvars.ContextVar("hf_tiny_layer_workspace", default=None)


@contextlib.contextmanager
def _opened(buffers: dict):
    token = _workspace.set(buffers)
    try:
        yield
    finally:
        _workspace.reset(token)


def layer_workspace(hidden_states: torch.Tensor):
    """Context for running a stack of layers: a workspace when inference_scale(hidden_states), else nothing
    (so traced and compiled forwards, training and decoding steps are as before). Freed on exit."""
    return _opened({}) if inference_scale(hidden_states) else contextlib.nullcontext()


def workspace_tensor(name: str, rows: int, cols: int, like: torch.Tensor) -> Optional[torch.Tensor]:
    """The workspace's [rows, cols] tensor called `name` (dtype and device of `like`), or None outside a
    workspace. Its contents are the caller's until the next call with the same name."""
    buffers = _workspace.get()
    if buffers is None:
        return None
    tensor = buffers.get(name)
    if tensor is None or tensor.shape != (rows, cols) or tensor.dtype != like.dtype or tensor.device != like.device:
        tensor = buffers[name] = torch.empty(rows, cols, dtype=like.dtype, device=like.device)
    return tensor


def _silu_(t: torch.Tensor) -> torch.Tensor:
    return F.silu(t, inplace=True)


def _relu_(t: torch.Tensor) -> torch.Tensor:
    return F.relu(t, inplace=True)


def _gelu_(t: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_(t, approximate="none")


def _gelu_tanh_(t: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_(t, approximate="tanh")


def _exact_classes(*names: str) -> tuple:
    """transformers' activation classes by name (which exist depends on its version), with their forward as
    defined, so a class whose forward was swapped later (a hub kernel) is not mistaken for the torch function."""
    found = (getattr(activations, name, None) for name in names)
    return tuple((cls, cls.forward) for cls in found if cls is not None)


_SILU = _exact_classes("SiLUActivation") + ((nn.SiLU, nn.SiLU.forward),)
_GELU = _exact_classes("GELUActivation")
_GELU_TANH = _exact_classes("GELUTanh", "PytorchGELUTanh")
_RELU = ((nn.ReLU, nn.ReLU.forward),)
_TORCH_GELU = ((nn.GELU, nn.GELU.forward),)


def _is(act_fn: nn.Module, classes: tuple) -> bool:
    kind = type(act_fn)
    return any(kind is cls and kind.forward is forward for cls, forward in classes)


def in_place_activation(act_fn: nn.Module) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """The in-place form of `act_fn` when it computes exactly a torch activation and calling it can be skipped
    (no hooks: recompute.has_hooks); None otherwise."""
    if has_hooks(act_fn):
        return None
    if _is(act_fn, _SILU):
        return _silu_
    if _is(act_fn, _RELU):
        return _relu_
    act = getattr(act_fn, "act", None)
    if _is(act_fn, _GELU) and act is F.gelu:
        return _gelu_
    if (
        _is(act_fn, _GELU_TANH)
        and isinstance(act, functools.partial)
        and act.func is F.gelu
        and not act.args
        and act.keywords == {"approximate": "tanh"}
    ):
        return _gelu_tanh_
    if _is(act_fn, _TORCH_GELU):
        return _gelu_tanh_ if act_fn.approximate == "tanh" else _gelu_
    return None


def _same_layout(out: torch.Tensor, other: torch.Tensor) -> bool:
    # Broadcasting or type promotion would make the in-place result differ from the out-of-place one.
    return out.shape == other.shape and out.dtype == other.dtype and out.device == other.device


def add_into(out: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """other + out, written into `out` (a temporary the caller may overwrite) where that gives the same tensor."""
    return out.add_(other) if _same_layout(out, other) else other + out


def mul_into(out: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """out * other, written into `out` (a temporary the caller may overwrite) where that gives the same tensor."""
    return out.mul_(other) if _same_layout(out, other) else out * other
