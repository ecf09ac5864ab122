"""The runtime's "fit_memory" path: a training forward that would not fit the device's memory keeps less.

Keeping every activation of a training step runs out of device memory at some sequence length. With this path on
(by default on CUDA; `model.set_runtime(fit_memory=False)` turns it off), a training forward on a device whose memory
torch counts (CUDA) plans as it goes, cheapest saving first:

1. its first layer runs as written, and what that layer kept (the bytes allocated after it, less those before) stands
   for what each later layer would keep;
2. when the remaining layers, the loss's logits and the backward's own needs would no longer fit the memory the device
   had at the start, the loss is computed without logits (chunked_loss.py: its matrix products are the ones an
   unchunked loss does), where it may be (labels given by name, skip_logits not False, a plain nn.Linear head); a
   step that keeps its logits counts them;
3. and when the layers alone would still not fit, each layer that does not keeps only its input and is replayed whole
   in backward (torch's non-reentrant checkpoint, as gradient checkpointing does), until the rest fits.

Where everything fits, every layer runs as written and nothing is replayed: the path costs a few counter reads a
layer. A replayed layer reruns the same kernels, so gradients are those of the plain step; the chunked loss equals the
plain one up to fp32 summation order.
"""

from __future__ import annotations

import contextvars
from typing import Callable, NamedTuple, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# Bytes a [tokens, vocab] loss keeps per logit without chunking: the fp32 logits, their log-softmax and, in backward,
# their gradient (chunked_loss.py), plus the head's own half-precision output.
LOGIT_BYTES = 16
# Of the memory the device has at the start, the share a plan counts on: the allocator's blocks never fit exactly.
USABLE_SHARE = 0.9


def counts_memory(device: torch.device) -> bool:
    """Whether torch counts the memory of `device` (CUDA's allocator does; the CPU's does not)."""
    return device.type == "cuda"


def _current(device: torch.device, *names: str) -> tuple[int, ...]:
    """The allocator's current value of each counter named (e.g. "allocated_bytes"), from one read of its counters.
    Not torch.cuda.memory_allocated: it flattens every counter into a sorted dict in Python at each read (849 Python
    calls), and a plan reads once a layer."""
    counters = torch.cuda.memory_stats_as_nested_dict(device)
    return tuple(counters.get(name, {}).get("all", {}).get("current", 0) for name in names)


def device_memory(device: torch.device) -> Optional[tuple[int, int]]:
    """(bytes torch holds allocated on `device`, bytes it could still allocate there: free on the device plus its own
    cached blocks), or None on a device whose memory torch does not count."""
    if not counts_memory(device):
        return None
    free, _ = torch.cuda.mem_get_info(device)
    allocated, reserved = _current(device, "allocated_bytes", "reserved_bytes")
    return allocated, free + reserved - allocated


def allocated_bytes(device: torch.device) -> int:
    return _current(device, "allocated_bytes")[0]


def census(model: nn.Module, is_layer: Callable[[type], bool]) -> tuple[int, int]:
    """(layers, gradient bytes) of `model`, in one walk over its modules (once a training step): how many modules
    is_layer(type(module)) calls layers, and what backward will allocate for the parameters' gradients not allocated
    yet. A DataParallel replica holds its weights as plain attributes (parameters() gives none), listed in each
    module's _former_parameters; backward gives them gradients on the replica's device as well."""
    layers = gradients = 0
    for module in model.modules():  # plain loops, and no attribute lookup that can miss (nn.Module's would raise)
        if is_layer(type(module)):
            layers += 1
        former = vars(module).get("_former_parameters")
        for w in ({**module._parameters, **former} if former else module._parameters).values():
            # a replica's copies are not leaves: their gradients pass through its device on their way to the originals
            if w is not None and w.requires_grad and (not w.is_leaf or w.grad is None):
                gradients += w.numel() * w.element_size()
    return layers, gradients


class LossPlan(NamedTuple):
    """A language model's logits in its training forward: vocab_size; tokens (None: the first layer's); whether the
    loss may be computed without them (labels given, skip_logits not False, a plain head: chunked_loss.py)."""

    vocab_size: int
    tokens: Optional[int]
    chunkable: bool


class MemoryPlan:
    """One training forward's plan (the module docstring): built before its first layer, consulted by each layer and
    by the loss."""

    def __init__(self, device: torch.device, layers: int, loss: Optional[LossPlan], gradient_bytes: int,
                 memory: tuple[int, int]):
        allocated, available = memory
        self.device = device
        self.limit = allocated + int(available * USABLE_SHARE) - gradient_bytes
        self.layers_left = layers
        self.loss = loss
        self.kept_per_layer: Optional[int] = None
        self.logit_bytes = 0
        self.chunk_loss = False

    def run_layer(self, math: Callable, layer: nn.Module, hidden_states: torch.Tensor, args: tuple, kwargs: dict, *,
                  replayable: Callable[[], bool]):
        """One layer of the step; one that may not be replayed (replayable() false: runtime._replayable, a cache to
        write; asked only where the layer does not fit) runs as written and is counted all the same."""
        self.layers_left -= 1
        if self.kept_per_layer is None:
            before = allocated_bytes(self.device)
            output = math(layer, hidden_states, *args, **kwargs)
            self.kept_per_layer = max(allocated_bytes(self.device) - before, 0)
            self._plan_loss(hidden_states.shape[:-1].numel())
            return output
        if self._fits(self.layers_left + 1, 0 if self.chunk_loss else self.logit_bytes) or not replayable():
            return math(layer, hidden_states, *args, **kwargs)
        return checkpoint(math, layer, hidden_states, *args, use_reentrant=False, **kwargs)

    def _plan_loss(self, first_layer_tokens: int) -> None:
        """The logits' bytes, and whether the loss goes without them: only where it may, and the rest would not fit."""
        if self.loss is None:
            return
        tokens = first_layer_tokens if self.loss.tokens is None else self.loss.tokens
        self.logit_bytes = LOGIT_BYTES * self.loss.vocab_size * tokens
        self.chunk_loss = self.loss.chunkable and not self._fits(self.layers_left, self.logit_bytes)

    def _fits(self, plain_layers: int, loss_bytes: int) -> bool:
        """Whether `plain_layers` more layers kept whole, the loss and backward's working set (a layer replayed and
        its gradients) fit under the limit."""
        kept = self.kept_per_layer * (plain_layers + 2)
        return allocated_bytes(self.device) + kept + loss_bytes <= self.limit


_plan: contextvars.ContextVar = contextvars.ContextVar("hf_tiny_memory_plan", default=None)


def current_plan() -> Optional[MemoryPlan]:
    return _plan.get()


def planned(math: Callable, model: nn.Module, args: tuple, kwargs: dict, *, device: torch.device,
            is_layer: Callable[[type], bool], loss: Optional[LossPlan]):
    """model's forward `math` run under a new plan for `device` (is_layer: which module classes are its layers;
    loss: a language model's, None for a stack of layers); as written where the device's memory is not counted."""
    memory = device_memory(device)
    if memory is None:
        return math(model, *args, **kwargs)
    layers, gradients = census(model, is_layer)
    token = _plan.set(MemoryPlan(device, layers, loss, gradients, memory))
    try:
        return math(model, *args, **kwargs)
    finally:
        _plan.reset(token)
