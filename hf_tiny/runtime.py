"""The runtime: the same math, run faster or leaner, declared on the classes it may run differently.

A modeling class whose forward the runtime may run differently says so where the forward is defined, with one of this
file's decorators on it (`runtime_layer`, `runtime_feed_forward`, `runtime_stack`, `runtime_decoding`,
`runtime_products`), as transformers marks
its hub kernels. The decorator keeps the forward as written (the math) and puts a dispatcher in its place, in the class:
nothing is set on module instances, so copies, pickles and DataParallel replicas run their own weights, and tools see
the forward's own signature. The dispatcher calls the math unless one of these paths applies:

- recompute (training memory; `runtime_layer`, `runtime_feed_forward`): a layer run in training while gradients are recorded
  keeps only the outputs of its matrix products and attention kernels; everything element-wise is recomputed in
  backward by replaying the layer's own forward (torch's selective activation checkpointing), so losses and gradients
  are bit-identical to keeping everything. A layer that draws random numbers (dropout) is not replayed whole (its
  masks would be drawn again); its feed-forward is recomputed alone. Off under gradient checkpointing, torch.compile,
  hooks inside the layer, or a cache to fill. One backward per forward, as every selective checkpoint.
- in place (inference at scale; `runtime_layer(in_place=...)`, `runtime_stack`, `runtime_feed_forward`): with autograd off and
  at least MIN_ELEMENTS of hidden states, a layer runs `in_place`, its forward with each residual sum written into the
  sublayer's fresh output (the forms are in runtime_forms.py, each proven equal to its layer's forward), and a
  feed-forward writes its activation and gated product into its first projection's output, in a workspace the
  layers of one forward share.
- chunked loss (training; chunked_loss.py, asked by the language models' heads): the loss of a training forward with
  labels computed a chunk of tokens at a time, without the full logits (`skip_logits`, Liger-Kernel's name, decides
  when given).
- few rows (decoding; `runtime_decoding` opens the step, `runtime_feed_forward` and `runtime_products` act): on a
  model's forward over 1 to MAX_FEW_ROWS fp32 tokens without gradients, the feed-forwards' and the output
  projection's nn.Linear products with a weight of at least MIN_WEIGHT_ELEMENTS are taken weight-first (W @ xT),
  which reads the weight faster than x @ WT on a CPU (benchmarks/few_rows.py). They hold about 80 % of the weight
  bytes SmolLM2 reads per step. A feed-forward runs its few-rows form (runtime_forms.py), each projection through
  few_rows_product; the output projection's product is intercepted by a TorchFunctionMode around the head's method.
  Not wider: a mode costs Python calls for every torch call in its scope (over a whole step, SmolLM2's batch-1
  decoding was 1.14x slower than with 36aebb4's per-module products; benchmarks.side_by_side, 2026-11-27), and the
  attention projections hold a fifth of the bytes. The one path that is not bit-identical: the same sum in another
  order (greedy tokens are unchanged in every test).
- fit memory (training on CUDA; memory_fit.py, opened by `runtime_decoding` / `runtime_stack`, acted on by
  `runtime_layer` and the chunked loss): a training forward that would not fit the device's memory chunks its loss,
  then replays whole the layers that do not fit; where it fits, nothing changes.

A path is on by default only on the device types where a benchmark showed it winning at the shapes users run
(ON_BY_DEFAULT). `model.set_runtime(False)` runs the math only; `model.set_runtime(recompute=True)` (any path, True or
False) overrides the default on every device; `with hf_tiny.runtime.disabled():` turns everything off in a block.
Nothing runs where something could tell: under torch.compile or fx tracing, on modules with hooks or a forward someone
else set (accelerate's offloading), on projections that are not plain nn.Linear (PEFT, quantizers, DTensor).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import threading
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_globals
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .memory_fit import LossPlan, counts_memory, current_plan, planned
from .transformers_api import is_activation_checkpointing

PATHS = ("recompute", "in_place", "few_rows", "chunked_loss", "fit_memory", "rebuild")
ON_BY_DEFAULT = {
    # benchmarks/runtime_ab.py (2-core CPU): 0.6x the training memory at 1.0-1.16x the time. On an H100 the step took
    # 2.0-2.4x official's time at 1x64 for no memory saved (results/cuda-nvidia-h100-80gb-hbm3-2026-11-26-quick.md):
    # on accelerators it is a named option (set_runtime(recompute=True)) until a GPU benchmark shows where it wins.
    "recompute": frozenset({"cpu"}),
    # A CPU allocator effect: glibc maps each new multi-MiB tensor from the OS and faults it in page by page; CUDA's
    # caching allocator reuses its blocks.
    "in_place": frozenset({"cpu"}),
    # A CPU BLAS effect (benchmarks/few_rows.py): weight-first reads the weight 1.0-4.2x faster for 1 to 128 rows.
    "few_rows": frozenset({"cpu"}),
    # chunked_loss.py: a training loss without the [tokens, vocab] logits (the CPU side by side's training memory).
    # On a GPU the field's kernel does it through the ecosystem's switch (use_liger_kernel=True: Liger's fused linear
    # cross-entropy); skip_logits=True asks for ours anywhere.
    "chunked_loss": frozenset({"cpu"}),
    # memory_fit.py: acts only where the alternative is running out of device memory (CUDA). On by default there since
    # the GPU check showed both of its conditions on an H200 (results/gpu-check-nvidia-h200-2026-11-28.md: a 3.00x
    # longer sequence at batch 1 than official's; ...-2026-11-30.md: 1.01x the time where the 4x2048 step fits).
    "fit_memory": frozenset({"cuda"}),
    # rebuilt_in_backward: a gated feed-forward's product, not kept for the down projection, rebuilt in backward from
    # what its activation keeps anyway (one element-wise kernel a layer). A named option until the GPU check's
    # Liger row with it on shows its memory saved and its time (benchmarks/gpu_rows.py).
    "rebuild": frozenset(),
}

# In place: 128 KiB of fp32, glibc's smallest threshold for mapping an allocation from the OS (smaller tensors come
# from its free lists).
MIN_ELEMENTS = 1 << 15
# Few rows (benchmarks/few_rows.py, SmolLM2's shapes, 2 threads): weight-first wins for 2 to 128 rows when the weight
# has at least 8 output rows per input row, and for one row when each thread's slice has at least 256 output rows;
# weights of fewer than 100,000 elements keep F.linear (their product is over before the extra operators pay).
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


# ---- the switch: per model, per path -----------------------------------------------------------------------------


def configure(model: nn.Module, enabled: bool = True, **paths: bool) -> nn.Module:
    """The runtime of `model`'s modules: enabled=False, every path off; enabled=True alone, every path back to its
    device default (ON_BY_DEFAULT); each path named here on (True) or off (False) on every device, the others as
    they were."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_runtime: enabled must be True or False, got {enabled!r}")
    if not enabled and any(value is True for value in paths.values()):
        on = sorted(name for name, value in paths.items() if value is True)
        raise ValueError(f"set_runtime(False, ...) turns every path off; it cannot also turn on {on}: call "
                         f"set_runtime({', '.join(f'{name}=True' for name in on)}) instead")
    for name, value in paths.items():
        if name not in PATHS:
            raise ValueError(f"set_runtime: unknown runtime path {name!r}; the paths are {list(PATHS)}")
        if not isinstance(value, bool):
            raise TypeError(f"set_runtime: {name} must be True or False, got {value!r}")
    if enabled and any(paths.values()):
        global _path_chosen_on
        _path_chosen_on = True
    for module in model.modules():
        if not declared(type(module)):
            continue
        if not enabled:
            module.runtime_paths = dict.fromkeys(PATHS, False)
        elif paths:
            module.runtime_paths = {**vars(module).get("runtime_paths", {}), **paths}
        else:
            vars(module).pop("runtime_paths", None)
    return model


