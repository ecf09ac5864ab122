"""Model cards that travel with saved and pushed hf_tiny models, and the repo id check of push_to_hub.

A converted checkpoint holds a README.md that `python -m conversion` rendered from model_cards/hf_tiny.md (YAML
metadata: library_name, license, base_model, pipeline_tag, tags; the parity numbers measured at conversion).
The card is not re-rendered here: the card of the folder a model was loaded from is carried to wherever the
model is saved or pushed, with the id in its loading snippets pointed at the new place and any extra tags
added, as long as it still describes the model (its class, its weights as loaded). A model with no such card
(built from a config, fine-tuned, quantized, say) keeps the card transformers or Trainer writes.

This module is shipped as remote code with the modeling files (modeling_base imports it), so it imports only
the standard library: the same carrying works where hf_tiny is not installed.
"""

from __future__ import annotations

import json
import os
import re
import weakref
from pathlib import Path

import torch

CARD_FILE = "README.md"
CARD_TAG = "hf_tiny"  # every card rendered from model_cards/hf_tiny.md carries it

_FRONT_MATTER = re.compile(r"\A---[ \t]*\n(?P<yaml>.*?\n)?---[ \t]*(?:\n|\Z)", re.DOTALL)
_TAGS_BLOCK = re.compile(r"^tags:[ \t]*\n(?P<items>(?:[ \t]*-[^\n]*\n)*)", re.MULTILINE)
_LOAD_SNIPPET_ID = re.compile(r'(\.from_pretrained\(\s*)"[^"\n]*"')


def check_repo_id(repo_id) -> str:
    """push_to_hub's repo id must be a non-empty 'name' or 'namespace/name' string."""
    if not isinstance(repo_id, str) or not repo_id.strip():
        raise ValueError(
            f"push_to_hub needs a repo_id such as 'your-name/model-name' (the Hub repository to create or "
            f"update); got repo_id={repo_id!r}"
        )
    if repo_id.count("/") > 1 or repo_id.startswith("/") or repo_id.endswith("/"):
        raise ValueError(f"push_to_hub: repo_id must be 'name' or 'namespace/name', got repo_id={repo_id!r}")
    return repo_id


def card_tags(card: str) -> list[str]:
    """The `tags:` list of a card's YAML front matter (block style, as Hub cards write it)."""
    front = _FRONT_MATTER.match(card)
    if front is None or front.group("yaml") is None:
        return []
    block = _TAGS_BLOCK.search(front.group("yaml"))
    if block is None:
        return []
    tags = []
    for line in block.group("items").splitlines():
        value = line.strip()[1:].strip()
        if value.startswith(("'", '"')) and value.endswith(value[0]) and len(value) >= 2:
            value = value[1:-1]
        if value:
            tags.append(value)
    return tags


def is_hf_tiny_card(card: str) -> bool:
    return CARD_TAG in card_tags(card)


def source_card(model) -> tuple[Path, str] | None:
    """(path, text) of the hf_tiny card in the local folder the model was loaded from, if there is one."""
    name_or_path = getattr(getattr(model, "config", None), "_name_or_path", None) or ""
    if not name_or_path or not os.path.isdir(name_or_path):
        return None
    path = Path(name_or_path) / CARD_FILE
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    return (path, text) if is_hf_tiny_card(text) else None


def retarget_card(card: str, model_id: str | None, extra_tags=()) -> str:
    """The card with its from_pretrained snippets loading `model_id` and `extra_tags` added to its YAML tags."""
    if model_id is not None:
        card = _LOAD_SNIPPET_ID.sub(lambda m: m.group(1) + json.dumps(str(model_id)), card)
    missing = [tag for tag in dict.fromkeys(extra_tags) if tag and tag not in card_tags(card)]
    if missing:
        front = _FRONT_MATTER.match(card)
        block = _TAGS_BLOCK.search(front.group("yaml") or "") if front else None
        if block is None:
            raise ValueError("cannot add tags to a model card whose front matter has no block-style 'tags:' list")
        insert_at = front.start("yaml") + block.end("items")
        lines = "".join(f"  - {json.dumps(tag)}\n" for tag in missing)
        card = card[:insert_at] + lines + card[insert_at:]
    return card


