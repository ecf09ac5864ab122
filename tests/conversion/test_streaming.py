"""Streaming conversion: save_pretrained's shards and index under --max-shard-size (both directions), the per-layer
parity rows (where a mismatch starts), the CLI's last line, lazy reading of the source."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import hf_tiny  # noqa: F401
from causal_helpers import left_padded_batch, max_diff, real_logits, tiny_official
from conversion import ConversionError, llama, streamed
from conversion.__main__ import main
from conversion.lazy import LazyTensors
from conversion.parity import in_memory, measure, parity_batch
from conversion.readers import open_checkpoint
from conversion.streamed import Streamed, run_in_lockstep, streamed_runner


@pytest.fixture(scope="module")
def official_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("streaming") / "official"
    tiny_official("llama", num_hidden_layers=3).save_pretrained(folder)
    return folder


def shard_names(folder):
    return sorted(path.name for path in folder.glob("*.safetensors"))


def test_max_shard_size_writes_save_pretrained_shards_both_ways(official_folder, tmp_path):
    whole = llama.convert(official_folder, tmp_path / "whole")
    sharded = llama.convert(official_folder, tmp_path / "sharded", max_shard_size="20KB")
    assert shard_names(tmp_path / "whole") == ["model.safetensors"]
    names = shard_names(tmp_path / "sharded")
    assert len(names) > 2 and names[0] == f"model-00001-of-{len(names):05d}.safetensors", names
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    stored = {key: name for name in names for key in load_file(tmp_path / "sharded" / name)}
    assert index["weight_map"] == stored
    assert index["metadata"]["total_size"] == whole["bytes"] == sharded["bytes"]
    for name in names:  # each shard within the limit, except a single tensor larger than it
        tensors = load_file(tmp_path / "sharded" / name)
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= 20_000
    batch = left_padded_batch(97)
    ours = [AutoModelForCausalLM.from_pretrained(tmp_path / folder).eval() for folder in ("whole", "sharded")]
    assert max_diff(real_logits(ours[1], batch), real_logits(ours[0], batch)) == 0.0

    result = llama.convert_back(tmp_path / "sharded", tmp_path / "back", max_shard_size="20KB")
    assert len(result["files"]) > 2
    back, info = LlamaForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    original = LlamaForCausalLM.from_pretrained(official_folder).state_dict()
    assert all(torch.equal(back.state_dict()[key], value) for key, value in original.items())


@pytest.mark.parametrize("size", ["abc", "0", "-5GB", 0])
def test_bad_max_shard_size_names_the_value(official_folder, tmp_path, size):
    with pytest.raises(ValueError, match=rf"max_shard_size must be a positive size .* got {size!r}"):
        llama.convert(official_folder, tmp_path / "out", max_shard_size=size)
    assert not (tmp_path / "out").exists()


def test_cli_last_line_says_what_was_written_and_the_verdict(official_folder, tmp_path, capsys):
    assert main(["llama", str(official_folder), str(tmp_path / "out"), "--max-shard-size", "30KB"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    count = len(shard_names(tmp_path / "out"))
    assert last.startswith(f"converted llama: {official_folder} -> {tmp_path / 'out'} (")
    assert f"MiB of weights; {count} weights file(s); parity passed: " in last, last
    assert main(["llama", str(official_folder), str(tmp_path / "x"), "--max-shard-size", "big"]) == 1
    assert "max_shard_size must be a positive size" in capsys.readouterr().err


def test_card_has_a_row_per_layer(official_folder, tmp_path):
    result = llama.convert(official_folder, tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Each layer's output, max |ours - official|" in card
    for layer in range(3):
        assert f"| model.layers.{layer} |" in card
    assert set(result["parity_layers"]["cpu float32 eager"]) >= {f"model.layers.{i}" for i in range(3)}


def test_layer_rows_show_where_a_mismatch_starts(official_folder, tmp_path):
    """Negative control of the per-layer rows: a perturbed second layer leaves layer 0 exact and shows from layer 1."""
    llama.convert(official_folder, tmp_path / "out")
    official = LlamaForCausalLM.from_pretrained(official_folder).eval()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        ours.model.layers[1].mlp.down_proj.weight.mul_(1.01)
    batch = parity_batch("causal", ours.config)
    layers = measure(in_memory(official), in_memory(ours), batch, torch.float32, backends=("eager",)).layers
    rows = layers["cpu float32 eager"]
    assert rows["model.layers.0"] == 0.0
    assert rows["model.layers.1"] > 1e-4 and rows["model.layers.2"] > 1e-4


def test_source_is_read_lazily(official_folder, monkeypatch):
    """Opening a checkpoint reads headers only; a tensor is read when asked, each time afresh (nothing kept)."""
    reads = []
    state = open_checkpoint(official_folder)
    original = state._read
    monkeypatch.setattr(state, "_read", lambda key: reads.append(key) or original(key))
    assert len(state) == len(LlamaForCausalLM.from_pretrained(official_folder).state_dict()) and reads == []
    assert state.info("model.embed_tokens.weight").shape == (97, 32) and reads == []
    first = state["model.norm.weight"]
    assert reads == ["model.norm.weight"] and torch.equal(state["model.norm.weight"], first)


def test_rows_are_read_alone_and_equal_the_slice(official_folder, tmp_path):
    """A weight's rows read by themselves (the streamed head and the dtype conversion read blocks of rows) equal
    the slice of the whole tensor, from one file and from an index of shards; a buffer of the wrong shape is
    refused naming the tensor, rows outside the tensor naming the rows."""
    LlamaForCausalLM.from_pretrained(official_folder).save_pretrained(tmp_path / "shards", max_shard_size="20KB")
    key = "model.embed_tokens.weight"
    for state in (open_checkpoint(official_folder), open_checkpoint(tmp_path / "shards")):
        whole = state[key]
        assert torch.equal(state.rows(key, 10, 20), whole[10:20])
        out = torch.empty(5, 32, dtype=whole.dtype)
        assert state.rows(key, 90, 95, out) is out and torch.equal(out, whole[90:95])
        with pytest.raises(ValueError, match=r"model.embed_tokens.weight: rows 0:5 are \(5, 32\)"):
            state.rows(key, 0, 5, torch.empty(4, 32, dtype=whole.dtype))
        assert torch.equal(state.rows(key, 96, 97), whole[96:])
        with pytest.raises(ValueError, match=r"model.embed_tokens.weight: rows 90:98 are outside its 97 rows"):
            state.rows(key, 90, 98)
    renamed = open_checkpoint(official_folder).renamed(lambda name: "x." + name)
    assert torch.equal(renamed.rows("x." + key, 3, 4), whole[3:4])


@pytest.fixture()
def small_blocks(monkeypatch):
    """Blocks of 10 rows for the head (97 rows of 32 float32: ten blocks, the last one of 7) and of 256 bytes when
    converting."""
    monkeypatch.setattr(streamed, "HEAD_BLOCK_BYTES", 10 * 32 * 4)
    monkeypatch.setattr(streamed, "BLOCK_BYTES", 256)


def test_streamed_head_in_vocabulary_blocks_gives_the_logits_in_memory(official_folder, small_blocks):
    """The streamed model (head in blocks of rows, weights read in blocks) gives the logits of the model in memory:
    every layer bit for bit, the head's columns up to the order of additions the matrix kernel picks for a block of
    10 rows (at real sizes, blocks of HEAD_BLOCK_BYTES, the TinyLlama-shaped card is unchanged to the last digit).
    Negative control: one spoiled row of the head's last block shows in that token's logits only."""
    official = LlamaForCausalLM.from_pretrained(official_folder, attn_implementation="eager").eval()
    batch = parity_batch("causal", official.config)
    real = batch.real_tokens
    with torch.no_grad():
        expected = official(**batch.inputs).logits[real]
    tensors = open_checkpoint(official_folder)
    run = streamed_runner(Streamed(LlamaForCausalLM, official.config, tensors), base_prefix="model")
    output, layers = run(batch.inputs, "cpu", torch.float32, "eager")
    with torch.no_grad(), streamed.recording_layers(official) as in_memory_layers:
        official(**batch.inputs)
    assert all(torch.equal(layers[name][real], in_memory_layers[name][real]) for name in in_memory_layers)
    assert (output.logits[real] - expected).abs().max() <= 1e-5

    head = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    spoiled_weight = tensors[head].clone()
    spoiled_weight[95] += 1.0
    spoiled = tensors.with_tensors({"lm_head.weight": (tensors.info(head), lambda: spoiled_weight)})
    run = streamed_runner(Streamed(LlamaForCausalLM, official.config, spoiled), base_prefix="model")
    difference = (run(batch.inputs, "cpu", torch.float32, "eager")[0].logits[real] - expected).abs()
    assert difference[..., 95].max() > 1e-3 and difference[..., :95].max() <= 1e-5


def test_parity_runs_in_lockstep_measure_what_they_measure_one_after_another(official_folder, tmp_path):
    """The conversion's parity runs (official reference, ours in eager and sdpa) run side by side, each its own
    model and backend: rows and per-layer differences equal those of the same runs one after the other."""
    from hf_tiny import TinyCausalConfig, TinyCausalForCausalLM

    result = llama.convert(official_folder, tmp_path / "out", dtype="bfloat16")
    official = streamed_runner(Streamed(LlamaForCausalLM, LlamaForCausalLM.config_class.from_pretrained(
        official_folder), open_checkpoint(official_folder)), base_prefix="model")
    config = TinyCausalConfig.from_pretrained(tmp_path / "out")
    ours = streamed_runner(Streamed(TinyCausalForCausalLM, config, open_checkpoint(tmp_path / "out")))
    batch = parity_batch("causal", config, tmp_path / "out")
    one_after_another = measure(lambda *args: official(*args), lambda *args: ours(*args), batch, torch.bfloat16)
    assert [row["max_abs_diff"] for row in result["parity"]] == [row["max_abs_diff"] for row in one_after_another.rows]
    assert result["parity_layers"] == one_after_another.layers
    eager, sdpa = (row["max_abs_diff"] for row in result["parity"])
    assert eager != sdpa  # each run kept its own backend (they once shared one config object)


def test_lockstep_keeps_every_run_within_a_layer_of_the_others(monkeypatch):
    """Three runs of 6, 6 and 4 layers, the first slow: whenever a run has started a layer, no unfinished run has
    started more than one layer more than another. Read from the lockstep's own counts, under its lock, as each run
    passes its gate (what the runs record themselves after the gate can be reordered by the OS's scheduling)."""
    import threading
    import time

    seen = []

    class RecordingLockstep(streamed._Lockstep):
        def gate(self, run: int):
            wait = super().gate(run)

            def recorded():
                wait()
                with self.condition:
                    seen.append(([*self.started], [*self.finished]))

            return recorded

    monkeypatch.setattr(streamed, "_Lockstep", RecordingLockstep)
    layers_run, lock = [0, 0, 0], threading.Lock()

    def job(index: int, layers: int, pause: float):
        def run(gate):
            for _ in range(layers):
                gate()
                with lock:
                    layers_run[index] += 1
                time.sleep(pause)
            return index

        return run

    assert run_in_lockstep([job(0, 6, 0.01), job(1, 6, 0.0), job(2, 4, 0.0)]) == [0, 1, 2]
    assert layers_run == [6, 6, 4] and len(seen) == 16
    for started, finished in seen:
        unfinished = [count for count, done in zip(started, finished) if not done]
        assert max(unfinished) - min(unfinished) <= 1, seen
    assert any(max(started) - min(started) > 1 for started, _ in seen), "the short run never finished early"


def test_an_output_that_is_a_weight_keeps_its_memory():
    """A module whose output is a view of its weight: the weight's buffer is not reused by the next module."""
    from torch import nn

    class Table(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(300, 300))

        def forward(self, x):
            return self.weight[: x.shape[0]]

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = Table(), Table()

        def forward(self, x):
            return self.first(x), self.second(x)

    values = {"first.weight": torch.full((300, 300), 1.0), "second.weight": torch.full((300, 300), 2.0)}
    tensors = LazyTensors.of(values)
    model = Model()
    with streamed.streaming(model, tensors, {k: k for k in values}, device="cpu", dtype=torch.float32):
        first, second = model(torch.zeros(2))
    assert bool((first == 1.0).all()) and bool((second == 2.0).all())


def test_a_writer_failure_mid_way_is_the_error_and_nothing_is_left(official_folder, tmp_path, monkeypatch):
    """The folder is written while the parity runs read it: a failure in the middle of the writing (here the
    second layer's down projection) stops the runs waiting for its tensors and is the error raised; the
    destination does not appear."""
    from conversion import folder_write

    cast = folder_write.cast_tensor

    def failing(key, tensor, dtype):
        if key == "model.layers.1.mlp.down_proj.weight":
            raise ConversionError(f"cannot cast {key}")
        return cast(key, tensor, dtype)

    monkeypatch.setattr(folder_write, "cast_tensor", failing)
    with pytest.raises(ConversionError, match=r"the tensors do not fit LlamaForCausalLM .*cannot cast "
                                              r"model.layers.1.mlp.down_proj.weight"):
        llama.convert(official_folder, tmp_path / "out")
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_buffers_the_checkpoint_does_not_hold_are_built_on_the_runs_device(tmp_path):
    """BERT's position_ids and token_type_ids are not saved: the streamed model reads them beside its weights, on
    the run's device. They stayed on the CPU, and every BERT-style conversion on a CUDA machine failed in its
    parity proof (an embedding's index on the CPU, its weights on the GPU). The meta device stands in for a second
    device here; by default (the CPU run) they stay where they were built, with their values."""
    from bert_models import official_model
    from transformers import BertModel

    official = official_model("BertModel")
    official.save_pretrained(tmp_path)
    spec = Streamed(BertModel, official.config, open_checkpoint(tmp_path))
    unsaved = {"embeddings.position_ids", "embeddings.token_type_ids"}
    on_cpu = dict(spec.build(torch.float32).named_buffers())
    assert unsaved <= set(on_cpu) and not unsaved & set(spec.tensors)
    assert all(on_cpu[name].device.type == "cpu" for name in unsaved)
    assert torch.equal(on_cpu["embeddings.position_ids"], official.embeddings.position_ids)
    on_other = spec.build(torch.float32, "meta")
    assert {name: buffer.device.type for name, buffer in on_other.named_buffers()} == dict.fromkeys(on_cpu, "meta")
    assert all(parameter.device.type == "meta" for parameter in on_other.parameters())