def is_enabled(model: nn.Module) -> bool:
    """Whether any path may act on the model (at its device defaults, or a path turned on)."""
    for module in model.modules():
        chosen = vars(module).get("runtime_paths")
        if declared(type(module)) and (chosen is None or len(chosen) < len(PATHS) or any(chosen.values())):
            return True
    return False


_DECLARATIONS: dict = {}


def _declaration(cls: type) -> Optional[str]:
    """The declaration the class's forward carries (through any wrappers of it, such as transformers'
    GradientCheckpointingLayer's), or None."""
    if cls not in _DECLARATIONS:
        forward, found = getattr(cls, "forward", None), None
        while forward is not None and found is None:
            found = getattr(forward, "runtime_declaration", None)
            forward = getattr(forward, "__wrapped__", None)
        _DECLARATIONS[cls] = found
    return _DECLARATIONS[cls]


def declared(cls: type) -> bool:
    """Whether the class's forward carries one of this file's declarations."""
    return _declaration(cls) is not None


# Whether set_runtime ever turned a path on in this process: until then a path is on only on its devices, and
# path_on answers off them without a call (the host work of every layer on a GPU, where every path is off).
_path_chosen_on = False


def path_on(module: nn.Module, path: str, device: torch.device) -> bool:
    """Whether `path` may act on the module's work on `device`: the model's choice (set_runtime) or the device
    default, no `disabled()` block, not under torch.compile (its partitioner and fusions make these choices there;
    and dynamo cannot read the block's ContextVar without a graph break)."""
    if not _path_chosen_on and device.type not in ON_BY_DEFAULT[path]:
        return False
    if torch.compiler.is_compiling():
        return False
    chosen = module.__dict__.get("runtime_paths")
    if chosen is not None and path in chosen:
        return chosen[path] and not _disabled.get()
    return device.type in ON_BY_DEFAULT[path] and not _disabled.get()


