"""MXFP4 weights (OCP Microscaling Formats v1.0, the format GPT-OSS's experts are published in) to floats.

A conversion transform, independent of hf_tiny (torch only): nothing in the models imports it. MXFP4 stores blocks
of 32 values that share one scale: each value is a 4-bit FP4 E2M1 code (sign, 2 exponent bits, 1 mantissa bit:
0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), two codes per byte with the low nibble first, and the block's
scale is an E8M0 byte, the power of two 2^(byte - 127). Every value of the result is exact in bfloat16 and float32.

In a GPT-OSS checkpoint (model.layers.{i}.mlp.experts.*), per layer:
    gate_up_proj_blocks  uint8 [E, 2 * I, H / 32, 16]   gate_up_proj_scales  uint8 [E, 2 * I, H / 32]
    down_proj_blocks     uint8 [E, H, I / 32, 16]       down_proj_scales     uint8 [E, H, I / 32]
(the biases gate_up_proj_bias [E, 2 * I] and down_proj_bias [E, H] are stored in bfloat16). dequantize_mxfp4 gives
[E, 2 * I, H] and [E, H, I]: each expert's weights as [out_features, in_features], nn.Linear's layout; the rows of
gate_up alternate gate, up (gate = rows 0::2, up = rows 1::2). transformers' GptOssExperts holds the transpose.
"""

from __future__ import annotations

import torch

FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
VALUES_PER_BLOCK = 32
E8M0_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16,
                     blocks_per_chunk: int = 1 << 20) -> torch.Tensor:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] -> [..., G * 32] in `dtype`: value 2j of a block is
    FP4(low nibble of byte j) * 2^(scale - 127), value 2j + 1 the high nibble's. blocks_per_chunk bounds the
    temporary index tensors (a GPT-OSS-120B layer holds 66 million blocks)."""
    _check_mxfp4(blocks, scales, dtype)
    *prefix, groups, packed = blocks.shape
    rows = blocks.reshape(-1, packed)
    exponents = scales.reshape(-1, 1).to(torch.int32) - E8M0_BIAS
    table = torch.tensor(FP4_E2M1_VALUES, dtype=dtype, device=blocks.device)
    out = torch.empty(rows.shape[0], 2 * packed, dtype=dtype, device=blocks.device)
    for start in range(0, rows.shape[0], blocks_per_chunk):
        chunk = slice(start, start + blocks_per_chunk)
        part = out[chunk]
        part[:, 0::2] = table[(rows[chunk] & 0x0F).long()]
        part[:, 1::2] = table[(rows[chunk] >> 4).long()]
        torch.ldexp(part, exponents[chunk], out=part)
    return out.reshape(*prefix, groups * 2 * packed)


def _check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks and scales are uint8 tensors; got blocks {blocks.dtype}, scales {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != VALUES_PER_BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks must be [..., G, {VALUES_PER_BLOCK // 2}] (32 four-bit values per block) and scales "
            f"[..., G]; got blocks {tuple(blocks.shape)}, scales {tuple(scales.shape)}"
        )
    if not dtype.is_floating_point:
        raise ValueError(f"dequantize_mxfp4: dtype must be a floating-point dtype, got {dtype}")


__all__ = ["dequantize_mxfp4", "FP4_E2M1_VALUES"]
