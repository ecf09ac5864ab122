"""Glue shared by the seq2seq converters (bart.py, t5.py, bert2seq.py): tied-copy handling, writing an hf_tiny or
an official folder, and the parity measurement written into the model card. What every family shares (config
loading, tolerances, parity rows and verdict, the official folder) lives in conversion.core.

Each converter keeps its own declarative KeyMap; encoder layers use the placeholder {i} and decoder layers {j},
so `num_layers={"i": encoder_depth, "j": decoder_depth}` handles stacks of different depths.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import torch

from .core import (
    ConversionError,
    KeyMap,
    cast_floating,
    check_shapes,
    copy_tokenizer_files,
    expected_shapes,
    fail_on_parity,
    load_checkpoint,
    load_hf_tiny_config,
    max_abs_diff,
    parity_plans,
    parity_row,
    write_model_card,
    write_official_folder,
)

OUR_CLASS = "TinySeq2SeqForConditionalGeneration"
AUTO_MAP = {
    "AutoConfig": "configuration_seq2seq.TinySeq2SeqConfig",
    "AutoModel": "modeling_seq2seq.TinySeq2SeqModel",
    "AutoModelForSeq2SeqLM": "modeling_seq2seq.TinySeq2SeqForConditionalGeneration",
}


def ours_class():
    from hf_tiny import TinySeq2SeqForConditionalGeneration

    return TinySeq2SeqForConditionalGeneration


def our_config(src, **fields):
    """TinySeq2SeqConfig(**fields), with a config error reported as a ConversionError naming the source."""
    from hf_tiny import TinySeq2SeqConfig

    try:
        return TinySeq2SeqConfig(**fields)
    except (TypeError, ValueError) as error:
        raise ConversionError(f"{src}: this checkpoint has no hf_tiny seq2seq equivalent: {error}") from error


def load_our_config(src: Path):
    """The config of an hf_tiny seq2seq folder (model_type and architecture checked), for a reverse conversion."""
    from hf_tiny import TinySeq2SeqConfig

    config, _ = load_hf_tiny_config(src, TinySeq2SeqConfig, supported=(OUR_CLASS,), default=OUR_CLASS)
    return config


def stack_depths(config) -> dict[str, int]:
    """num_layers for a seq2seq KeyMap: {i} runs over encoder layers, {j} over decoder layers."""
    return {"i": config.num_hidden_layers, "j": config.num_decoder_layers}


def read_ours_for_reverse(src: Path, config) -> tuple[dict, torch.dtype]:
    """An hf_tiny folder's tensors with the tied copies put back, and the dtype they are stored in."""
    state = with_tied_copies(load_checkpoint(src), config)
    return state, next(iter(state.values())).dtype


def to_official_names(mapping: KeyMap, state: dict, config) -> dict:
    return mapping.to_source(state, num_layers=stack_depths(config), progress=sys.stderr.isatty())


def require_equal(config, src, **expected) -> None:
    """Every field must have the value the target format can express; the error names field and value."""
    for field, value in expected.items():
        actual = getattr(config, field)
        if actual != value:
            raise ConversionError(f"{src}: {field}={actual!r} cannot be expressed in this format (it needs {value!r})")


def drop_tied_copies(state: dict, canonical: str, copies: list[str], *, src) -> dict:
    """Checkpoints may store tied embeddings several times; each stored copy must equal `canonical`."""
    state = dict(state)
    if canonical not in state:
        raise ConversionError(f"{src}: missing tensor {canonical}")
    for key in copies:
        if key in state:
            if state[key].shape != state[canonical].shape or not torch.equal(state[key], state[canonical]):
                raise ConversionError(
                    f"{src}: {key} differs from {canonical}; hf_tiny ties them (one shared embedding table)"
                )
            state.pop(key)
    return state


def head_is_tied(state: dict, embedding_key: str, head_key: str = "lm_head.weight") -> bool:
    """A head counts as tied when the checkpoint does not store it or stores an identical copy."""
    if head_key not in state:
        return True
    head, embedding = state[head_key], state.get(embedding_key)
    return embedding is not None and head.shape == embedding.shape and torch.equal(head, embedding)


def tie_map(config) -> dict[str, str]:
    """{tied copy: source} of an hf_tiny seq2seq model with this config."""
    with torch.device("meta"):
        model = ours_class()(config)
    return model.get_expanded_tied_weights_keys(all_submodels=True)


