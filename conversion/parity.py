"""Parity at conversion time: one padded batch per modality, one measurement loop, one verdict.

The official model (float32, eager attention: the plain math) is the reference on every device; the converted
model runs each (device, dtype, backend) of parity_plans. Per-token outputs are compared at real tokens only.
tolerance = RELATIVE_TOLERANCE[dtype] * max(1, max |official output|).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ConversionError

def first_non_finite(state_dict: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first floating tensor holding NaN or inf, or None."""
    for key, value in state_dict.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return key
    return None


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| as a Python float, computed in float64 on the CPU (NaN if either side has a NaN)."""
    if a.shape != b.shape:
        raise ValueError(f"max_abs_diff needs equal shapes, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    diff = (a.detach().to("cpu", torch.float64) - b.detach().to("cpu", torch.float64)).abs()
    if torch.isnan(diff).any():
        return math.nan
    return float(diff.max())


# Parity measured at conversion time: tolerance = RELATIVE_TOLERANCE[dtype] * max(1, max |official output|).
RELATIVE_TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def parity_plans(dtype: torch.dtype) -> list[tuple[str, torch.dtype, str]]:
    """(device, dtype, backend) runs to measure: CPU eager/sdpa in `dtype`; with CUDA also fp32 eager/sdpa and
    bf16 eager/sdpa/flash."""
    plans = [("cpu", dtype, backend) for backend in ("eager", "sdpa")]
    if torch.cuda.is_available():
        plans += [("cuda", torch.float32, b) for b in ("eager", "sdpa")]
        plans += [("cuda", torch.bfloat16, b) for b in ("eager", "sdpa", "flash_attention_2")]
    return plans


def parity_row(backend: str, dtype: torch.dtype, device: str, diff: float, scale: float) -> dict:
    """One model-card parity row; scale is max(1, max |official output|)."""
    return {
        "backend": backend,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "max_abs_diff": diff,
        "tolerance": RELATIVE_TOLERANCE[dtype] * scale,
    }


def fail_on_parity(
    rows: Iterable[dict], what: str, state_dict: Mapping[str, torch.Tensor] | None = None
) -> None:
    """Raises naming every failed row: a float32 / float64 row above its tolerance, or a row of any dtype whose
    difference is NaN or inf (a lossy cast that makes the outputs non-finite must not pass). bfloat16 / float16
    rows above their (loose) tolerance are reported on the model card, not failed: rounding to 8 or 11 bits of
    mantissa is the user's choice. state_dict (the converted tensors), when given, lets the message name the
    first non-finite tensor."""
    failed = [
        r for r in rows
        if not math.isfinite(r["max_abs_diff"])
        or (r["dtype"] in ("float32", "float64") and not r["max_abs_diff"] <= r["tolerance"])
    ]
    if failed:
        detail = ", ".join(
            f"{r['backend']} on {r['device']} ({r['dtype']}): {r['max_abs_diff']:.3g} > {r['tolerance']:.3g}"
            for r in failed
        )
        message = f"converted model does not match the official {what}: {detail}"
        if any(not math.isfinite(r["max_abs_diff"]) for r in failed):
            bad = first_non_finite(state_dict) if state_dict is not None else None
            message += "; the outputs are not finite" + (
                f" (first non-finite tensor: {bad})" if bad is not None else " (every converted tensor is finite)"
                if state_dict is not None else ""
            )
        raise ConversionError(message)


# ----------------------------------------------------------------------------------------------------------------
# Inputs: one padded batch per modality
# ----------------------------------------------------------------------------------------------------------------

SAMPLE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):",
    "Hi",
    "A converted checkpoint holds the same numbers under different names, so both models must agree.",
)
# Without one of these, AutoTokenizer may build an empty tokenizer that maps every word to one id.
VOCABULARY_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
MODALITIES = ("encoder", "causal", "seq2seq")


@dataclass
class ParityBatch:
    inputs: dict[str, torch.Tensor]
    real_tokens: torch.Tensor | None  # [batch, seq] bool: where per-token outputs are compared (None: everywhere)
    description: str


def parity_batch(modality: str, config, tokenizer_folder: Path | None = None, *, seed: int = 0) -> ParityBatch:
    """The batch parity is measured on: SAMPLE_TEXTS through the folder's tokenizer when it has a usable one
    (encoder: right-padded; causal: left-padded with position ids counted over real tokens, as generate() does),
    else seeded random ids padded to lengths L, L-5, L/4. seq2seq: random encoder ids padded to L, L-4, L/2 and
    6 decoder tokens starting with decoder_start_token_id."""
    if modality not in MODALITIES:
        raise ValueError(f"modality must be one of {', '.join(MODALITIES)}, got {modality!r}")
    if modality == "seq2seq":
        return _seq2seq_batch(config, seed)
    side = "left" if modality == "causal" else "right"
    batch = _tokenized(tokenizer_folder, side, config) if tokenizer_folder is not None else None
    if batch is not None:
        description = f"{len(SAMPLE_TEXTS)} texts of different lengths through the tokenizer, {side}-padded"
    else:
        # RoBERTa-style positions start after the padding row of the position table
        offset = config.pad_token_id + 1 if getattr(config, "positions_from_padding", False) else 0
        length = min(16, config.max_position_embeddings - offset)
        batch = _random_padded(config, [length, max(1, length - 5), max(1, length // 4)], length, side, seed)
        description = f"seeded random token ids, {side}-padded batch of lengths {batch['attention_mask'].sum(-1).tolist()}"
    if modality == "causal":
        batch["position_ids"] = (batch["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
    return ParityBatch(batch, batch["attention_mask"].bool(), description)


def _tokenized(folder: Path, side: str, config) -> dict | None:
    if not any((folder / name).is_file() for name in VOCABULARY_FILES):
        return None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        tokenizer.padding_side = side
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        batch = tokenizer(list(SAMPLE_TEXTS), padding=True, return_tensors="pt")
    except Exception:  # an unusable tokenizer: seeded random ids are as good a parity input
        return None
    if int(batch["input_ids"].max()) >= config.vocab_size:
        return None
    keep = ("input_ids", "attention_mask", "token_type_ids") if side == "right" else ("input_ids", "attention_mask")
    return {k: v for k, v in batch.items() if k in keep}


def _random_padded(config, lengths: list[int], length: int, side: str, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (len(lengths), length), generator=generator)
    attention_mask = torch.zeros_like(input_ids)
    for row, real in enumerate(lengths):
        attention_mask[row, :real] = 1
    if side == "left":
        attention_mask = attention_mask.flip(-1)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    batch = {"input_ids": input_ids.masked_fill(attention_mask == 0, pad), "attention_mask": attention_mask}
    if side == "right" and getattr(config, "type_vocab_size", 0):
        batch["token_type_ids"] = torch.randint(0, config.type_vocab_size, input_ids.shape, generator=generator)
    return batch


def _seq2seq_batch(config, seed: int) -> ParityBatch:
    relative = config.position_embedding_type == "relative"  # no position table limits the length
    length = 12 if relative else min(12, config.max_position_embeddings)
    batch = _random_padded(config, [length, max(1, length - 4), max(1, length // 2)], length, "right", seed)
    batch.pop("token_type_ids", None)
    generator = torch.Generator().manual_seed(seed + 1)
    decoder_length = 6 if relative else min(6, config.max_position_embeddings)
    decoder_input_ids = torch.randint(0, config.vocab_size, (batch["input_ids"].shape[0], decoder_length), generator=generator)
    start = config.decoder_start_token_id if config.decoder_start_token_id is not None else config.pad_token_id or 0
    decoder_input_ids[:, 0] = start
    batch.update(decoder_input_ids=decoder_input_ids, use_cache=False)
    lengths = batch["attention_mask"].sum(-1).tolist()
    description = (
        f"seeded random token ids, encoder batch padded to lengths {lengths}, {decoder_length} decoder tokens "
        "starting with decoder_start_token_id"
    )
    return ParityBatch(batch, None, description)


# ----------------------------------------------------------------------------------------------------------------
# The measurement
# ----------------------------------------------------------------------------------------------------------------

# Output fields compared, in this order, where the output has them.
COMPARED_FIELDS = (
    "last_hidden_state", "pooler_output", "logits", "start_logits", "end_logits", "prediction_logits",
    "seq_relationship_logits",
)


# official output fields hf_tiny names after BERT (ALBERT's sentence-order logits are BERT's next-sentence logits)
FIELD_ALIASES = {"seq_relationship_logits": "sop_logits"}


def compared_outputs(output, real_tokens: torch.Tensor | None) -> list[torch.Tensor]:
    """The outputs parity is measured on, in float32; per-token ones ([batch, seq, ...]) at real tokens only."""
    tensors = []
    for field in COMPARED_FIELDS:
        value = getattr(output, field, None)
        if value is None and field in FIELD_ALIASES:
            value = getattr(output, FIELD_ALIASES[field], None)
        if value is None:
            continue
        if real_tokens is not None and value.dim() >= 2 and tuple(value.shape[:2]) == tuple(real_tokens.shape):
            value = value[real_tokens.to(value.device)]
        tensors.append(value.float())
    if not tensors:
        raise ConversionError(f"the model output {type(output).__name__} has none of the compared fields {COMPARED_FIELDS}")
    return tensors


def _run(model, inputs: Mapping, device: str):
    with torch.no_grad():
        return model(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})


def measure_parity(
    official, ours, batch: ParityBatch, dtype: torch.dtype, *, backends: Sequence[str] = ("eager", "sdpa", "flash_attention_2")
) -> list[dict]:
    """max |ours - official| per (device, dtype, backend) of parity_plans(dtype) whose backend is in `backends`.
    A backend this machine cannot run off the CPU (e.g. flash on an old GPU) is reported on stderr and skipped."""
    official.eval()
    ours.eval()
    rows, skipped, reference_device, reference, scale = [], [], None, None, 1.0
    # Full-precision rows first: moving `ours` to a half dtype rounds its float buffers too (RoPE's inv_freq), and
    # a later .to(float32) does not undo that (measured on an H100: a bf16 CPU row, then fp32 CUDA rows 0.0055 off).
    plans = sorted(parity_plans(dtype), key=lambda plan: plan[1] in (torch.float16, torch.bfloat16))
    for device, run_dtype, backend in plans:
        if backend not in backends:
            continue
        if device != reference_device:
            official.to(device=device, dtype=torch.float32)
            official.set_attn_implementation("eager")
            reference = compared_outputs(_run(official, batch.inputs, device), batch.real_tokens)
            scale = max(1.0, max(float(t.abs().max()) for t in reference if t.numel()))
            reference_device = device
        ours.to(device=device, dtype=run_dtype)
        try:
            ours.set_attn_implementation(backend)
            produced = compared_outputs(_run(ours, batch.inputs, device), batch.real_tokens)
        except ValueError as error:
            if device == "cpu":
                raise
            skipped.append(f"{backend} {str(run_dtype).removeprefix('torch.')} on {device}: {error}")
            continue
        diff = max(max_abs_diff(a, b) for a, b in zip(produced, reference, strict=True))
        rows.append(parity_row(backend, run_dtype, device, diff, scale))
    official.to("cpu")
    ours.to(device="cpu", dtype=dtype)
    if skipped:
        print("parity rows not measured: " + "; ".join(skipped), file=sys.stderr)
    return rows
