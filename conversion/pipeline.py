"""The one conversion pipeline every family runs, and the Family interface a family module fills in.

Forward (`convert`): read the source -> the family's Plan (hf_tiny config, classes, key map) -> map names ->
cast -> write the hf_tiny folder -> measure parity against the official model -> model card -> verdict, all
inside one atomic output folder, with the same guards, progress stages and return value for every family.
Reverse (`convert_back`): an hf_tiny folder -> the family's ReversePlan -> the official folder, loaded back with
the official class before it is swapped in.

A family module is its tables (official <-> hf_tiny names and config fields) plus a Family subclass that says
how to read its sources, which classes correspond, and its named quirks.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from .cards import source_license, write_model_card
from .folder_write import HfTinyFolderWrite
from .errors import ConversionError
from .keymap import KeyMap
from .lazy import LazyTensors
from .parity import MODALITIES, fail_on_parity, in_memory, layer_table, measure, parity_batch
from .readers import (
    hub_id_of, load_config_json, load_hf_tiny_config, open_checkpoint, require_model_type, source_name,
)
from .shards import parse_max_shard_size
from .streamed import Streamed, can_stream, streamed_runner
from .tensors import declared_dtype, parse_dtype
from .writer import (
    atomic_output_dir, copy_tokenizer_files, first_floating, pin_tokenizer_class, stream_official_folder,
    with_tied_copies,
)
from .writer import write_generation_config_of_config_json


@dataclass
class Source:
    """A checkpoint as read, under its official tensor names."""

    path: Path  # the file or folder that was read
    folder: Path  # the folder holding its tokenizer and other side files
    kind: str  # "hf" (a Hugging Face folder), "gguf", "meta", "warm start", ...
    raw_config: dict  # config.json (or what stands for it: GGUF metadata, params.json)
    state: LazyTensors | dict  # read lazily (readers.open_checkpoint); a dict is wrapped by the pipeline
    description: str  # for the model card: "the official `BertModel` checkpoint `x`"
    official: Any = None  # an official model already built while reading (e.g. a warm start)
    notes: list[str] = field(default_factory=list)  # what reading assumed (for stderr and the model card)


@dataclass
class Plan:
    """How one source becomes an hf_tiny folder."""

    config: Any  # the hf_tiny config
    our_class: str  # hf_tiny class name
    official_class: str  # the transformers class parity is measured against
    key_map: KeyMap
    num_layers: int | dict[str, int]
    state: LazyTensors | dict  # the source tensors ready for key_map (stored tied copies dropped), lazily
    official_config: Any = None  # the transformers config (seq2seq derives generation_config.json from it)
    notes: list[str] = field(default_factory=list)  # lines for the model card
    official_kwargs: dict = field(default_factory=dict)  # for the official from_pretrained (e.g. add_pooling_layer)
    tags: tuple[str, ...] = ()  # card tags beside the family's (e.g. the source's model type)


@dataclass
class ReversePlan:
    """How an hf_tiny folder becomes an official one."""

    official_class: str
    official_config: Any
    key_map: KeyMap
    num_layers: int | dict[str, int]
    # False where the official class's state_dict names are not the names it stores (transformers 5 fuses MoE
    # experts into 3-D tensors when it loads and splits them when it saves): the written folder is then checked
    # by loading it only, not against the class's in-memory names beforehand.
    stored_as_loaded: bool = True
    # regexes of tensors the official class drops on purpose when it loads (DeepSeek's MTP layers)
    dropped_by_official: tuple = ()


class Family:
    """One checkpoint family. Subclasses set the class attributes and implement plan() and reverse()."""

    name: str = ""
    model_types: tuple[str, ...] = ()  # config.json model_type values read (family detection uses them)
    gguf_architectures: tuple[str, ...] = ()  # GGUF general.architecture values read
    config_class: str = ""  # the hf_tiny config class
    classes: dict[str, tuple[str, str]] = {}  # hf_tiny class -> (Auto class, pipeline tag) it converts to
    default_class: str = ""  # the class of an hf_tiny folder whose config names none
    modality: str = ""  # one of parity.MODALITIES: which parity batch
    card_family: str = ""
    tags: tuple[str, ...] = ()
    parity_backends: tuple[str, ...] = ("eager", "sdpa", "flash_attention_2")
    keep_stored_tied_copies: bool = False  # reverse: write a tied copy the hf_tiny folder stores (untied heads)
    reversible: bool = True
    detected: bool = True  # False: only by name (e.g. bert2seq reads plain BERT folders, as `bert` does)
    # tensor names only this family's checkpoints hold: detection of a config.json without model_type
    tensor_markers: tuple[str, ...] = ()
    # official config fields hf_tiny's models do not read (hints to official's own kernels), kept as they are in the
    # hf_tiny config so that the way back writes them
    kept_fields: tuple[str, ...] = ()

    # --- forward ---

    def read(self, src: Path) -> Source:
        """Default: a Hugging Face folder (or a weights file inside one) of one of model_types."""
        return self.read_hf_folder(src)

    def read_hf_folder(self, src: Path, *, allow_missing_model_type: bool = False) -> Source:
        """A Hugging Face folder of one of model_types. allow_missing_model_type: a config.json without
        model_type (written by transformers before it had one) is read as this family, with a note; one that
        names another model_type is still refused."""
        raw = load_config_json(src)
        notes = []
        if allow_missing_model_type and "model_type" not in raw:
            notes.append(f"config.json has no model_type (written by an old transformers version): read as "
                         f"{self.model_types[0]!r}, the {self.name} family's model type.")
            raw = {**raw, "model_type": self.model_types[0]}
        require_model_type(raw, self.model_types, src=src)
        folder = src if src.is_dir() else src.parent
        return Source(src, folder, "hf", raw, open_checkpoint(src), f"the official checkpoint `{source_name(src)}`",
                      notes=notes)

    def plan(self, source: Source) -> Plan:
        raise NotImplementedError

    def streamed_reference(self, source: Source, plan: Plan):
        """The official class streaming the source's tensors (official_stream), or None (with a note on the card)
        when its class does not read them as they are stored."""
        spec = self.official_stream(source, plan)
        if spec is None:
            return None
        prefix = spec.model_class.base_model_prefix
        why = can_stream(spec, base_prefix=prefix)
        if why is None:
            return streamed_runner(spec, base_prefix=prefix)
        plan.notes.append(f"The official reference was loaded whole: its class does not read this checkpoint's "
                          f"names as they are stored ({why}).")
        return None

    def official_stream(self, source: Source, plan: Plan) -> Optional[Streamed]:
        """The official class over the source's tensors (a Hugging Face folder), or None to load it whole."""
        if source.kind != "hf":
            return None
        import transformers

        official_class = getattr(transformers, plan.official_class)
        config = official_class.config_class.from_pretrained(str(source.folder))
        return Streamed(official_class, config, source.state, dict(plan.official_kwargs))

    def official_model(self, source: Source, plan: Plan):
        """The official model parity is measured against, in float32."""
        if source.official is not None:
            return source.official
        import transformers

        return getattr(transformers, plan.official_class).from_pretrained(
            str(source.folder), dtype=torch.float32, **plan.official_kwargs
        )

    def write_side_files(self, source: Source, plan: Plan, tmp: Path) -> str:
        """Tokenizer and the other files that travel with the weights, and the generation config official takes
        from a Hugging Face folder that has none (its config.json's); returns a phrase for the card."""
        copied = copy_tokenizer_files(source.folder, tmp)
        generates = (tmp / "generation_config.json").is_file()  # written with the model's files
        if generates and source.kind == "hf" and "generation_config.json" not in copied:
            write_generation_config_of_config_json(tmp, source.folder)
        if not copied:
            return "none in the source folder"
        pinned = pin_tokenizer_class(source.folder, tmp) if source.kind == "hf" else None
        named = f"; tokenizer_class {pinned}, the class official loads it with" if pinned else ""
        return f"copied from the source ({', '.join(copied)}{named})"

    # --- reverse ---

    def reverse(self, config, our_class: str, src: Path) -> ReversePlan:
        raise NotImplementedError

    def finish_official_state(self, state: LazyTensors, config, plan: ReversePlan) -> LazyTensors:
        """Named quirks of the official layout applied after the key map, as lazy views (default: none)."""
        return state

    # --- shared ---

    def hf_tiny_class(self, name: str):
        import hf_tiny

        return getattr(hf_tiny, name)

    def auto_map(self, our_class: str | None = None) -> dict[str, str]:
        """auto_map naming the config and every hf_tiny class of this config, so a converted folder loads with
        any Auto head and trust_remote_code; where two classes share an Auto class, our_class (the folder's)."""
        import hf_tiny
        from hf_tiny.saving import family_auto_map

        own = self.hf_tiny_class(our_class) if our_class is not None else None
        return family_auto_map(self.hf_tiny_class(self.config_class), vars(hf_tiny).values(), own=own)


