"""Training under torch.compile and exporting with gradients on (issue 33, items 6 and 7): compiled training
(fullgraph) gives eager's loss and gradients within 1e-5, with and without the runtime's recompute (gradient
checkpointing); torch.export(strict=True) of a training forward with grad enabled, and transformers' executorch
wrapper with grad enabled, export; a forward without attention mask on sdpa exports with a dynamic sequence length
(torch.export and torch.onnx.export(dynamo=True)) and the exported program equals eager at two lengths."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_tiny  # noqa: F401  (registers the Auto classes)
from causal_helpers import tiny_official
from runtime_models import causal_model
from conversion import llama

pytestmark = pytest.mark.usefixtures("single_torch_thread")

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    tiny_official("llama").save_pretrained(path / "src")
    llama.convert(path / "src", path / "ours")
    return path / "ours"


def batch(length: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 97, (2, length), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(model, ids, forward=None) -> tuple[torch.Tensor, dict]:
    """The training loss of ids and the model's parameter gradients, through forward (the model unless given)."""
    model.zero_grad()
    loss = (model if forward is None else forward)(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_training_equals_eager(folder, checkpointing):
    model = AutoModelForCausalLM.from_pretrained(folder).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = batch()
    eager_loss, eager_grads = loss_and_grads(model, ids)
    compiled_loss, compiled_grads = loss_and_grads(model, ids, torch.compile(model, fullgraph=True, backend="aot_eager"))
    assert relative_gap(compiled_loss, eager_loss) <= TOLERANCE
    assert eager_grads.keys() == compiled_grads.keys()
    for name, grad in eager_grads.items():
        assert relative_gap(compiled_grads[name], grad) <= TOLERANCE, name
    # negative control: another batch moves the loss and the gradients well past the tolerance
    other_loss, _ = loss_and_grads(model, batch(seed=1))
    assert relative_gap(other_loss, eager_loss) > 1e-3


@pytest.mark.parametrize("boundaries", ["cu_seq_lens", "seq_idx"])
def test_a_packed_training_forward_compiles_in_one_graph(folder, boundaries):
    """Padding-free packing (DataCollatorWithFlattening, TRL's padding-free collator) passes the sequences'
    boundaries as keyword arguments; the step reads them inside the graph (fullgraph=True) and gives eager's loss."""
    model = AutoModelForCausalLM.from_pretrained(folder).train()
    ids = batch(10)[:1]
    extra = {"cu_seq_lens": dict(cu_seq_lens_q=torch.tensor([0, 4, 7, 10], dtype=torch.int32), max_length_q=4),
             "seq_idx": dict(seq_idx=torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2, 2]], dtype=torch.int32))}[boundaries]
    inputs = dict(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]]), labels=ids, **extra)
    eager = model(**inputs).loss
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")(**inputs).loss
    assert relative_gap(compiled, eager) <= TOLERANCE
    # negative control: one packed row read as one sequence attends across the boundaries
    assert relative_gap(model(input_ids=ids, labels=ids).loss, eager) > 1e-3


@pytest.mark.parametrize("requested", ["attentions", "router_logits"])
def test_outputs_recorded_by_hooks_compile_without_fullgraph_and_fullgraph_says_why_not(folder, requested):
    """output_attentions and output_router_logits are recorded by forward hooks registered for that forward. With
    fullgraph=False (CompileConfig's default) they come back equal to eager's; fullgraph=True cannot register them
    and says so (before: dynamo's "setattr() on unsupported type" from inside torch.utils.hooks)."""
    if requested == "attentions":
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        ask = dict(output_attentions=True)
    else:
        model = causal_model("mixtral")
        ask = dict(output_router_logits=True)
    ids = batch(6)
    with torch.no_grad():
        eager = getattr(model(ids, **ask), requested)
        torch._dynamo.reset()
        compiled = getattr(torch.compile(model, fullgraph=False, backend="eager")(ids, **ask), requested)
        assert len(compiled) == len(eager) == model.config.num_hidden_layers
        for got, want in zip(compiled, eager):
            assert relative_gap(got, want) <= TOLERANCE
        # negative control: another batch's outputs differ
        assert relative_gap(getattr(model(batch(6, seed=1), **ask), requested)[0], eager[0]) > 1e-3
        torch._dynamo.reset()
        with pytest.raises(Exception, match=r"forward hooks .*fullgraph=True\) cannot do; compile with fullgraph=False"):
            torch.compile(model, fullgraph=True, backend="eager")(ids, **ask)


