"""save_pretrained / push_to_hub of every hf_tiny model: atomic saves, and the model card that travels with them."""

from __future__ import annotations

import inspect
import os
import re
import shutil
import sys
from pathlib import Path

from transformers import PreTrainedModel

from .hub import CARD_FILE, carry_model_card, check_repo_id, remember_loaded_weights, source_card
from .io_utils import atomic_directory, follow_umask, link_or_copy_tree


class AtomicSaveAndCardMixin:
    """Mixed in before PreTrainedModel (super() is PreTrainedModel's save / push)."""

    # Hub: the model card of a converted checkpoint (README.md with its measured parity numbers) travels with
    # save_pretrained / push_to_hub; see hf_tiny/hub.py.
    #
    # save_pretrained is atomic: transformers writes into a temp folder beside save_directory, which then replaces
    # it in one rename (hf_tiny/io_utils.py), so a save killed midway leaves the previous folder as it was. What a
    # plain save into the folder would keep (tokenizer files, Trainer checkpoints, ...) is carried over.
    def save_pretrained(self, save_directory, *args, **kwargs):
        arguments = inspect.signature(PreTrainedModel.save_pretrained).bind(self, save_directory, *args, **kwargs)
        arguments.apply_defaults()
        options = arguments.arguments
        self._name_every_auto_class()
        if not _can_save_atomically(save_directory, options):
            before = _entries(save_directory)
            result = super().save_pretrained(save_directory, *args, **kwargs)
            if options.get("is_main_process", True) and os.path.isdir(save_directory):
                carry_model_card(self, save_directory)
                # what this save wrote (new or replaced files) follows the umask, as in the atomic case
                follow_umask([os.path.join(save_directory, name) for name, inode in _entries(save_directory).items()
                              if before.get(name) != inode])
            return result
        destination = Path(os.path.realpath(save_directory))
        with atomic_directory(destination, replace=True) as tmp:
            result = super().save_pretrained(tmp, *args, **kwargs)
            follow_umask(tmp)  # before the previous folder's entries are linked in: those keep their modes
            _carry_over_previous_folder(self, destination, tmp, os.fspath(save_directory), options.get("variant"))
        return result

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        loaded = super().from_pretrained(*args, **kwargs)
        remember_loaded_weights(loaded[0] if isinstance(loaded, tuple) else loaded)  # output_loading_info: a tuple
        return loaded

    def _name_every_auto_class(self) -> None:
        """transformers' save writes into auto_map only the saved class's own Auto class: the config's auto_map gets
        every class of the family first, so the folder loads with any Auto head (entries it has are kept)."""
        family = family_auto_map(type(self.config), vars(sys.modules[type(self).__module__]).values(), own=type(self))
        self.config.auto_map = {**family, **(getattr(self.config, "auto_map", None) or {})}

    def push_to_hub(self, repo_id=None, *args, **kwargs):
        return super().push_to_hub(check_repo_id(repo_id), *args, **kwargs)

    def _upload_modified_files(self, working_dir, repo_id, *args, **kwargs):
        # transformers has just written its generic README.md here (after save_pretrained): put our card back,
        # pointed at the repo, before the upload.
        carry_model_card(self, working_dir, model_id=repo_id, over_any_readme=True)
        return super()._upload_modified_files(working_dir, repo_id, *args, **kwargs)


def family_auto_map(config_class, classes, own=None) -> dict[str, str]:
    """auto_map naming config_class and, per Auto class, the first of `classes` registered for it with that config;
    own (the class a folder holds) wins where two share an Auto class (AutoModelForPreTraining)."""
    auto_map = {"AutoConfig": _code_path(config_class)}
    for value in [*classes, *([own] if own is not None else [])]:
        if isinstance(value, type) and getattr(value, "config_class", None) is config_class:
            auto_class = getattr(value, "_auto_class", None)
            if auto_class and (auto_class not in auto_map or value is own):
                auto_map[auto_class] = _code_path(value)
    return auto_map


def _code_path(cls) -> str:
    return f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"


def _entries(folder) -> dict:
    """{name: inode} of a folder's files (empty when it is not a folder)."""
    if not os.path.isdir(folder):
        return {}
    return {entry.name: entry.inode() for entry in os.scandir(folder) if entry.is_file(follow_symlinks=False)}


def _can_save_atomically(save_directory, options: dict) -> bool:
    """The cases where save_pretrained writes in place, as transformers does: other ranks of a distributed save
    (only the main process writes), push_to_hub=True (the repo id defaults to the folder's name), distributed
    checkpoints (every rank writes), a path that is a file (transformers reports it), and a folder holding the
    working directory (it cannot be renamed away from under the process)."""
    if not options.get("is_main_process", True) or options.get("push_to_hub") or options.get("distributed_checkpoint"):
        return False
    if os.path.isfile(save_directory):
        return False
    destination = Path(os.path.realpath(save_directory))
    cwd = Path(os.path.realpath(os.getcwd()))
    return destination != cwd and destination not in cwd.parents


def _is_stale_shard(name: str, variant) -> bool:
    """Weight shards transformers' save_pretrained deletes from a folder it saves into (when not rewritten)."""
    prefix = "model" if variant is None else f"model.{variant}"
    stem = name.replace(".bin", "").replace(".safetensors", "")
    return name.startswith(prefix) and re.fullmatch(r"(.*?)-\d{5}-of-\d{5}", stem) is not None


def _carry_over_previous_folder(model, destination: Path, tmp: Path, save_directory: str, variant) -> None:
    """Completes the new folder tmp before it replaces destination: our model card (hf_tiny/hub.py), then every
    entry of the previous destination this save did not write, except stale weight shards. Entries are
    hard-linked, never written through, so the previous folder stays intact until the swap."""
    previous_card = destination / CARD_FILE
    new_card = tmp / CARD_FILE
    if previous_card.is_file() and not new_card.exists():
        shutil.copy2(previous_card, new_card)  # a copy: carry_model_card may rewrite it (keeping its tags)
    found = source_card(model)
    saving_over_own_folder = found is not None and found[0].resolve() == previous_card.resolve()
    if not saving_over_own_folder:  # there the card is already in place, as official leaves a README
        carry_model_card(model, tmp, model_id=save_directory)
    if not destination.is_dir():
        return
    for entry in destination.iterdir():
        target = tmp / entry.name
        if os.path.lexists(target) or (entry.is_file() and _is_stale_shard(entry.name, variant)):
            continue
        link_or_copy_tree(entry, target)
