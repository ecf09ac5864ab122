"""config.json files an earlier hf_tiny wrote for causal models, with what that version read from each: the fixture
tests/golden/causal_configs.json that tests/models/test_causal_mechanisms.py loads with today's code.

Written once with hf_tiny at 36aebb4 (the last version with the optional fields in name-keyed tables) and
transformers 5.24.0, from the config.json of every causal model tests/conversion/ (test_2025_families, test_llama,
test_gpt_oss, test_gpt2, test_phi3, test_gguf_architectures, test_pipeline, test_streaming, test_file_modes) wrote,
captured at PretrainedConfig.to_json_file, and of the golden models (golden.py's CAUSAL). Regenerating it with
today's code would prove nothing; with the old code first on the path:

    PYTHONPATH=<a checkout of 36aebb4> python tests/helpers/causal_config_snapshots.py CAPTURED_DIR
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "golden" / "causal_configs.json"  # {"off": {...}, "snapshots": {...}}

# Every optional field of TinyCausalConfig (held only while its mechanism is in use), written out.
OPTIONAL_FIELDS = (
    "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "router_scoring", "norm_topk_prob", "n_group",
    "topk_group", "routed_scaling_factor", "shared_expert_intermediate_size", "shared_expert_gate", "mlp_layer_types",
    "router_aux_loss_coef", "router_jitter_noise", "output_router_logits",
    "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mla_absorb",
    "num_nextn_predict_layers", "mtp_loss_weight", "alibi_bias_max", "nope_layers", "qk_norm_type", "pre_norms",
    "attention_chunk_size", "attn_temperature_tuning", "floor_scale", "attn_scale", "apply_router_weight_on_input",
    "attention_sinks", "router_bias", "expert_bias", "swiglu_limit", "swiglu_alpha", "use_padding_idx",
)
# Optional fields added after the snapshots were written: a config.json of that time holds none of them and reads
# each as its table's "off" value (tests/models/test_causal_mechanisms.py).
NEWER_OPTIONAL_FIELDS = ("norm_product_float32", "rope_float32", "longrope_cache_kept")


def comparable(value):
    """A value as JSON holds it (tuples become lists), so that readings compare across a round trip."""
    return json.loads(json.dumps(value))


def without_version(config_dict: dict) -> dict:
    return {key: value for key, value in config_dict.items() if key != "transformers_version"}


def loaded_fields(snapshot: dict) -> dict:
    """What the earlier version's config held after loading a snapshot's config.json (its to_dict())."""
    return {**snapshot["written"], **snapshot["loaded_besides"]}


def optional_readings(snapshot: dict, off: dict) -> dict:
    """What the earlier version read for every optional field: the field where the config held it, else its off
    value."""
    loaded = loaded_fields(snapshot)
    return {name: loaded[name] if name in loaded else off[name] for name in OPTIONAL_FIELDS}


def _snapshot(written: dict, off: dict) -> dict:
    from hf_tiny.configuration_causal import TinyCausalConfig, field_value

    config = TinyCausalConfig.from_dict(written)
    resaved = json.loads(config.to_json_string(use_diff=True))
    assert without_version(resaved) == without_version(written), "the old version does not save what it loaded"
    loaded = comparable(without_version(config.to_dict()))
    snapshot = {"written": written,
                "loaded_besides": {k: v for k, v in loaded.items() if k not in written or written[k] != v}}
    assert loaded_fields(snapshot) == {**loaded, **({"transformers_version": written["transformers_version"]}
                                                    if "transformers_version" in written else {})}
    read = comparable({name: field_value(config, name) for name in OPTIONAL_FIELDS})
    assert optional_readings(snapshot, off) == read, "the compact form would lose what the old version read"
    return snapshot


def _golden_configs() -> dict[str, dict]:
    from golden import CAUSAL, CAUSAL_BASE
    from hf_tiny import TinyCausalConfig

    written = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, fields in CAUSAL.items():
            TinyCausalConfig(**{**CAUSAL_BASE, **fields}).save_pretrained(folder)
            written[f"golden_{name}"] = json.loads((Path(folder) / "config.json").read_text())
    return written


def write(captured: Path) -> None:
    import hf_tiny.configuration_causal as old

    assert hasattr(old, "OPTIONAL_FIELDS"), f"{old.__file__} is not the earlier version (put 36aebb4 first on the path)"
    from hf_tiny.configuration_causal import TinyCausalConfig, field_value

    dense = TinyCausalConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4)
    off = comparable({name: field_value(dense, name) for name in OPTIONAL_FIELDS})
    written = _golden_configs()
    for index, path in enumerate(sorted(captured.glob("*.json"))):
        config = json.loads(path.read_text())
        kind = config.get("architectures", ["config"])[0]
        written[f"conversion_{index:03d}_{kind}"] = config
    snapshots = {name: _snapshot(config, off) for name, config in written.items()}
    lines = [f"{json.dumps(name)}: {json.dumps(snapshot, sort_keys=True)}" for name, snapshot in sorted(snapshots.items())]
    FIXTURE.write_text('{"off": ' + json.dumps(off, sort_keys=True) + ',\n"snapshots": {\n' + ",\n".join(lines) + "\n}}\n")
    print(f"wrote {len(snapshots)} snapshots to {FIXTURE}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    write(Path(sys.argv[1]))