def test_strict_export_of_a_training_forward_with_grad_enabled(folder):
    model = AutoModelForCausalLM.from_pretrained(folder).train()
    ids = batch()
    with torch.enable_grad():
        program = torch.export.export(model, (), {"input_ids": ids, "labels": ids}, strict=True)
        expected = model(input_ids=ids, labels=ids, skip_logits=False)
    got = program.module()(input_ids=ids, labels=ids)
    assert relative_gap(got.loss.detach(), expected.loss.detach()) <= TOLERANCE
    assert relative_gap(got.logits.detach(), expected.logits.detach()) <= TOLERANCE
    other = program.module()(input_ids=batch(seed=1), labels=batch(seed=1))  # negative control
    assert relative_gap(other.loss.detach(), expected.loss.detach()) > 1e-3


def test_executorch_decoder_only_export_with_grad_enabled(folder):
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    model.generation_config.cache_implementation = "static"
    exportable = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=32)
    ids = batch(4)[:1]
    with torch.enable_grad():
        program = exportable.export(input_ids=ids, cache_position=torch.arange(4))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    got = program.module()(input_ids=ids, cache_position=torch.arange(4))
    got = got.logits if hasattr(got, "logits") else got
    assert relative_gap(got.detach(), expected) <= TOLERANCE
    assert relative_gap(model(input_ids=batch(4, seed=1)[:1]).logits.detach(), expected) > 1e-3  # negative control