def _declaring(math: Callable, dispatcher: Callable, declaration: str) -> Callable:
    dispatcher = functools.wraps(math)(dispatcher)
    dispatcher.runtime_declaration = declaration
    # The math under a name that finds it (the class attribute is the dispatcher; the math is its __wrapped__): pickle
    # saves a function as module and qualified name, and vLLM's compile cache pickles the model forwards it traced. A
    # GradientCheckpointingLayer's forward is wrapped again by transformers after this, and does not pickle so.
    math.__qualname__ = f"{dispatcher.__qualname__}.__wrapped__"
    return dispatcher


# ---- when the runtime may act ------------------------------------------------------------------------------------


def _any_global_hooks() -> bool:
    return bool(module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks)


def untouched(module: nn.Module) -> bool:
    """No hook of any kind on the module (nor a global one) and no forward set on the instance: its output may be
    overwritten and its work done without calling it."""
    # Written out rather than calling _any_global_hooks and vars: decoding asks this of every projection it takes.
    hooks = module._forward_hooks or module._forward_pre_hooks
    if hooks or module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
        return False
    return "forward" not in module.__dict__


def plain_linear(module: nn.Module) -> bool:
    """An nn.Linear (not a subclass: PEFT, quantized) on ordinary tensors, untouched (chunked_loss.py multiplies a
    plain head's weight itself)."""
    if type(module) is not nn.Linear or not untouched(module):
        return False
    return all(type(p) in (torch.Tensor, nn.Parameter) for p in module.parameters(recurse=False))


def draws_random(module: nn.Module) -> bool:
    """Whether the module's training forward draws random numbers: a dropout, or an attention's dropout rate."""
    for part in module.modules():
        rate = part.p if isinstance(part, nn.modules.dropout._DropoutNd) else getattr(part, "dropout", 0.0)
        if isinstance(rate, float) and rate > 0.0:
            return True
    return False


def _replayable(layer: nn.Module, *, own_code_only: bool = False) -> bool:
    """Whether replaying the layer's forward in backward would be invisible: no hook inside it (a hook would run
    twice), except the output recorders of step.LayerOutputs, which are removed before backward; no forward set on a
    submodule by someone else (accelerate's offloading).

    own_code_only (the recompute): every module inside is also torch.nn's, one of transformers' activations or the
    model's own code (hf_tiny's, or the copy a saved folder ships). The recompute keeps the layer's matrix products'
    outputs (torch's selective checkpoint caches them), so a module that writes into one in place would change what
    backward reads: PEFT's AdaLoRA, C3A and GraLoRA add their update into the base projection's output
    (`result += ...`), and so do LoRA's mixed-adapter batches. A whole-layer replay (fit_memory's) keeps nothing of
    the layer and needs no such check."""
    if _any_global_hooks():
        return False
    own = type(layer).__module__.rpartition(".")[0] + "."
    for module in layer.modules():
        hooks = list(module._forward_hooks.values()) + list(module._forward_pre_hooks.values())
        if any(not getattr(hook, "records_outputs", False) for hook in hooks):
            return False
        if "forward" in vars(module):
            return False
        code = type(module).__module__
        if own_code_only and not (code.startswith(("torch.nn.", own)) or code == "transformers.activations"):
            return False
    return True


def under_functorch() -> bool:
    """Inside a torch.func transform (grad, vjp, jacrev, vmap), where saved-tensor hooks (recompute, rebuild) and
    the chunked loss's autograd.Function cannot run: those paths step aside there."""
    return torch._C._are_functorch_transforms_active()