class _Stages:
    """A progress bar over the named steps of a conversion (writing and parity add their own bars)."""

    NAMES = ("reading the source", "writing the folder and measuring parity", "writing the card")

    def __init__(self):
        from tqdm.auto import tqdm

        # disable=None: a bar on a terminal only, so logs and captured stderr hold just the result or the error.
        self.bar = tqdm(total=len(self.NAMES), desc=self.NAMES[0], unit="step", file=sys.stderr, leave=False, disable=None)

    def next(self) -> None:
        self.bar.update(1)
        if self.bar.n < len(self.NAMES):
            self.bar.set_description(self.NAMES[self.bar.n])

    def close(self) -> None:
        self.bar.close()


def convert(family: Family, src: str | os.PathLike, dst: str | os.PathLike, *, force: bool = False,
            dtype: Optional[torch.dtype | str] = None, base_model: Optional[str] = None, reference_model=None,
            max_shard_size: Optional[int | str] = None) -> dict:
    """An official checkpoint -> an hf_tiny folder (atomic: DST appears complete or not at all), streamed: one
    rule's tensors in memory at a time while writing, one module's weights at a time while measuring parity.

    reference_model: the official model already loaded from the same source (saves loading it again).
    max_shard_size: as save_pretrained's (default 50GB). Returns {"dst", "family", "source_kind",
    "architecture" (the official class), "hf_tiny_class", "config", "parity" (rows measured now),
    "parity_layers" (per run, each layer's max difference), "parity_inputs", "card" (the model card's path),
    "files", "bytes"}.
    """
    if family.modality not in MODALITIES:
        raise ValueError(f"family {family.name!r}: modality must be one of {MODALITIES}, got {family.modality!r}")
    src, dst = Path(src), Path(dst)
    dtype = parse_dtype(dtype)
    parse_max_shard_size(max_shard_size)
    if not src.exists():
        raise ConversionError(f"source {src} does not exist")
    stages = _Stages()
    try:
        with atomic_output_dir(dst, force=force, src=src) as tmp:
            source = family.read(src)
            source.state = LazyTensors.of(source.state)
            plan = family.plan(source)
            carry_output_switches(source.raw_config, plan.config)
            carry_fields(source.raw_config, plan.config, family.kept_fields)
            plan.state = LazyTensors.of(plan.state)
            stages.next()
            write = _start_write(family, source, plan, tmp, dtype, max_shard_size)
            plan.notes.insert(0, f"Tokenizer: {family.write_side_files(source, plan, tmp)}.")
            try:
                written, parity, batch = _write_with_parity(family, source, plan, tmp, write, reference_model)
            except AttributeError as error:
                write.abort()
                raise _return_dict_refused(source, plan, error) or error
            except BaseException:
                write.abort()
                raise
            stages.next()
            card = _write_card(family, source, plan, tmp, dst, parity, batch, base_model)
            stages.next()
            fail_on_parity(parity.rows, plan.official_class, written)
    finally:
        stages.close()
    return {"dst": dst, "family": family.name, "source_kind": source.kind, "architecture": plan.official_class,
            "hf_tiny_class": plan.our_class, "config": plan.config, "parity": parity.rows,
            "parity_layers": parity.layers, "parity_inputs": batch.description, "card": dst / card.name,
            "bytes": written.nbytes,
            "files": sorted(path.name for path in dst.glob("*.safetensors"))}


