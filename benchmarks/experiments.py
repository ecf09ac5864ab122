"""Prototypes of proposed hf_tiny speed changes, measured on loaded model instances without touching hf_tiny/.

`python -m benchmarks.experiments [--model overhead|smollm2] [--repeats 7]`

Each variant is an hf_tiny model whose modules are patched in place (per instance, so the other variants and the
baseline stay untouched) to behave like a proposed edit of hf_tiny/layers.py / rope.py / modeling_causal.py:

  lean_block         TransformerBlock.forward written flat (no _residual helper, no lambda per sublayer) and
                     dropout called only when training with p > 0 (an eval-mode or p=0 nn.Dropout still costs a
                     module call and an aten::dropout per sublayer); FeedForward likewise
  rope_once          cos/sin unsqueezed once per forward instead of 4 times per layer, rotate_half by slicing
                     (chunk = split + 2 narrow), one dtype cast skipped when the dtype already matches
  fused_qkv          one [hidden, (H + 2·Hkv)·D] projection instead of q_proj, k_proj, v_proj (a layout change:
                     conversion, PEFT target_modules and docs would follow)

For every variant it prints aten calls per prefill and per decode step (load-independent), interleaved median
timings against official transformers and the baseline, and the max |logits − baseline logits| (faithfulness).
"""

from __future__ import annotations

import argparse
import time
import types

import torch
from torch import nn

from . import measure
from .models import HF_TINY, MODELS, OFFICIAL, load_model
from .run import load_pair
from .workloads import Shape, build_generate, build_prefill, random_ids

VARIANTS = {
    "hf_tiny": (),
    "+lean_block": ("lean_block",),
    "+rope_once": ("lean_block", "rope_once"),
    "+fused_qkv": ("lean_block", "rope_once", "fused_qkv"),
}


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    out = x * cos + rotated * sin
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _attention_forward(self, hidden_states, attention_mask=None, *, position_embeddings=None, key_value_states=None,
                       past_key_values=None, output_attentions=False):
    """layers.Attention.forward for causal self-attention, with cos/sin already [B, 1, S, D] and an optional fused
    q/k/v projection."""
    from hf_tiny.attention import get_attention_backend

    batch, seq_len = hidden_states.shape[:2]
    if hasattr(self, "qkv_proj"):
        query, key, value = self.qkv_proj(hidden_states).split(self._qkv_sizes, dim=-1)
    else:
        query, key, value = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
    query = query.view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
    key = key.view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
    value = value.view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, self.layer_idx)
    backend = get_attention_backend(self.config._attn_implementation)
    mask, is_causal = attention_mask if attention_mask is not None else (None, False)
    out, weights = backend(
        query, key, value, mask, scale=self.scaling, dropout_p=self.dropout if self.training else 0.0,
        is_causal=is_causal, output_attentions=output_attentions,
    )
    return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1)), weights


