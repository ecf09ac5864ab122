"""Flash attention: FlashAttention kernels over the real tokens of a batch, found in the mask's declared layout.

Two backends, with attention.py's signature plus `layout`:
- flash_attention ("flash_attention_2"): the flash-attn package (CUDA) when installed; otherwise our Triton kernel on
  CUDA (hf_tiny_flash_attention; with attention dropout, which it lacks, PyTorch's flash kernel) and PyTorch's
  FLASH_ATTENTION SDPA kernel on CPU. Attention sinks, which the flash-attn package lacks, run on our Triton kernel on
  CUDA and as one more key on PyTorch's kernel.
- hf_tiny_flash_attention ("hf_tiny_flash"): our Triton kernel (hf_tiny/flash_triton.py) by name: CUDA, or CPU under
  Triton's interpreter (TRITON_INTERPRET=1). Causal sliding windows and sinks in the kernel, no dropout.

Flash kernels take no mask. They take the tokens they compute packed one sequence after another (varlen:
cu_seqlens), with causality and a sliding window as flags. Which tokens are real, where sequences start and end
(padding, packed rows, chunks) and which window applies is what the step declared in the mask's layout
(masks.MaskLayout); this file derives the packed indices from it once per forward, in the layout's memo, and never
reads a tensor mask. A padded query of causal attention (its own key is padding) is not computed and gives zeros, as
in flash-attn's varlen path and official flash_attention_2. A mask without a layout (a caller's 4-D mask, which may
hold any pattern) or with an additive bias is refused, naming the backends that apply any mask.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from .masks import MaskLayout, causal_bool_mask

FLASH_DTYPES = {"cuda": (torch.float16, torch.bfloat16), "cpu": (torch.float32, torch.float16, torch.bfloat16)}


def flash_attn_package_available(device: Optional[torch.device] = None) -> bool:
    """The flash-attn package (CUDA only) is used when installed and the tensors are on CUDA."""
    if device is not None and device.type != "cuda":
        return False
    return importlib.util.find_spec("flash_attn") is not None


def check_flash_can_run(device: torch.device, dtype: torch.dtype) -> None:
    """Flash kernels exist for CUDA tensors in fp16/bf16 and (PyTorch's) CPU tensors in fp32/fp16/bf16; anything
    else is a clear error, never a fallback."""
    if device.type not in FLASH_DTYPES:
        raise ValueError(
            f"attn_implementation='flash_attention_2' runs on CUDA or CPU tensors, got device '{device}'; "
            "use attn_implementation='sdpa' or 'eager' on this device"
        )
    if dtype not in FLASH_DTYPES[device.type]:
        names = " or ".join(str(t).removeprefix("torch.") for t in FLASH_DTYPES[device.type])
        raise ValueError(
            f"attn_implementation='flash_attention_2' runs in {names} on {device.type}, got dtype {dtype}; cast the "
            "model (model.to(torch.bfloat16)) or use attn_implementation='sdpa' or 'eager'"
        )


def check_triton_can_run(device: torch.device, dtype: torch.dtype) -> None:
    _triton_kernel().check_device_and_dtype(device, dtype)


def _check_call(q, k, v, output_attentions: bool, backend: str) -> None:
    """Flash kernels return no attention weights and take values of the queries' and keys' head_dim only."""
    if output_attentions:
        raise ValueError(
            f"output_attentions=True needs the attention weights, which the {backend!r} backend does not compute; "
            "use attn_implementation='eager'"
        )
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"attn_implementation={backend!r} needs one head_dim for queries, keys and values; got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (MLA's v_head_dim); use "
            "attn_implementation='sdpa' or 'eager'"
        )


def sink_as_first_key(q, k, v, mask, sinks: torch.Tensor, scale: float):
    """Attention sinks for kernels that take none (SDPA, PyTorch's flash kernel): the sink as one more key, first in
    line so that bottom-right causal masks keep it visible, seen by every query, with a zero value. Its score comes
    from extra head dimensions (zeros up to the next multiple of 8, which fast kernels want): in the first of them
    the queries of head h carry sinks[h] / scale and the sink key 1, so its score (q · k_sink) · scale is sinks[h]
    (exactly when scale is a power of two). Returns (q, k, v, mask) for the kernel; the caller drops the extra
    dimensions of the output."""
    batch, heads, sq, dim = q.shape
    extra = 8 - dim % 8
    # finite, so that the real keys' zeros in this dimension give 0 (a sink of -inf times 0 would give NaN)
    sink_scores = (sinks.to(q.dtype) / scale).clamp(min=torch.finfo(q.dtype).min)
    sink_scores = sink_scores[None, :, None, None].expand(batch, heads, sq, 1)
    q = F.pad(torch.cat([q, sink_scores], dim=-1), (0, extra - 1))
    sink_key = F.pad(k.new_ones(1), (dim, extra - 1)).expand(batch, k.shape[1], 1, dim + extra)
    k = torch.cat([sink_key, F.pad(k, (0, extra))], dim=2)
    v = F.pad(v, (0, extra, 1, 0))  # the sink's value (a first row of zeros), and the extra dimensions
    if mask is not None:
        seen = torch.ones((), dtype=torch.bool) if mask.dtype == torch.bool else torch.zeros((), dtype=mask.dtype)
        mask = torch.cat([seen.to(mask.device).expand(*mask.shape[:-1], 1), mask], dim=-1)
    return q, k, v, mask


# ---- the layout: which tokens a flash kernel computes --------------------------------------------------------------


def declared_layout(mask, layout: Optional[MaskLayout], q, k, backend: str) -> Optional[MaskLayout]:
    """The layout of the call (None: no mask, every token computed), checked against q and k; a mask flash cannot
    take is a clear error."""
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(
            f"attn_implementation={backend!r} cannot apply an additive (float) attention mask or position bias; use "
            "attn_implementation='sdpa' or 'eager'"
        )
    if layout is None:
        if mask is not None:
            raise ValueError(
                f"attn_implementation={backend!r} runs the masks whose layout hf_tiny declares (built from a 2-D "
                "attention_mask, position_ids or cu_seq_lens: padding, causal, windows, chunks, packed sequences); this "
                "mask has none (a 4-D attention_mask, which may hold any pattern). Pass the 2-D padding mask, or use "
                "attn_implementation='sdpa' or 'eager'"
            )
        return None
    batch = q.shape[0]
    rows = batch if layout.key_valid is None else layout.key_valid.shape[0]
    if (q.shape[2], k.shape[2], rows) != (layout.query_length, layout.key_length, batch):
        raise ValueError(
            f"the mask's layout describes {layout.query_length} queries over {layout.key_length} keys"
            f"{'' if layout.key_valid is None else f' in {rows} rows'}; got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    return layout


class Varlen(NamedTuple):
    """A layout in the packed form varlen kernels take: q_idx / k_idx are the computed rows of [B * Sq] / [B * Sk]
    (None: every row), q_lens / k_lens the int32 lengths of the sequences in order (one per batch row, or one per
    packed sequence or chunk), max_q / max_k the longest. per_row: one sequence per batch row, query_valid / key_valid
    [B, S] its real tokens (None: all). key_end: the keys attended to are the first key_end (a static cache's empty
    slots cut off). window: the sliding window where it cuts a sequence (None elsewhere). cu_q / cu_k: the int32
    offsets of the sequences (cu_seqlens)."""

    q_idx: Optional[torch.Tensor]
    k_idx: Optional[torch.Tensor]
    q_lens: torch.Tensor
    k_lens: torch.Tensor
    max_q: int
    max_k: int
    causal: bool
    window: Optional[int]
    key_end: int
    per_row: bool
    query_valid: Optional[torch.Tensor] = None
    key_valid: Optional[torch.Tensor] = None
    cu_q: Optional[torch.Tensor] = None
    cu_k: Optional[torch.Tensor] = None

    @property
    def dense(self) -> bool:
        """Every query of every row over every key: the plain kernels, no varlen."""
        return self.per_row and self.q_idx is None and self.k_idx is None


def varlen(layout: MaskLayout, q: torch.Tensor) -> Varlen:
    """The varlen form of the layout, derived once per layout and device (every layer its mask serves reads it)."""
    key = ("varlen", q.shape[0], q.device)
    found = layout.memo.get(key)
    if found is None:
        found = layout.memo[key] = _derive(layout, q.shape[0], q.device)
    return found


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def _derive(layout: MaskLayout, batch: int, device) -> Varlen:
    end = layout.key_length
    if layout.causal and layout.query_offset is not None:  # a static cache: keys after the newest are empty slots
        end = int(layout.query_offset) + layout.query_length
    if layout.segment_ids is not None:
        lengths = _segment_lengths(layout.segment_ids.to(device)).to(torch.int32)
        return _with_window(layout, Varlen(None, None, lengths, lengths, 0, 0, layout.causal, None, end, False))
    key_valid = None if layout.key_valid is None else layout.key_valid[:, :end].to(device)
    query_valid = _query_valid(layout, key_valid, end)
    if layout.chunks is not None:
        return _chunk_segments(layout, key_valid, query_valid, batch, end, device)
    q_lens = torch.full((batch,), layout.query_length, dtype=torch.int32, device=device)
    k_lens = torch.full((batch,), end, dtype=torch.int32, device=device)
    q_idx = k_idx = None
    if query_valid is not None and not bool(query_valid.all()):
        q_lens, q_idx = query_valid.sum(-1, dtype=torch.int32), query_valid.flatten().nonzero().squeeze(-1)
    if key_valid is not None and not bool(key_valid.all()):
        k_lens, k_idx = key_valid.sum(-1, dtype=torch.int32), key_valid.flatten().nonzero().squeeze(-1)
    found = Varlen(q_idx, k_idx, q_lens, k_lens, 0, 0, layout.causal, None, end, True, query_valid, key_valid)
    return _with_window(layout, found)


def _query_valid(layout: MaskLayout, key_valid: Optional[torch.Tensor], end: int) -> Optional[torch.Tensor]:
    """[B, Sq] the queries flash computes: in causal self-attention those whose own key is real; otherwise those of
    rows with a real key (None: every query)."""
    if key_valid is None:
        return None
    if layout.causal:
        return key_valid[:, end - layout.query_length :]
    return key_valid.any(-1, keepdim=True).expand(-1, layout.query_length)


def _with_window(layout: MaskLayout, found: Varlen) -> Varlen:
    """The lengths' maxima, and the window where it cuts a sequence: a causal window counts real tokens (as flash
    kernels do), which equals the mask's count of positions only when each row's real tokens are contiguous."""
    max_q, max_k = int(found.q_lens.max()), int(found.k_lens.max())
    window = layout.window
    if window is not None and layout.causal and max_k <= window:
        window = None  # no row holds more real keys than the window: it cuts nothing
    if window is not None and found.key_valid is not None and layout.causal and not _contiguous(found.key_valid):
        raise ValueError(
            f"a sliding window of {window} over rows whose real tokens are not contiguous (padding between real "
            "tokens) counts positions, which flash kernels cannot: they count real tokens; use "
            "attn_implementation='sdpa' or 'eager'"
        )
    return found._replace(max_q=max_q, max_k=max_k, window=window, cu_q=_offsets(found.q_lens),
                          cu_k=_offsets(found.k_lens))


def _contiguous(valid: torch.Tensor) -> bool:
    """Whether each row's True entries form one run."""
    starts = valid[:, :1].sum(-1) + (valid[:, 1:] & ~valid[:, :-1]).sum(-1)
    return bool((starts <= 1).all())


def _segment_lengths(segment_ids: torch.Tensor) -> torch.Tensor:
    """Lengths of the packed sequences in [B, S] segment ids, in order over the whole batch (a run of equal ids in
    a row is one sequence; row b's come after those of rows < b)."""
    batch, seq = segment_ids.shape
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return torch.diff(F.pad(starts.flatten().nonzero().squeeze(-1), (0, 1), value=batch * seq))


def _chunk_segments(layout: MaskLayout, key_valid, query_valid, batch: int, end: int, device) -> Varlen:
    """Chunked causal attention: every (row, chunk) is a causal sequence of its own, its real queries over its real
    keys (a chunk whose keys are all cached has no query)."""
    size, first, query_positions, key_positions = layout.chunks
    first = first.to(device)
    key_chunk = (key_positions[None, :end].to(device) - first[:, None]).div(size, rounding_mode="floor")
    query_chunk = (query_positions[None, :].to(device) - first[:, None]).div(size, rounding_mode="floor")
    key_chunk, query_chunk = key_chunk.expand(batch, end), query_chunk.expand(batch, -1)
    span = int(key_chunk.max()) - int(key_chunk.min()) + 1
    row = torch.arange(batch, device=device)[:, None] * span - key_chunk.min()
    key_segment, query_segment = key_chunk + row, query_chunk + row  # distinct ids per (row, chunk), in order
    if key_valid is None:
        key_valid = torch.ones(batch, end, dtype=torch.bool, device=device)
    if query_valid is None:
        query_valid = torch.ones(batch, layout.query_length, dtype=torch.bool, device=device)
    segments, k_lens = torch.unique_consecutive(key_segment[key_valid], return_counts=True)
    q_segment = torch.searchsorted(segments, query_segment[query_valid])
    q_lens = torch.bincount(q_segment, minlength=len(segments))
    if len(segments) == 0:  # no real key anywhere: one empty sequence per row, as the padding path gives
        q_lens = k_lens = torch.zeros(batch, dtype=torch.int64, device=device)
    q_idx, k_idx = query_valid.flatten().nonzero().squeeze(-1), key_valid.flatten().nonzero().squeeze(-1)
    found = Varlen(q_idx, k_idx, q_lens.to(torch.int32), k_lens.to(torch.int32), 0, 0, layout.causal, None, end, False)
    return _with_window(layout, found)


def _refuse_window(found: Varlen, backend: str, device: torch.device, *, in_kernel: bool) -> None:
    """Causal sliding windows run in our Triton kernel (in_kernel); no flash kernel here runs a bidirectional one."""
    if found.window is None or (in_kernel and found.causal):
        return
    if not found.causal:
        raise ValueError(
            f"attn_implementation={backend!r}: no flash kernel here applies a bidirectional sliding window "
            f"(ModernBERT's local attention, {found.window} keys either side); use attn_implementation='sdpa' or 'eager'"
        )
    raise ValueError(
        f"attn_implementation={backend!r} supports padding and causal masks only on {device.type} without our Triton "
        f"kernel (PyTorch's flash kernel, the flash-attn package); this layer's sliding window of {found.window} needs "
        "attn_implementation='sdpa' or 'eager', or 'hf_tiny_flash' (our Triton kernel, which applies windows)"
    )


def _filled_keys(k: torch.Tensor, v: torch.Tensor, found: Varlen):
    """The keys and values attended to: a static cache's empty slots cut off."""
    if found.key_end == k.shape[2]:
        return k, v
    return k[:, :, : found.key_end], v[:, :, : found.key_end]


def _packed(q, k, v, found: Optional[Varlen], attend) -> torch.Tensor:
    """attend(q, k, v) over the packed rows [T, H, D] of the tokens flash computes, scattered back to [B, H, Sq, D]
    (rows not computed are zeros)."""
    batch, heads, sq, dim = q.shape
    packed_q = q.transpose(1, 2).reshape(batch * sq, heads, dim)
    packed_k, packed_v = (t.transpose(1, 2).reshape(batch * k.shape[2], k.shape[1], t.shape[-1]) for t in (k, v))
    if found is not None and found.q_idx is not None:
        packed_q = packed_q.index_select(0, found.q_idx)
    if found is not None and found.k_idx is not None:
        packed_k, packed_v = packed_k.index_select(0, found.k_idx), packed_v.index_select(0, found.k_idx)
    out = attend(packed_q, packed_k, packed_v)
    if found is not None and found.q_idx is not None:
        out = out.new_zeros(batch * sq, heads, out.shape[-1]).index_copy(0, found.q_idx, out)
    return out.view(batch, sq, heads, -1).transpose(1, 2)


# ---- our Triton kernel: one varlen call per layer for padded, packed or chunked batches ---------------------------


def _triton_kernel():
    # `from .flash_triton import ...` (not `from . import flash_triton`): the form transformers follows when it
    # copies a model's code files into a saved folder.
    try:
        from .flash_triton import check_device_and_dtype, check_kernel_can_run, flash_attn_varlen
    except ImportError as error:
        raise ValueError(f"{error}; or use attn_implementation='sdpa'") from None
    return SimpleNamespace(check_device_and_dtype=check_device_and_dtype, check_kernel_can_run=check_kernel_can_run,
                           flash_attn_varlen=flash_attn_varlen)


def _triton_flash(q, k, v, layout: Optional[MaskLayout], *, scale, is_causal, sinks=None, backend: str) -> torch.Tensor:
    """[B, H, S, D] attention through our kernel: the computed rows gathered into the packed layout, one kernel
    call, scattered back (rows not computed are zeros)."""
    kernel = _triton_kernel()
    kernel.check_kernel_can_run(q, k, v)
    if layout is None:  # every row whole
        batch, sq, sk = q.shape[0], q.shape[2], k.shape[2]
        cu_q = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * sq
        cu_k = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * sk
        return _packed(q, k, v, None, lambda pq, pk, pv: kernel.flash_attn_varlen(
            pq, pk, pv, cu_q, cu_k, sq, sk, scale=scale, causal=is_causal, window=None, sinks=sinks))
    found = varlen(layout, q)
    _refuse_window(found, backend, q.device, in_kernel=True)
    k, v = _filled_keys(k, v, found)
    return _packed(q, k, v, found, lambda pq, pk, pv: kernel.flash_attn_varlen(
        pq, pk, pv, found.cu_q, found.cu_k, found.max_q, found.max_k, scale=scale, causal=found.causal,
        window=found.window, sinks=sinks))


def hf_tiny_flash_attention(q, k, v, mask=None, *, scale: float, dropout_p: float = 0.0, is_causal: bool = False,
                            output_attentions: bool = False, layout: Optional[MaskLayout] = None,
                            sinks=None) -> tuple[torch.Tensor, None]:
    """hf_tiny's own FlashAttention kernel in Triton (hf_tiny/flash_triton.py): padded, packed and chunked batches in
    one varlen call, GQA without repeated K/V, causal and sliding-window masks, attention sinks, fp16/bf16/fp32. Runs
    on CUDA, and on CPU under Triton's interpreter (TRITON_INTERPRET=1)."""
    _check_call(q, k, v, output_attentions, "hf_tiny_flash")
    if dropout_p > 0:
        raise ValueError(
            f"attn_implementation='hf_tiny_flash' has no attention dropout, got dropout_p={dropout_p}; set the config's "
            "attention dropout to 0, call model.eval(), or use attn_implementation='sdpa'"
        )
    layout = declared_layout(mask, layout, q, k, "hf_tiny_flash")
    return _triton_flash(q, k, v, layout, scale=scale, is_causal=is_causal, sinks=sinks, backend="hf_tiny_flash"), None


# ---- flash_attention_2: the flash-attn package, our Triton kernel, or PyTorch's flash kernel ----------------------


def flash_attention(q, k, v, mask=None, *, scale: float, dropout_p: float = 0.0, is_causal: bool = False,
                    output_attentions: bool = False, layout: Optional[MaskLayout] = None,
                    sinks=None) -> tuple[torch.Tensor, None]:
    """FlashAttention: the flash-attn package (CUDA, varlen for padded, packed and chunked batches) when installed;
    otherwise on CUDA our Triton kernel (one varlen call; with attention dropout, which it lacks, PyTorch's flash
    kernel one sequence at a time), and on CPU PyTorch's FLASH_ATTENTION SDPA kernel (one sequence at a time for
    padded, packed and chunked batches). Attention sinks, which the flash-attn package lacks, run on our Triton kernel
    on CUDA."""
    _check_call(q, k, v, output_attentions, "flash_attention_2")
    check_flash_can_run(q.device, q.dtype)
    layout = declared_layout(mask, layout, q, k, "flash_attention_2")
    package = flash_attn_package_available(q.device)
    if q.device.type == "cuda" and (not package or sinks is not None) and dropout_p == 0.0:
        out = _triton_flash(q, k, v, layout, scale=scale, is_causal=is_causal, sinks=sinks, backend="flash_attention_2")
        return out, None
    if sinks is not None and (package or q.device.type == "cuda"):
        raise ValueError(
            f"attn_implementation='flash_attention_2' cannot combine attention sinks with attention dropout "
            f"(dropout_p={dropout_p}) on {q.device.type}: the flash-attn package has no sinks and hf_tiny's Triton kernel "
            "no dropout; call model.eval() or use attn_implementation='sdpa' or 'eager'"
        )
    kernels = _PackageKernels(scale, dropout_p) if package else _TorchKernels(scale, dropout_p, sinks)
    if layout is None:
        return kernels.dense(q, k, v, is_causal), None
    found = varlen(layout, q)
    _refuse_window(found, "flash_attention_2", q.device, in_kernel=False)
    k, v = _filled_keys(k, v, found)
    if found.dense:
        return kernels.dense(q, k, v, found.causal), None
    return kernels.varlen(q, k, v, found, layout), None


class _PackageKernels(NamedTuple):
    """The flash-attn package: [B, S, H, D] tensors, causal masks aligned bottom-right as ours."""

    scale: float
    dropout_p: float

    def dense(self, q, k, v, causal: bool) -> torch.Tensor:
        flash_attn_func = _flash_attn_functions()[0]
        q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))
        return flash_attn_func(q_, k_, v_, dropout_p=self.dropout_p, softmax_scale=self.scale, causal=causal).transpose(1, 2)

    def varlen(self, q, k, v, found: Varlen, layout: MaskLayout) -> torch.Tensor:
        flash_attn_varlen_func = _flash_attn_functions()[1]
        return _packed(q, k, v, found, lambda pq, pk, pv: flash_attn_varlen_func(
            pq, pk, pv, cu_seqlens_q=found.cu_q, cu_seqlens_k=found.cu_k, max_seqlen_q=found.max_q,
            max_seqlen_k=found.max_k, dropout_p=self.dropout_p, softmax_scale=self.scale, causal=found.causal))