def _start_write(family: Family, source: Source, plan: Plan, tmp: Path, dtype, max_shard_size) -> HfTinyFolderWrite:
    plan.config.architectures = [plan.our_class]
    # Official from_pretrained loads weights in the dtype config.json names, whatever they are stored in (dtype="auto",
    # transformers 5's default): the converted config names the source's, so a default load of either gives the same.
    loads_as = declared_dtype(source.raw_config) if dtype is None and source.kind == "hf" else None
    try:
        write = HfTinyFolderWrite(
            tmp, family.hf_tiny_class(plan.our_class), plan.config, plan.state, plan.key_map, plan.num_layers,
            dtype=dtype, loads_as=loads_as, max_shard_size=max_shard_size, auto_map=family.auto_map(plan.our_class),
            progress=sys.stderr.isatty(),
        )
    except ConversionError as error:
        raise _not_fitting(family, source, plan, error) from error
    if loads_as is not None and loads_as != write.stored_dtype:
        plan.notes.append(f"config.json names dtype={str(loads_as).removeprefix('torch.')}, as the source's does: "
                          "from_pretrained loads the weights in it, as official loads the source's. They are stored "
                          f"in {str(write.stored_dtype).removeprefix('torch.')} as the source stores them, and parity "
                          "is measured in that dtype.")
    return write


