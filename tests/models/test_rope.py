"""Rotary embeddings: inverse frequencies and cos/sin against transformers' modeling_rope_utils, bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from hf_tiny import TinyCausalConfig, TinyCausalForCausalLM
from hf_tiny.layers import RotaryEmbedding, apply_rotary
from hf_tiny.rope import compute_inv_freq, standardize_rope_parameters

pytestmark = pytest.mark.usefixtures("single_torch_thread")

ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 100.0, "factor": 3.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn_mscale": {
        "rope_type": "yarn",
        "rope_theta": 1000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "mscale": 0.7,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}
SIZES = dict(hidden_size=64, num_attention_heads=4, head_dim=32, max_position_embeddings=64, vocab_size=32)


def configs(rope: dict):
    official = LlamaConfig(**SIZES, num_hidden_layers=1, intermediate_size=8, rope_parameters=dict(rope))
    ours = TinyCausalConfig(**SIZES, num_hidden_layers=1, intermediate_size=8, rope_parameters=dict(rope))
    return official, ours


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_inv_freq_and_scaling_match_transformers_exactly(case):
    official_config, ours = configs(ROPE_CASES[case])
    rope_type = ROPE_CASES[case]["rope_type"]
    if rope_type == "default":
        expected, expected_scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(official_config)
    else:
        expected, expected_scaling = ROPE_INIT_FUNCTIONS[rope_type](official_config)
    inv_freq, scaling = compute_inv_freq(ours.rope_parameters, ours.head_dim, ours.max_position_embeddings)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (16,)
    assert torch.equal(inv_freq, expected), (inv_freq - expected).abs().max()
    assert scaling == expected_scaling
    if rope_type not in ("default", "dynamic"):  # negative control: the scaling really changes the frequencies
        plain, _ = compute_inv_freq({"rope_type": "default", "rope_theta": ours.rope_parameters["rope_theta"]}, 32, 64)
        assert not torch.allclose(plain, inv_freq)


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_cos_sin_match_official_rotary_module(case):
    official_config, ours = configs(ROPE_CASES[case])
    official, mine = LlamaRotaryEmbedding(official_config), RotaryEmbedding(ours)
    x = torch.zeros(1, dtype=torch.float32)
    # left-padded style positions, a repeated position and the last allowed position
    positions = torch.tensor([[0, 0, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 63]])
    (cos_ref, sin_ref), (cos, sin) = official(x, positions), mine(x, positions)
    assert cos.shape == (2, 8, 32) and cos.dtype == torch.float32
    torch.testing.assert_close(cos, cos_ref, rtol=0, atol=1e-7)
    torch.testing.assert_close(sin, sin_ref, rtol=0, atol=1e-7)
    # bf16 activations get bf16 tables computed in fp32 (as the official module does)
    cos_bf16, _ = mine(x.bfloat16(), positions)
    assert cos_bf16.dtype == torch.bfloat16
    assert torch.equal(cos_bf16, cos_ref.bfloat16())


def test_table_lookup_equals_direct_computation():
    _, ours = configs(ROPE_CASES["llama3"])
    rope = RotaryEmbedding(ours)
    positions = torch.arange(64)[None]
    cos_table, sin_table = rope(torch.zeros(1), positions)
    assert rope._table is not None  # the table path was taken
    cos_direct, sin_direct = rope._cos_sin(positions, torch.device("cpu"))
    torch.testing.assert_close(cos_table, cos_direct, rtol=0, atol=1e-7)
    torch.testing.assert_close(sin_table, sin_direct, rtol=0, atol=1e-7)


def test_off_the_cpu_cos_sin_are_computed_without_a_table_or_a_sync():
    """The table is a CPU path: on an accelerator (meta tensors stand in; they hold no values, so a bounds check
    that waits on the device, int(position_ids.max()), would raise) cos/sin are computed from the positions and no
    table is held."""
    _, ours = configs(ROPE_CASES["llama3"])
    rope = RotaryEmbedding(ours).to("meta")
    cos, sin = rope(torch.zeros(1, device="meta"), torch.arange(64, device="meta")[None])
    assert cos.device.type == sin.device.type == "meta" and cos.shape == (1, 64, rope.head_dim)
    assert rope._table is None


def test_dynamic_ntk_follows_the_official_stateful_update():
    """Growing past max_position_embeddings recomputes the frequencies; a short sequence afterwards resets them;
    a long-but-shorter one keeps the larger cached frequencies. Same sequence of calls, same outputs."""
    official_config, ours = configs(ROPE_CASES["dynamic"])
    official, mine = LlamaRotaryEmbedding(official_config), RotaryEmbedding(ours)
    x = torch.zeros(1)
    first_long = None
    for length in (10, 100, 150, 120, 20, 90):
        positions = torch.arange(length)[None]
        (cos_ref, sin_ref), (cos, sin) = official(x, positions), mine(x, positions)
        torch.testing.assert_close(cos, cos_ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, sin_ref, rtol=0, atol=1e-6)
        if length == 100:
            first_long = cos
    short = RotaryEmbedding(ours)(x, torch.arange(100)[None])[0]
    plain_config = TinyCausalConfig(**{**SIZES, "max_position_embeddings": 128}, num_hidden_layers=1, intermediate_size=8)
    default = RotaryEmbedding(plain_config)(x, torch.arange(100)[None])[0]
    assert torch.equal(short, first_long)
    assert not torch.allclose(first_long, default, atol=1e-3)  # negative control: NTK scaling did kick in


# Lengths (max position + 1) around max_position_embeddings = 64, in an order that meets both stateful rules at
# their boundary: growth past the cached length (seq_len > cached: 64 keeps, 65 grows) and the reset to the
# original frequencies (seq_len < 64 after growing: 63 resets, 64 and 65 keep the grown ones).
DYNAMIC_BOUNDARY_LENGTHS = (63, 64, 65, 64, 63, 64, 100, 64, 65, 63, 65, 66, 65, 64, 63, 63)


def test_dynamic_ntk_at_max_position_embeddings_and_one_either_side():
    """Each call's cos/sin bit for bit those of official's module after the same calls (both are stateful)."""
    official_config, ours = configs(ROPE_CASES["dynamic"])
    assert ours.max_position_embeddings == 64
    official, mine = LlamaRotaryEmbedding(official_config), RotaryEmbedding(ours)
    x = torch.zeros(1)
    produced = {}
    for step, length in enumerate(DYNAMIC_BOUNDARY_LENGTHS):
        positions = torch.arange(length)[None]
        (cos_ref, sin_ref), (cos, sin) = official(x, positions), mine(x, positions)
        assert torch.equal(cos, cos_ref) and torch.equal(sin, sin_ref), (step, length)
        produced.setdefault(length, []).append(cos[0, -1])
    # The calls really reach different states at the boundary, so a rule off by one there changes the outputs.
    # Length 64 ran with the original frequencies (calls 1 and 5), 65's (call 3), 100's (call 7), 66's (call 13);
    # length 65 with its own (calls 2 and 10), 100's (call 8), 66's (call 12).
    at_64, at_65 = produced[64], produced[65]
    assert torch.equal(at_64[0], at_64[2]) and torch.equal(at_65[0], at_65[2])
    assert len({tuple(cos.tolist()) for cos in at_64}) == 4 and len({tuple(cos.tolist()) for cos in at_65}) == 3


def test_init_buffers_rebuilds_garbage_inv_freq():
    _, ours = configs(ROPE_CASES["yarn"])
    rope = RotaryEmbedding(ours)
    expected = rope.inv_freq.clone()
    rope.inv_freq.fill_(float("nan"))
    rope.original_inv_freq.zero_()
    rope._init_buffers()
    assert torch.equal(rope.inv_freq, expected) and torch.equal(rope.original_inv_freq, expected)


def test_apply_rotary_is_a_rotation_relative_in_position():
    """<rot(q, m), rot(k, n)> depends only on m - n: the property RoPE exists for."""
    _, ours = configs(ROPE_CASES["default"])
    rope = RotaryEmbedding(ours)
    q, k = torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32)

    def score(m, n):
        cos_m, sin_m = rope(q, torch.tensor([[m]]))
        cos_n, sin_n = rope(q, torch.tensor([[n]]))
        q_rot, _ = apply_rotary(q, q, cos_m, sin_m)
        k_rot, _ = apply_rotary(k, k, cos_n, sin_n)
        return float((q_rot * k_rot).sum())

    assert score(7, 3) == pytest.approx(score(14, 10), abs=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 5), abs=1e-3)


def test_legacy_spellings_are_standardized():
    params = standardize_rope_parameters({"type": "linear", "factor": 2.0}, max_position_embeddings=64, rope_theta=500.0)
    assert params == {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}
    config = TinyCausalConfig(**SIZES, num_hidden_layers=1, intermediate_size=8, rope_scaling={"type": "dynamic", "factor": 2.0}, rope_theta=50.0)
    assert config.rope_parameters == {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 50.0}
    yarn = standardize_rope_parameters({"rope_type": "yarn", "factor": 2.0}, max_position_embeddings=64)
    assert yarn["original_max_position_embeddings"] == 64 and yarn["rope_theta"] == 10000.0


def test_layer_type_rope_beside_transformers_5_16_flat_leftovers():
    """transformers 5.16-5.17 build Gemma 3's rope_parameters with a flat rope_type / rope_theta beside the layer
    types, which their rotary embeddings never read: the same config as without them. Any other key is refused."""
    keyed = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    fields = dict(SIZES, num_hidden_layers=2, intermediate_size=8, sliding_window=4,
                  layer_types=["sliding_attention", "full_attention"])
    plain = TinyCausalConfig(**fields, rope_parameters=keyed)
    leftovers = TinyCausalConfig(**fields, rope_parameters={**keyed, "rope_type": "default", "rope_theta": None})
    assert leftovers.rope_parameters == plain.rope_parameters
    assert plain.rope_parameters["full_attention"]["rope_theta"] == 1e6
    with pytest.raises(ValueError, match=r"may hold only \['full_attention', 'sliding_attention'\]; got keys \['factor'\]"):
        TinyCausalConfig(**fields, rope_parameters={**keyed, "factor": 2.0})


@pytest.mark.parametrize(
    "rope, message",
    [
        ({"rope_type": "longrope"}, "needs the field 'short_factor'"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 3}, "'long_factor'] has 3 entries"),
        ({"rope_type": "longrope", "short_factor": [1.0, "x"], "long_factor": [2.0]}, "must be a list of positive numbers, got [1.0, 'x']"),
        ({"rope_type": "yarn_v9", "factor": 2.0}, "unknown rope_parameters['rope_type'] 'yarn_v9'"),
        ({"rope_type": "linear"}, "needs the field 'factor'"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "needs the field 'high_freq_factor'"),
        ({"rope_type": "dynamic", "factor": "2"}, "rope_parameters['factor'] must be a number, got '2'"),
        ({"rope_type": "default", "rope_theta": -1.0}, "rope_theta'] must be > 0, got -1.0"),
        ({"rope_type": "default", "partial_rotary_factor": 1.5}, "partial_rotary_factor'] must be in (0, 1], got 1.5"),
        ({"rope_type": "default", "partial_rotary_factor": 0.01}, "partial_rotary_factor 0.01 = 0 rotary dimensions"),
        ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0}, "original_max_position_embeddings"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0}, "must differ"),
    ],
)
def test_bad_rope_parameters_name_field_and_value(rope, message):
    with pytest.raises(ValueError) as error:
        TinyCausalConfig(**SIZES, num_hidden_layers=1, intermediate_size=8, rope_parameters=rope)
    assert message in str(error.value)
    assert "TinyCausalConfig" in str(error.value)


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_positions_past_max_position_embeddings_match_official_logits(case):
    """Official Llama rotates any position, so checkpoints run past max_position_embeddings (the pre-scaling
    length for linear / yarn / llama3). 100 tokens on max_position_embeddings=64: logits equal official's."""
    from causal_helpers import max_diff, tiny_official

    official = tiny_official("llama", rope_parameters=dict(ROPE_CASES[case]))
    fields = {k: v for k, v in official.config.to_dict().items() if k in TinyCausalConfig().to_dict()}
    for name in ("architectures", "transformers_version", "model_type"):
        fields.pop(name, None)
    ours = TinyCausalForCausalLM(TinyCausalConfig(**fields)).eval()
    ours.load_state_dict(official.state_dict())
    ids = torch.randint(3, 97, (2, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = official(ids).logits
        produced = ours(ids).logits
    assert max_diff(produced, expected) <= 1e-5 * max(1.0, float(expected.abs().max()))
    # negative control: positions clamped to the table (what a cap would silently give) differ past it
    clamped = torch.arange(100).clamp(max=63)[None].expand(2, -1)
    with torch.no_grad():
        wrong = ours(ids, position_ids=clamped).logits
    assert max_diff(wrong[:, 64:], expected[:, 64:]) > 1e-2