def _flash_attn_functions():
    """(flash_attn_func, flash_attn_varlen_func) of the flash-attn package."""
    # Inside try: so that transformers' remote-code import check (which skips try blocks) does not demand the
    # optional flash-attn package from every machine that downloads a pushed model.
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except ImportError as error:
        raise ImportError(f"the flash-attn package is installed but cannot be imported: {error}") from error
    return flash_attn_func, flash_attn_varlen_func


class _TorchKernels(NamedTuple):
    """PyTorch's flash kernel (SDPA's FLASH_ATTENTION backend), which takes no varlen: one sequence at a time."""

    scale: float
    dropout_p: float
    sinks: Optional[torch.Tensor]

    def dense(self, q, k, v, causal: bool) -> torch.Tensor:
        return _flash_sdpa(q, k, v, scale=self.scale, dropout_p=self.dropout_p, is_causal=causal, sinks=self.sinks)

    def varlen(self, q, k, v, found: Varlen, layout: MaskLayout) -> torch.Tensor:
        if found.per_row:  # padding: each row's real queries over its real keys
            out = q.new_zeros(q.shape)
            for b, (qi, ki) in enumerate(_row_indices(layout, found)):
                if qi.numel() and ki.numel():
                    out[b : b + 1, :, qi] = self.dense(q[b : b + 1, :, qi], k[b : b + 1, :, ki], v[b : b + 1, :, ki],
                                                       found.causal)
            return out
        return _packed(q, k, v, found, lambda pq, pk, pv: self._segments(pq, pk, pv, found))

    def _segments(self, q_, k_, v_, found: Varlen) -> torch.Tensor:
        """Packed rows [T, H, D], sequence s being q_lens[s] queries over k_lens[s] keys, one at a time."""
        outputs = [q_.new_zeros(0, *q_.shape[1:])]
        pieces = (t.split(n.tolist()) for t, n in ((q_, found.q_lens), (k_, found.k_lens), (v_, found.k_lens)))
        for part_q, part_k, part_v in zip(*pieces):
            if part_q.shape[0]:  # a sequence of cached keys only has no query to compute
                part = self.dense(*(t.transpose(0, 1)[None] for t in (part_q, part_k, part_v)), found.causal)
                outputs.append(part[0].transpose(0, 1))
        return torch.cat(outputs)