def _write_with_parity(family: Family, source: Source, plan: Plan, tmp: Path, write: HfTinyFolderWrite,
                       reference_model):
    """(the written tensors, parity, its batch): the folder written while the parity runs read it (parity.measure
    with the write alongside), the source read from the disk once."""
    batch = parity_batch(family.modality, plan.config, tmp)
    try:
        official, alongside = _reference(family, source, plan, reference_model), write.run
        if official is None:  # the official model loaded whole: only once the source proved to fit
            write.run(None)
            official, alongside = in_memory(family.official_model(source, plan)), None
        ours = streamed_runner(Streamed(family.hf_tiny_class(plan.our_class), plan.config, write.tensors))
        with _layer_bar(write) as bar:
            parity = measure(official, ours, batch, write.stored_dtype, backends=family.parity_backends,
                             alongside=alongside, progress=bar)
    except ConversionError as error:
        if write.done.error is error:
            raise _not_fitting(family, source, plan, error) from error
        raise
    return write.finish(), parity, batch


def _layer_bar(write: HfTinyFolderWrite):
    from tqdm.auto import tqdm

    from .streamed import layer_lists

    layers = sum(len(stack) for _, stack in layer_lists(write.model))
    return tqdm(total=layers, desc="parity, layer by layer", unit="layer", file=sys.stderr, leave=False,
                disable=not sys.stderr.isatty())


def _reference(family: Family, source: Source, plan: Plan, reference_model):
    if reference_model is not None:
        return in_memory(reference_model)
    if source.official is not None:
        return in_memory(source.official)
    return family.streamed_reference(source, plan)


def _not_fitting(family: Family, source: Source, plan: Plan, error: ConversionError) -> ConversionError:
    return ConversionError(f"{source.path}: the tensors do not fit {plan.official_class} (family {family.name}): {error}")


def _write_card(family: Family, source: Source, plan: Plan, tmp: Path, dst: Path, parity, batch, base_model) -> Path:
    auto_class, pipeline_tag = family.classes[plan.our_class]
    notes = " ".join(plan.notes)
    return write_model_card(
        tmp, model_name=dst.name, license=source_license(source.folder), model_id=str(dst),
        base_model=base_model or hub_id_of(source.path, source.raw_config.get("_name_or_path")),
        source_name=base_model or source_name(source.path),
        pipeline_tag=pipeline_tag, family=family.card_family, auto_class=auto_class,
        description=f"`{plan.our_class}` converted from {source.description}.", parity_rows=parity.rows,
        tags=list(dict.fromkeys((*family.tags, *plan.tags))),
        extra=f"\nParity inputs: {batch.description}; per-token outputs are compared at real tokens only. "
        f"The reference is the official `{plan.official_class}` in float32 with eager attention. Tolerance = "
        "relative tolerance of the dtype × max(1, max |official output|); float32 rows must pass and every "
        "row must be finite, or the conversion fails.\n" + _layers_section(parity.layers)
        + (f"\n{notes}\n" if notes else ""),
    )


def _layers_section(layers) -> str:
    table = layer_table(layers)
    if not table:
        return ""
    return ("\nEach layer's output, max |ours - official| at real tokens (the official float32 eager layer is the "
            f"reference; where a mismatch starts):\n\n{table}\n")


