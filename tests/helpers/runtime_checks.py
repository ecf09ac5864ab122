"""The runtime's promise on any model (outputs and gradients bit-identical with the runtime on and off), the aten
operators a step runs, and the Python frames a call runs."""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections import Counter, OrderedDict

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
import hf_tiny
from hf_tiny import runtime


ROWS = 2 * 80  # more than runtime.MAX_FEW_ROWS, so the products are F.linear's


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


@contextlib.contextmanager
def python_frames(counts: Counter):
    """Counts, by function name, the Python frames run inside the block (sys.setprofile)."""
    previous = sys.getprofile()

    def record(frame, event, arg):
        if event == "call":
            counts[frame.f_code.co_name] += 1

    sys.setprofile(record)
    try:
        yield
    finally:
        sys.setprofile(previous)


class LiveBytes(TorchDispatchMode):
    """The most bytes of storage that the operators run inside the mode allocated and that were alive at once (each
    storage counted once, freed when torch frees it): torch.cuda.max_memory_allocated's measure, without the
    allocator's rounding, on any device. A view's or an in-place operator's output is an input's storage, not
    counted."""

    def __init__(self):
        super().__init__()
        self.alive: set[int] = set()
        self.current = self.peak = 0

    def _freed(self, key: int, size: int) -> None:
        self.alive.discard(key)
        self.current -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size and key not in inputs and key not in self.alive:
                self.alive.add(key)
                self.current += size
                self.peak = max(self.peak, self.current)
                weakref.finalize(storage, self._freed, key, size)
        return out


def peak_bytes(fn) -> int:
    """LiveBytes' peak over one call of fn."""
    with LiveBytes() as mode:
        fn()
    return mode.peak


def batch(model, seed: int = 1, size: int = 2, length: int = ROWS // 2) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (size, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, : length // 4] = 0
    inputs = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    if isinstance(model, hf_tiny.TinyCausalForCausalLM):
        inputs["attention_mask"] = mask.flip(-1).contiguous()  # left padding
        inputs["labels"] = ids.masked_fill(inputs["attention_mask"] == 0, -100)
    return inputs


def logits(model, inputs) -> torch.Tensor:
    inputs = {k: v for k, v in inputs.items() if k != "labels"}
    if isinstance(model, hf_tiny.TinySeq2SeqForConditionalGeneration):
        inputs["decoder_input_ids"] = inputs["input_ids"]
    with torch.inference_mode():
        return model(**inputs).logits


def training_step(model, inputs, seed: int = 5) -> dict:
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks for both runs
    loss = model(**inputs).loss
    loss.backward()
    model.eval()
    return {"loss": loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


def assert_bit_identical_on_and_off(model, *, runs_in_place: bool = True) -> None:
    """Logits of a left-padded batch and a training step's loss and gradients are bit-identical with the runtime on
    and off; runs_in_place: the in-place path really ran (an add_ on, none off). The chunked loss, which equals the
    unchunked one up to the order of additions (tests/models/test_chunked_loss.py), is off on both sides."""
    model.set_runtime(chunked_loss=False)
    inputs = batch(model)
    on_ops = ops_of(lambda: logits(model, inputs))
    on_logits, on_step = logits(model, inputs), training_step(model, inputs)
    with runtime.disabled():
        off_ops = ops_of(lambda: logits(model, inputs))
        off_logits, off_step = logits(model, inputs), training_step(model, inputs)
    assert torch.equal(on_logits, off_logits)
    assert on_step.keys() == off_step.keys() and len(on_step) > 10
    different = [name for name in on_step if not torch.equal(on_step[name], off_step[name])]
    assert not different, different
    if runs_in_place:
        assert "add_" in on_ops and "add_" not in off_ops
    model.set_runtime(True)


def replicate_on_cpu(network: nn.Module, scale: float = 0.5) -> nn.Module:
    """One replica of `network`, wired as torch.nn.parallel.replicate wires each of its replicas (which needs CUDA
    devices; torch/nn/parallel/replicate.py), its parameters copies of the original's times `scale`."""
    modules = list(network.modules())
    copies = {id(module): module._replicate_for_data_parallel() for module in modules}
    for module in modules:
        replica = copies[id(module)]
        replica._former_parameters = OrderedDict()
        for key, child in module._modules.items():
            if child is None:
                replica._modules[key] = None
            else:
                setattr(replica, key, copies[id(child)])
        for key, param in module._parameters.items():
            if param is None:
                replica._parameters[key] = None
            else:
                param_copy = param * scale  # not a leaf, as replicate's broadcast copies
                setattr(replica, key, param_copy)
                replica._former_parameters[key] = param_copy
        for key, buffer in module._buffers.items():
            setattr(replica, key, None if buffer is None else buffer.clone())
    return copies[id(network)]