class LogitsOnly(torch.nn.Module):
    """input_ids -> logits with no attention mask and no cache: the export the issue names (sdpa, is_causal read
    from a symbolic sequence length)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


@pytest.fixture(scope="module")
def logits_only(folder):
    return LogitsOnly(AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")).eval()


def eager_logits(module, ids) -> torch.Tensor:
    with torch.no_grad():
        return module(ids)


def test_export_with_a_dynamic_sequence_length_and_no_mask_equals_eager_at_two_lengths(logits_only):
    """strict=True (TorchDynamo); the ONNX test below exports through strict=False."""
    length = torch.export.Dim("length", min=2, max=48)
    program = torch.export.export(logits_only, (batch(10),), dynamic_shapes=({1: length},), strict=True)
    for size in (10, 17):
        ids = batch(size, seed=size)
        expected = eager_logits(logits_only, ids)
        got = program.module()(ids)
        assert got.shape == expected.shape
        assert relative_gap(got, expected) <= TOLERANCE, size
    # negative control: other ids of the same length are far outside the tolerance
    assert relative_gap(program.module()(batch(17, seed=1)), expected) > 1e-3


def test_onnx_export_with_a_dynamic_sequence_length_equals_eager_at_two_lengths(logits_only, tmp_path):
    pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript (the test extra)")
    onnxruntime = pytest.importorskip("onnxruntime", reason="running the ONNX file needs onnxruntime (the test extra)")
    length = torch.export.Dim("length", min=2, max=48)
    exported = torch.onnx.export(logits_only, (batch(10),), dynamo=True, dynamic_shapes=({1: length},))
    exported.save(str(tmp_path / "model.onnx"))
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    for size in (10, 17):
        ids = batch(size, seed=size)
        expected = eager_logits(logits_only, ids)
        got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: ids.numpy()})[0])
        assert got.shape == expected.shape
        assert relative_gap(got, expected) <= TOLERANCE, size



class LogitsWithMask(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


SLIDING = {
    "mistral": dict(sliding_window=4),
    "gemma3_text": dict(head_dim=8, num_hidden_layers=3, sliding_window=4,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
}


@pytest.mark.parametrize("kind", sorted(SLIDING))
@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_sliding_window_model_exports_with_a_dynamic_length_shorter_and_longer_than_the_window(kind, strict, tmp_path):
    """The window mask is built whatever the length while tracing (a window wider than the keys restricts nothing);
    before, the mask code branched on the symbolic length and export failed 'Constraints violated' (5 <= length),
    where official Mistral and Gemma 3 export. The program equals official eager (padded rows) at 3 and 17 tokens."""
    official = tiny_official(kind, **SLIDING[kind])
    official.save_pretrained(tmp_path / "src")
    llama.convert(tmp_path / "src", tmp_path / "ours")
    ours = LogitsWithMask(AutoModelForCausalLM.from_pretrained(tmp_path / "ours")).eval()
    length = torch.export.Dim("length", min=2, max=48)
    program = torch.export.export(ours, (batch(10), torch.ones(2, 10, dtype=torch.long)),
                                  dynamic_shapes=({1: length}, {1: length}), strict=strict).module()
    for size in (3, 17):
        ids = batch(size, seed=size)
        mask = torch.ones_like(ids)
        mask[1, :2] = 0
        expected = eager_logits(lambda i: LogitsWithMask(official)(i, mask), ids)
        got = program(ids, mask)
        assert relative_gap(got[mask.bool()], expected[mask.bool()]) <= TOLERANCE, size
    # negative control: the window matters at 17 tokens: the full-attention model differs there
    unwindowed = tiny_official(kind, **{**SLIDING[kind], "sliding_window": 64})
    assert relative_gap(LogitsWithMask(unwindowed)(ids, mask)[mask.bool()].detach(), expected[mask.bool()]) > 1e-3


def test_seq2seq_executorch_export_stops_on_the_static_cache_with_its_reason(tmp_path):
    """transformers' Seq2SeqLMExportableModule decodes into a StaticCache, which hf_tiny seq2seq models do not
    support (docs/compatibility.md): the export stops with that reason, not an attribute or binding error as before
    (no `d_model`, no `use_cache` on the decoder). The decoder takes official's call (`use_cache=True` starts a
    cache), the control that the refusal is the static cache's."""
    from transformers import AutoModelForSeq2SeqLM, BartForConditionalGeneration
    from transformers.integrations.executorch import Seq2SeqLMExportableModule

    from hf_tiny.step import cache_of

    from bart_models import make_official_bart
    from conversion import bart

    bart.convert(make_official_bart(tmp_path / "official"), tmp_path / "ours")
    ours = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ours").eval()
    official = BartForConditionalGeneration.from_pretrained(tmp_path / "official").eval()
    ids = batch(8)[:1] % ours.config.vocab_size
    exporter = Seq2SeqLMExportableModule(ours, batch_size=1, max_hidden_seq_length=16, max_cache_length=16)
    with pytest.raises(Exception, match=r"static \(compileable\) caches are not supported by hf_tiny seq2seq models"):
        exporter.export(encoder_input_ids=ids)
    with torch.no_grad():
        states = ours.get_encoder()(input_ids=ids).last_hidden_state
        start = torch.tensor([[ours.config.decoder_start_token_id]])
        got = ours.get_decoder()(input_ids=start, encoder_hidden_states=states, use_cache=True)
        expected = official.get_decoder()(input_ids=start, encoder_hidden_states=states, use_cache=True)
    assert type(cache_of(got)).__name__ == type(cache_of(expected)).__name__ == "EncoderDecoderCache"
    assert relative_gap(got.last_hidden_state, expected.last_hidden_state) <= TOLERANCE
