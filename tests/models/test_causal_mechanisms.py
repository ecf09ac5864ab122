"""The causal config's optional mechanisms as tables (hf_tiny/causal_mechanisms.py): a config holds a table's fields
(and its config.json lists them) exactly while the mechanism is in use, reads every table typed whether it holds it
or not, and loads every config.json an earlier version wrote as that version did (issue 43, item 4)."""

from __future__ import annotations

import json

import pytest
import torch
from causal_config_snapshots import FIXTURE, NEWER_OPTIONAL_FIELDS, OPTIONAL_FIELDS, comparable, loaded_fields
from causal_config_snapshots import optional_readings, without_version

from hf_tiny import TinyCausalConfig
from hf_tiny.causal_mechanisms import mechanism_views
from hf_tiny.moe import Moe
from hf_tiny.configuration_causal import field_value

FIXTURE_DATA = json.loads(FIXTURE.read_text())
SNAPSHOTS, OFF = FIXTURE_DATA["snapshots"], FIXTURE_DATA["off"]
SHAPES = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2)
MOE_FIELDS = {
    "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "router_scoring", "norm_topk_prob", "n_group",
    "topk_group", "routed_scaling_factor", "shared_expert_intermediate_size", "shared_expert_gate", "mlp_layer_types",
    "router_aux_loss_coef", "router_jitter_noise", "output_router_logits",
}
# A config that uses one mechanism -> the fields its config.json holds beyond a dense Llama's.
IN_USE = {
    "moe": (dict(num_local_experts=4), MOE_FIELDS),
    "mla": (dict(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_key_value_heads=None),
            {"kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mla_absorb"}),
    "mtp": (dict(num_nextn_predict_layers=1), {"num_nextn_predict_layers", "mtp_loss_weight"}),
    "alibi": (dict(position_embedding_type="alibi"), {"alibi_bias_max"}),
    "nope": (dict(nope_layers=[3, 1]), {"nope_layers"}),
    "qk_norm_type": (dict(qk_norm=True, qk_norm_type="projection"), {"qk_norm_type"}),
    "pre_norms": (dict(pre_norms=False, sandwich_norms=True), {"pre_norms"}),
    "use_padding_idx": (dict(use_padding_idx=False), {"use_padding_idx"}),
    "temperature": (dict(nope_layers=[1], attn_temperature_tuning=True),
                    {"nope_layers", "attn_temperature_tuning", "floor_scale", "attn_scale"}),
    "chunked": (dict(layer_types=["chunked_attention", "full_attention"] * 2, attention_chunk_size=4),
                {"attention_chunk_size"}),
    "router_input_weights": (dict(num_local_experts=4, apply_router_weight_on_input=True),
                             MOE_FIELDS | {"apply_router_weight_on_input"}),
    "sinks": (dict(attention_sinks=True), {"attention_sinks"}),
    "moe_biases": (dict(num_local_experts=4, expert_bias=True), MOE_FIELDS | {"router_bias", "expert_bias"}),
    "clamped_swiglu": (dict(swiglu_limit=7.0), {"swiglu_limit", "swiglu_alpha"}),
}


def typed_value(config: TinyCausalConfig, name: str):
    """The optional field `name` read through the table that holds it (config.moe.num_local_experts)."""
    views = [view_name for view_name, view in mechanism_views(TinyCausalConfig).items() if name in view.table.field_names()]
    assert len(views) == 1, (name, views)
    return getattr(getattr(config, views[0]), name)


@pytest.mark.parametrize("mechanism", sorted(IN_USE))
def test_a_config_holds_a_mechanism_fields_exactly_while_it_uses_it(mechanism):
    fields, expected = IN_USE[mechanism]
    dense = set(TinyCausalConfig(**SHAPES).to_dict())
    assert not dense & {*OPTIONAL_FIELDS, *NEWER_OPTIONAL_FIELDS}
    held = set(TinyCausalConfig(**{**SHAPES, **fields}).to_dict()) - dense
    assert held == expected


def test_a_dense_config_reads_every_table_with_its_off_values():
    config = TinyCausalConfig(**SHAPES)
    assert not any(hasattr(config, name) for name in (*OPTIONAL_FIELDS, *NEWER_OPTIONAL_FIELDS))  # nothing a tool could take for MoE
    assert config.moe == Moe() and config.moe.num_local_experts == 0 and not config.moe.in_use(config)
    assert config.mla.kv_lora_rank is None and config.mtp.num_nextn_predict_layers == 0
    assert config.sinks.attention_sinks is False and config.clamped_swiglu.swiglu_limit is None
    assert config.nope.nope_layers == () and config.padding_row.use_padding_idx is True
    assert config.alibi_bias.alibi_bias_max == 8.0 and config.norm_layout.pre_norms is True


def test_a_field_set_after_init_is_what_its_table_reads():
    config = TinyCausalConfig(**SHAPES, num_local_experts=4)
    assert config.moe.output_router_logits is False
    config.output_router_logits = True
    config.num_experts = 6  # the official alias (attribute_map) of num_local_experts
    assert config.moe.output_router_logits is True and config.moe.num_local_experts == 6


def test_a_table_view_is_read_only_and_names_its_fields():
    config = TinyCausalConfig(**SHAPES)
    with pytest.raises(AttributeError, match=r"TinyCausalConfig.moe is a view of the fields \['num_local_experts'"):
        config.moe = Moe(num_local_experts=4)
    assert "moe" not in config.to_dict()


def test_a_table_reads_inside_a_fullgraph_compiled_function():
    """Forwards read tables per call (the query temperature, chunk sizes, ALiBi slopes, MLA's absorption): the read
    must trace without a graph break (dataclasses.fields, which a view once called per read, does not)."""
    config = TinyCausalConfig(**SHAPES, nope_layers=[1], attn_temperature_tuning=True, attn_scale=0.5)

    def scaled(x):
        temperature = config.attn_temperature
        return x * temperature.attn_scale if temperature.attn_temperature_tuning else x

    torch._dynamo.reset()
    assert torch.equal(torch.compile(scaled, fullgraph=True)(torch.ones(2)), torch.full((2,), 0.5))


def test_field_value_for_conversion_reads_the_tables():
    config = TinyCausalConfig(**SHAPES, swiglu_limit=7.0)
    assert field_value(config, "swiglu_limit") == 7.0 and field_value(config, "num_local_experts") == 0
    assert field_value(config, "hidden_size") == 32
    with pytest.raises(AttributeError, match="TinyCausalConfig has no field 'no_such_field'"):
        field_value(config, "no_such_field")


def test_the_snapshots_cover_every_mechanism():
    """The fixture is worth its size only if old config.json files of every mechanism are in it."""
    held = {name for snapshot in SNAPSHOTS.values() for name in snapshot["written"]}
    assert set(OPTIONAL_FIELDS) <= held, sorted(set(OPTIONAL_FIELDS) - held)


@pytest.mark.parametrize("name", sorted(SNAPSHOTS))
def test_config_json_of_an_earlier_version_loads_and_saves_as_it_did(name):
    snapshot = SNAPSHOTS[name]
    config = TinyCausalConfig.from_dict(snapshot["written"])
    assert comparable(without_version(config.to_dict())) == without_version(loaded_fields(snapshot))
    assert {field: comparable(typed_value(config, field)) for field in OPTIONAL_FIELDS} == optional_readings(snapshot, OFF)
    resaved = json.loads(config.to_json_string(use_diff=True))
    assert without_version(resaved) == without_version(snapshot["written"])  # the same keys, the same values
