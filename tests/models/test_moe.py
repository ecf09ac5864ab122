"""Mixture-of-Experts: parity through the converter against official Mixtral, Qwen2-MoE and Qwen3-MoE (logits,
greedy and beam tokens, router logits, the load-balancing loss and its gradients), DeepSeek-V3's sigmoid grouped
routing against official DeepseekV3MoE, the reverse conversion, and bad configs."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.models.deepseek_v3 import modeling_deepseek_v3
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

import hf_tiny  # noqa: F401  (registers the Auto classes)
from causal_helpers import left_padded_batch, max_diff, real_logits, tiny_official
from conversion import llama
from hf_tiny import TinyCausalConfig
from hf_tiny.moe import MoeSpec, SparseMoeFeedForward, load_balancing_loss
from hf_tiny.transformers_api import enable_activation_checkpointing
from moe_models import VARIANTS

pytestmark = pytest.mark.usefixtures("single_torch_thread")

TOLERANCE = 1e-5
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def convert(variant, tmp_path):
    family, overrides = VARIANTS[variant]
    official = tiny_official(family, **overrides)
    official.save_pretrained(tmp_path / "src")
    result = llama.convert(tmp_path / "src", tmp_path / "ours")
    assert result["architecture"] == ARCHITECTURES[family]
    return official, result


def experts_used(model, batch) -> set:
    """(layer, expert) pairs the batch's real tokens are routed to: the variants must exercise several."""
    with torch.no_grad():
        out = model(**batch, output_router_logits=True)
    real = batch["attention_mask"].reshape(-1).bool()
    k = model.config.num_experts_per_tok
    return {(layer, int(e)) for layer, logits in enumerate(out.router_logits) for e in logits[real].topk(k).indices.unique()}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_official_per_backend(variant, tmp_path):
    official, result = convert(variant, tmp_path)
    assert all(row["max_abs_diff"] <= row["tolerance"] for row in result["parity"])
    batch = left_padded_batch(official.config.vocab_size)
    for backend in ("eager", "sdpa"):
        official.set_attn_implementation(backend)
        ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation=backend).eval()
        expected = real_logits(official, batch)
        assert expected.abs().max() > 1.0
        diff = max_diff(real_logits(ours, batch), expected)
        assert diff <= TOLERANCE, f"{variant} / {backend}: max |Δ| = {diff:.3g}"
    ours_config = ours.config
    assert len(experts_used(ours, batch)) >= 2 * ours_config.mlp_layer_types.count("sparse")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_and_beam_tokens_identical(variant, tmp_path):
    official, _ = convert(variant, tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    batch = left_padded_batch(official.config.vocab_size, lengths=(9, 6, 3), seed=1)
    settings = dict(attention_mask=batch["attention_mask"], max_new_tokens=10, do_sample=False, pad_token_id=0,
                    eos_token_id=None)
    for extra in ({}, {"num_beams": 3}):
        expected = official.generate(batch["input_ids"], **settings, **extra)
        assert torch.equal(ours.generate(batch["input_ids"], **settings, **extra), expected), extra


@pytest.mark.parametrize(
    "variant, perturbation",
    [
        ("mixtral_top2_of_4", {"num_experts_per_tok": 1}),
        ("mixtral_top2_of_4", {"norm_topk_prob": False}),
        ("qwen3_moe_dense_layer", {"norm_topk_prob": True}),
        ("qwen2_moe_shared_expert", {"num_experts_per_tok": 3}),
    ],
)
def test_negative_control_each_routing_switch_matters(variant, perturbation, tmp_path):
    official, _ = convert(variant, tmp_path)
    batch = left_padded_batch(official.config.vocab_size)
    wrong = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", **perturbation).eval()
    assert max_diff(real_logits(wrong, batch), real_logits(official, batch)) > 100 * TOLERANCE


@pytest.mark.parametrize("variant", ["mixtral_top2_of_4", "qwen2_moe_shared_expert", "qwen3_moe_norm_topk_sparse_step"])
def test_router_logits_aux_loss_and_gradients_match_official(variant, tmp_path):
    """Training forward with labels and output_router_logits: the router logits of every sparse layer, the
    load-balancing loss over the real tokens, loss = LM loss + coef * aux, and the gradients of the router and
    the embeddings (the aux loss reaches the router only through the softmax)."""
    official, _ = convert(variant, tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    # large enough to show (official copies the coefficient onto the model at construction)
    official.router_aux_loss_coef = ours.config.router_aux_loss_coef = 0.5
    batch = left_padded_batch(official.config.vocab_size)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    outputs = {}
    for name, model in (("official", official), ("ours", ours)):
        model.train()
        model.zero_grad()
        out = model(**batch, labels=labels, output_router_logits=True)
        out.loss.backward()
        outputs[name] = out
    theirs, mine = outputs["official"], outputs["ours"]
    assert len(mine.router_logits) == len(theirs.router_logits) == ours.config.mlp_layer_types.count("sparse")
    for a, b in zip(mine.router_logits, theirs.router_logits):
        assert max_diff(a.detach(), b.detach()) <= TOLERANCE
    mine_aux, theirs_aux, mine_loss, theirs_loss = (float(x.detach()) for x in (mine.aux_loss, theirs.aux_loss, mine.loss, theirs.loss))
    assert abs(mine_aux - theirs_aux) <= 1e-6 * theirs_aux
    assert abs(mine_loss - theirs_loss) <= 1e-6 * theirs_loss
    sparse = ours.config.mlp_layer_types.index("sparse")
    our_router = ours.model.layers[sparse].mlp.gate.weight.grad
    official_router = official.model.layers[sparse].mlp.gate.weight.grad
    assert our_router.abs().max() > 0
    assert max_diff(our_router, official_router) <= 1e-5 * float(official_router.abs().max())
    assert max_diff(ours.model.embed_tokens.weight.grad, official.model.embed_tokens.weight.grad) <= 1e-5


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("experts, top_k, layers", [(4, 2, 1), (8, 3, 3), (5, 1, 2)])
def test_load_balancing_loss_equals_official(experts, top_k, layers, masked):
    generator = torch.Generator().manual_seed(experts * 10 + top_k)
    batch, seq = 3, 7
    logits = tuple(torch.randn(batch * seq, experts, generator=generator) * 2 for _ in range(layers))
    mask = (torch.rand(batch, seq, generator=generator) > 0.3).long() if masked else None
    expected = load_balancing_loss_func(logits, experts, top_k, mask)
    assert abs(float(load_balancing_loss(logits, experts, top_k, mask)) - float(expected)) <= 1e-6 * float(expected)


def test_load_balancing_loss_of_a_uniform_router_is_top_k():
    """Written from the definition, not from official code: every expert gets the same share of assignments
    and of probability, so E * sum_e (k / E) * (1 / E) = k."""
    logits = (torch.zeros(12, 6),)
    assert float(load_balancing_loss(logits, 6, 2)) == pytest.approx(2.0)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_convert_back_is_bit_exact_and_loads_cleanly(variant, tmp_path):
    official, _ = convert(variant, tmp_path)
    result = llama.convert_back(tmp_path / "ours", tmp_path / "back")
    assert result["architecture"] == type(official).__name__
    back, info = type(official).from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    src_tensors = load_file(tmp_path / "src" / "model.safetensors")
    back_tensors = load_file(tmp_path / "back" / "model.safetensors")
    assert src_tensors.keys() == back_tensors.keys()
    assert all(torch.equal(src_tensors[k], back_tensors[k]) for k in src_tensors)


# ------------------------------------------------------------------------------------------------------------
# DeepSeek-V3 routing: sigmoid scores, correction bias, grouped top-k, shared experts, scaling
# ------------------------------------------------------------------------------------------------------------


def deepseek_pair(seed=0, **overrides):
    """Official DeepseekV3MoE and ours holding the same random weights (and a random correction bias)."""
    fields = dict(
        hidden_size=16, moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
        n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True, hidden_act="silu",
    )
    fields.update(overrides)
    config = modeling_deepseek_v3.DeepseekV3Config(**fields)
    torch.manual_seed(seed)
    official = modeling_deepseek_v3.DeepseekV3MoE(config).eval()
    with torch.no_grad():
        for param in official.parameters():
            param.normal_(0, 0.5)
        official.gate.e_score_correction_bias.normal_(0, 0.5)
    spec = MoeSpec(
        num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size, scoring="sigmoid", norm_topk_prob=config.norm_topk_prob,
        n_group=config.n_group, topk_group=config.topk_group, routed_scaling_factor=config.routed_scaling_factor,
        shared_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
    )
    from hf_tiny.layers import GatedFeedForward

    ours = SparseMoeFeedForward(16, spec, lambda size: GatedFeedForward(16, size, "silu", bias=False)).eval()
    with torch.no_grad():
        ours.gate.weight.copy_(official.gate.weight)
        ours.gate.e_score_correction_bias.copy_(official.gate.e_score_correction_bias)
        size = config.moe_intermediate_size
        for e, expert in enumerate(ours.experts):
            expert.gate_proj.weight.copy_(official.experts.gate_up_proj[e, :size])
            expert.up_proj.weight.copy_(official.experts.gate_up_proj[e, size:])
            expert.down_proj.weight.copy_(official.experts.down_proj[e])
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ours.shared_experts, name).weight.copy_(getattr(official.shared_experts, name).weight)
    return official, ours


@pytest.mark.parametrize("overrides", [{}, {"norm_topk_prob": False, "topk_group": 1}, {"n_group": 1, "topk_group": 1}])
def test_deepseek_v3_routing_matches_official_moe_block(overrides):
    official, ours = deepseek_pair(**overrides)
    hidden = torch.randn(2, 11, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = official(hidden)
        produced = ours(hidden)
        router_logits = ours.gate(hidden.reshape(-1, 16))[0]
    assert expected.abs().max() > 1.0
    # relative: outputs reach ~25 here, where fp32 rounding alone is ~1e-6
    assert max_diff(produced, expected) <= 2e-6 * float(expected.abs().max())
    assert router_logits.shape == (22, 8)


def test_deepseek_v3_correction_bias_and_groups_change_the_choice():
    """Negative controls: the same weights with the correction bias zeroed, or with every group allowed,
    route differently (and so give other outputs)."""
    official, ours = deepseek_pair()
    hidden = torch.randn(2, 11, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = official(hidden)
        ours.gate.e_score_correction_bias.zero_()
        assert max_diff(ours(hidden), expected) > 100 * TOLERANCE
    _, ungrouped = deepseek_pair(n_group=1, topk_group=1)
    with torch.no_grad():
        assert max_diff(ungrouped(hidden), expected) > 100 * TOLERANCE


# routing styles of the compiled step's fixed-shape experts; GPT-OSS's experts are clamped SwiGLUs with biases
FIXED_SHAPE_SPECS = {
    "softmax": MoeSpec(8, 2, 24, "softmax", True),
    "sigmoid_groups_shared": MoeSpec(8, 2, 24, "sigmoid", True, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                     shared_intermediate_size=16),
    "topk_softmax_biases": MoeSpec(8, 4, 24, "topk_softmax", True, router_bias=True),
    "topk_sigmoid_weights_on_input": MoeSpec(4, 1, 24, "topk_sigmoid", False, weights_on_input=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(FIXED_SHAPE_SPECS))
def test_every_expert_on_every_token_gives_the_routed_loops_sums(name, dtype):
    """The compiled step's experts (every token through every expert, the unchosen dropped) against the routed loop
    (the reading, used outside compilation): the same sums in the same order, up to the products' rounding over other
    row counts (fp32 here: ~1e-7 of the largest output; bf16: equal, bounded at one bf16 rounding of it). Negative control: another routing (the tokens' choices rolled by one token) differs."""
    from hf_tiny.layers import ClampedSwiGLUFeedForward, GatedFeedForward

    biases = name == "topk_softmax_biases"
    make = (lambda size: ClampedSwiGLUFeedForward(32, size, alpha=1.702, limit=7.0, bias=True)) if biases else \
        (lambda size: GatedFeedForward(32, size, "silu", bias=False))
    torch.manual_seed(0)
    layer = SparseMoeFeedForward(32, FIXED_SHAPE_SPECS[name], make)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.3)
    layer = layer.to(dtype).eval()
    tokens = torch.randn(37, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        _, top_k_index, top_k_weights = layer.gate(tokens)
        assert len(top_k_index.unique()) == layer.spec.num_experts  # every expert has tokens
        routed = layer._each_expert_on_its_tokens(tokens, top_k_index, top_k_weights)
        fixed = layer._every_expert_on_every_token(tokens, top_k_index, top_k_weights)
        rerouted = layer._every_expert_on_every_token(tokens, top_k_index.roll(1, dims=0), top_k_weights)
    scale = float(routed.abs().max())
    assert scale > 1.0
    bound = (1e-6 if dtype == torch.float32 else 2.0**-8) * scale
    assert max_diff(fixed, routed) <= bound
    assert max_diff(rerouted, routed) > 0.1 * scale


def test_first_k_dense_replace_makes_the_first_layers_dense():
    config = TinyCausalConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=3, num_attention_heads=2,
        num_local_experts=4, first_k_dense_replace=1, moe_intermediate_size=8,
    )
    assert config.mlp_layer_types == ["dense", "sparse", "sparse"]
    model = hf_tiny.TinyCausalForCausalLM(config)
    assert model.model.layers[0].mlp.up_proj.weight.shape == (24, 16)
    assert model.model.layers[1].mlp.experts[3].up_proj.weight.shape == (8, 16)
    reloaded = TinyCausalConfig.from_dict(config.to_dict())
    assert reloaded.mlp_layer_types == config.mlp_layer_types


# ------------------------------------------------------------------------------------------------------------
# Bad configs: an error at construction naming the fields and values
# ------------------------------------------------------------------------------------------------------------

MOE = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
           num_local_experts=8, num_experts_per_tok=2)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds num_local_experts=8"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok must be a positive integer, got 0"),
        ({"n_group": 3}, "num_local_experts (8) must be divisible by n_group (3)"),
        ({"n_group": 2, "topk_group": 3}, "topk_group=3 exceeds n_group=2"),
        ({"n_group": 8, "topk_group": 2}, "n_group=8 leaves 1 expert(s) per group"),
        ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "num_experts_per_tok=3 exceeds the 2 experts"),
        ({"router_scoring": "relu"}, "router_scoring"),
        ({"num_local_experts": -1}, "num_local_experts must be an integer >= 0"),
        ({"shared_expert_gate": True}, "shared_expert_gate=True needs shared experts"),
        ({"routed_scaling_factor": 0.0}, "routed_scaling_factor must be a positive number"),
        ({"router_aux_loss_coef": -0.1}, "router_aux_loss_coef must be a number >= 0, got -0.1"),
        ({"mlp_bias": True}, "needs mlp_gated=True and mlp_bias=False"),
        ({"first_k_dense_replace": 3}, "first_k_dense_replace=3 exceeds num_hidden_layers=2"),
        ({"mlp_layer_types": ["dense"]}, "mlp_layer_types must list one of"),
        ({"mlp_layer_types": ["dense", "moe"]}, "mlp_layer_types[1]='moe'"),
        ({"mlp_layer_types": ["dense", "sparse"], "first_k_dense_replace": 1}, "not both"),
        ({"num_local_experts": 0, "first_k_dense_replace": 1}, "num_local_experts=0"),
    ],
)
def test_bad_moe_config_is_a_clear_error(changes, message):
    with pytest.raises((ValueError, TypeError)) as error:
        TinyCausalConfig(**{**MOE, **changes})
    assert message in str(error.value)