def convert_back(family: Family, src: str | os.PathLike, dst: str | os.PathLike, *, force: bool = False,
                 max_shard_size: Optional[int | str] = None) -> dict:
    """An hf_tiny folder -> the official folder that transformers loads with no missing or unexpected keys,
    streamed like convert(). Returns {"dst", "family", "architecture" (the official class)}."""
    if not family.reversible:
        raise ConversionError(f"family {family.name!r} has no reverse conversion")
    src, dst = Path(src), Path(dst)
    parse_max_shard_size(max_shard_size)
    config_class = family.hf_tiny_class(family.config_class)
    config, our_class = load_hf_tiny_config(src, config_class, supported=family.classes, default=family.default_class)
    with atomic_output_dir(dst, force=force, src=src) as tmp:
        state = with_tied_copies(open_checkpoint(src), family.hf_tiny_class(our_class), config)
        dtype = first_floating({key: state.info(key) for key in state})
        plan = family.reverse(config, our_class, src)
        carry_output_switches(config.to_dict(), plan.official_config)
        carry_fields(config.to_dict(), plan.official_config, family.kept_fields)
        official = plan.key_map.lazy_view(state, num_layers=plan.num_layers, forward=False)
        official = family.finish_official_state(official, config, plan)
        plan.official_config.dtype = declared_dtype(config.to_dict()) or dtype  # what the hf_tiny folder loads in
        import transformers

        stream_official_folder(
            tmp, getattr(transformers, plan.official_class), plan.official_config, official, src,
            keep_stored_tied_copies=family.keep_stored_tied_copies, check_in_memory_names=plan.stored_as_loaded,
            dropped_by_official=plan.dropped_by_official, max_shard_size=max_shard_size,
            progress=sys.stderr.isatty(),
        )
    return {"dst": dst, "family": family.name, "architecture": plan.official_class, "bytes": official.nbytes,
            "files": sorted(path.name for path in dst.glob("*.safetensors"))}


def _return_dict_refused(source: Source, plan: Plan, error: AttributeError) -> Optional[ConversionError]:
    """The error to raise where official's own forward failed (an output object expected, a tuple met) because the
    source's config says return_dict=False, as GPT-2's, Llama's, BART's and T5's task models do in transformers 5
    (MPT's and the encoders' run); None for any other failure."""
    if source.raw_config.get("return_dict") is not False:
        return None
    return ConversionError(f"{source.path}: return_dict=False is not supported for {plan.official_class}: official's "
                           f"own forward fails with it ({type(error).__name__}: {error}); remove it from config.json")


# PretrainedConfig's own switches of what a forward returns by default, which every family's models read as official's
# do: carried as they are both ways (mosaicml/mpt-* configs say use_cache=false, some BERT-era ones return_dict=false)
OUTPUT_SWITCHES = ("use_cache", "output_hidden_states", "return_dict")
# PretrainedConfig's label fields: a language model's config may name labels too, which its official sequence
# classifier reads (BartConfig's default has three); each family carries them as they are, both ways
LABEL_FIELDS = ("id2label", "label2id", "problem_type")


def carry_output_switches(source: dict, target) -> None:
    for name in OUTPUT_SWITCHES:
        if isinstance(source.get(name), bool):
            setattr(target, name, source[name])


def carry_fields(source: dict, target, names: tuple[str, ...]) -> None:
    """The named fields the source config holds (a family's kept_fields), set on the target as they are."""
    for name in names:
        if name in source:
            setattr(target, name, source[name])


def entry_points(family: Family):
    """The module-level convert() / convert_back() of a family module (the CLI and the examples call them)."""

    def convert_family(src, dst, *, force=False, dtype=None, base_model=None, reference_model=None,
                       max_shard_size=None) -> dict:
        return convert(family, src, dst, force=force, dtype=dtype, base_model=base_model,
                       reference_model=reference_model, max_shard_size=max_shard_size)

    def convert_family_back(src, dst, *, force: bool = False, max_shard_size=None) -> dict:
        return convert_back(family, src, dst, force=force, max_shard_size=max_shard_size)

    convert_family.__doc__ = f"An official {family.name} checkpoint -> an hf_tiny folder (pipeline.convert)."
    convert_family_back.__doc__ = f"An hf_tiny folder -> the official {family.name} format (pipeline.convert_back)."
    return convert_family, convert_family_back
