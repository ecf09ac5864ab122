"""Models that run with one module's weights in memory at a time: parity of checkpoints larger than memory.

A model is built with its parameters on the meta device (buffers real, as `from_pretrained` builds them in the
run's dtype) and every module holding parameters reads them from a lazy checkpoint (lazy.py) just before it runs
and drops them right after. The forward is the model's own, unchanged: the parity proof runs the official
model's and ours' complete forwards (two full chains, as an in-memory comparison would), and hooks on their
decoder/encoder layers record each layer's output, so the card can say where a mismatch starts.
"""

from __future__ import annotations

import contextlib
import copy
import signal
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from .errors import ConversionError, list_names
from .lazy import BufferPool, LazyTensors


@dataclass
class Streamed:
    """A model class, its config and where its weights are: `tensors` under the model's names (tied copies and
    a base model's prefix resolved by `stored_names`)."""

    model_class: type
    config: object
    tensors: LazyTensors
    kwargs: dict = field(default_factory=dict)  # for the class's constructor (e.g. add_pooling_layer)

    def build(self, dtype: torch.dtype, device: str = "cpu") -> nn.Module:
        """The model with parameters on the meta device, buffers computed as from_pretrained(dtype=...) would, on
        `device`: a buffer the checkpoint does not hold (BERT's position_ids) is read beside the streamed weights."""
        from accelerate import init_empty_weights

        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype if dtype.is_floating_point else previous)
        try:
            with init_empty_weights(include_buffers=False):
                model = self.model_class(copy.deepcopy(self.config), **self.kwargs)  # each its own backend
        finally:
            torch.set_default_dtype(previous)
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device.type != "meta":
                    module._buffers[name] = buffer.to(device)
        return model.eval()


