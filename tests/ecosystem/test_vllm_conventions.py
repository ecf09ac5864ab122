"""What vLLM's Transformers backend does to a model, checked without vLLM (tests/ecosystem/test_vllm.py serves real
folders in vLLM's venv): it sets attn_implementation "vllm" (a function without a mask builder), passes each
sequence's positions from 0, reads `scaling=` and `s_aux=` from the attention call's source, and may replace a MoE
block's experts by its own runner. A stand-in registered under vLLM's name plays its attention function."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch
from torch import nn
from transformers import AttentionInterface, AutoModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import hf_tiny
from hf_tiny.layers import Attention
from conversion import modernbert, roberta
from encoder_checkpoint_models import official_roberta, save

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def vllm_like(module, query, key, value, attention_mask, **kwargs):
    """vLLM's function as hf_tiny sees it: no mask (it masks from its own metadata), bidirectional for encoders."""
    return sdpa_attention_forward(module, query, key, value, None, **{**kwargs, "is_causal": module.is_causal})


AttentionInterface.register("vllm", vllm_like)


def test_a_roberta_encoder_counts_vllm_s_positions_from_the_padding_index(tmp_path):
    """vLLM passes positions from 0 and adds RoBERTa's offset (pad_token_id + 1) only for model types named
    "roberta": an hf_tiny RoBERTa adds it itself, so its embeddings equal official's. Before, they differed (1e-2 on
    a served tiny RoBERTa). Control: the same 0-based positions under another function name are read as given."""
    official = official_roberta("RobertaModel").eval()
    roberta.convert(save(official, tmp_path / "src"), tmp_path / "ours")
    ours = AutoModel.from_pretrained(tmp_path / "ours").eval()
    ids = torch.randint(3, official.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    zero_based = torch.arange(9)[None]
    with torch.no_grad():
        expected = official(ids).last_hidden_state
        ours.set_attn_implementation("vllm")
        served = ours(ids, position_ids=zero_based).last_hidden_state
        ours.set_attn_implementation("sdpa")
        as_given = ours(ids, position_ids=zero_based).last_hidden_state
    assert float((served - expected).abs().max()) <= 1e-5
    assert float((as_given - expected).abs().max()) > 1e-3


def test_a_local_attention_encoder_is_refused_under_vllm(tmp_path):
    """vLLM reads sliding_window as a causal window of that many keys; ModernBERT's is the reach on either side, so
    its embeddings would be off (4e-2 measured): refused with the reason."""
    official = transformers_modernbert()
    official.save_pretrained(tmp_path / "src")
    modernbert.convert(tmp_path / "src", tmp_path / "ours")
    ours = AutoModel.from_pretrained(tmp_path / "ours", attn_implementation="vllm").eval()
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"vLLM cannot serve this encoder's local attention: it reads "
                                         r"sliding_window=3 as a causal window"):
        ours(ids, position_ids=torch.arange(12)[None])


def transformers_modernbert():
    from transformers import ModernBertConfig, ModernBertModel

    torch.manual_seed(0)
    return ModernBertModel(ModernBertConfig(
        vocab_size=97, hidden_size=48, num_attention_heads=3, num_hidden_layers=3, intermediate_size=40,
        global_attn_every_n_layers=3, local_attention=6, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)).eval()