def test_router_logits_of_a_dense_model_is_a_clear_error():
    config = TinyCausalConfig(**{**MOE, "num_local_experts": 0})
    model = hf_tiny.TinyCausalForCausalLM(config).eval()
    with pytest.raises(ValueError, match="num_local_experts=0"):
        model(torch.tensor([[1, 2, 3]]), output_router_logits=True)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"router_scoring": "sigmoid"}, "router_scoring='sigmoid'"),
        ({"shared_expert_intermediate_size": 8}, "shared_expert_gate=False"),
        ({"first_k_dense_replace": 1}, "Mixtral has every layer sparse"),
    ],
)
def test_configs_no_official_moe_class_holds_refuse_to_convert_back(changes, message, tmp_path):
    from conversion import ConversionError

    model = hf_tiny.TinyCausalForCausalLM(TinyCausalConfig(**{**MOE, **changes}))
    model.save_pretrained(tmp_path / "ours")
    with pytest.raises(ConversionError, match=message):
        llama.convert_back(tmp_path / "ours", tmp_path / "back")
    assert not (tmp_path / "back").exists()


def test_gradient_checkpointing_keeps_loss_aux_loss_and_gradients():
    config = TinyCausalConfig(**{**MOE, "output_router_logits": True, "router_aux_loss_coef": 0.5})
    torch.manual_seed(0)
    model = hf_tiny.TinyCausalForCausalLM(config).train()
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    plain = model(ids, labels=ids)
    plain.loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    enable_activation_checkpointing(model, {"use_reentrant": False})
    checkpointed = model(ids, labels=ids)
    checkpointed.loss.backward()
    assert torch.equal(checkpointed.aux_loss, plain.aux_loss) and torch.equal(checkpointed.loss, plain.loss)
    assert expected.keys() == {name for name, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert torch.allclose(p.grad, expected[name], atol=1e-7), name


def test_reentrant_checkpointing_with_router_logits_is_a_clear_error():
    """Reentrant checkpointing runs each layer without gradients in the forward: the router logits then carry none and
    the load-balancing loss would train nothing (official Mixtral's gradients silently differ there)."""
    config = TinyCausalConfig(**{**MOE, "output_router_logits": True, "router_aux_loss_coef": 0.5})
    model = hf_tiny.TinyCausalForCausalLM(config).train()
    enable_activation_checkpointing(model, {"use_reentrant": True})
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="use_reentrant': False"):
        model(ids, labels=ids)
    model(ids, labels=ids, output_router_logits=False).loss.backward()  # without router logits it trains


