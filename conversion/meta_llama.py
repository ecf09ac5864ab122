"""Meta's original Llama layout: consolidated.*.pth (one per model-parallel shard) + params.json.

Meta's q/k rows interleave the two halves of each rotary pair; transformers' Llama expects them split into halves
(rotate_half), hence the RoPE permutation (the `permute` of transformers' convert_llama_weights_to_hf.py) and its
inverse. The model-parallel shards are read lazily and merged one tensor at a time, as it is asked for.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from .errors import ConversionError
from .keymap import KeyMap, Rule, Transform
from .pipeline import Plan, Source
from .lazy import LazyTensors, TensorInfo
from .readers import open_checkpoint

# Meta layout: tensors split across model-parallel shards along this dimension (None = replicated).
META_SHARD_DIMS = {
    "attention.wq.weight": 0,
    "attention.wk.weight": 0,
    "attention.wv.weight": 0,
    "attention.wo.weight": 1,
    "feed_forward.w1.weight": 0,
    "feed_forward.w2.weight": 1,
    "feed_forward.w3.weight": 0,
    "attention_norm.weight": None,
    "ffn_norm.weight": None,
    "norm.weight": None,
    "output.weight": 0,
}


META_IGNORED = (r"rope\.freqs",)


# Meta's params.json has no context length; these are the lengths transformers' converter assigns.
META_CONTEXT_LENGTH = {"llama3.1": 131072, "llama3": 8192, "codellama": 16384, "llama2": 4096}


def rope_permutation(num_heads: int) -> Transform:
    """Meta's q/k row order (rotary pairs interleaved) <-> Llama's (pairs split into halves), per head."""

    def to_halves(weight: torch.Tensor) -> torch.Tensor:
        rows, cols = weight.shape
        return weight.view(num_heads, rows // num_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)

    def to_interleaved(weight: torch.Tensor) -> torch.Tensor:
        rows, cols = weight.shape
        return weight.view(num_heads, 2, rows // num_heads // 2, cols).transpose(1, 2).reshape(rows, cols)

    return Transform(f"rope_permutation({num_heads} heads)", to_halves, to_interleaved)


def meta_key_map(config) -> KeyMap:
    """Meta consolidated.*.pth naming <-> hf_tiny TinyCausalForCausalLM."""
    rules = [
        ("tok_embeddings.weight", "model.embed_tokens.weight"),
        ("norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        Rule(
            "layers.{i}.attention.wq.weight",
            "model.layers.{i}.self_attn.q_proj.weight",
            rope_permutation(config.num_attention_heads),
        ),
        Rule(
            "layers.{i}.attention.wk.weight",
            "model.layers.{i}.self_attn.k_proj.weight",
            rope_permutation(config.num_key_value_heads),
        ),
        ("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
        ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
        ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
        ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
        ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
        ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
        ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ]
    return KeyMap(rules, ignore=META_IGNORED)


def meta_config(params: dict, state: LazyTensors, *, src):
    """TinyCausalConfig of a Meta checkpoint: params.json for the architecture, the tensors for the sizes."""
    from hf_tiny import TinyCausalConfig

    params = params.get("model", params)
    for field in ("dim", "n_layers", "n_heads", "norm_eps"):
        if field not in params:
            raise ConversionError(f"{src}/params.json lacks the field {field!r}; it has {sorted(params)}")
    for key in ("tok_embeddings.weight", "layers.0.feed_forward.w1.weight"):
        if key not in state:
            raise ConversionError(f"{src}: consolidated checkpoint lacks the tensor {key!r}")
    vocab_size = state.info("tok_embeddings.weight").shape[0]
    theta = float(params.get("rope_theta", 10000.0))
    if params.get("use_scaled_rope"):
        # Llama 3.1's apply_scaling(): low/high frequency factors 1 and 4 around an 8192-token original context.
        rope = {
            "rope_type": "llama3",
            "rope_theta": theta,
            "factor": float(params.get("rope_scaling_factor", 8.0)),
            "low_freq_factor": 1.0,
            "high_freq_factor": float(params.get("high_freq_factor", 4.0)),
            "original_max_position_embeddings": 8192,
        }
        version = "llama3.1"
    else:
        rope = {"rope_type": "default", "rope_theta": theta}
        version = "llama3" if vocab_size >= 128000 else ("codellama" if theta > 10000.0 else "llama2")
    max_positions = params.get("max_seq_len") or META_CONTEXT_LENGTH[version]
    bos, eos = (128000, 128001) if vocab_size >= 128000 else (1, 2)
    try:
        return TinyCausalConfig(
            vocab_size=vocab_size,
            hidden_size=params["dim"],
            intermediate_size=state.info("layers.0.feed_forward.w1.weight").shape[0],
            num_hidden_layers=params["n_layers"],
            num_attention_heads=params["n_heads"],
            num_key_value_heads=params.get("n_kv_heads") or params["n_heads"],
            max_position_embeddings=max_positions,
            rms_norm_eps=params["norm_eps"],
            rope_parameters=rope,
            tie_word_embeddings=False,
            bos_token_id=bos if bos < vocab_size else None,
            eos_token_id=eos if eos < vocab_size else None,
        )
    except (TypeError, ValueError) as error:
        raise ConversionError(f"{src}/params.json describes no valid model: {error}") from error


def merge_meta_shards(shards: list[LazyTensors], params: dict, *, src) -> LazyTensors:
    """One lazy state from Meta's model-parallel shards (each holds a slice of every split tensor): names and the
    merged shapes are checked now, each tensor is joined from its slices when it is read (a replicated one is
    checked to be equal in every shard then)."""
    if len(shards) == 1:
        return shards[0]
    keys = set(shards[0])
    for number, shard in enumerate(shards[1:], start=1):
        if set(shard) != keys:
            raise ConversionError(
                f"{src}: consolidated.{number:02d}.pth holds different tensor names than consolidated.00.pth"
            )
    dim = params.get("model", params).get("dim")
    infos, axes = {}, {}
    for key in sorted(keys):
        pieces = [shard.info(key) for shard in shards]
        axes[key] = _split_axis(key, pieces, dim, src)
        infos[key] = _merged_info(pieces, axes[key], key, src)

    def read(key: str) -> torch.Tensor:
        if axes[key] is None:
            first = shards[0][key]
            for number, shard in enumerate(shards[1:], start=1):
                if not torch.equal(shard[key], first):
                    raise ConversionError(f"{src}: replicated tensor {key!r} differs between shard 00 and shard {number:02d}")
            return first
        return torch.cat([shard[key] for shard in shards], dim=axes[key])

    return LazyTensors(infos, read)


def _split_axis(key: str, pieces: list[TensorInfo], dim, src) -> int | None:
    """The dimension Meta split `key` along across shards, None for a replicated tensor."""
    suffix = re.sub(r"^layers\.\d+\.", "", key)
    if key == "tok_embeddings.weight":
        _check_shard_ranks(pieces, key, 2, src)
        # Llama 1/2 split the embedding width across shards, Llama 3 the vocabulary.
        return 0 if pieces[0].shape[1] == dim else 1
    if META_SHARD_DIMS.get(suffix) is not None:
        _check_shard_ranks(pieces, key, META_SHARD_DIMS[suffix] + 1, src)
        return META_SHARD_DIMS[suffix]
    return None


def _shapes(pieces: list[TensorInfo]) -> str:
    return ", ".join(f"shard {number:02d}: {tuple(piece.shape)}" for number, piece in enumerate(pieces))


def _check_shard_ranks(pieces: list[TensorInfo], key: str, min_dims: int, src) -> None:
    for number, piece in enumerate(pieces):
        if len(piece.shape) < min_dims:
            raise ConversionError(
                f"{src}: tensor {key!r} in consolidated.{number:02d}.pth is {len(piece.shape)}-D with shape "
                f"{tuple(piece.shape)}; a model-parallel shard of it needs at least {min_dims} dimensions"
            )


def _merged_info(pieces: list[TensorInfo], axis: int | None, key: str, src) -> TensorInfo:
    """The joined tensor's shape and dtype: slices concatenate along axis (every other dimension agrees), a
    replicated tensor has one shape in every shard."""
    if len({piece.dtype for piece in pieces}) != 1:
        raise ConversionError(f"{src}: the shards of tensor {key!r} differ in dtype "
                              f"({', '.join(str(piece.dtype) for piece in pieces)})")
    if axis is None:
        if len({piece.shape for piece in pieces}) != 1:
            raise ConversionError(f"{src}: replicated tensor {key!r} differs in shape between shards ({_shapes(pieces)})")
        return pieces[0]
    others = {tuple(size for number, size in enumerate(piece.shape) if number != axis) for piece in pieces}
    if len({len(piece.shape) for piece in pieces}) != 1 or len(others) != 1:
        raise ConversionError(
            f"{src}: the shards of tensor {key!r} do not concatenate along dimension {axis} ({_shapes(pieces)})"
        )
    shape = list(pieces[0].shape)
    shape[axis] = sum(piece.shape[axis] for piece in pieces)
    return TensorInfo(tuple(shape), pieces[0].dtype)


def _read_params(src: Path) -> dict:
    params_path = src / "params.json"
    try:
        params = json.loads(params_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConversionError(f"cannot read {params_path}: {error}") from error
    if not isinstance(params, dict):
        raise ConversionError(f"{params_path} holds a JSON {type(params).__name__}, expected an object")
    return params


def read_meta_source(path: Path) -> Source:
    params = _read_params(path)
    files = sorted(path.glob("consolidated.*.pth"))
    state = merge_meta_shards([open_checkpoint(f) for f in files], params, src=path)
    return Source(path, path, "meta", params, state, f"the Meta consolidated checkpoint ({len(files)} shard(s))")


def meta_official_model(plan: Plan, official_config):
    """The official model holding a Meta checkpoint's weights in the Hugging Face layout (transformers has no
    loader for Meta's layout)."""
    import transformers

    with torch.device("meta"):
        model = getattr(transformers, plan.official_class)(official_config)
    state = plan.key_map.to_target(plan.state, num_layers=plan.num_layers)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True, assign=True)
    # the rotary buffers are not in the state dict: build them for real (they are all that is left on meta)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=official_config)
    model.tie_weights()
    return model