def _recomputes(layer: nn.Module, hidden_states) -> bool:
    # path_on first: off its devices it answers without a call, and under compilation it says no
    return (
        type(hidden_states) is torch.Tensor
        and path_on(layer, "recompute", hidden_states.device)
        and torch.is_grad_enabled()
        and not layer.gradient_checkpointing
        and _replayable(layer, own_code_only=True)
        and not under_functorch()
        and not _autocast_caches(hidden_states.device.type)
    )


def _autocast_caches(device_type: str) -> bool:
    """Inside torch.autocast with its cast cache (the default), recompute steps aside: a weight used twice in one
    autocast block (two forwards before one backward, ALBERT's shared layers) is cast once and its gradients summed
    in the low precision before the cast's backward. A replay after the cache is gone casts again: its ops did not
    line up with the recorded ones (backward failed), and without the cache the gradients would be summed otherwise
    than official's."""
    try:
        return torch.is_autocast_enabled(device_type) and torch.is_autocast_cache_enabled()
    except RuntimeError:  # a device type autocast does not know (meta): no autocast there
        return False


def in_place_scale(module: nn.Module, tensor) -> bool:
    """Inference at scale: no autograd, at least MIN_ELEMENTS, not compiling, the in-place path on."""
    # path_on's first test inline, which makes no call (a GPU's answer); compilation before the size test, which
    # under dynamo would add a guard on the shape
    return (
        type(tensor) is torch.Tensor
        and (_path_chosen_on or tensor.device.type in ON_BY_DEFAULT["in_place"])
        and not torch.compiler.is_compiling()
        and tensor.numel() >= MIN_ELEMENTS
        and not torch.is_grad_enabled()
        and path_on(module, "in_place", tensor.device)
    )


# ---- recompute: a layer's own forward replayed in backward --------------------------------------------------------

_aten = torch.ops.aten
# What a layer keeps for backward: the outputs of its matrix products and attention kernels. Everything else in it is
# element-wise or a reduction over one row (norms, softmax of the eager path, activations, rotations).
_SAVED = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default, _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default, _aten._scaled_dot_product_cudnn_attention.default,
}


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts():
    forward, recompute = create_selective_checkpoint_contexts(_policy)
    return forward, _SecondBackwardNamed(recompute)


class _SecondBackwardNamed(contextlib.AbstractContextManager):
    """torch's recompute context (entered at each backward through the layer), whose error for a second backward
    (retain_graph=True, or autograd.grad before backward, as adversarial training does) names the runtime and how
    to turn it off."""

    def __init__(self, recompute):
        self.recompute = recompute

    def __enter__(self):
        return self.recompute.__enter__()

    def __exit__(self, kind, error, traceback):
        if self.recompute.__exit__(kind, error, traceback):
            return True
        if isinstance(error, RuntimeError) and "backward an extra time" in str(error):
            raise RuntimeError(
                "a second backward through a layer that hf_tiny's training recompute ran (on by default on the CPU: "
                "it keeps a layer's matrix products and recomputes the rest once, in the first backward), e.g. "
                "backward(retain_graph=True), or torch.autograd.grad(..., retain_graph=True) then backward. Turn the "
                "recompute off for this model, model.set_runtime(recompute=False), or the whole runtime, "
                "model.set_runtime(False)"
            ) from error
        return False


# Set while a layer that draws random numbers runs in training: its feed-forward is recomputed alone.
_parts_recomputed: contextvars.ContextVar = contextvars.ContextVar("hf_tiny_parts_recomputed", default=False)

# How many step-scoped paths (_parts_recomputed, _few_rows_step) are open, in any thread. While none is, a
# feed-forward or an output projection reads no ContextVar: on a GPU, where no path is on by default, that is every
# step (2 Python calls a layer saved). Under the lock, so that no open path is ever counted out.
_scoped_open = 0
_scoped_lock = threading.Lock()


@contextlib.contextmanager
def _scoped(flag: contextvars.ContextVar) -> Iterator[None]:
    global _scoped_open
    with _scoped_lock:
        _scoped_open += 1
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)
        with _scoped_lock:
            _scoped_open -= 1


def _replayed(math: Callable, module: nn.Module, *args, **kwargs):
    return checkpoint(math, module, *args, use_reentrant=False, context_fn=_contexts, **kwargs)


