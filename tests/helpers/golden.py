"""Golden snapshots of every family's behaviour, pinned before the readability redesign and compared after every
step of it: the state-dict keys, and the exact fp32 CPU logits and gradients of small fixed models on padded,
packed, static-cache, paged (continuous batching) and cached-decode inputs.

    python tests/helpers/golden.py --write     # (re)writes tests/golden/*.safetensors + keys; only when a change is meant

Weights do not come from the models' init (whose random draws depend on the order modules are built in): every
parameter is filled from a generator seeded by its own name, so a model built in another order gets the same
numbers. Computations run on one thread (matrix kernels may add in another order with more threads).
"""

from __future__ import annotations

import contextlib
import json
import sys
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"
sys.path.insert(0, str(ROOT))

CAUSAL_BASE = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
CAUSAL = {
    "llama": dict(),
    "gemma3": dict(
        head_dim=16, num_hidden_layers=4, qk_norm=True, rms_norm_unit_offset=True, scale_embeddings=True,
        sandwich_norms=True, query_pre_attn_scalar=12, final_logit_softcapping=5.0, hidden_act="gelu_pytorch_tanh",
        sliding_window=3, layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
        tie_word_embeddings=True,
    ),
    "qwen3": dict(qk_norm=True, attention_bias=True, attention_output_bias=False, rms_norm_eps=1e-5),
    "phi3": dict(
        max_position_embeddings=32, hidden_act="silu",
        rope_parameters={"rope_type": "longrope", "original_max_position_embeddings": 8, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.5], "long_factor": [2.0, 3.0], "rope_theta": 10000.0},
    ),
    "gpt2": dict(position_embedding_type="learned", norm_type="layernorm", mlp_gated=False, hidden_act="gelu_new",
                 attention_bias=True, mlp_bias=True, num_key_value_heads=4, tie_word_embeddings=True),
    "mpt": dict(position_embedding_type="alibi", norm_type="layernorm", norm_bias=False, mlp_gated=False,
                hidden_act="gelu", num_key_value_heads=4, alibi_bias_max=8.0),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, router_aux_loss_coef=0.02,
                    output_router_logits=True),
    "deepseek": dict(
        num_hidden_layers=3, num_key_value_heads=None, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        router_scoring="sigmoid", n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        shared_expert_intermediate_size=16, first_k_dense_replace=1, num_nextn_predict_layers=1,
        mtp_loss_weight=0.3,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                         "mscale": 0.9, "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0},
    ),
}
ENCODER = {
    "bert": dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                 max_position_embeddings=64, type_vocab_size=2, hidden_dropout=0.0, attention_dropout=0.0),
    "roberta": dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                    max_position_embeddings=64, type_vocab_size=1, hidden_dropout=0.0, attention_dropout=0.0,
                    pad_token_id=1, positions_from_padding=True, dropout_before_pooler=True),
}
SEQ2SEQ = {
    "bart": dict(style="bart", vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=48, max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                 decoder_start_token_id=2, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0),
    "t5": dict(style="t5", vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=48, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
               decoder_start_token_id=0, hidden_dropout=0.0, attention_dropout=0.0, mlp_gated=True,
               hidden_act="gelu_new", relative_attention_num_buckets=8, relative_attention_max_distance=16),
}
FAMILIES = (*CAUSAL, *ENCODER, *SEQ2SEQ)
# Left-padded causal batch (generate's layout), right-padded encoder / seq2seq batches (tokenizers' layout).
LEFT_PADDED = (torch.tensor([[0, 0, 9, 14, 3, 22, 7], [8, 11, 30, 5, 11, 4, 17]]),
               torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]]))
PACKED_IDS = torch.tensor([[5, 9, 14, 3, 22, 7, 8, 40, 30]])
PACKED_POSITIONS = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])
PAGED_PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [30, 31]]
DECODE_STEPS = 3
# Continuous batching costs seconds per call on a CPU: full attention, and full + sliding layers (one paged
# allocation per layer type).
PAGED_FAMILIES = ("llama", "gemma3")


def fill_by_name(model: torch.nn.Module, scale: float = 0.3) -> torch.nn.Module:
    """Every parameter and floating buffer that a checkpoint holds, from a generator seeded by its name: norm
    weights 1 + noise (0 + noise with Gemma's unit offset), everything else noise."""
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            if not tensor.is_floating_point() or name.endswith("inv_freq"):
                continue
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            noise = torch.randn(tensor.shape, generator=generator) * scale
            is_norm = "norm" in name and name.endswith("weight")
            offset = is_norm and not getattr(model.config, "rms_norm_unit_offset", False)
            tensor.copy_(1.0 + noise if offset else noise)
    return model


def build(family: str):
    import hf_tiny  # noqa: F401

    from hf_tiny import (TinyCausalConfig, TinyCausalForCausalLM, TinyEncoderConfig, TinyEncoderForMaskedLM,
                         TinySeq2SeqConfig, TinySeq2SeqForConditionalGeneration)

    if family in CAUSAL:
        model = TinyCausalForCausalLM(TinyCausalConfig(**{**CAUSAL_BASE, **CAUSAL[family]}))
    elif family in ENCODER:
        model = TinyEncoderForMaskedLM(TinyEncoderConfig(**ENCODER[family]))
    else:
        fields = dict(SEQ2SEQ[family])
        model = TinySeq2SeqForConditionalGeneration(TinySeq2SeqConfig.from_style(fields.pop("style"), **fields))
    return fill_by_name(model).eval()


def _kind(family: str) -> str:
    return "causal" if family in CAUSAL else "encoder" if family in ENCODER else "seq2seq"


