"""Models that run with one module's weights in memory at a time: parity of checkpoints larger than memory.

A model is built with its parameters on the meta device (buffers real, as `from_pretrained` builds them in the
run's dtype) and every module holding parameters reads them from a lazy checkpoint (lazy.py) just before it runs
and drops them right after. The forward is the model's own, unchanged: the parity proof runs the official
model's and ours' complete forwards (two full chains, as an in-memory comparison would), and hooks on their
decoder/encoder layers record each layer's output, so the card can say where a mismatch starts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from .errors import ConversionError, list_names
from .lazy import LazyTensors


@dataclass
class Streamed:
    """A model class, its config and where its weights are: `tensors` under the model's names (tied copies and
    a base model's prefix resolved by `stored_names`)."""

    model_class: type
    config: object
    tensors: LazyTensors
    kwargs: dict = field(default_factory=dict)  # for the class's constructor (e.g. add_pooling_layer)

    def build(self, dtype: torch.dtype) -> nn.Module:
        """The model with parameters on the meta device, buffers computed as from_pretrained(dtype=...) would."""
        from accelerate import init_empty_weights

        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype if dtype.is_floating_point else previous)
        try:
            with init_empty_weights(include_buffers=False):
                model = self.model_class(self.config, **self.kwargs)
        finally:
            torch.set_default_dtype(previous)
        return model.eval()


def stored_names(model: nn.Module, tensors: Mapping, *, base_prefix: str = "") -> dict[str, str]:
    """{parameter or buffer name: checkpoint key} of every parameter, and of every buffer the checkpoint holds.
    A name missing from the checkpoint is found as its tied source (the model's tie map), or with the base model's
    prefix added or removed (as from_pretrained accepts); anything else, or a shape that differs, is an error."""
    tied = model.get_expanded_tied_weights_keys(all_submodels=True) if hasattr(
        model, "get_expanded_tied_weights_keys") else {}
    names, unresolved = {}, []
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        key = _stored_key(name, tensors, tied, base_prefix)
        if key is None:
            if isinstance(tensor, nn.Parameter):
                unresolved.append(name)
            continue
        info = tensors.info(key) if isinstance(tensors, LazyTensors) else None
        if info is not None and tuple(info.shape) != tuple(tensor.shape):
            unresolved.append(f"{name} (stored {tuple(info.shape)}, model {tuple(tensor.shape)})")
            continue
        names[name] = key
    if unresolved:
        raise ConversionError(f"the checkpoint holds no tensor for: {list_names(unresolved)}")
    return names


def _stored_key(name: str, tensors: Mapping, tied: Mapping[str, str], base_prefix: str) -> str | None:
    for candidate in (name, tied.get(name)):
        if candidate is None:
            continue
        options = [candidate]
        if base_prefix:
            options += [candidate.removeprefix(base_prefix + "."), f"{base_prefix}.{candidate}"]
        for option in options:
            if option in tensors:
                return option
    return None


@contextlib.contextmanager
def streaming(model: nn.Module, tensors: Mapping, names: Mapping[str, str], *, device: str,
              dtype: torch.dtype) -> Iterator[nn.Module]:
    """While open, each module reads its own parameters (and stored buffers) from `tensors` when it runs, on
    `device`, floating ones in `dtype`, and lets them go when it returns. Modules of at most RESIDENT_ELEMENTS
    (norms, biases, small tables a model may read without calling the module, as BERT-style token type embeddings)
    are read once and held while the block is open."""
    handles, resident = [], []
    for prefix, module in model.named_modules():
        own = {local: names[_join(prefix, local)] for local in [*module._parameters, *module._buffers]
               if _join(prefix, local) in names and _owned(module, local)}
        if not own:
            continue
        loader = _ModuleWeights(own, tensors, device, dtype)
        if sum(_size(module, local) for local in own) <= RESIDENT_ELEMENTS:
            loader.load(module, ())
            resident.append((loader, module))
            continue
        handles.append(module.register_forward_pre_hook(loader.load))
        handles.append(module.register_forward_hook(loader.release))
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()
        for loader, module in resident:
            loader.release(module, (), None)


RESIDENT_ELEMENTS = 1 << 16


def _size(module: nn.Module, local: str) -> int:
    value = module._parameters.get(local) if local in module._parameters else module._buffers.get(local)
    return value.numel()


def _owned(module: nn.Module, local: str) -> bool:
    value = module._parameters.get(local) if local in module._parameters else module._buffers.get(local)
    return value is not None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class _ModuleWeights:
    """One module's tensors: read before its forward, given back (to what it held before) after."""

    def __init__(self, keys: Mapping[str, str], tensors: Mapping, device: str, dtype: torch.dtype):
        self.keys, self.tensors, self.device, self.dtype = dict(keys), tensors, device, dtype
        self.held: dict = {}

    def load(self, module: nn.Module, _args) -> None:
        for local, key in self.keys.items():
            value = self.tensors[key].to(self.device)
            if value.is_floating_point():
                value = value.to(self.dtype)
            if local in module._parameters:
                self.held[local] = module._parameters[local]
                module._parameters[local] = nn.Parameter(value, requires_grad=False)
            else:
                self.held[local] = module._buffers[local]
                module._buffers[local] = value

    def release(self, module: nn.Module, _args, _output) -> None:
        for local, original in self.held.items():
            if local in module._parameters:
                module._parameters[local] = original
            else:
                module._buffers[local] = original
        self.held = {}


# ---- layer outputs ------------------------------------------------------------------------------------------------


def layer_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The model's stacks of layers (decoder layers; encoder and decoder blocks of a seq2seq model), outermost
    first: ModuleLists whose entries hold parameters, not nested in another such list."""
    found: list[tuple[str, nn.ModuleList]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or not len(module):
            continue
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue
        if all(any(True for _ in entry.parameters()) for entry in module):
            found.append((name, module))
    return found


@contextlib.contextmanager
def recording_layers(model: nn.Module, on_layer=None) -> Iterator[dict[str, torch.Tensor]]:
    """{"<list name>.<index>": the layer's output hidden states (float32, CPU)} filled while open; on_layer() is
    called after each layer (progress)."""
    outputs: dict[str, torch.Tensor] = {}
    handles = []
    for list_name, layers in layer_lists(model):
        for index, layer in enumerate(layers):
            handles.append(layer.register_forward_hook(_recorder(outputs, f"{list_name}.{index}", on_layer)))
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def _recorder(outputs: dict, name: str, on_layer):
    def record(_module, _args, output) -> None:
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(hidden, torch.Tensor):
            outputs[name] = hidden.detach().to("cpu", torch.float32)
        if on_layer is not None:
            on_layer()

    return record


def streamed_runner(spec: Streamed, *, base_prefix: str = "", on_layer=None):
    """A parity runner (parity.measure) building spec's model for each run and streaming its weights."""

    def run(inputs, device: str, dtype: torch.dtype, backend: str):
        model = spec.build(dtype)
        model.set_attn_implementation(backend)
        names = stored_names(model, spec.tensors, base_prefix=base_prefix)
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        with torch.no_grad(), streaming(model, spec.tensors, names, device=device, dtype=dtype), \
                recording_layers(model, on_layer) as layers:
            output = model(**moved)
        return output, layers

    return run


def can_stream(spec: Streamed, *, base_prefix: str = "") -> str | None:
    """None when every parameter of spec's model is found in its tensors (stored_names), else why not."""
    try:
        stored_names(spec.build(torch.float32), spec.tensors, base_prefix=base_prefix)
    except ConversionError as error:
        return str(error)
    return None