def _recomputed(math: Callable, layer: nn.Module, hidden_states, args: tuple, kwargs: dict):
    if not draws_random(layer):
        return _replayed(math, layer, hidden_states, *args, **kwargs)
    with _scoped(_parts_recomputed):
        return math(layer, hidden_states, *args, **kwargs)


# ---- rebuild: a tensor backward recomputes cheaply, not kept for it -----------------------------------------------


def rebuilds(module: nn.Module, tensor) -> bool:
    """A training step records gradients with the rebuild path on, not compiled, and no saved-tensor hooks are open
    already (gradient checkpointing's, CPU offloading's: theirs decide what is kept)."""
    # path_on first: off its devices it answers without a call, and under compilation it says no
    return (
        type(tensor) is torch.Tensor
        and path_on(module, "rebuild", tensor.device)
        and torch.is_grad_enabled()
        and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        and not under_functorch()
    )


@contextlib.contextmanager
def rebuilt_in_backward(module: nn.Module, tensor: torch.Tensor, rebuild: Callable[[], torch.Tensor]) -> Iterator[None]:
    """While open, what autograd saves of `tensor` (it, or a view of its memory) is kept as a recipe, and backward
    takes the same view of rebuild() (run without gradients; it must compute `tensor` bit for bit from tensors that
    are kept anyway): `tensor`'s memory is freed after the forward, not after the backward. As written elsewhere."""
    if not (rebuilds(module, tensor) and tensor.requires_grad and tensor.is_contiguous()):
        yield
        return
    memory = tensor.untyped_storage().data_ptr(), tensor.dtype, tensor.device
    base = tensor.storage_offset()

    def pack(saved: torch.Tensor):
        if (saved.untyped_storage().data_ptr(), saved.dtype, saved.device) != memory:
            return saved
        return tuple(saved.shape), saved.stride(), saved.storage_offset() - base

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        shape, stride, offset = packed
        with torch.no_grad():
            return rebuild().as_strided(shape, stride, offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


# ---- the declarations ----------------------------------------------------------------------------------------------


def runtime_layer(in_place: Optional[str] = None) -> Callable[[Callable], Callable]:
    """Declares a residual layer's forward: recomputed in training; with `in_place` (the name of a runtime_forms
    function computing the same forward), run in that form at inference scale."""

    def declare(math: Callable) -> Callable:
        def forward(self, hidden_states, *args, **kwargs):
            if self.training:
                fresh = kwargs.get("cache") is None  # a replay would write a cache twice
                if fresh and _recomputes(self, hidden_states):
                    return _recomputed(math, self, hidden_states, args, kwargs)
                # dynamo cannot read a ContextVar without a graph break; no plan exists before a path is chosen or
                # on by default somewhere
                plan_possible = _path_chosen_on or ON_BY_DEFAULT["fit_memory"]
                plan = current_plan() if plan_possible and not torch.compiler.is_compiling() else None
                if plan is not None:
                    return plan.run_layer(math, self, hidden_states, args, kwargs,
                                          replayable=lambda: fresh and _replayable(self))
            # a decoding step's one token never is (and dynamo specializes sizes of 1 anyway: no new guard)
            elif (in_place is not None and type(hidden_states) is torch.Tensor and hidden_states.shape[1] > 1
                  and in_place_scale(self, hidden_states) and untouched(self)):
                return runtime_form("IN_PLACE_LAYERS", in_place)(self, hidden_states, *args, **kwargs)
            return math(self, hidden_states, *args, **kwargs)

        forward.in_place_name = in_place
        return _declaring(math, forward, "runtime_layer")

    return declare


@functools.lru_cache(maxsize=64)  # looked up by every feed-forward of every decoding step
def runtime_form(table: str, key) -> Optional[Callable]:
    """The form runtime_forms' `table` holds for `key` (imported on first use: runtime_forms imports the modules that
    declare)."""
    from .runtime_forms import (  # transformers copies `from .x import` files
        FEW_ROWS_FEED_FORWARDS, IN_PLACE_LAYERS, REBUILT_FEED_FORWARDS,
    )

    tables = {"FEW_ROWS_FEED_FORWARDS": FEW_ROWS_FEED_FORWARDS, "IN_PLACE_LAYERS": IN_PLACE_LAYERS,
              "REBUILT_FEED_FORWARDS": REBUILT_FEED_FORWARDS}
    return tables[table].get(key)


def runtime_feed_forward(math: Callable) -> Callable:
    """Declares a feed-forward's forward: in a training layer that draws random numbers it is recomputed alone; in a
    decoding step with few rows its products are taken weight-first; a layer's in-place form runs the feed-forward's
    own (runtime_forms.feed_forward_in_place)."""

    def forward(self, x):
        # a named path only (nowhere a default): a GPU's every step passes on the first test
        if _path_chosen_on and self.training and rebuilds(self, x):
            form = runtime_form("REBUILT_FEED_FORWARDS", type(self))
            if form is not None:
                return form(self, x)
        # Compilation first: dynamo cannot read a ContextVar without a graph break.
        if not _scoped_open or torch.compiler.is_compiling():
            return math(self, x)
        if self.training:
            if _parts_recomputed.get() and untouched(self) and not draws_random(self):
                return _replayed(math, self, x)
        elif _few_rows_step.get():
            form = runtime_form("FEW_ROWS_FEED_FORWARDS", type(self))
            if form is not None:
                return form(self, x)
        return math(self, x)

    return _declaring(math, forward, "runtime_feed_forward")


def runtime_products(math: Callable) -> Callable:
    """Declares a language model's method that applies its output projection (the largest weight): in a decoding
    step with few rows its product is taken weight-first."""

    def forward(self, *args, **kwargs):
        if not _scoped_open or torch.compiler.is_compiling() or not _few_rows_step.get():
            return math(self, *args, **kwargs)
        with WeightFirstProducts():
            return math(self, *args, **kwargs)

    return _declaring(math, forward, "runtime_products")


_workspace: contextvars.ContextVar = contextvars.ContextVar("hf_tiny_layer_workspace", default=None)


def runtime_stack(math: Callable) -> Callable:
    """Declares the forward of a model's stack of layers: inference without autograd opens the workspace its layers'
    in-place forms share (freed on exit)."""

    def forward(self, *args, **kwargs):
        # Compilation before the ContextVar: dynamo cannot read one without a graph break.
        if self.training:
            return _fitted(math, self, args, kwargs)
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or _workspace.get() is not None:
            return math(self, *args, **kwargs)
        token = _workspace.set({})
        try:
            return math(self, *args, **kwargs)
        finally:
            _workspace.reset(token)

    return _declaring(math, forward, "runtime_stack")


def _fitted(math: Callable, model: nn.Module, args: tuple, kwargs: dict, *, head: Optional[nn.Module] = None,
            tokens=None):
    """A training forward, planned to fit its device's memory (memory_fit.py) where the fit_memory path is on,
    gradients are recorded, no plan is open yet (a language model's opens it for its stack and its head's loss) and
    gradient checkpointing is off."""
    # inference first (one call); then, where no device has the path by default and no model chose a path, no more
    if (not torch.is_grad_enabled() or not (_path_chosen_on or ON_BY_DEFAULT["fit_memory"])
            or torch.compiler.is_compiling() or current_plan() is not None):
        return math(model, *args, **kwargs)
    # the inputs' device: a DataParallel replica holds its weights as plain attributes, parameters() gives none
    device = next((v.device for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
    if (device is None or not counts_memory(device) or not path_on(model, "fit_memory", device)
            or is_activation_checkpointing(model)):
        return math(model, *args, **kwargs)
    loss = None if head is None else _planned_loss(model, head, kwargs, tokens)
    return planned(math, model, args, kwargs, device=device, is_layer=_is_runtime_layer, loss=loss)


def _is_runtime_layer(cls: type) -> bool:
    return _declaration(cls) == "runtime_layer"


def _planned_loss(model: nn.Module, head: nn.Module, kwargs: dict, tokens) -> LossPlan:
    """What a language model's training forward will make of its logits: their tokens (the labels', else the step's
    tokens: a seq2seq model's decoder side) and whether the loss may be computed without them (chunked_loss.py's
    conditions: labels given by name, skip_logits not False, a plain head, every position's logits)."""
    labels = kwargs.get("labels")
    if isinstance(labels, torch.Tensor):
        count = labels.numel()
    elif isinstance(tokens, torch.Tensor) and tokens.dim() >= 2:
        count = tokens.shape[0] * tokens.shape[1]
    else:
        count = None  # the first layer's tokens
    keep = kwargs.get("logits_to_keep", 0)  # an int, or a tensor of the positions to keep
    chunkable = (isinstance(labels, torch.Tensor) and kwargs.get("skip_logits") is not False and plain_linear(head)
                 and isinstance(keep, int) and keep == 0)
    return LossPlan(model.config.vocab_size, count, chunkable)


def workspace_tensor(name: str, rows: int, cols: int, like: torch.Tensor) -> Optional[torch.Tensor]:
    """The open workspace's [rows, cols] tensor `name` (dtype and device of `like`), or None outside a workspace. Its
    contents are the caller's until the next call with the same name."""
    buffers = _workspace.get()
    if buffers is None:
        return None
    tensor = buffers.get(name)
    if tensor is None or tensor.shape != (rows, cols) or tensor.dtype != like.dtype or tensor.device != like.device:
        tensor = buffers[name] = torch.empty(rows, cols, dtype=like.dtype, device=like.device)
    return tensor


# ---- few rows: decoding's products weight-first --------------------------------------------------------------------


# Set while a decoding step of few rows runs: the feed-forwards' and the output projection's products are then taken
# weight-first (runtime_feed_forward, runtime_products). Only there: a TorchFunctionMode sees every torch call inside
# it, and over a whole step (norms, attention, residuals) its cost outweighed the products' gain.
_few_rows_step: contextvars.ContextVar = contextvars.ContextVar("hf_tiny_few_rows_step", default=False)


def runtime_decoding(head: str, tokens: str = "input_ids") -> Callable[[Callable], Callable]:
    """Declares a language model's forward whose decoding steps may take their products weight-first; `head`: the
    attribute holding its output projection, whose weight stands for the model's (its dtype and size decide);
    `tokens`: the keyword argument holding the step's token ids (or their embeddings, `inputs_embeds` for
    `input_ids`)."""
    embeds = tokens.replace("input_ids", "inputs_embeds")

    def declare(math: Callable) -> Callable:
        position = list(inspect.signature(math).parameters).index(tokens) - 1  # in args, after self

        def forward(self, *args, **kwargs):
            step = args[position] if len(args) > position else kwargs.get(tokens)
            step = kwargs.get(embeds) if step is None else step
            if self.training:
                return _fitted(math, self, args, kwargs, head=getattr(self, head), tokens=step)
            if torch.is_grad_enabled() or not _few_rows_apply(self, getattr(self, head), step):
                return math(self, *args, **kwargs)
            with _scoped(_few_rows_step):
                return math(self, *args, **kwargs)

        declared = _declaring(math, forward, "runtime_decoding")
        # The math's signature, computed once: generate() reads a custom-code model's forward signature at every step
        # (prepare_inputs_for_generation's cache_position check), 238 Python calls each time without it, 30 with it.
        # On the math, which inspect reaches through the dispatcher's __wrapped__: a wrapper built with
        # functools.wraps from the bound forward (accelerate's hooks) copies the dispatcher's __dict__, and a
        # signature there would be read as the wrapper's own, self included. Only here: vLLM compiles the stack's
        # forward, and its compiler failed on a dispatcher carrying one.
        math.__signature__ = MethodSignature.of(math)
        return declared

    return declare


_NOT_GIVEN = object()  # replace()'s own default (inspect's is private)


class MethodSignature(inspect.Signature):
    """A method's signature that keeps its bound form (without `self`). inspect.signature(model.forward) binds the
    function's signature at every call, through replace(parameters=all but the first), which builds and validates a
    new Signature (41 Python calls for a causal LM's forward); here that request returns the form built once.
    Any other replace builds a new one as usual."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        parameters = tuple(self.parameters.values())
        self._unbound_tail = parameters[1:]
        self._bound = inspect.Signature(parameters[1:], return_annotation=self.return_annotation)

    def __setstate__(self, state):  # a copy or unpickling: __init__ ran without the return annotation
        super().__setstate__(state)
        self._bound = self._bound.replace(return_annotation=self.return_annotation)

    @classmethod
    def of(cls, function: Callable) -> "MethodSignature":
        signature = inspect.signature(function)
        return cls(tuple(signature.parameters.values()), return_annotation=signature.return_annotation)

    def replace(self, *, parameters=_NOT_GIVEN, return_annotation=_NOT_GIVEN):
        # a tuple compare checks identity first: no Python call when inspect passes this signature's own parameters
        if return_annotation is _NOT_GIVEN and parameters == self._unbound_tail:
            return self._bound
        changes = {"parameters": parameters, "return_annotation": return_annotation}
        return super().replace(**{name: value for name, value in changes.items() if value is not _NOT_GIVEN})


def _few_rows_apply(model: nn.Module, head: nn.Module, tokens) -> bool:
    """A decoding step of few fp32 tokens on a CPU (the product's kernel is a CPU one), outside autocast."""
    weight = getattr(head, "weight", None)
    return (
        type(tokens) is torch.Tensor and tokens.dim() >= 2 and tokens.shape[0] * tokens.shape[1] <= MAX_FEW_ROWS
        and type(weight) in (torch.Tensor, nn.Parameter) and weight.dtype is torch.float32 and weight.is_cpu
        and weight.numel() >= MIN_WEIGHT_ELEMENTS and not torch.is_autocast_enabled("cpu")
        and path_on(model, "few_rows", weight.device)
    )


def few_rows_product(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """linear(x) in a decoding step of few rows (runtime_forms' feed-forward forms): weight-first when linear is an
    untouched plain nn.Linear and the product qualifies (_few_rows); otherwise the module, called."""
    if type(linear) is nn.Linear and untouched(linear):
        weight, bias = linear.weight, linear.bias
        rows = _few_rows(x, weight, bias)
        if rows:
            return few_rows_linear(x, weight, bias, rows)
    return linear(x)


class WeightFirstProducts(TorchFunctionMode):
    """Within a decoding step, F.linear on few fp32 rows and a large plain weight is computed weight-first (the
    output projection's product: runtime_products; the feed-forwards call few_rows_product, which costs fewer Python
    calls than a mode, through runtime_forms)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            rows = _few_rows(*args, **kwargs)
            if rows:
                return few_rows_linear(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias"), rows)
        return func(*args, **kwargs)


def weight_first(out_features: int, rows: int) -> bool:
    """Whether the runtime computes a product of `rows` rows with an [out_features, *] fp32 weight (of at least
    MIN_WEIGHT_ELEMENTS) weight-first."""
    if rows == 1:
        return _slices_per_thread(out_features, torch.get_num_threads(), MIN_SLICE) > 1
    return 1 < rows <= MAX_FEW_ROWS and rows * MIN_OUTPUTS_PER_ROW <= out_features


def _few_rows(x, weight, bias=None) -> int:
    """The number of rows of x when the weight-first product applies to F.linear(x, weight, bias), else 0."""
    if (type(x) is not torch.Tensor or type(weight) not in (torch.Tensor, nn.Parameter) or weight.ndim != 2
            or x.dtype is not torch.float32 or weight.dtype is not torch.float32 or not x.is_cpu):
        return 0
    if bias is not None and (type(bias) not in (torch.Tensor, nn.Parameter) or bias.dtype is not torch.float32):
        return 0
    out_features, in_features = weight.shape
    shape = x.shape
    if (out_features * in_features < MIN_WEIGHT_ELEMENTS or not shape or shape[-1] != in_features
            or not weight.is_contiguous()):
        return 0
    rows = x.numel() // in_features
    return rows if weight_first(out_features, rows) else 0


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias, rows: int) -> torch.Tensor:
    """F.linear(x, weight, bias) as W @ xT; one row as one product per thread over slices of W's output rows. weight
    must be contiguous."""
    out_features, in_features = weight.shape
    flat = x.reshape(rows, in_features)
    if rows == 1:
        slices = _slices_per_thread(out_features, torch.get_num_threads(), MIN_SLICE)
        sliced = weight.view(slices, out_features // slices, in_features)
        # x as the transposed view of its row: the strides with which bmm reads it at full speed
        column = flat.t().expand(slices, in_features, 1)
        out = torch.bmm(sliced, column) if bias is None else torch.baddbmm(bias.reshape(slices, -1, 1), sliced, column)
        return out.view(*x.shape[:-1], out_features)
    out = torch.mm(weight, flat.t()) if bias is None else torch.addmm(bias.unsqueeze(1), weight, flat.t())
    return out.t().contiguous().view(*x.shape[:-1], out_features)


@functools.lru_cache(maxsize=256)  # asked for every product of every decoding step, of a handful of shapes
def _slices_per_thread(out_features: int, threads: int, min_slice: int) -> int:
    """The most slices, up to one per intra-op thread, that divide the output rows evenly into slices of at least
    min_slice rows (1: no slicing)."""
    slices = min(threads, out_features // min_slice)
    while slices > 1 and out_features % slices:
        slices -= 1
    return max(slices, 1)