@torch.no_grad()
def _causal_outputs(model) -> dict:
    from transformers import DynamicCache, StaticCache

    ids, mask = LEFT_PADDED
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = {"padded.logits": model(ids, attention_mask=mask, position_ids=positions).logits}
    out["packed.logits"] = model(PACKED_IDS, position_ids=PACKED_POSITIONS).logits
    for name, cache in (("decode", DynamicCache(config=model.config)),
                        ("static", StaticCache(config=model.config, max_cache_len=16))):
        step_ids, step_mask, step_positions = ids, mask, positions
        for step in range(DECODE_STEPS + 1):
            logits = model(step_ids, attention_mask=step_mask, position_ids=step_positions, cache=cache,
                           use_cache=True).logits
            out[f"{name}.step{step}.logits"] = logits
            step_ids = logits[:, -1:].argmax(-1)
            step_mask = torch.cat((step_mask, torch.ones_like(step_ids)), dim=1)
            step_positions = step_positions[:, -1:] + 1
    return out


def _paged_tokens(model) -> dict:
    from transformers import GenerationConfig

    from causal_helpers import small_paged_cache

    config = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    results = model.generate_batch(inputs=PAGED_PROMPTS, generation_config=config, progress_bar=False,
                                   continuous_batching_config=small_paged_cache())
    ordered = sorted(results.values(), key=lambda result: PAGED_PROMPTS.index(list(result.prompt_ids)))
    return {"paged.tokens": torch.tensor([list(result.generated_tokens) for result in ordered])}


@torch.no_grad()
def _encoder_outputs(model) -> dict:
    ids, mask = LEFT_PADDED
    ids, mask = ids.flip(-1), mask.flip(-1)  # right-padded
    pad = model.config.pad_token_id
    ids = ids.masked_fill(mask == 0, pad)
    return {"padded.logits": model(ids, attention_mask=mask).logits}


@torch.no_grad()
def _seq2seq_outputs(model) -> dict:
    from transformers import DynamicCache, EncoderDecoderCache

    ids, mask = LEFT_PADDED
    ids, mask = ids.flip(-1), mask.flip(-1)
    ids = ids.masked_fill(mask == 0, model.config.pad_token_id)
    decoder_ids = torch.tensor([[model.config.decoder_start_token_id, 7, 12], [model.config.decoder_start_token_id, 3, 9]])
    out = {"padded.logits": model(ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits}
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    step_ids = decoder_ids
    encoder = model.get_encoder()(ids, attention_mask=mask)
    for step in range(DECODE_STEPS + 1):
        logits = model(encoder_outputs=encoder, attention_mask=mask, decoder_input_ids=step_ids, cache=cache,
                       use_cache=True).logits
        out[f"decode.step{step}.logits"] = logits
        step_ids = logits[:, -1:].argmax(-1)
    return out


def _labels(family: str):
    ids, mask = LEFT_PADDED
    if _kind(family) == "causal":
        return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    ids, mask = ids.flip(-1), mask.flip(-1)
    if _kind(family) == "encoder":
        return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    labels = torch.tensor([[7, 12, 4, 2], [3, 9, 2, -100]])
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def gradients(model, family: str) -> dict:
    """The loss and every parameter's gradient of one training step (dropout is 0 in every golden config)."""
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(**_labels(family)).loss
    loss.backward()
    # an MoE expert no token chose has a zero gradient (as official's), where the snapshots were written with none
    grads = {f"grad.{name}": param.grad.clone() for name, param in model.named_parameters()
             if param.grad is not None and torch.count_nonzero(param.grad)}
    model.zero_grad(set_to_none=True)
    model.eval()
    return {"train.loss": loss.detach().reshape(1), **grads}


def snapshot(family: str, *, paged: bool = True) -> dict:
    """Everything pinned for one family: outputs of each input kind and one training step's gradients, computed on
    one thread (the reduction order the snapshots were written with; the caller's thread count is put back)."""
    threads = torch.get_num_threads()
    with torch.random.fork_rng():
        torch.set_num_threads(1)
        try:
            outputs = _outputs_and_gradients(family, paged=paged)
        finally:
            torch.set_num_threads(threads)
    return {key: value.detach().contiguous() for key, value in outputs.items()}


def _outputs_and_gradients(family: str, *, paged: bool) -> dict:
    from hf_tiny.runtime import disabled as keep_all_activations

    model = build(family)
    kind = _kind(family)
    if kind == "causal":
        outputs = _causal_outputs(model)
        if paged and family in PAGED_FAMILIES:
            outputs.update(_paged_tokens(model))
    elif kind == "encoder":
        outputs = _encoder_outputs(model)
    else:
        outputs = _seq2seq_outputs(model)
    outputs.update(gradients(model, family))
    with keep_all_activations():
        reference = gradients(model, family)
    outputs.update({f"keep_all.{key}": value for key, value in reference.items()})
    return outputs


def state_dict_keys(family: str) -> list[str]:
    return sorted(build(family).state_dict())


def cpu_identity() -> str:
    """The CPU as matrix libraries tell CPUs apart: vendor, family and model (MKL picks its kernels by these, beyond
    the instruction set torch reports), e.g. 'AuthenticAMD family 26 model 2'."""
    fields = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            fields.setdefault(key, value)
    return f"{fields.get('vendor_id', '?')} family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"


def write() -> None:
    from safetensors.torch import save_file

    GOLDEN_DIR.mkdir(exist_ok=True)
    for family in FAMILIES:
        save_file(snapshot(family), GOLDEN_DIR / f"{family}.safetensors",
                  metadata={"cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu": cpu_identity(),
                            "torch": torch.__version__})
        (GOLDEN_DIR / f"{family}.keys.json").write_text(json.dumps(state_dict_keys(family), indent=0) + "\n")
        print(f"wrote {family}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python tests/helpers/golden.py --write")
    write()
