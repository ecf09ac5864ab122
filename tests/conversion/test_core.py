"""Tests of the conversion building blocks (readers, GGUF, key maps, writer, cards) and the CLI error handling, on small fake checkpoints (no model family needed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from conversion import writer
from conversion.__main__ import FAMILIES, main
from conversion.gguf_files import gguf_tensors
from conversion import (
    ConversionError,
    KeyMap,
    Rule,
    Transform,
    atomic_output_dir,
    cast_floating,
    check_shapes,
    copy_tokenizer_files,
    expected_shapes,
    load_checkpoint,
    load_config_json,
    load_gguf,
    max_abs_diff,
    parse_dtype,
    render_model_card,
    require_model_type,
    save_state_dict_safetensors,
    write_model_card,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def assert_same_state(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a[key], b[key]), key


def random_state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "emb.weight": torch.randn(10, 4, generator=generator),
        "layer.0.w": torch.randn(4, 4, generator=generator),
        "layer.1.w": torch.randn(4, 4, generator=generator).to(torch.bfloat16),
        "ids": torch.arange(6),
    }


# ---------------------------------------------------------------------------------------------------------------
# KeyMap
# ---------------------------------------------------------------------------------------------------------------

# The Meta -> HF RoPE permutation of q/k rows (interleaved pairs -> two halves), exactly invertible.
def rope_permute(weight: torch.Tensor, heads: int = 2) -> torch.Tensor:
    rows, cols = weight.shape
    return weight.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def rope_unpermute(weight: torch.Tensor, heads: int = 2) -> torch.Tensor:
    rows, cols = weight.shape
    return weight.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


ROPE = Transform("rope_permute", rope_permute, rope_unpermute)
SPLIT_QKV = Transform(
    "split_qkv",
    lambda fused: tuple(t.clone() for t in fused.chunk(3, dim=0)),
    lambda q, k, v: torch.cat([q, k, v], dim=0),
)


def bert_like_map() -> KeyMap:
    return KeyMap(
        [
            ("emb.word.weight", ("embed_tokens.weight", "lm_head.weight")),  # one source tensor, two tied targets
            ("enc.{i}.q.weight", "layers.{i}.q_proj.weight", ROPE),
            ("enc.{i}.qkv.weight", ("layers.{i}.a.weight", "layers.{i}.b.weight", "layers.{i}.c.weight"), SPLIT_QKV),
            Rule("enc.{i}.q.bias", "layers.{i}.q_proj.bias", optional=True),
            ("final_norm.weight", "norm.weight"),  # a rule without placeholder
        ],
        ignore=[r"emb\.position_ids", r"enc\.\d+\.rotary\.inv_freq"],
    )


def bert_like_state(num_layers: int = 3, *, with_bias: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    state = {"emb.word.weight": torch.randn(11, 8, generator=generator), "final_norm.weight": torch.randn(8)}
    for i in range(num_layers):
        state[f"enc.{i}.q.weight"] = torch.randn(8, 8, generator=generator).to(torch.bfloat16)
        state[f"enc.{i}.qkv.weight"] = torch.randn(24, 8, generator=generator)
        if with_bias:
            state[f"enc.{i}.q.bias"] = torch.randn(8, generator=generator)
    return state


def test_keymap_round_trip_is_bit_exact_and_drops_only_ignored_keys():
    source = bert_like_state()
    with_buffers = {**source, "emb.position_ids": torch.arange(8), "enc.1.rotary.inv_freq": torch.ones(4)}
    keymap = bert_like_map()
    target = keymap.to_target(with_buffers, num_layers=3)
    assert "layers.2.c.weight" in target and "norm.weight" in target
    assert torch.equal(target["layers.1.b.weight"], source["enc.1.qkv.weight"][8:16])
    # the transform really ran: the RoPE permutation moves rows
    assert not torch.equal(target["layers.0.q_proj.weight"], source["enc.0.q.weight"])
    assert target["layers.0.q_proj.weight"].dtype == torch.bfloat16
    back = keymap.to_source(target, num_layers=3)
    assert_same_state(back, source)


@settings(max_examples=25, deadline=None)
@given(
    num_layers=st.integers(0, 4),
    with_bias=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_keymap_round_trip_property(num_layers, with_bias, dtype, seed):
    source = cast_floating(bert_like_state(num_layers, with_bias=with_bias, seed=seed), dtype)
    target = bert_like_map().to_target(source, num_layers=num_layers)
    assert len(target) == 3 + num_layers * (4 + with_bias)
    assert_same_state(bert_like_map().to_source(target, num_layers=num_layers), source)


def test_keymap_unknown_and_missing_keys_are_all_named():
    source = bert_like_state()
    del source["enc.1.qkv.weight"]
    del source["final_norm.weight"]
    source["enc.0.mystery.weight"] = torch.zeros(2)
    source["pooler.dense.weight"] = torch.zeros(2)
    with pytest.raises(ConversionError) as raised:
        bert_like_map().to_target(source, num_layers=3)
    message = str(raised.value)
    for key in ("enc.1.qkv.weight", "final_norm.weight", "enc.0.mystery.weight", "pooler.dense.weight"):
        assert key in message
    assert "missing" in message and "unexpected" in message


def test_keymap_layer_count_is_checked_both_ways():
    source = bert_like_state(num_layers=3)
    with pytest.raises(ConversionError, match=r"enc\.3\.q\.weight"):  # asked for 4 layers, 3 present
        bert_like_map().to_target(source, num_layers=4)
    with pytest.raises(ConversionError, match=r"enc\.2\.q\.weight"):  # asked for 2 layers, 3 present
        bert_like_map().to_target(source, num_layers=2)


def test_keymap_optional_rule_may_be_absent_everywhere_but_not_partially():
    no_bias = bert_like_state(with_bias=False)
    target = bert_like_map().to_target(no_bias, num_layers=3)
    assert not any(key.endswith("q_proj.bias") for key in target)
    assert_same_state(bert_like_map().to_source(target, num_layers=3), no_bias)

    partial = bert_like_state(with_bias=True)
    del partial["enc.1.q.bias"]
    with pytest.raises(ConversionError, match=r"enc\.1\.q\.bias"):
        bert_like_map().to_target(partial, num_layers=3)


def test_keymap_ignored_source_keys_are_dropped_but_unlisted_buffers_are_not():
    source = bert_like_state()
    target = bert_like_map().to_target({**source, "emb.position_ids": torch.arange(4)}, num_layers=3)
    assert not any("position" in key for key in target)
    with pytest.raises(ConversionError, match=r"emb\.token_type_ids"):
        bert_like_map().to_target({**source, "emb.token_type_ids": torch.zeros(4)}, num_layers=3)


def test_keymap_ignore_target_applies_to_the_reverse_direction():
    keymap = KeyMap([("a", "x")], ignore_target=[r"rope\.inv_freq"])
    assert keymap.to_source({"x": torch.ones(2), "rope.inv_freq": torch.ones(2)}, num_layers=0).keys() == {"a"}
    with pytest.raises(ConversionError, match=r"rope\.inv_freq"):
        keymap.to_target({"a": torch.ones(2), "rope.inv_freq": torch.ones(2)}, num_layers=0)


def test_keymap_tied_targets_must_be_identical_when_mapping_back():
    target = bert_like_map().to_target(bert_like_state(), num_layers=3)
    assert torch.equal(target["embed_tokens.weight"], target["lm_head.weight"])
    target["lm_head.weight"] = target["lm_head.weight"] + 1
    with pytest.raises(ConversionError, match=r"embed_tokens\.weight and lm_head\.weight"):
        bert_like_map().to_source(target, num_layers=3)


def test_keymap_several_tied_sources_collapse_to_one_target():
    shared = torch.randn(5, 3)
    keymap = KeyMap([(("shared.weight", "encoder.embed_tokens.weight"), "embed_tokens.weight")])
    target = keymap.to_target({"shared.weight": shared, "encoder.embed_tokens.weight": shared.clone()}, num_layers=0)
    assert list(target) == ["embed_tokens.weight"]
    back = keymap.to_source(target, num_layers=0)
    assert torch.equal(back["shared.weight"], shared) and torch.equal(back["encoder.embed_tokens.weight"], shared)
    with pytest.raises(ConversionError, match="tied"):
        keymap.to_target({"shared.weight": shared, "encoder.embed_tokens.weight": shared + 1}, num_layers=0)


def test_keymap_separate_layer_counts_per_placeholder():
    keymap = KeyMap([("enc.{i}.w", "encoder.layers.{i}.w"), ("dec.{j}.w", "decoder.layers.{j}.w")])
    source = {"enc.0.w": torch.ones(1), "enc.1.w": torch.ones(1), "dec.0.w": torch.zeros(1)}
    target = keymap.to_target(source, num_layers={"i": 2, "j": 1})
    assert sorted(target) == ["decoder.layers.0.w", "encoder.layers.0.w", "encoder.layers.1.w"]
    with pytest.raises(ValueError, match=r"\{j\}"):
        keymap.to_target(source, num_layers={"i": 2})


def test_keymap_rejects_malformed_rules():
    with pytest.raises(ValueError, match="placeholders"):
        Rule("enc.{i}.w", "layers.w")
    with pytest.raises(ValueError, match=r"layers\.0\.w"):
        KeyMap([("a.{i}", "layers.{i}.w"), ("b.{i}", "layers.{i}.w")]).to_target({}, num_layers=1)
    with pytest.raises(TypeError, match="rule"):
        KeyMap(["just-a-string"])
    with pytest.raises(ValueError, match="num_layers"):
        KeyMap([("a.{i}", "b.{i}")]).to_target({}, num_layers=-1)


def test_keymap_transform_that_returns_the_wrong_count_is_reported():
    bad = Transform("bad_split", lambda x: (x, x), lambda a, b, c: a)
    keymap = KeyMap([("fused", ("a", "b", "c"), bad)])
    with pytest.raises(ConversionError, match="bad_split.*2 tensors for 3 keys"):
        keymap.to_target({"fused": torch.ones(3)}, num_layers=0)


def test_keymap_progress_bar_goes_to_stderr(capsys):
    bert_like_map().to_target(bert_like_state(), num_layers=3, progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "mapping tensors" in captured.err


# ---------------------------------------------------------------------------------------------------------------
# check_shapes and small helpers
# ---------------------------------------------------------------------------------------------------------------


def test_check_shapes_names_every_wrong_missing_and_unexpected_key():
    expected = {"a": torch.Size([2, 3]), "b": torch.Size([4]), "c": torch.Size([1]), "d": torch.Size([5])}
    state = {"a": torch.zeros(3, 2), "b": torch.zeros(5), "c": torch.zeros(1), "extra": torch.zeros(1)}
    with pytest.raises(ConversionError) as raised:
        check_shapes(state, expected)
    message = str(raised.value)
    assert "a (expected (2, 3), got (3, 2))" in message
    assert "b (expected (4,), got (5,))" in message
    assert "missing tensors: d" in message and "unexpected tensors: extra" in message
    assert " c " not in message and "c (" not in message
    check_shapes({"c": torch.zeros(1)}, {"c": torch.Size([1])})  # a match raises nothing


def test_expected_shapes_from_a_meta_module():
    with torch.device("meta"):
        module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    assert expected_shapes(module) == {
        "0.weight": torch.Size([4, 3]),
        "0.bias": torch.Size([4]),
        "1.weight": torch.Size([4]),
        "1.bias": torch.Size([4]),
    }


def test_max_abs_diff():
    assert max_abs_diff(torch.tensor([1.0, 2.0, -3.0]), torch.tensor([1.0, 2.5, -3.25])) == 0.5
    assert max_abs_diff(torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([1.0])) == 0.0
    assert np.isnan(max_abs_diff(torch.tensor([float("nan")]), torch.tensor([0.0])))
    with pytest.raises(ValueError, match=r"\(2,\) and \(3,\)"):
        max_abs_diff(torch.zeros(2), torch.zeros(3))


def test_parse_dtype_and_cast_floating():
    assert parse_dtype("bfloat16") is torch.bfloat16 and parse_dtype(None) is None
    with pytest.raises(ValueError, match="'float8'"):
        parse_dtype("float8")
    cast = cast_floating({"w": torch.ones(2), "ids": torch.arange(2)}, torch.float16)
    assert cast["w"].dtype == torch.float16 and cast["ids"].dtype == torch.int64


def test_require_model_type_names_the_value():
    assert require_model_type({"model_type": "bert"}, "bert", src="x") == "bert"
    with pytest.raises(ConversionError, match=r"model_type='gpt2'"):
        require_model_type({"model_type": "gpt2"}, ["bert", "roberta"], src="some/dir")


# ---------------------------------------------------------------------------------------------------------------
# Reading checkpoints
# ---------------------------------------------------------------------------------------------------------------


def test_load_single_safetensors_folder_and_file(tmp_path):
    state = random_state()
    save_file(state, tmp_path / "model.safetensors")
    assert_same_state(load_checkpoint(tmp_path), state)
    assert_same_state(load_checkpoint(tmp_path / "model.safetensors"), state)


def write_sharded(folder: Path, state: dict, *, fmt: str = "safetensors") -> None:
    keys = sorted(state)
    halves = {f"model-0000{n + 1}-of-00002.{fmt}": keys[n::2] for n in range(2)}
    for shard, shard_keys in halves.items():
        part = {key: state[key] for key in shard_keys}
        save_file(part, folder / shard) if fmt == "safetensors" else torch.save(part, folder / shard)
    index = {"metadata": {}, "weight_map": {key: shard for shard, ks in halves.items() for key in ks}}
    name = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    (folder / name).write_text(json.dumps(index))


def test_load_sharded_safetensors_with_index(tmp_path):
    state = random_state()
    write_sharded(tmp_path, state)
    assert_same_state(load_checkpoint(tmp_path), state)


def test_load_sharded_bin_with_index(tmp_path):
    state = random_state()
    write_sharded(tmp_path, state, fmt="bin")
    assert_same_state(load_checkpoint(tmp_path), state)


def test_index_pointing_at_a_missing_shard_names_it(tmp_path):
    write_sharded(tmp_path, random_state())
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConversionError, match=r"missing shard.*model-00002-of-00002\.safetensors"):
        load_checkpoint(tmp_path)


def test_shard_lacking_a_tensor_of_its_index_names_it(tmp_path):
    state = random_state()
    write_sharded(tmp_path, state)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ConversionError, match=r"model-00001-of-00002\.safetensors lacks.*ghost\.weight"):
        load_checkpoint(tmp_path)


def test_index_without_weight_map_is_refused(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ConversionError, match="weight_map"):
        load_checkpoint(tmp_path)


def test_pytorch_bin_loaded_with_weights_only(tmp_path):
    state = random_state()
    torch.save(state, tmp_path / "pytorch_model.bin")
    assert_same_state(load_checkpoint(tmp_path), state)


class _RunsCodeWhenUnpickled:
    """A pickle payload that would create a file if it were ever unpickled without weights_only."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_pickle_needing_more_than_weights_only_is_refused_without_running_code(tmp_path):
    marker = tmp_path / "code-ran"
    torch.save({"w": torch.ones(2), "payload": _RunsCodeWhenUnpickled(marker)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ConversionError) as raised:
        load_checkpoint(tmp_path)
    assert "refusing to load" in str(raised.value) and "pytorch_model.bin" in str(raised.value)
    assert "weights_only" in str(raised.value)
    assert not marker.exists()


def test_pickle_with_plain_non_tensor_values_is_not_a_state_dict(tmp_path):
    torch.save({"w": torch.ones(2), "step": 3}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="not tensors: step"):
        load_checkpoint(tmp_path)
    torch.save([torch.ones(2)], tmp_path / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="holds a list"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("keep", [0.5, 0.01])
def test_truncated_safetensors_is_reported_with_its_path(tmp_path, keep):
    save_file(random_state(), tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ConversionError, match=r"model\.safetensors is not a valid safetensors file"):
        load_checkpoint(tmp_path)


def test_garbage_safetensors_and_truncated_bin_are_reported(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ConversionError, match="not a valid safetensors"):
        load_checkpoint(tmp_path / "model.safetensors")
    torch.save(random_state(), tmp_path / "pytorch_model.bin")
    data = (tmp_path / "pytorch_model.bin").read_bytes()
    (tmp_path / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError, match=r"pytorch_model\.bin is not a readable PyTorch weights file"):
        load_checkpoint(tmp_path / "pytorch_model.bin")


def test_folder_without_weights_lists_what_it_holds(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConversionError, match=r"no weights found in .*config\.json"):
        load_checkpoint(tmp_path)
    with pytest.raises(ConversionError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_load_config_json(tmp_path):
    with pytest.raises(ConversionError, match="no config.json"):
        load_config_json(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "bert",}')
    with pytest.raises(ConversionError, match="not valid JSON"):
        load_config_json(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConversionError, match="expected an object"):
        load_config_json(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    assert load_config_json(tmp_path) == {"model_type": "bert"}


# ---------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------


def test_save_state_dict_safetensors_handles_tied_and_view_tensors(tmp_path):
    embedding = torch.randn(6, 4)
    state = {"embed.weight": embedding, "lm_head.weight": embedding, "half": embedding[:3], "t": embedding.t()}
    save_state_dict_safetensors(state, tmp_path / "model.safetensors")
    loaded = load_checkpoint(tmp_path / "model.safetensors")
    assert_same_state(loaded, {k: v.contiguous() for k, v in state.items()})
    with pytest.raises(ValueError, match="meta"):
        save_state_dict_safetensors({"w": torch.empty(2, device="meta")}, tmp_path / "x.safetensors")


def listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def existing_destination(tmp_path: Path) -> Path:
    dst = tmp_path / "out"
    (dst / "sub").mkdir(parents=True)
    (dst / "model.safetensors").write_bytes(b"old weights")
    (dst / "sub" / "config.json").write_text('{"old": true}')
    return dst


def test_atomic_output_dir_success_creates_dst_and_leaves_nothing_beside(tmp_path):
    with atomic_output_dir(tmp_path / "out") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.tmp-")
        (tmp / "a.txt").write_text("new")
    assert listing(tmp_path / "out") == {"a.txt": b"new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("exception", [RuntimeError("boom"), KeyboardInterrupt()])
@pytest.mark.parametrize("dst_exists", [False, True])
def test_atomic_output_dir_failure_leaves_dst_untouched(tmp_path, exception, dst_exists):
    dst = existing_destination(tmp_path) if dst_exists else tmp_path / "out"
    before = listing(dst) if dst_exists else None
    with pytest.raises(type(exception)):
        with atomic_output_dir(dst, force=True) as tmp:
            (tmp / "model.safetensors").write_bytes(b"half-written")
            raise exception
    assert (listing(dst) if dst.exists() else None) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if dst_exists else [])


def test_atomic_output_dir_refuses_existing_dst_without_force_before_any_work(tmp_path):
    dst = existing_destination(tmp_path)
    before = listing(dst)
    body_ran = False
    with pytest.raises(ConversionError, match="already exists.*--force"):
        with atomic_output_dir(dst):
            body_ran = True
    assert not body_ran and listing(dst) == before


@pytest.mark.parametrize("exchange_supported", [True, False])
def test_atomic_output_dir_force_replaces_dst(tmp_path, monkeypatch, exchange_supported):
    if not exchange_supported:
        monkeypatch.setattr(writer, "_exchange", lambda a, b: False)  # the two-rename fallback
    dst = existing_destination(tmp_path)
    with atomic_output_dir(dst, force=True) as tmp:
        (tmp / "model.safetensors").write_bytes(b"new weights")
    assert listing(dst) == {"model.safetensors": b"new weights"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_atomic_output_dir_refuses_to_replace_its_own_source(tmp_path):
    dst = existing_destination(tmp_path)
    before = listing(dst)
    for src in (dst, dst / "sub", dst / "model.safetensors"):
        with pytest.raises(ConversionError, match="is \\(or contains\\) the source"):
            with atomic_output_dir(dst, force=True, src=src):
                pass
    assert listing(dst) == before
    with atomic_output_dir(dst / "converted", src=dst) as tmp:  # a destination inside the source is fine
        (tmp / "a").write_text("1")
    assert (dst / "converted" / "a").exists()


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_next_run_cleans_stale_temp_folders_and_restores_a_moved_aside_dst(tmp_path):
    pid = dead_pid()
    stale = tmp_path / f".out.tmp-{pid}-abcd1234"
    stale.mkdir()
    (stale / "partial").write_bytes(b"x")
    moved_aside = tmp_path / f".out.old-{pid}-abcd1234"  # killed between the two renames of the fallback swap
    moved_aside.mkdir()
    (moved_aside / "model.safetensors").write_bytes(b"old weights")
    live = tmp_path / f".out.tmp-{os.getpid()}-00000000"  # a run still in progress is left alone
    live.mkdir()
    # the moved-aside destination is put back first, so it "already exists" for a run without --force
    with pytest.raises(ConversionError, match="already exists"):
        with atomic_output_dir(tmp_path / "out"):
            pass
    assert not stale.exists() and not moved_aside.exists() and live.exists()
    assert listing(tmp_path / "out") == {"model.safetensors": b"old weights"}
    with atomic_output_dir(tmp_path / "out", force=True) as tmp:
        (tmp / "new").write_text("1")
    assert listing(tmp_path / "out") == {"new": b"1"}


KILLED_WRITER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from conversion import atomic_output_dir, save_state_dict_safetensors
    import torch

    dst, ready = sys.argv[1], Path(sys.argv[2])
    with atomic_output_dir(dst, force=True) as tmp:
        save_state_dict_safetensors({"w": torch.ones(1000)}, tmp / "model.safetensors")
        (tmp / "config.json").write_text("{")  # half-written
        ready.with_name(ready.name + ".part").write_text(str(tmp))  # written whole, then renamed: never read half-written
        os.replace(ready.with_name(ready.name + ".part"), ready)
        time.sleep(120)
    """
)


@pytest.mark.parametrize("dst_exists", [True, False])
def test_sigkill_mid_write_leaves_dst_as_it_was(tmp_path, dst_exists):
    dst = existing_destination(tmp_path) if dst_exists else tmp_path / "out"
    before = listing(dst) if dst_exists else None
    ready = tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(dst), str(ready)], env=env)
    try:
        deadline = time.monotonic() + 240  # a fresh interpreter imports torch first: 20 s and more on 2 busy cores
        while not ready.exists():
            assert process.poll() is None, f"writer exited early with {process.returncode}"
            assert time.monotonic() < deadline, "writer never signalled readiness"
            time.sleep(0.05)
        temp_folder = Path(ready.read_text())
        assert (temp_folder / "model.safetensors").exists()  # it really was mid-write
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL
    assert (listing(dst) if dst.exists() else None) == before
    assert temp_folder.exists()  # the stale temp folder is left beside dst ...
    with atomic_output_dir(dst, force=True) as tmp:  # ... and the next run removes it
        (tmp / "fresh").write_text("1")
    assert not temp_folder.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "ready"]


def test_copy_tokenizer_files_copies_only_those_present(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir(), dst.mkdir()
    for name in ("tokenizer.json", "vocab.txt", "generation_config.json", "config.json", "model.safetensors"):
        (src / name).write_text(name)
    copied = copy_tokenizer_files(src, dst)
    assert sorted(copied) == ["generation_config.json", "tokenizer.json", "vocab.txt"]
    assert listing(dst) == {name: name.encode() for name in copied}
    with pytest.raises(ConversionError, match="not a folder"):
        copy_tokenizer_files(tmp_path / "missing", dst)


@pytest.mark.real_weights
def test_copy_tokenizer_files_of_real_minilm(real_minilm_dir, tmp_path):
    copied = copy_tokenizer_files(real_minilm_dir, tmp_path)
    assert {"tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"} <= set(copied)
    assert not (tmp_path / "model.safetensors").exists()
    assert (tmp_path / "vocab.txt").read_bytes() == (real_minilm_dir / "vocab.txt").read_bytes()


CARD_FIELDS = dict(
    model_name="all-MiniLM-L6-v2 (hf_tiny)",
    model_id="me/all-MiniLM-L6-v2-hf_tiny",
    base_model="sentence-transformers/all-MiniLM-L6-v2",
    source_name="sentence-transformers/all-MiniLM-L6-v2",
    pipeline_tag="feature-extraction",
    family="bert",
    auto_class="AutoModel",
    description="A sentence encoder.",
    parity_rows=[
        {"backend": "eager", "dtype": "float32", "device": "cpu", "max_abs_diff": 3.1e-6, "tolerance": 1e-4},
        ("sdpa", "float32", "cpu", 2.5e-4, 1e-4),
    ],
    tags=["bert", "sentence-similarity"],
)


def test_model_card_front_matter_and_parity_table(tmp_path):
    path = write_model_card(tmp_path, **CARD_FIELDS)
    text = path.read_text()
    assert path.name == "README.md" and text.startswith("---\n")
    front = yaml.safe_load(text.split("---\n")[1])
    assert front == {
        "library_name": "transformers",
        "license": "apache-2.0",
        "base_model": "sentence-transformers/all-MiniLM-L6-v2",
        "pipeline_tag": "feature-extraction",
        "tags": ["hf_tiny", "custom_code", "bert", "sentence-similarity"],
    }
    assert "| eager | float32 | cpu | 3.1e-06 | 0.0001 | yes |" in text
    assert "| sdpa | float32 | cpu | 0.00025 | 0.0001 | NO |" in text
    assert 'AutoModel.from_pretrained("me/all-MiniLM-L6-v2-hf_tiny", trust_remote_code=True)' in text
    assert "import hf_tiny" in text and "`flash_attention_2`" in text
    assert "`hf_tiny_flash`" in text  # every backend the models take (hf_tiny.attention.ATTENTION_BACKENDS)


def test_model_card_front_matter_survives_yaml_special_characters():
    odd = 'my: "odd" #path\nwith newline'
    text = render_model_card(**{**CARD_FIELDS, "base_model": odd, "tags": ["a: b", "- c"]})
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["base_model"] == odd and front["tags"][-2:] == ["a: b", "- c"]


def test_model_card_of_a_source_without_hub_id_has_no_base_model_line():
    """The Hub refuses a card whose base_model is no model id: a source with none (a local folder) leaves it out."""
    text = render_model_card(**{**CARD_FIELDS, "base_model": None, "source_name": "my-local-folder"})
    front = yaml.safe_load(text.split("---\n")[1])
    assert "base_model" not in front and front["license"] == "apache-2.0" and front["pipeline_tag"]
    assert "the weights of `my-local-folder` converted" in text


def test_model_card_missing_unknown_and_malformed_fields_are_named():
    fields = dict(CARD_FIELDS)
    del fields["base_model"], fields["family"]
    with pytest.raises(ValueError, match="needs field.*base_model, family"):
        render_model_card(**fields)
    with pytest.raises(ValueError, match="no field.*parity_numbers"):
        render_model_card(**CARD_FIELDS, parity_numbers=[])
    with pytest.raises(ValueError, match=r"parity_rows\[0\]"):
        render_model_card(**{**CARD_FIELDS, "parity_rows": [{"backend": "sdpa"}]})
    with pytest.raises(ValueError, match="at least one"):
        render_model_card(**{**CARD_FIELDS, "parity_rows": []})
    with pytest.raises(ValueError, match="no model card template 'nope'"):
        render_model_card("nope", **CARD_FIELDS)


# ---------------------------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------------------------

TINY = dict(hidden=16, heads=4, kv_heads=2, layers=2, vocab=32, intermediate=24)


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to HF q/k rows (transformers undoes it when loading)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path: Path, *, architecture="llama", extra_tensors=()) -> dict[str, np.ndarray]:
    """A tiny F32 Llama GGUF; returns the HF-layout tensors it was made from."""
    import gguf

    hidden, heads, kv, layers = TINY["hidden"], TINY["heads"], TINY["kv_heads"], TINY["layers"]
    vocab, inter = TINY["vocab"], TINY["intermediate"]
    head_dim = hidden // heads
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(layers)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)
    hf = {}

    def tensor(gguf_name, hf_name, shape, permute_heads=None):
        array = rng.standard_normal(shape).astype(np.float32)
        hf[hf_name] = array
        writer.add_tensor(gguf_name, llama_cpp_permute(array, permute_heads) if permute_heads else array)

    tensor("token_embd.weight", "model.embed_tokens.weight", (vocab, hidden))
    tensor("output_norm.weight", "model.norm.weight", (hidden,))
    tensor("output.weight", "lm_head.weight", (vocab, hidden))
    for i in range(layers):
        p = f"model.layers.{i}."
        tensor(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", (hidden, hidden), heads)
        tensor(f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", (kv * head_dim, hidden), kv)
        tensor(f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight", (kv * head_dim, hidden))
        tensor(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight", (hidden, hidden))
        tensor(f"blk.{i}.ffn_gate.weight", p + "mlp.gate_proj.weight", (inter, hidden))
        tensor(f"blk.{i}.ffn_up.weight", p + "mlp.up_proj.weight", (inter, hidden))
        tensor(f"blk.{i}.ffn_down.weight", p + "mlp.down_proj.weight", (hidden, inter))
        tensor(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", (hidden,))
        tensor(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight", (hidden,))
    for name, array, raw_dtype in extra_tensors:
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def test_load_gguf_tiny_llama_unpermutes_q_and_k(tmp_path):
    path = tmp_path / "tiny.gguf"
    hf = write_tiny_gguf(path)
    config, state = load_gguf(path, expected_architecture="llama")
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == TINY["layers"]
    assert config["num_key_value_heads"] == TINY["kv_heads"] and config["tie_word_embeddings"] is False
    assert sorted(state) == sorted(hf)
    for name, array in hf.items():
        assert torch.equal(state[name], torch.from_numpy(array)), name


def test_load_gguf_refuses_an_unsupported_quantization_type(tmp_path):
    import gguf

    quant = gguf.GGMLQuantizationType.Q8_1  # gguf-py (and so transformers) cannot dequantize Q8_1
    block, type_size = gguf.GGML_QUANT_SIZES[quant]
    path = tmp_path / "q8_1.gguf"
    write_tiny_gguf(path, extra_tensors=[("blk.0.attn_q8.weight", np.zeros((4, type_size), np.uint8), quant)])
    with pytest.raises(ConversionError, match=r"blk\.0\.attn_q8\.weight \(Q8_1\)"):
        load_gguf(path, expected_architecture="llama")


def test_load_gguf_refuses_other_architectures_unmapped_tensors_and_non_gguf(tmp_path):
    write_tiny_gguf(tmp_path / "gpt2.gguf", architecture="gpt2")
    with pytest.raises(ConversionError, match=r"architecture 'gpt2', expected 'llama'"):
        load_gguf(tmp_path / "gpt2.gguf", expected_architecture="llama")
    write_tiny_gguf(tmp_path / "odd.gguf", extra_tensors=[("blk.0.mystery.weight", np.ones(4, np.float32), None)])
    with pytest.raises(ConversionError, match=r"no transformers name.*blk\.0\.mystery\.weight"):
        load_gguf(tmp_path / "odd.gguf", expected_architecture="llama")
    data = (tmp_path / "odd.gguf").read_bytes()
    (tmp_path / "truncated.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError, match=r"truncated\.gguf is not a valid GGUF file"):
        load_gguf(tmp_path / "truncated.gguf", expected_architecture="llama")
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ConversionError, match=r"fake\.gguf is not a valid GGUF file"):
        load_gguf(tmp_path / "fake.gguf", expected_architecture="llama")
    with pytest.raises(ConversionError, match="does not exist"):
        load_gguf(tmp_path / "missing.gguf", expected_architecture="llama")


def write_aligned_gguf(path: Path, alignment: int) -> None:
    """Plain and Q8_0 tensors of odd sizes behind a header with a string array (a vocabulary) and general.alignment."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(alignment)
    writer.add_token_list([f"token-{i}" * (i % 5) for i in range(300)])
    writer.add_tensor("first.weight", np.arange(7, dtype=np.float32))
    writer.add_tensor("half.weight", np.linspace(-1, 1, 3 * 5, dtype=np.float16).reshape(3, 5))
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0]
    values = np.random.default_rng(0).standard_normal((3, 2 * block)).astype(np.float32)
    writer.add_tensor("quantized.weight", gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("last.weight", np.full((2, 3, 5), 2.5, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_same_tensors_as_ggufs_reader(path: Path) -> None:
    from gguf import GGUFReader

    ours, theirs = gguf_tensors(path), GGUFReader(str(path)).tensors
    assert [t.name for t in ours] == [t.name for t in theirs]
    for mine, reference in zip(ours, theirs):
        assert (mine.tensor_type, mine.shape) == (reference.tensor_type, tuple(reference.shape.tolist())), mine.name
        assert mine.data.dtype == reference.data.dtype and np.array_equal(mine.data, reference.data), mine.name


def test_the_gguf_tensor_table_is_what_ggufs_reader_reads_behind_any_alignment(tmp_path):
    for alignment in (32, 64, 8):
        write_aligned_gguf(tmp_path / f"aligned{alignment}.gguf", alignment)
        assert_same_tensors_as_ggufs_reader(tmp_path / f"aligned{alignment}.gguf")
    # negative control: the same bytes read as if aligned to 32 put the tensors elsewhere
    data = bytearray((tmp_path / "aligned64.gguf").read_bytes())
    key = b"general.alignment"
    at = data.index(key) + len(key) + 4  # past the key and its value type
    data[at : at + 4] = (32).to_bytes(4, "little")
    (tmp_path / "realigned.gguf").write_bytes(bytes(data))
    moved = {t.name: t.data for t in gguf_tensors(tmp_path / "realigned.gguf")}
    assert not np.array_equal(moved["last.weight"], np.full((2, 3, 5), 2.5, dtype=np.float32))
    data[at : at + 4] = (48).to_bytes(4, "little")
    (tmp_path / "odd_alignment.gguf").write_bytes(bytes(data))
    with pytest.raises(ConversionError, match=r"general\.alignment must be a uint32 power of two, got 48"):
        gguf_tensors(tmp_path / "odd_alignment.gguf")


def test_the_gguf_tensor_table_refuses_a_big_endian_file_and_a_name_given_twice(tmp_path):
    write_aligned_gguf(tmp_path / "file.gguf", 32)
    data = (tmp_path / "file.gguf").read_bytes()
    version = int.from_bytes(data[4:8], "little")
    (tmp_path / "big_endian.gguf").write_bytes(data[:4] + version.to_bytes(4, "big") + data[8:])
    with pytest.raises(ConversionError, match=r"big_endian\.gguf is a big-endian GGUF file"):
        gguf_tensors(tmp_path / "big_endian.gguf")
    assert data.count(b"half.weight") == 1
    (tmp_path / "twice.gguf").write_bytes(data.replace(b"half.weight", b"last.weight"))
    with pytest.raises(ConversionError, match=r"twice\.gguf holds tensors of the same name twice: .*last\.weight"):
        gguf_tensors(tmp_path / "twice.gguf")



def test_a_gguf_is_parsed_once_and_its_architecture_read_from_the_first_field(tmp_path, monkeypatch):
    """open_gguf of an architecture whose processor reads the file whole (GPT-2's) parses it with transformers once,
    where it used to open (and parse) it twice; gguf_architecture stops at its field: a file cut right after it
    still names its architecture (the tensor table, read later, names the damage)."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import GPT2Config, GPT2LMHeadModel

    from conversion.gguf_files import gguf_architecture, open_gguf
    from gguf_writer import write_gguf_from_official

    torch.manual_seed(0)
    official = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=300, n_positions=64))
    path = write_gguf_from_official(official, tmp_path / "gpt2.gguf", "gpt2")
    parses = []
    real = gguf_utils.load_gguf_checkpoint
    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", lambda *a, **k: parses.append(a) or real(*a, **k))
    config, state = open_gguf(path, expected_architecture="gpt2")
    assert len(parses) == 1 and config["model_type"] == "gpt2"
    assert torch.equal(state["transformer.wte.weight"], official.transformer.wte.weight)  # float32: exact
    data = path.read_bytes()
    end = data.index(b"gpt2") + len(b"gpt2")  # general.architecture, the first field
    (tmp_path / "cut.gguf").write_bytes(data[:end])
    assert gguf_architecture(tmp_path / "cut.gguf") == "gpt2"
    with pytest.raises(ConversionError, match=r"cut\.gguf is not a valid GGUF file"):
        gguf_tensors(tmp_path / "cut.gguf")

@pytest.mark.real_weights
def test_the_gguf_tensor_table_of_the_real_smollm2_is_what_ggufs_reader_reads(smollm2_gguf):
    assert_same_tensors_as_ggufs_reader(smollm2_gguf)


@pytest.mark.real_weights
def test_load_gguf_refuses_the_real_smollm2_as_another_architecture(smollm2_gguf):
    with pytest.raises(ConversionError, match=r"architecture 'llama', expected 'bert'"):
        load_gguf(smollm2_gguf, expected_architecture="bert")


@pytest.mark.real_weights
@pytest.mark.slow
def test_load_gguf_real_smollm2(smollm2_gguf):
    config, state = load_gguf(smollm2_gguf, expected_architecture="llama")
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]) == (30, 576, 9)
    assert config["num_key_value_heads"] == 3 and config["tie_word_embeddings"] is True
    # 30 layers x 9 tensors + embeddings + final norm; the LM head is tied, so the file has no output.weight
    assert len(state) == 272 and "lm_head.weight" not in state
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in state.values())


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------


def test_cli_unknown_family_is_one_line_usage_error_in_a_subprocess(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run(
        [sys.executable, "-m", "conversion", "bloom", str(tmp_path / "src"), str(tmp_path / "dst")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown family 'bloom'")
    for family in FAMILIES:
        assert family in lines[0]
    assert not (tmp_path / "dst").exists()


FAKE_FAMILY = textwrap.dedent(
    """
    from conversion import ConversionError
    calls = []

    def convert(src, dst, *, force=False, dtype=None):
        calls.append(("convert", src, dst, force, dtype))
        if src == "bad":
            raise ConversionError("src bad is not a fake checkpoint:\\n  model_type='gpt2'")
        if src == "crash":
            raise ZeroDivisionError("division by zero")
    """
)


@pytest.fixture
def fake_family(tmp_path, monkeypatch):
    (tmp_path / "fake_family_for_cli.py").write_text(FAKE_FAMILY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(FAMILIES, "fake", "fake_family_for_cli")
    monkeypatch.setitem(FAMILIES, "ghost", "conversion.ghost_family_not_written")
    sys.modules.pop("fake_family_for_cli", None)
    import fake_family_for_cli

    yield fake_family_for_cli
    sys.modules.pop("fake_family_for_cli", None)


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("argv", [
    ("fake", "src", "dst", "--force", "--dtype", "bfloat16"),
    ("fake", "--force", "--dtype", "bfloat16", "src", "dst"),  # options between FAMILY and SRC (before: exit 2)
    ("--force", "fake", "src", "--dtype", "bfloat16", "dst"),
])
def test_cli_forward_passes_force_and_dtype(fake_family, capsys, argv):
    code, out, err = run_cli(capsys, *argv)
    assert code == 0 and err == "" and "converted fake: src -> dst" in out
    assert fake_family.calls == [("convert", "src", "dst", True, torch.bfloat16)]


def test_cli_failures_are_one_line_with_exit_code(fake_family, capsys):
    code, _, err = run_cli(capsys, "fake", "bad", "dst")
    assert code == 1 and err == "error: src bad is not a fake checkpoint: model_type='gpt2'\n"
    code, _, err = run_cli(capsys, "fake", "crash", "dst")
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("error: ZeroDivisionError: division by zero") and "--debug" in err
    code, _, err = run_cli(capsys, "fake", "src", "dst", "--reverse")
    assert code == 2 and "no reverse conversion" in err and err.count("\n") == 1
    code, _, err = run_cli(capsys, "ghost", "src", "dst")
    assert code == 1 and "conversion.ghost_family_not_written is not available" in err and err.count("\n") == 1
    code, _, err = run_cli(capsys, "fake", "src", "dst", "--dtype", "float8")
    assert code == 2 and "float8" in err and err.count("\n") == 1 and "usage" not in err
    code, _, err = run_cli(capsys, "fake")
    assert code == 2 and "required" in err and err.count("\n") == 1


def test_cli_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as raised:
        main(["--help"])
    assert raised.value.code == 0 and "--reverse" in capsys.readouterr().out


def test_cli_debug_shows_the_traceback(fake_family, capsys):
    with pytest.raises(ZeroDivisionError):
        main(["fake", "crash", "dst", "--debug"])
