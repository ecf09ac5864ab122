"""The converted folder written beside the parity runs: the source is read from the disk once.

The tensors are written in the model's layer order, one rule at a time, by a job that runs in lockstep with the
parity runs (streamed.run_in_lockstep): the official reference reads each layer's source tensors just after the
writer did (from the page cache), and ours reads each written tensor as soon as it is written (a read waits for
it), so neither the source nor the output is read from the disk a second time. Run alone (run(None), then
finish()), it is a plain streamed write.
"""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

import torch

from .errors import ConversionError
from .keymap import check_shapes, expected_shapes
from .lazy import BufferPool, LazyTensors, read_safetensors
from .shards import ShardWriter
from .streamed import RESIDENT_ELEMENTS, layer_lists
from .tensors import cast_tensor
from .writer import first_floating, planned_outputs, write_model_files


class HfTinyFolderWrite:
    """An hf_tiny folder streamed from `state` through `key_map`: names and shapes checked against the class's
    (meta) state dict before any tensor is read; tied copies stored once, as save_pretrained stores them.
    `tensors`: the written tensors, each readable once written (a read waits for the writer)."""

    def __init__(self, tmp: Path, model_class, config, state, key_map, num_layers, *, dtype=None, loads_as=None,
                 max_shard_size=None, auto_map=None, progress: bool = False):
        """dtype: the stored tensors' (None: as the source stores them); loads_as: the dtype config.json names (None:
        the stored one)."""
        with torch.device("meta"):
            self.model = model_class(config)
        expected = expected_shapes(self.model)
        steps = key_map.steps(state.keys(), num_layers=num_layers)
        planned = planned_outputs(steps, state, expected, dtype)
        check_shapes({key: info.meta() for key, info in planned.items()}, expected)
        copies = set(self.model.get_expanded_tied_weights_keys(all_submodels=True))
        self.stored = {key: info for key, info in planned.items() if key not in copies}
        self.steps = _in_layer_order(steps, self.model, planned)
        self.tmp, self.state, self.dtype = tmp, LazyTensors.of(state), dtype
        self.stored_dtype = first_floating(self.stored)  # dtype, where given: planned_outputs cast to it
        self.progress = progress
        self.writer = ShardWriter(tmp, self.stored, max_shard_size=max_shard_size,
                                  total_parameters=self.model.num_parameters())
        write_model_files(tmp, self.model, config, loads_as=loads_as or self.stored_dtype, auto_map=auto_map)
        self.done = _Written()
        written = read_safetensors([tmp / name for name in self.writer.files])
        self.tensors = LazyTensors(
            {key: written.info(key) for key in written},
            lambda key: self.done.wait(key) or written[key],
            rows=lambda key, *args: self.done.wait(key) or written.rows(key, *args))

    def run(self, gate=None) -> None:
        """Reads, maps, casts and writes every step's tensors, in layer order; gate() (run_in_lockstep's) is
        called as each layer starts. A failure is handed to the readers waiting for a tensor."""
        from tqdm.auto import tqdm

        try:
            bar = tqdm(total=sum(info.nbytes for info in self.stored.values()), desc="writing tensors", unit="B",
                       unit_scale=True, disable=not self.progress, file=sys.stderr, leave=False)
            pool, started = BufferPool(), 0  # each layer's tensors read into the buffers of the layer before
            for ordinal, step in self.steps:
                while gate is not None and started <= ordinal:
                    gate()
                    started += 1
                self._write(step, pool, bar)
            bar.close()
        except BaseException as error:
            self.done.fail(error)
            raise

    def _write(self, step, pool: BufferPool, bar) -> None:
        inputs = [self.state.read_reusing(key, pool) for key in step.inputs]
        for key, tensor in zip(step.outputs, step.run(inputs), strict=True):
            if key in self.stored:
                self.writer.write(key, cast_tensor(key, tensor, self.dtype))
                self.done.add(key)
                bar.update(self.stored[key].nbytes)
        pool.give(*(tensor for tensor in inputs if tensor.dim()))  # written: nothing holds them now (0-d: the state's own)

    def finish(self) -> LazyTensors:
        """The index of a sharded folder (config.json, the remote code and generation_config.json were written at
        the start); returns the written tensors (all present now)."""
        files = self.writer.close()
        return read_safetensors([self.tmp / name for name in files if name.endswith(".safetensors")])

    def abort(self) -> None:
        self.writer.abort()


class _Written:
    """The keys written so far; wait(key) returns once `key` is, or raises if the writer failed."""

    def __init__(self):
        self.keys: set[str] = set()
        self.error: BaseException | None = None
        self.condition = threading.Condition()

    def add(self, key: str) -> None:
        with self.condition:
            self.keys.add(key)
            self.condition.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.condition:
            self.error = error
            self.condition.notify_all()

    # A read waits while the writer works through the layers before it; never this long unless the two disagree
    # on the layers' order (then a clear error rather than a hang).
    TIMEOUT_SECONDS = 1800

    def wait(self, key: str) -> None:
        with self.condition:
            self.condition.wait_for(lambda: key in self.keys or self.error is not None, timeout=self.TIMEOUT_SECONDS)
            if self.error is not None and key not in self.keys:
                raise ConversionError(f"tensor {key!r} was never written: the writer failed ({self.error})")
            if key not in self.keys:
                raise ConversionError(f"tensor {key!r} was not written within {self.TIMEOUT_SECONDS} s of being "
                                      "asked for: the writer and the parity runs disagree on the layers' order")


def _in_layer_order(steps, model, planned) -> list[tuple[int, object]]:
    """(layer ordinal, step) in the order the parity runs read them: first (ordinal -1) the steps outside the
    model's layers (embeddings, final norm, head) and those of tensors small enough for streamed.streaming to
    read them all before the forward starts (norms, biases), then each layer's, as the forward meets the layers."""
    ordinals = {name: index for index, name in enumerate(
        f"{list_name}.{index}" for list_name, layers in layer_lists(model) for index in range(len(layers)))}
    pattern = re.compile(r"^(.*?\.\d+)\.")

    def ordinal(step) -> int:
        if all(planned[key].numel <= RESIDENT_ELEMENTS for key in step.outputs if key in planned):
            return -1
        found = [ordinals.get(prefix.group(1), -1) for key in step.outputs if (prefix := pattern.match(key))]
        known = [value for value in found if value >= 0]
        return min(known) if known else -1

    return sorted(((ordinal(step), step) for step in steps), key=lambda pair: pair[0])
