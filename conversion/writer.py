"""Writing converted folders: atomically, with tied copies handled, tokenizer and sentence-transformers files
carried over, and (reverse direction) an official folder that transformers loads cleanly."""

from __future__ import annotations

import re

import contextlib
import copy
import json
import os
import shutil
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from .errors import ConversionError
from .keymap import check_shapes, expected_shapes
from .lazy import LazyTensors, TensorInfo

def save_state_dict_safetensors(
    state_dict: Mapping[str, torch.Tensor], path: str | os.PathLike, *, metadata: Mapping[str, str] | None = None
) -> None:
    """Saves tensors with safetensors; tensors sharing memory (tied weights, views) are stored as copies."""
    from safetensors.torch import save_file

    seen_storages: set[tuple[int, str]] = set()
    prepared: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state_dict[{key!r}] is a {type(tensor).__name__}, not a tensor")
        if tensor.device.type == "meta":
            raise ValueError(f"state_dict[{key!r}] is on the meta device (no data to save)")
        tensor = tensor.detach()
        storage = (tensor.untyped_storage().data_ptr(), str(tensor.device))
        if storage in seen_storages:  # safetensors refuses two names over one storage (ties, chunks of a fusion)
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        else:
            seen_storages.add(storage)
        prepared[key] = tensor.to("cpu").contiguous()
    save_file(prepared, str(path), metadata={"format": "pt", **(metadata or {})})
    from hf_tiny.io_utils import follow_umask

    follow_umask(path)  # safetensors creates the file 0600, whatever the umask


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    from hf_tiny.io_utils import exchange_paths

    return exchange_paths(a, b)


@contextlib.contextmanager
def atomic_output_dir(
    dst: str | os.PathLike, *, force: bool = False, src: str | os.PathLike | None = None
) -> Iterator[Path]:
    """Yields a fresh temp folder beside dst; on success it becomes dst, on any failure dst is untouched.

    An existing dst is an error unless force=True, raised before any work. With force the old dst is
    swapped out atomically (renameat2 exchange; two renames where unsupported) and then deleted. A run killed
    mid-write leaves only a `.DST.tmp-PID-XXXX` folder beside dst, which the next run removes.
    src (optional): the checkpoint being converted; a dst that is src or contains it is refused, since
    replacing it would delete the source.
    The mechanism is hf_tiny.io_utils.atomic_directory (shared with save_pretrained); imported here lazily so
    that this module stays importable without the model package.
    """
    from hf_tiny.io_utils import atomic_directory, clean_stale_temporaries, follow_umask

    dst = Path(dst).absolute()
    if dst.is_symlink():  # the folder the link points to is replaced; the link stays (see atomic_directory)
        dst = Path(os.path.realpath(dst))
    if src is not None:
        source = Path(src).resolve()
        if dst.resolve() == source or dst.resolve() in source.parents:
            raise ConversionError(f"destination {dst} is (or contains) the source {src}; choose another destination")
    try:
        clean_stale_temporaries(dst)  # first: it may put back a destination a killed --force swap had moved aside
    except OSError as error:
        raise ConversionError(f"cannot clean stale temporary folders beside {dst}: {error}") from error
    if dst.exists() and not force:
        raise ConversionError(f"destination {dst} already exists; pass --force to replace it")
    if dst.exists() and not dst.is_dir():
        raise ConversionError(f"destination {dst} exists and is not a folder; remove it or choose another path")
    stage = "create"  # -> "write" (the caller's block) -> "swap"
    try:
        with atomic_directory(dst, replace=force, exchange=_exchange) as tmp:
            stage = "write"
            yield tmp
            follow_umask(tmp)  # every file written (copied ones included) with the modes a plain write gives
            stage = "swap"
    except OSError as error:
        if stage == "create":
            raise ConversionError(f"cannot create an output folder beside {dst}: {error}") from error
        if stage == "swap" and isinstance(error, FileExistsError):
            raise ConversionError(f"destination {dst} appeared while converting; pass --force to replace it") from error
        raise


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "tokenizer.model",
    "sentencepiece.bpe.model",
    "source.spm",  # Marian: one SentencePiece model per language, and the target vocabulary when separate
    "target.spm",
    "target_vocab.json",
    "chat_template.jinja",
    "chat_template.json",
    # not a tokenizer file, but it belongs with the converted model just the same
    "generation_config.json",
)