def interface_call_keywords(function) -> dict[str, str]:
    """The keywords of the one call of what `ALL_ATTENTION_FUNCTIONS.get_interface(...)` returned, as vLLM's
    AttentionFuser finds it in the forward's source (its `interface_call`)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    names = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
             and isinstance(node.value, ast.Call) and ast.unparse(node.value.func).endswith("get_interface")
             for target in node.targets if isinstance(target, ast.Name)}
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id in names]
    assert len(calls) == 1, "vLLM's backend needs exactly one call of the attention interface"
    return {keyword.arg: ast.unparse(keyword.value) for keyword in calls[0].keywords if keyword.arg}


def test_the_attention_call_names_its_scaling_and_sinks_as_vllm_reads_them():
    """vLLM reads `scaling=self.<attr>` and `s_aux=self.<attr>` from the call's source and wires the sinks into its
    attention layer from there (GPT-OSS); before, the sinks went in through **kwargs and vLLM refused the model."""
    keywords = interface_call_keywords(Attention.forward)
    assert keywords["scaling"] == "self.scaling" and keywords["s_aux"] == "self.sinks"


def test_a_sink_model_reaches_vllm_s_function_with_its_sinks():
    """Under vLLM's name the sinks are handed over (vLLM checks itself that its layer took them); a function of
    another name without an s_aux parameter stays refused."""
    attention = Attention(hf_tiny.TinyCausalConfig(vocab_size=11, hidden_size=16, num_attention_heads=2,
                                                   num_hidden_layers=1, intermediate_size=8), 0, hidden_size=16,
                          num_heads=2, num_key_value_heads=2, head_dim=8, bias=False, output_bias=False,
                          scaling=8**-0.5, sinks=True)
    seen = []
    AttentionInterface.register("vllm", lambda module, q, k, v, mask, **kw: (seen.append(kw["s_aux"]), vllm_like(
        module, q, k, v, mask, **kw))[1])
    try:
        attention.config._attn_implementation = "vllm"
        attention(torch.randn(1, 3, 16), None)
        assert seen and seen[0] is attention.sinks
        AttentionInterface.register("sinkless", vllm_like)
        attention.config._attn_implementation = "sinkless"
        with pytest.raises(ValueError, match="'sinkless' does not take attention sinks"):
            attention(torch.randn(1, 3, 16), None)
    finally:
        AttentionInterface.register("vllm", vllm_like)


class ExpertRunner(nn.Module):
    """An engine's runner in transformers' experts call, computing with the experts it took over."""

    def __init__(self, experts: nn.ModuleList):
        super().__init__()
        self.taken = experts

    def forward(self, tokens, top_k_index, top_k_weights):
        output = torch.zeros_like(tokens)
        for slot in range(top_k_index.shape[1]):
            for index, expert in enumerate(self.taken):
                chosen = top_k_index[:, slot] == index
                output[chosen] += expert(tokens[chosen]) * top_k_weights[chosen, slot, None]
        return output


def moe_block(**fields):
    config = hf_tiny.TinyCausalConfig(vocab_size=11, hidden_size=16, num_attention_heads=2, num_hidden_layers=1,
                                      intermediate_size=8, num_local_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=8, **fields)
    torch.manual_seed(0)
    model = hf_tiny.TinyCausalForCausalLM(config).eval()
    return model.model.layers[0].mlp


def test_experts_replaced_by_an_engine_s_runner_are_called_as_transformers_experts():
    """vLLM replaces the experts of a block it cannot fuse whole (shared experts) by a runner called
    experts(tokens, top_k_index, top_k_weights); before, the block iterated it ('not iterable'). Qwen2-MoE then
    served official's tokens in vLLM."""
    block = moe_block()
    assert block.experts_kind == "swiglu"
    hidden = torch.randn(2, 5, 16)
    with torch.no_grad():
        expected = block(hidden)
        block.experts = ExpertRunner(block.experts)
        assert torch.allclose(block(hidden), expected, atol=1e-6)


def test_experts_a_runner_would_compute_otherwise_are_refused():
    """vLLM's runner computes bias-free SwiGLU experts weighted on their outputs: GPT-OSS's clamped experts would
    come out other numbers (its tokens differed from the first one), so the block refuses the replacement."""
    block = moe_block(router_scoring="topk_softmax", router_bias=True, expert_bias=True, swiglu_limit=7.0,
                      swiglu_alpha=1.702)
    assert block.experts_kind == "ClampedSwiGLUFeedForward experts"
    block.experts = ExpertRunner(block.experts)
    with pytest.raises(ValueError, match="computes SwiGLU experts without biases .* these are "
                                         "ClampedSwiGLUFeedForward experts"):
        block(torch.randn(1, 3, 16))