_CARD_CLASS = re.compile(r"^`(?P<name>\w+)` converted from ", re.MULTILINE)


def remember_loaded_weights(model) -> None:
    """Notes each parameter as from_pretrained left it (the object, its in-place version counter and a sample of
    its elements, which `.to()` keeps and an in-place edit moves), for card_still_holds, and watches optimizer
    steps from now on (an optimizer step over the model's parameters also ends the card)."""
    model._hf_tiny_loaded_weights = _parameter_states(model)
    _watch_optimizer_steps()


# Optimizers that have stepped in this process (torch's global step post-hook, registered when the first hf_tiny model
# is loaded): a fused step writes without bumping _version, and a sparse one (only the rows a batch touched, no
# weight decay) can miss every sampled element.
_stepped_optimizers: "weakref.WeakSet" = weakref.WeakSet()
_step_hook = None


def _watch_optimizer_steps() -> None:
    global _step_hook
    if _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _step_hook = register_optimizer_step_post_hook(
            lambda optimizer, args, kwargs: _stepped_optimizers.add(optimizer))


def _stepped_since_loading(model) -> bool:
    """Whether an optimizer holding one of the model's parameters has stepped since it was loaded."""
    ours = {id(p) for p in model.parameters()}
    return any(id(p) in ours for optimizer in list(_stepped_optimizers)
               for group in optimizer.param_groups for p in group["params"])


def _parameter_states(model) -> dict:
    return {name: (id(p), p._version, _sampled_bytes(p)) for name, p in model.named_parameters()}


SAMPLED_ELEMENTS = 16


def _sampled_bytes(parameter: torch.Tensor) -> tuple:
    """A few of the tensor's elements, as bytes. An in-place edit bumps _version, but fused optimizers
    (torch._fused_adamw_, Trainer's default on transformers 5.24) write without bumping it; their step moves
    (nearly) every element of a trained tensor, these among them."""
    data = parameter.detach()
    if type(data) is not torch.Tensor or data.device.type == "meta" or data.numel() == 0:
        return ()
    flat = data.reshape(-1)
    count = min(SAMPLED_ELEMENTS, flat.numel())
    # integer steps (a float32 linspace rounds the last index past the end of a 10^8-element tensor)
    index = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)
    return tuple(flat[index].contiguous().view(torch.uint8).tolist())


def card_still_holds(model, card: str) -> bool:
    """The source card describes this model: the class it names, and every parameter as loaded. After training,
    merging an adapter, quantizing, resizing or loading into another head, its "same numbers" and parity table would
    be claims about other weights."""
    named = _CARD_CLASS.search(card)
    if named is not None and named.group("name") != type(model).__name__:
        return False
    if getattr(getattr(model, "config", None), "quantization_config", None) is not None:
        return False
    loaded = getattr(model, "_hf_tiny_loaded_weights", None)
    return loaded == _parameter_states(model) and not _stepped_since_loading(model)


def carry_model_card(model, folder, *, model_id: str | None = None, over_any_readme: bool = False) -> Path | None:
    """Writes the model's source card (see module doc) into folder/README.md; returns its path, or None when the
    model has no hf_tiny card or the card no longer describes it (card_still_holds). A README already in `folder`
    that is not an hf_tiny card (the user's, Trainer's) is left as it is, as official save_pretrained leaves it;
    over_any_readme (push_to_hub, where transformers has just written its generic card): replaced, its tags kept.
    """
    found = source_card(model)
    if found is None or not card_still_holds(model, found[1]):
        return None
    source_path, card = found
    target = Path(folder) / CARD_FILE
    if target.exists() and target.resolve() == source_path.resolve():
        return target  # saving over the folder it came from: the card is already there
    existing = target.read_text(encoding="utf-8") if target.is_file() else None
    if existing is not None and not over_any_readme and not is_hf_tiny_card(existing):
        return None
    existing_tags = card_tags(existing) if existing is not None else []
    target.write_text(
        retarget_card(card, model_id if model_id is not None else str(folder), existing_tags), encoding="utf-8"
    )
    return target