def with_tied_copies(state: dict, config) -> dict:
    """hf_tiny folders store tied weights once: put the copies back so a key map sees every name."""
    state = dict(state)
    for copy, source in tie_map(config).items():
        if copy not in state and source in state:
            state[copy] = state[source]
    return state


def save_ours(config, state: dict, tmp: Path, src: Path) -> None:
    """Writes an hf_tiny folder: config.json with auto_map, model.safetensors, the modeling code, tokenizer files."""
    config.architectures = [OUR_CLASS]
    config.auto_map = dict(AUTO_MAP)
    with torch.device("meta"):
        model = ours_class()(config)
    check_shapes(state, expected_shapes(model))
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    model.save_pretrained(tmp)
    copy_tokenizer_files(src if src.is_dir() else src.parent, tmp)


def write_ours(
    tmp: Path, src: Path, config, mapping: KeyMap, state: dict, *, dtype, official_config=None, keep_source_generation=True
) -> None:
    """Maps official tensors to hf_tiny names, casts them to dtype and writes the hf_tiny folder with its
    generation_config.json (the source's unless keep_source_generation=False, else derived; see
    write_generation_config)."""
    ours = mapping.to_target(state, num_layers=stack_depths(config), progress=sys.stderr.isatty())
    save_ours(config, cast_floating(ours, dtype), tmp, src)
    if not keep_source_generation:
        (tmp / "generation_config.json").unlink(missing_ok=True)
    write_generation_config(tmp, config, official_config)


def save_official(official_class, official_config, state: dict, tmp: Path, src: Path) -> None:
    """Writes an official folder (conversion.core.write_official_folder; a tied copy the state holds is kept, as
    it may be an untied head), then checks the official class loads it with no missing or unexpected keys."""
    write_official_folder(tmp, official_class, official_config, state, src, keep_stored_tied_copies=True)
    _, info = official_class.from_pretrained(str(tmp), output_loading_info=True)
    _require_clean_load(info, f"the written {official_class.__name__} folder")


def _require_clean_load(info: dict, what: str) -> None:
    problems = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if problems or info.get("error_msgs"):
        raise ConversionError(f"{what} does not load cleanly: {problems or info['error_msgs']}")