def test_lora_reaches_the_experts_by_their_llama_names():
    from peft import LoraConfig, get_peft_model

    model = hf_tiny.TinyCausalForCausalLM(TinyCausalConfig(**MOE))
    peft_model = get_peft_model(model, LoraConfig(target_modules=["gate_proj", "up_proj", "down_proj"], r=4))
    wrapped = {name for name, _ in peft_model.named_modules() if name.endswith(".lora_A")}
    # 2 layers x 8 experts x 3 projections; the router (mlp.gate) is not a target
    assert len(wrapped) == 2 * 8 * 3 and not any(".mlp.gate.lora" in name for name in wrapped)
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(0))
    peft_model(ids, labels=ids).loss.backward()
    # the experts some token was routed to train their adapters (lora_B starts at zero; its gradient does not)
    trained = [name for name, p in peft_model.named_parameters() if "lora_B" in name and p.grad is not None and p.grad.abs().sum() > 0]
    assert len(trained) >= 2 * 2 * 3, trained


def test_an_expert_no_token_chose_gets_a_zero_gradient_as_official_s_slice(tmp_path):
    """Official keeps the experts in one 3-D parameter, so an expert no token chose still has a (zero) gradient.
    Ours skipped it: its gradient was None, AdamW then skipped its momentum and weight decay (6.9e-3 off official
    after one step), and DDP / FSDP, which reduce every parameter's gradient, stopped. Two tokens, top-1 of 3."""
    official, _ = convert("mixtral_top1_of_3_sliding_mha", tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").train()
    official.train()
    ids = torch.tensor([[5, 9]])
    for model in (official, ours):
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
    layer = ours.config.mlp_layer_types.index("sparse")
    with torch.no_grad():
        chosen = ours(input_ids=ids, output_router_logits=True).router_logits[layer].topk(ours.config.num_experts_per_tok)
    idle = sorted(set(range(ours.config.num_local_experts)) - set(chosen.indices.flatten().tolist()))
    assert idle
    official_experts = official.model.layers[layer].mlp.experts
    for expert in idle:
        grads = [p.grad for p in ours.model.layers[layer].mlp.experts[expert].parameters()]
        assert all(g is not None and torch.count_nonzero(g) == 0 for g in grads)
        assert torch.count_nonzero(official_experts.down_proj.grad[expert]) == 0  # official's slice, the reference