def _dropout(module: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
    return module(x) if module.training and module.p > 0 else x


def _block_forward(self, hidden_states, attention_mask=None, position_embeddings=None, encoder_hidden_states=None,
                   encoder_attention_mask=None, past_key_values=None, output_attentions=False):
    """TransformerBlock.forward for a pre-norm self-attention block, flat."""
    attn_out, weights = self.self_attn(
        self.input_layernorm(hidden_states), attention_mask, position_embeddings=position_embeddings,
        past_key_values=past_key_values, output_attentions=output_attentions,
    )
    hidden_states = hidden_states + _dropout(self.dropout, attn_out)
    hidden_states = hidden_states + _dropout(self.dropout, self.mlp(self.post_attention_layernorm(hidden_states)))
    return hidden_states, weights, None


def _mlp_forward(self, x):
    if self.gated:
        hidden = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
    else:
        hidden = self.act_fn(self.up_proj(x))
    return self.down_proj(_dropout(self.dropout, hidden))


def _lean_block(model) -> None:
    for layer in model.model.layers:
        if not layer.pre_norm or hasattr(layer, "cross_attn"):
            raise ValueError("the lean_block prototype covers pre-norm self-attention blocks only")
        layer.forward = types.MethodType(_block_forward, layer)
        layer.mlp.forward = types.MethodType(_mlp_forward, layer.mlp)


def _rope_once(model) -> None:
    rotary = model.model.rotary_emb
    original = rotary.forward

    def forward(x, position_ids):
        cos, sin = original(x, position_ids)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    rotary.forward = forward
    for layer in model.model.layers:
        layer.self_attn.forward = types.MethodType(_attention_forward, layer.self_attn)


def _fused_qkv(model) -> None:
    for layer in model.model.layers:
        attn = layer.self_attn
        weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
        attn.qkv_proj = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        attn.qkv_proj.weight = nn.Parameter(weight)
        attn._qkv_sizes = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        del attn.q_proj, attn.k_proj, attn.v_proj


PATCHES = {"lean_block": _lean_block, "rope_once": _rope_once, "fused_qkv": _fused_qkv}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.experiments", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="overhead", choices=["overhead", "smollm2"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, help="1 (recommended on a shared machine) times with process CPU time")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device("cpu"), torch.float32
    spec = MODELS[args.model]
    folders, models, errors = load_pair(spec, device, dtype, "sdpa", refresh=False)
    if HF_TINY not in models:
        raise SystemExit(f"error: hf_tiny side unavailable: {errors}")
    contenders = {OFFICIAL: models[OFFICIAL]}
    for name, patches in VARIANTS.items():
        model = models[HF_TINY] if not patches else load_model(spec, HF_TINY, folders[HF_TINY], dtype=dtype, device=device, attn="sdpa")
        for patch in patches:
            PATCHES[patch](model)
        contenders[name] = model

    prefill_shape, decode_shape = Shape(1, 128), Shape(1, 16, args.new_tokens)
    extra = {"use_cache": False, "logits_to_keep": 1}
    ids = random_ids(2, 24, contenders[OFFICIAL].config.vocab_size, device, seed=3)
    with torch.inference_mode():
        reference = contenders["hf_tiny"](input_ids=ids).logits
        diffs = {name: float((m(input_ids=ids).logits - reference).abs().max()) for name, m in contenders.items()}

    clock_name = "process CPU time" if torch.get_num_threads() == 1 else "wall time"
    print(f"model {args.model}: calls and timings (median {clock_name} of {args.repeats}, interleaved; "
          f"{torch.get_num_threads()} torch threads)")
    prefill = {name: build_prefill(m, "causal", prefill_shape, device, extra) for name, m in contenders.items()}
    generate = {name: build_generate(m, decode_shape, device) for name, m in contenders.items()}
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    t_prefill = measure.time_interleaved(prefill, device=device, warmup=1, repeats=args.repeats, clock=clock)
    t_generate = measure.time_interleaved(generate, device=device, warmup=1, repeats=args.repeats, clock=clock)
    print(f"| variant | aten calls / prefill {prefill_shape.label()} | aten calls / decode step | Python calls / "
          f"decode step | prefill ms | generate tok/s ({decode_shape.label()}) | tok/s vs official | "
          "max |Δlogits| vs hf_tiny |")
    print("|---|---|---|---|---|---|---|---|")
    for name, model in contenders.items():
        per_step = {}
        for kind, counter in (("aten", measure.count_aten_ops), ("python", measure.count_python_calls)):
            long = counter(build_generate(model, decode_shape, device, new_tokens=9))
            short = counter(build_generate(model, decode_shape, device, new_tokens=1))
            per_step[kind] = (long - short) / 8
        rate = decode_shape.new_tokens / t_generate[name].median
        base_rate = decode_shape.new_tokens / t_generate[OFFICIAL].median
        print(f"| {name} | {measure.count_aten_ops(prefill[name]):,} | {per_step['aten']:,.0f} | "
              f"{per_step['python']:,.0f} | {t_prefill[name].median * 1e3:,.1f} | {rate:,.1f} | "
              f"{rate / base_rate:.2f} | {diffs[name]:.1e} |")


if __name__ == "__main__":
    main()