def write_generation_config(tmp: Path, config, official_config=None) -> None:
    """generation_config.json: the source's (copied with the tokenizer files) or one derived from the official
    config, as transformers derives it; special ids it leaves unset are filled from the hf_tiny config (T5
    configs often omit decoder_start_token_id, which is the pad token there)."""
    from transformers import GenerationConfig

    if (tmp / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(str(tmp))
    else:
        generation = GenerationConfig.from_model_config(official_config if official_config is not None else config)
    for field in ("decoder_start_token_id", "pad_token_id", "eos_token_id", "bos_token_id"):
        if getattr(generation, field, None) is None and getattr(config, field, None) is not None:
            setattr(generation, field, getattr(config, field))
    generation.save_pretrained(tmp)


def load_ours_checked(path: Path, **kwargs):
    """Loads a converted folder and fails unless every tensor was found and used."""
    model, info = ours_class().from_pretrained(str(path), output_loading_info=True, **kwargs)
    _require_clean_load(info, "the converted folder")
    return model


# ----------------------------------------------------------------------------------------------------------------
# Parity at conversion time
# ----------------------------------------------------------------------------------------------------------------


def parity_batch(config, *, seed: int = 0) -> dict:
    """A padded encoder batch (lengths L, L-4, L/2) and decoder inputs starting with decoder_start_token_id."""
    generator = torch.Generator().manual_seed(seed)
    length = 12
    if config.position_embedding_type != "relative":
        length = min(length, config.max_position_embeddings)
    lengths = [length, max(1, length - 4), max(1, length // 2)]
    input_ids = torch.randint(0, config.vocab_size, (len(lengths), length), generator=generator)
    attention_mask = torch.zeros_like(input_ids)
    for row, real in enumerate(lengths):
        attention_mask[row, :real] = 1
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    input_ids = input_ids.masked_fill(attention_mask == 0, pad)
    decoder_length = min(6, config.max_position_embeddings) if config.position_embedding_type != "relative" else 6
    decoder_input_ids = torch.randint(0, config.vocab_size, (len(lengths), decoder_length), generator=generator)
    decoder_input_ids[:, 0] = config.decoder_start_token_id if config.decoder_start_token_id is not None else pad
    return {"input_ids": input_ids, "attention_mask": attention_mask, "decoder_input_ids": decoder_input_ids}


def _logits(model, batch: dict, device: str) -> torch.Tensor:
    with torch.no_grad():
        return model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False).logits


def round_trip_weights(model: torch.nn.Module, dtype: Optional[torch.dtype]) -> None:
    """Rounds the official model's weights through the stored dtype, so both sides hold the same numbers."""
    if dtype is None or dtype == torch.float32:
        return
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(dtype).to(tensor.dtype))


def measure_parity(official, ours, config, *, flash_ok: bool) -> tuple[list[dict], str]:
    """max |ours - official| of the logits on a padded batch, per backend (CPU: eager, sdpa; CUDA too if present).

    official: the official model in fp32 (its weights already rounded to the stored dtype); ours: the converted
    model loaded in fp32. The official model runs the same backend (sdpa where ours runs flash). Returns (rows for
    the model card, a description of the inputs)."""
    official.eval()
    ours.eval()
    batch = parity_batch(config)
    plans = [plan for plan in parity_plans(torch.float32) if flash_ok or plan[2] != "flash_attention_2"]
    rows, references = [], {}
    for device, dtype, backend in plans:
        official_backend = "sdpa" if backend == "flash_attention_2" else backend
        if (device, official_backend) not in references:
            official.to(device)
            official.set_attn_implementation(official_backend)
            reference = _logits(official, batch, device).float()
            references[(device, official_backend)] = (reference, max(1.0, float(reference.abs().max())))
        reference, scale = references[(device, official_backend)]
        ours.to(device=device, dtype=dtype)
        ours.set_attn_implementation(backend)
        produced = _logits(ours, batch, device).float()
        rows.append(parity_row(backend, dtype, device, max_abs_diff(produced, reference), scale))
    official.to("cpu")
    ours.to(device="cpu", dtype=torch.float32)
    lengths = batch["attention_mask"].sum(-1).tolist()
    description = (
        f"seeded random token ids, encoder batch padded to lengths {lengths}, "
        f"{batch['decoder_input_ids'].shape[1]} decoder tokens starting with decoder_start_token_id; the official "
        "model runs the same attention backend (sdpa for flash rows)"
    )
    return rows, description


def check_parity_and_write_card(
    tmp: Path, dst: Path, *, official, config, dtype, flash_ok: bool, what: str, **card
) -> tuple[list[dict], str]:
    """Measures the written folder against `official` (fp32; its weights rounded to dtype first), writes the model
    card (card: write_card's fields) and fails on any row above tolerance or not finite. Returns (rows, inputs)."""
    round_trip_weights(official, dtype)
    ours = load_ours_checked(tmp, dtype=torch.float32)
    rows, inputs = measure_parity(official, ours, config, flash_ok=flash_ok)
    write_card(tmp, dst, rows=rows, inputs=inputs, **card)
    fail_on_parity(rows, what, ours.state_dict())
    return rows, inputs


def write_card(tmp: Path, dst: Path, *, base_model: str, description: str, rows: list[dict], inputs: str, tags, extra: str = ""):
    write_model_card(
        tmp,
        model_name=dst.name,
        model_id=str(dst),
        base_model=base_model,
        pipeline_tag="text2text-generation",
        family="hf_tiny_seq2seq (encoder-decoder)",
        auto_class="AutoModelForSeq2SeqLM",
        description=description,
        parity_rows=rows,
        tags=list(tags),
        extra=f"\nParity inputs: {inputs}. The tolerance is the relative tolerance of the dtype times "
        f"max(1, max |official logits|); float32 rows must pass and every row must be finite, or the conversion fails.\n{extra}",
    )


def layer_rules(source_prefix: str, target_prefix: str, modules: dict[str, str], params=("weight", "bias")) -> list:
    """(source, target) rules for every module of a layer template and each of its parameters."""
    return [(f"{source_prefix}.{s}.{p}", f"{target_prefix}.{t}.{p}") for s, t in modules.items() for p in params]
