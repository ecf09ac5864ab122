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
from .writer import VOCABULARY_FILES

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
        length = min(16, _positions_room(config))
        batch = _random_padded(config, [length, max(1, length - 5), max(1, length // 4)], length, side, seed)
        description = f"seeded random token ids, {side}-padded batch of lengths {batch['attention_mask'].sum(-1).tolist()}"
    if modality == "causal":
        batch["position_ids"] = (batch["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
    return ParityBatch(batch, batch["attention_mask"].bool(), description)


def _positions_room(config) -> int:
    """How many tokens a sequence may hold: max_position_embeddings, less RoBERTa-style positions' offset (they
    start after the padding row of the position table)."""
    offset = config.pad_token_id + 1 if getattr(config, "positions_from_padding", False) else 0
    return config.max_position_embeddings - offset


def _tokenized(folder: Path, side: str, config) -> dict | None:
    if not any((folder / name).is_file() for name in VOCABULARY_FILES):
        return None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)  # never a prompt mid-run
        tokenizer.padding_side = side
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        batch = tokenizer(list(SAMPLE_TEXTS), padding=True, return_tensors="pt")
    except Exception:  # an unusable tokenizer: seeded random ids are as good a parity input
        return None
    if int(batch["input_ids"].max()) >= config.vocab_size or batch["input_ids"].shape[1] > _positions_room(config):
        return None  # ids or a length the model cannot take (a tiny model's learned position table)
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
    pad = config.pad_token_id if config.pad_token_id is not None and config.pad_token_id >= 0 else 0  # -1: old LLaMA
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


def _moved(inputs: Mapping, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


@dataclass
class ParityResult:
    rows: list[dict]  # one per (device, dtype, backend) run: the model card's parity table
    layers: dict[str, dict[str, float]]  # {"cpu float32 sdpa": {"model.layers.0": max |diff|, ...}, ...}


def in_memory(model):
    """A runner over a model already in memory: run(inputs, device, dtype, backend) -> (output, layer outputs)."""
    from .streamed import return_dict_kwargs, recording_layers

    model.eval()

    def run(inputs, device: str, dtype: torch.dtype, backend: str):
        model.to(device=device, dtype=dtype)
        model.set_attn_implementation(backend)
        with torch.no_grad(), recording_layers(model) as layers:
            output = model(**_moved(inputs, device), **return_dict_kwargs(model))
        return output, layers

    run.restore = lambda stored: model.to(device="cpu", dtype=stored)
    return run


def measure(official, ours, batch: ParityBatch, dtype: torch.dtype, *,
            backends: Sequence[str] = ("eager", "sdpa", "flash_attention_2"), alongside=None,
            progress=None) -> ParityResult:
    """max |ours - official| per (device, dtype, backend) of parity_plans(dtype) whose backend is in `backends`,
    and per layer. official / ours: runners (in_memory, or streamed.streamed_runner). The reference is official in
    float32 with eager attention, once per device. A backend this machine cannot run off the CPU (e.g. flash on
    an old GPU) is reported on stderr and skipped. Two streamed runners run each device's runs side by side
    (streamed.run_in_lockstep: every layer's weights read from the disk once for all of them); runners over
    models in memory run one after the other. alongside(gate): a job run in lockstep with the first device's runs
    (the folder's writer, whose tensors ours reads as they are written), or before them; its failure is raised
    first. progress (a tqdm bar): advanced layer by layer in lockstep."""
    rows, layers, skipped = [], {}, []
    # Full-precision rows first: moving an in-memory model to a half dtype rounds its float buffers too (RoPE's
    # inv_freq), and a later .to(float32) does not undo that (measured on an H100: fp32 CUDA rows 0.0055 off).
    plans = [plan for plan in sorted(parity_plans(dtype), key=lambda plan: plan[1] in (torch.float16, torch.bfloat16))
             if plan[2] in backends]
    streams = hasattr(official, "prepare") and hasattr(ours, "prepare")
    for (device, run_dtype, backend), (output, reference_layers), result in (
            _in_lockstep(official, ours, batch.inputs, plans, alongside, progress) if streams
            else _in_order(official, ours, batch.inputs, plans, alongside)):
        reference = compared_outputs(output, batch.real_tokens)
        scale = max(1.0, max(float(t.abs().max()) for t in reference if t.numel()))
        if isinstance(result, BaseException):
            if device == "cpu" or not isinstance(result, ValueError):
                raise result
            skipped.append(f"{backend} {str(run_dtype).removeprefix('torch.')} on {device}: {result}")
            continue
        produced = compared_outputs(result[0], batch.real_tokens)
        diff = max(max_abs_diff(a, b) for a, b in zip(produced, reference, strict=True))
        rows.append(parity_row(backend, run_dtype, device, diff, scale))
        run_name = f"{device} {str(run_dtype).removeprefix('torch.')} {backend}"
        layers[run_name] = layer_differences(reference_layers, result[1], batch.real_tokens)
    for runner in (official, ours):
        if hasattr(runner, "restore"):
            runner.restore(torch.float32 if runner is official else dtype)
    if skipped:
        print("parity rows not measured: " + "; ".join(skipped), file=sys.stderr)
    return ParityResult(rows, layers)


def _in_order(official, ours, inputs, plans, alongside=None):
    """(plan, reference (output, layers), ours' (output, layers) or the exception it raised), one run at a time
    after alongside(None); the reference once per device."""
    if alongside is not None:
        alongside(None)
    reference_device, reference = None, None
    for device, run_dtype, backend in plans:
        if device != reference_device:
            reference, reference_device = official(inputs, device, torch.float32, "eager"), device
        try:
            result = ours(inputs, device, run_dtype, backend)
        except ValueError as error:
            result = error
        yield (device, run_dtype, backend), reference, result


def _raising(error: BaseException):
    def job(_gate):
        raise error

    return job


def _in_lockstep(official, ours, inputs, plans, alongside=None, progress=None):
    """As _in_order, each device's reference and runs side by side (the first device's with alongside)."""
    from .streamed import run_in_lockstep

    for device in dict.fromkeys(plan[0] for plan in plans):
        group = [plan for plan in plans if plan[0] == device]
        jobs = [official.prepare(inputs, device, torch.float32, "eager")]
        for plan in group:
            try:
                jobs.append(ours.prepare(inputs, *plan))
            except ValueError as error:  # a backend this device cannot run
                jobs.append(_raising(error))
        if progress is not None:
            progress.reset()
            progress.set_description(f"parity on {device}, layer by layer")
        reference, *results = run_in_lockstep(jobs + ([] if alongside is None else [alongside]), progress)
        if alongside is not None:
            written, alongside = results.pop(), None
            if isinstance(written, BaseException):
                raise written
        if isinstance(reference, BaseException):
            raise reference
        for plan, result in zip(group, results):
            yield plan, reference, result


def layer_differences(official: Mapping[str, torch.Tensor], ours: Mapping[str, torch.Tensor],
                      real_tokens: torch.Tensor | None) -> dict[str, float]:
    """max |ours - official| of each layer's output, paired by position (the n-th layer of each stack), at real
    tokens where the output is per token; {} when the two models' stacks differ in number or shape."""
    if len(official) != len(ours):
        return {}
    result = {}
    for (name, theirs), mine in zip(official.items(), ours.values()):
        if theirs.shape != mine.shape:
            return {}
        if real_tokens is not None and tuple(theirs.shape[:2]) == tuple(real_tokens.shape):
            theirs, mine = theirs[real_tokens], mine[real_tokens]
        result[name] = max_abs_diff(theirs, mine)
    return result


def measure_parity(official, ours, batch: ParityBatch, dtype: torch.dtype, *,
                   backends: Sequence[str] = ("eager", "sdpa", "flash_attention_2")) -> list[dict]:
    """measure() of two models in memory: the rows only."""
    return measure(in_memory(official), in_memory(ours), batch, dtype, backends=backends).rows


def layer_table(layers: Mapping[str, Mapping[str, float]]) -> str:
    """Markdown: each layer's max |ours - official| per run (columns), where a mismatch would start."""
    runs = [run for run, values in layers.items() if values]
    if not runs:
        return ""
    names = list(layers[runs[0]])
    lines = ["| layer | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    for name in names:
        cells = [_number(layers[run].get(name)) for run in runs]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _number(value) -> str:
    if value is None:
        return "-"
    return "0" if value == 0 else f"{value:.3g}"