# A sentence-transformers model is a folder like any other plus these files and the module folders that
# modules.json names (1_Pooling/, 2_Normalize/, ...). Without them SentenceTransformer(folder) falls back to plain
# mean pooling with no normalisation and max_seq_length 512: other embeddings, silently.
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")


def copy_tokenizer_files(src_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> list[str]:
    """Copies the TOKENIZER_FILES present in src_dir into dst_dir, the chat templates besides the default one
    (additional_chat_templates/), the code of a remote-code tokenizer (the modules tokenizer_config.json's auto_map
    names), and the sentence-transformers files with the module folders of modules.json; returns the names copied."""
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    if not src_dir.is_dir():
        raise ConversionError(f"tokenizer source {src_dir} is not a folder")
    copied = []
    for name in TOKENIZER_FILES + SENTENCE_TRANSFORMERS_FILES + _tokenizer_code_files(src_dir):
        if (src_dir / name).is_file():
            shutil.copyfile(src_dir / name, dst_dir / name)
            copied.append(name)
    for folder in (CHAT_TEMPLATES_FOLDER, *_sentence_transformers_module_folders(src_dir)):
        if (src_dir / folder).is_dir():
            shutil.copytree(src_dir / folder, dst_dir / folder)
            copied.append(folder + "/")
    return copied


# Without one of these, AutoTokenizer may build an empty tokenizer that maps every word to one id.
VOCABULARY_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")

# transformers saves a tokenizer's named chat templates (all but the default one) there, one .jinja file each
CHAT_TEMPLATES_FOLDER = "additional_chat_templates"


def _tokenizer_code_files(src_dir: Path) -> tuple[str, ...]:
    """The .py files of the modules a remote-code tokenizer's auto_map names ("tokenization_x.XTokenizer")."""
    auto_map = (_tokenizer_config(src_dir) or {}).get("auto_map") or {}
    references = [ref for value in auto_map.values() for ref in (value if isinstance(value, list) else [value])]
    modules = {ref.split("--")[-1].rsplit(".", 1)[0] for ref in references if isinstance(ref, str) and "." in ref}
    return tuple(sorted(f"{module}.py" for module in modules))


def _tokenizer_config(folder: Path) -> dict | None:
    """tokenizer_config.json's fields ({} without the file), or None where it is not a JSON object: copied as it
    is, read by nothing here (official's loader would refuse it too)."""
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return config if isinstance(config, dict) else None


def pin_tokenizer_class(src_dir: Path, dst_dir: Path) -> str | None:
    """Names in dst_dir's tokenizer_config.json the tokenizer class official AutoTokenizer loads src_dir's with.
    AutoTokenizer takes it from tokenizer_config.json's tokenizer_class when there is one, but from config.json's
    model_type where there is none (bert-base-uncased, gpt2), and for some model types (Mistral, Phi-3, Qwen2) in
    place of the one the file names; a converted folder's model_type is hf_tiny's, so without this it would load
    another class (BERT's without its special tokens, Mistral's with other ids). Returns the class written, or
    None where nothing needs writing (the file already names it, a remote-code tokenizer, no vocabulary, or a
    tokenizer official cannot load either, an unreadable tokenizer_config.json among them)."""
    from transformers import AutoTokenizer

    tokenizer_config = _tokenizer_config(dst_dir)
    if tokenizer_config is None or "auto_map" in tokenizer_config:
        return None
    if not any((dst_dir / name).is_file() for name in VOCABULARY_FILES):
        return None
    try:
        name = type(AutoTokenizer.from_pretrained(str(src_dir), trust_remote_code=False)).__name__
    except Exception:  # official loads no tokenizer from the source either: nothing to match
        return None
    if tokenizer_config.get("tokenizer_class") == name:
        return None
    pinned = {**tokenizer_config, "tokenizer_class": name}
    (dst_dir / "tokenizer_config.json").write_text(json.dumps(pinned, indent=2) + "\n")
    return name


def _sentence_transformers_module_folders(src_dir: Path) -> list[str]:
    """The module folders modules.json names (its entry of path "" is the model itself, converted here)."""
    modules_path = src_dir / "modules.json"
    if not modules_path.is_file():
        return []
    try:
        modules = json.loads(modules_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConversionError(f"cannot read {modules_path}: {error}") from error
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ConversionError(f"{modules_path} must hold a list of module objects (sentence-transformers' format)")
    folders = []
    for module in modules:
        folder = module.get("path", "")
        if not isinstance(folder, str):
            raise ConversionError(f"{modules_path}: module path {folder!r} is not a string")
        if not folder:
            continue
        resolved = (src_dir / folder).resolve()
        if src_dir.resolve() not in resolved.parents:
            raise ConversionError(f"{modules_path}: module path {folder!r} points outside {src_dir}")
        if resolved.is_dir():  # a module without files (Normalize) may have no folder at all
            folders.append(folder)
    return folders


def stream_official_folder(tmp: Path, official_class, official_config, state, src, *,
                           keep_stored_tied_copies: bool = False, check_in_memory_names: bool = True,
                           dropped_by_official: tuple = (), max_shard_size=None, progress: bool = False) -> None:
    """The official folder, streamed: state (lazy.LazyTensors) is written one tensor at a time to
    save_pretrained's shards, and the final check loads the folder on the meta device (names and shapes, no
    tensor read)."""
    from tqdm.auto import tqdm

    from .shards import ShardWriter

    with torch.device("meta"):
        reference = official_class(official_config)
    expected = expected_shapes(reference)
    dropped = set()
    for tied_copy in reference.get_expanded_tied_weights_keys(all_submodels=True):
        if not (keep_stored_tied_copies and tied_copy in state):
            expected.pop(tied_copy, None)
            dropped.add(tied_copy)
    for recomputed in reference._keys_to_ignore_on_save or ():
        expected.pop(recomputed, None)
    state = state.without(dropped)
    if check_in_memory_names:
        check_shapes({key: state.info(key).meta() for key in state}, expected)
    order = [key for key in expected if key in state] + [key for key in state if key not in expected]
    official_config.save_pretrained(str(tmp))
    writer = ShardWriter(tmp, {key: state.info(key) for key in order},
                         max_shard_size=max_shard_size)
    try:
        for key in tqdm(order, desc="writing tensors", unit="tensor", disable=not progress, file=sys.stderr, leave=False):
            writer.write(key, state[key])
        writer.close()
    except BaseException:
        writer.abort()
        raise
    copy_tokenizer_files(src, tmp)
    load_cleanly(official_class, tmp, f"the written {official_class.__name__} folder", dropped=dropped_by_official,
                 device_map="meta")


# ----------------------------------------------------------------------------------------------------------------
# Tied copies
# ----------------------------------------------------------------------------------------------------------------


def drop_tied_copies(state: Mapping[str, torch.Tensor], canonical: str, copies, *, src, hint: str = "") -> LazyTensors:
    """A checkpoint may store one tied table several times: each stored copy must equal `canonical` and is
    dropped (hf_tiny stores it once). hint: what to do if the copy really differs."""
    state = LazyTensors.of(state)
    if canonical not in state:
        if any(copy in state for copy in copies):
            raise ConversionError(f"{src}: missing tensor {canonical}")
        return state
    stored = [key for key in copies if key in state]
    for key in stored:
        if state.info(key).shape != state.info(canonical).shape or not torch.equal(state[key], state[canonical]):
            raise ConversionError(f"{src}: {key} differs from {canonical}, but they are tied{hint}")
    return state.without(stored)


def stores_tied_copy(state: Mapping[str, torch.Tensor], canonical: str, copy: str) -> bool:
    """True when a checkpoint's `copy` is absent or bit-equal to `canonical` (the head counts as tied)."""
    if copy not in state:
        return True
    original = state.get(canonical)
    return original is not None and state[copy].shape == original.shape and torch.equal(state[copy], original)


def tie_map(model_class, config) -> dict[str, str]:
    """{tied copy: source} of an hf_tiny model class with this config (built on the meta device)."""
    with torch.device("meta"):
        model = model_class(config)
    return model.get_expanded_tied_weights_keys(all_submodels=True)


def with_tied_copies(state, model_class, config):
    """hf_tiny folders store tied weights once: the copies put back (as views of their source, read lazily) so a
    key map sees every name."""

    state = LazyTensors.of(state)
    copies = {copy: source for copy, source in tie_map(model_class, config).items() if copy not in state and source in state}
    return state.with_tensors({copy: (state.info(source), lambda source=source: state[source])
                               for copy, source in copies.items()})


# ----------------------------------------------------------------------------------------------------------------
# hf_tiny folders
# ----------------------------------------------------------------------------------------------------------------


def load_cleanly(model_class, path: Path, what: str, *, dropped: tuple = (), **kwargs):
    """from_pretrained that fails unless every stored tensor was found and used (except unexpected ones matching
    a `dropped` regex)."""
    model, info = model_class.from_pretrained(str(path), output_loading_info=True, **kwargs)
    info = dict(info)
    info["unexpected_keys"] = [k for k in info.get("unexpected_keys", ()) if not any(re.fullmatch(p, k) for p in dropped)]
    problems = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if problems or info.get("error_msgs"):
        raise ConversionError(f"{what} does not load cleanly: {problems or info['error_msgs']}")
    return model


def write_generation_config_of_config_json(tmp: Path, source_folder: Path) -> None:
    """generation_config.json for a source folder without one: what official from_pretrained generates with then
    (GenerationMixin.adjust_generation_fn), the generation fields of the folder's config.json. Checkpoints saved
    before transformers 4.26 keep num_beams, no_repeat_ngram_size, forced_bos_token_id, ... there, and the parsed
    config drops them."""
    from transformers import GenerationConfig

    generation = GenerationConfig.from_pretrained(str(source_folder), config_file_name="config.json",
                                                  _from_model_config=True)
    _without_negative_pad(generation).save_pretrained(tmp)


def write_generation_config(tmp: Path, config, official_config=None) -> None:
    """generation_config.json: the one written with the side files (the source's, or official's reading of its
    config.json) as it is, since official generates with it as it is (a T5 file without pad_token_id pads finished
    rows with eos there); where there is none (a warm start, bert2seq: a BERT folder's file is for another model),
    one derived from the official config, as transformers derives it, with the special ids it leaves unset filled
    from the hf_tiny config (the decoder start token a warm start chooses)."""
    from transformers import GenerationConfig

    if (tmp / "generation_config.json").is_file():
        return
    generation = GenerationConfig.from_model_config(official_config if official_config is not None else config)
    for field in ("decoder_start_token_id", "pad_token_id", "eos_token_id", "bos_token_id"):
        if getattr(generation, field, None) is None and getattr(config, field, None) is not None:
            setattr(generation, field, getattr(config, field))
    _without_negative_pad(generation).save_pretrained(tmp)


def _without_negative_pad(generation):
    """Old LLaMA's pad_token_id=-1 is left out of generation_config.json (transformers 5.16 refuses to save it)."""
    if isinstance(generation.pad_token_id, int) and generation.pad_token_id < 0:
        generation = copy.deepcopy(generation)
        generation.pad_token_id = None
    return generation


# ----------------------------------------------------------------------------------------------------------------
# Streaming: tensors mapped, cast and written one rule at a time
# ----------------------------------------------------------------------------------------------------------------


def planned_outputs(steps, state, expected: Mapping[str, torch.Size], dtype: torch.dtype | None) -> dict:
    """{key: TensorInfo} every step will produce, from the inputs' shapes and dtypes alone (each transform run on
    meta tensors; one that cannot run there is planned with the model's shape and its first input's dtype), in
    the expected (state dict) order, cast to dtype where floating."""

    produced = {}
    for step in steps:
        for key, info in zip(step.outputs, step.output_infos(state, expected), strict=True):
            if dtype is not None and info.dtype.is_floating_point:
                info = TensorInfo(info.shape, dtype)
            produced[key] = info
    order = [key for key in expected if key in produced] + [key for key in produced if key not in expected]
    return {key: produced[key] for key in order}


def first_floating(infos: Mapping) -> torch.dtype:
    return next((info.dtype for info in infos.values() if info.dtype.is_floating_point), torch.float32)


def write_model_files(tmp: Path, model, config, *, loads_as: torch.dtype, auto_map=None) -> None:
    """What save_pretrained writes besides the weights: config.json (dtype: what from_pretrained loads the weights
    in by default; architectures, auto_map), the modeling code of a remote-code class and generation_config.json for
    a model that generates."""
    from transformers.dynamic_module_utils import custom_object_save

    config.dtype = str(loads_as).removeprefix("torch.")
    config.architectures = [type(model).__name__]
    custom_object_save(model, tmp, config=config)
    if auto_map is not None:
        config.auto_map = auto_map
    config.save_pretrained(tmp)
    if model.can_generate():
        _without_negative_pad(model.generation_config).save_pretrained(tmp)