def _row_indices(layout: MaskLayout, found: Varlen) -> list:
    """[(query indices, key indices)] of each row's real tokens, found once per layout."""
    key = ("rows", found.query_valid.shape[0], found.query_valid.device)
    rows = layout.memo.get(key)
    if rows is None:
        rows = [(qv.nonzero().squeeze(-1), kv.nonzero().squeeze(-1)) for qv, kv in zip(found.query_valid, found.key_valid)]
        layout.memo[key] = rows
    return rows


def _flash_sdpa(q, k, v, *, scale, dropout_p, is_causal, sinks=None) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    value_dim = v.shape[-1]
    if sinks is not None:  # the sink key comes first: the bottom-right causal mask below keeps it visible
        q, k, v, _ = sink_as_first_key(q, k, v, None, sinks, scale)
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    if is_causal and q.shape[2] == 1:
        is_causal = False
    mask = None
    if is_causal and q.shape[2] != k.shape[2] and q.device.type == "cpu":
        # PyTorch's CPU flash kernel takes a mask (its CUDA one does not): the bottom-right causal chunk, explicitly.
        mask, is_causal = causal_bool_mask(q.shape[2], k.shape[2], q.device), False
    if is_causal and q.shape[2] != k.shape[2]:
        raise ValueError(
            "attn_implementation='flash_attention_2' without the flash-attn package cannot run a causal step with "
            f"{q.shape[2]} new queries over {k.shape[2]} keys; install flash-attn or use 'sdpa'"
        )
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                                 scale=scale)
        return out if sinks is None else out[..., :value_dim]
    except RuntimeError as error:
        if "No available kernel" not in str(error):
            raise
        raise ValueError(
            f"attn_implementation='flash_attention_2': PyTorch's flash kernel cannot run q {tuple(q.shape)} "
            f"{q.dtype} on this GPU (head_dim or GPU unsupported, see the warnings above); install flash-attn or "
            "use attn_implementation='sdpa' or 'eager'"
        ) from None