def return_dict_kwargs(model) -> dict:
    """return_dict=True for a model whose config says return_dict=False (BERT-era configs may): parity reads the
    output's fields by name."""
    return {} if getattr(model.config, "return_dict", True) else {"return_dict": True}


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
    `device`, floating ones in `dtype`, and lets them go when it returns; the output head (an nn.Linear) reads its
    weight in blocks of vocabulary rows, each product written into its columns of the logits, and the input
    embedding reads only the rows of the ids it is given. Modules of at most
    RESIDENT_ELEMENTS (norms, biases, small tables a model may read without calling the module, as BERT-style token
    type embeddings) are read once and held while the block is open."""
    handles, resident, pool = [], [], BufferPool()
    head, embedding = _output_head(model, names), _input_embedding(model, names)
    for prefix, module in model.named_modules():
        own = {local: names[_join(prefix, local)] for local in [*module._parameters, *module._buffers]
               if _join(prefix, local) in names and _owned(module, local)}
        if not own:
            continue
        loader = _ModuleWeights(own, tensors, device, dtype, pool)
        if module is head:
            handles.append(_head_in_blocks(module, loader))
        elif module is embedding:
            handles += _rows_of_the_ids(module, loader)
        elif sum(_size(module, local) for local in own) <= RESIDENT_ELEMENTS:
            loader.load(module, ())
            resident.append((loader, module))
        else:
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
# Bytes of a weight's rows read and converted at once (a bf16 checkpoint run in float32 never holds a whole bf16
# copy beside the float32 one), and of the output head's rows (in the run's dtype) multiplied at once. Products
# over blocks of 1024 to 16384 rows equal the whole product bit for bit at the hidden sizes of TinyLlama,
# Llama-3-8B and SmolLM2 (fp32 and bf16, this CPU).
BLOCK_BYTES = 16 << 20
HEAD_BLOCK_BYTES = 16 << 20


def _output_head(model: nn.Module, names: Mapping[str, str]) -> nn.Module | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    plain = type(head) is nn.Linear and head.weight.dim() == 2
    return head if plain and _weight_is_stored(model, head, names) else None


def _input_embedding(model: nn.Module, names: Mapping[str, str]) -> nn.Module | None:
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    plain = isinstance(embedding, nn.Embedding) and embedding.max_norm is None
    return embedding if plain and _weight_is_stored(model, embedding, names) else None


def _weight_is_stored(model: nn.Module, part: nn.Module, names: Mapping[str, str]) -> bool:
    prefix = next((name for name, module in model.named_modules() if module is part), None)
    return prefix is not None and _join(prefix, "weight") in names


def _rows_of_the_ids(embedding: nn.Embedding, loader: "_ModuleWeights") -> list:
    """Gives `embedding`, for each call, only the rows of the ids it is called with, the ids renumbered into them
    (a lookup reads rows: the output is the same numbers); a vocabulary of 128k rows is never read whole. Between
    calls its weight is a placeholder of the full shape on the run's device and dtype (one row, expanded: no
    memory), for models that read the weight's device or dtype before the lookup. padding_idx (which only shapes
    gradients) is set aside for the call. Returns handles that undo all of it."""
    meta = embedding._parameters["weight"]
    placeholder = torch.empty(1, meta.shape[1], device=loader.device, dtype=loader.dtype).expand(meta.shape)
    embedding._parameters["weight"] = nn.Parameter(placeholder, requires_grad=False)
    padding_idx = embedding.padding_idx

    def before(module, args, kwargs):
        ids = args[0] if args else kwargs["input"]
        used, renumbered = torch.unique(ids, return_inverse=True)
        rows = [loader.rows("weight", index, index + 1) for index in used.tolist()]
        module._parameters["weight"] = nn.Parameter(torch.cat(rows), requires_grad=False)
        module.padding_idx = None
        loader.give(*rows)
        return ((renumbered, *args[1:]), kwargs) if args else (args, {**kwargs, "input": renumbered})

    def after(module, _args, _kwargs, _output):
        module._parameters["weight"], module.padding_idx = nn.Parameter(placeholder, requires_grad=False), padding_idx

    def undo():
        embedding._parameters["weight"], embedding.padding_idx = meta, padding_idx

    return [embedding.register_forward_pre_hook(before, with_kwargs=True),
            embedding.register_forward_hook(after, with_kwargs=True, always_call=True), _Undo(undo)]


class _Undo:
    def __init__(self, undo):
        self.remove = undo


def _head_in_blocks(head: nn.Linear, loader: "_ModuleWeights"):
    """Gives `head` (for the block) a forward that reads HEAD_BLOCK_BYTES of its weight's rows (and bias) at a
    time: each output column is the same dot product as in one nn.Linear call. Returns a handle that restores it."""
    own_forward = vars(head).get("forward")
    rows = head.weight.shape[0]
    block_rows = max(1, HEAD_BLOCK_BYTES // (head.weight.shape[1] * loader.dtype.itemsize))

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        out = None
        loader.pool.clear()  # the layers' spare buffers: the head comes last
        for start in range(0, rows, block_rows):
            stop = min(rows, start + block_rows)
            weight = loader.rows("weight", start, stop)
            bias = loader.rows("bias", start, stop) if "bias" in loader.keys else None
            block = torch.nn.functional.linear(hidden, weight, bias)
            out = block.new_empty((*block.shape[:-1], rows)) if out is None else out
            out[..., start:stop] = block
            loader.give(weight, bias)
        return out

    def undo():
        if own_forward is None:
            del head.forward
        else:
            head.forward = own_forward

    head.forward = forward
    return _Undo(undo)


def _size(module: nn.Module, local: str) -> int:
    value = module._parameters.get(local) if local in module._parameters else module._buffers.get(local)
    return value.numel()


def _owned(module: nn.Module, local: str) -> bool:
    value = module._parameters.get(local) if local in module._parameters else module._buffers.get(local)
    return value is not None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _storages(output) -> set[int]:
    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) else [output]
    return {value.untyped_storage().data_ptr() for value in values if isinstance(value, torch.Tensor)}


class _ModuleWeights:
    """One module's tensors: read before its forward, given back (to what it held before) after."""

    def __init__(self, keys: Mapping[str, str], tensors: Mapping, device: str, dtype: torch.dtype,
                 pool: BufferPool):
        self.keys, self.tensors, self.device, self.dtype, self.pool = dict(keys), tensors, device, dtype, pool
        self.held: dict = {}
        self.loaded: list[torch.Tensor] = []

    def load(self, module: nn.Module, _args) -> None:
        for local, key in self.keys.items():
            value = self.read(key)
            self.loaded.append(value)
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
        kept = _storages(_output)  # an output that is a view of a weight keeps that weight's memory
        self.give(*(tensor for tensor in self.loaded if tensor.untyped_storage().data_ptr() not in kept))
        self.loaded = []

    def give(self, *tensors) -> None:
        self.pool.give(*(tensor for tensor in tensors if tensor is not None))

    def read(self, key: str) -> torch.Tensor:
        info = self.tensors.info(key) if isinstance(self.tensors, LazyTensors) else None
        if info is None or not info.shape or self.device != "cpu":
            return self._on_run(self.tensors[key])
        return self._rows(key, info, 0, info.shape[0])

    def rows(self, local: str, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of the module's tensor `local`, on the device, in the run's dtype."""
        key = self.keys[local]
        info = self.tensors.info(key) if isinstance(self.tensors, LazyTensors) else None
        if info is None or self.device != "cpu":
            return self._on_run(self.tensors[key][start:stop])
        return self._rows(key, info, start, stop)

    def _on_run(self, value: torch.Tensor) -> torch.Tensor:
        value = value.to(self.device)
        return value.to(self.dtype) if value.is_floating_point() else value

    def _rows(self, key: str, info, start: int, stop: int) -> torch.Tensor:
        dtype = self.dtype if info.dtype.is_floating_point else info.dtype
        out = self.pool.take((stop - start, *info.shape[1:]), dtype)
        if dtype == info.dtype:
            return self.tensors.rows(key, start, stop, out)
        step = max(1, BLOCK_BYTES // max(1, info.nbytes // max(1, info.shape[0])))
        for first in range(start, stop, step):
            last = min(stop, first + step)
            raw = self.tensors.rows(key, first, last, self.pool.take((last - first, *info.shape[1:]), info.dtype))
            out[first - start:last - start].copy_(raw)
            self.pool.give(raw)
        return out


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
    """A parity runner (parity.measure) building spec's model for each run and streaming its weights.
    run.prepare(...) builds the model now and returns its forward, forward(gate), which run_in_lockstep paces with
    other runs' (the build sets torch's process-wide default dtype, so it must not overlap another)."""

    def prepare(inputs, device: str, dtype: torch.dtype, backend: str):
        model = spec.build(dtype, device)
        model.set_attn_implementation(backend)
        names = stored_names(model, spec.tensors, base_prefix=base_prefix)
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

        def forward(gate=None):
            with torch.no_grad(), streaming(model, spec.tensors, names, device=device, dtype=dtype), \
                    recording_layers(model, on_layer) as layers, paced(model, gate):
                output = model(**moved, **return_dict_kwargs(model))
            return output, layers

        return forward

    def run(inputs, device: str, dtype: torch.dtype, backend: str):
        return prepare(inputs, device, dtype, backend)()

    run.prepare = prepare
    return run


@contextlib.contextmanager
def paced(model: nn.Module, gate) -> Iterator[None]:
    """While open, each of the model's layers waits at its start for the gate (None: no pacing)."""
    handles = [] if gate is None else [
        layer.register_forward_pre_hook(lambda _module, _args: gate())
        for _, layers in layer_lists(model) for layer in layers
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class RunsStopped(Exception):
    """Raised in a parity run at its next layer once the runs were told to stop (the waiting thread was interrupted)."""


class _Lockstep:
    """Runs that start their n-th layer only once every other unfinished run has started its (n-1)-th: no run is
    more than a layer ahead, so what one reads from the disk the others find in the page cache."""

    def __init__(self, runs: int, progress=None):
        self.started = [0] * runs
        self.finished = [False] * runs
        self.stopping = False
        self.condition = threading.Condition()
        self.progress, self.reported = progress, 0  # progress.update(n): layers every run has started

    def gate(self, run: int):
        def wait() -> None:
            with self.condition:
                self.condition.wait_for(lambda: self.stopping or all(
                    self.finished[other] or self.started[other] >= self.started[run]
                    for other in range(len(self.started)) if other != run))
                if self.stopping:
                    raise RunsStopped("the parity runs were stopped")
                self.started[run] += 1
                self.condition.notify_all()
                if self.progress is not None and min(self.started) > self.reported:
                    self.progress.update(min(self.started) - self.reported)
                    self.reported = min(self.started)

        return wait

    def finish(self, run: int) -> None:
        with self.condition:
            self.finished[run] = True
            self.condition.notify_all()

    def stop(self) -> None:
        """Every run raises RunsStopped as it starts its next layer."""
        with self.condition:
            self.stopping = True
            self.condition.notify_all()

    def wait_until_finished(self, poll: float = 0.1) -> None:
        """Wakes every poll seconds: a signal that the OS handed to another thread (torch's workers do not block
        signals) does not wake a waiting lock, and its Python handler runs only once this thread runs again."""
        with self.condition:
            while not self.condition.wait_for(lambda: all(self.finished), timeout=poll):
                pass


def run_in_lockstep(jobs, progress=None) -> list:
    """Each job(gate) in its own thread, paced by one _Lockstep; their results (or the exception each raised), in
    order. The outputs equal those of one run after the other: each run is its own model and its own tensors.
    progress (a tqdm bar): advanced as every run has started one more layer.

    A SIGINT or SIGTERM meanwhile (Ctrl-C's KeyboardInterrupt, the CLI's Terminated) stops the runs at their next
    layer, and its exception is raised here once every run's thread has ended: no run is left computing while the
    interpreter shuts down (a thread still inside torch's C++ code then is killed with an unwind that C++ turns
    into abort(), "terminate called without an active exception")."""
    lockstep, results = _Lockstep(len(jobs), progress), [None] * len(jobs)

    def work(index: int) -> None:
        try:
            results[index] = jobs[index](lockstep.gate(index))
        except BaseException as error:  # handed to the caller, which raises it
            results[index] = error
        finally:
            lockstep.finish(index)

    threads = [threading.Thread(target=work, args=(index,), name=f"parity-run-{index}") for index in range(len(jobs))]
    with _signals_deferred(until_then=lockstep.stop):
        with _signals_blocked():  # inherited by the runs' threads: the OS hands a signal to this one
            for thread in threads:
                thread.start()
        try:
            lockstep.wait_until_finished()
        finally:  # what a handler that could not be deferred raised stops the runs too
            lockstep.stop()
            lockstep.wait_until_finished()
            for thread in threads:
                thread.join()
    return results


@contextlib.contextmanager
def _signals_deferred(until_then) -> Iterator[None]:
    """While open, a SIGINT or SIGTERM whose handler is Python's (Ctrl-C's KeyboardInterrupt, the CLI's Terminated)
    only calls until_then() and is remembered; on closing, the handlers are put back and the first one remembered
    is handled, raising its exception there. Deferred in Python rather than blocked by the OS: the OS may hand a
    signal to any thread that does not block it (torch's worker threads), and Python then runs its handler in the
    main thread at the next bytecode, wherever that is (it once was while the runs were being started, which left
    them running). Only the main thread handles signals: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received, closed, previous = [], [], {}

    def defer(signum, frame):
        if closed:  # its handler was not yet put back when the signal came: handled as that handler would
            return previous[signum](signum, frame)
        received.append(signum)
        until_then()

    for signum in (signal.SIGINT, signal.SIGTERM):
        if callable(signal.getsignal(signum)):
            previous[signum] = signal.signal(signum, defer)
    try:
        yield
    finally:
        closed.append(True)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if received:
            previous[received[0]](received[0], None)


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """SIGINT and SIGTERM blocked in this thread, and in the threads it starts, while open; delivered after."""
    held = {signal.SIGINT, signal.SIGTERM}
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX: nothing to block
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def can_stream(spec: Streamed, *, base_prefix: str = "") -> str | None:
    """None when every parameter of spec's model is found in its tensors (stored_names), else why not."""
    try:
        stored_names(spec.build(torch.float32), spec.tensors, base_prefix=base_prefix)
    except ConversionError as error:
        return str(error)
    return None
