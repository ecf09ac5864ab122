"""Captured decoding the transformers way (issue 42 item 3): generate() with cache_implementation="static" and a
CompileConfig compiles the decoding step once (generate's auto-compile) and replays it; with mode="reduce-overhead"
on CUDA, inductor captures it in a CUDA graph.

CPU: the compiled generate gives official Llama's tokens (greedy and sampled with a fixed seed, a left-padded batch
of 3), through one graph for every decoding step (no recompilation as positions and the cache advance); fullgraph=True
proves there is no graph break; with flex_attention too (generate's BlockMasks inside the graph). The compile backend
here is dynamo's "eager" (it traces and checks the graph, then runs it with the same kernels, so tokens equal eager's
exactly and the test stays within seconds on 2 cores).

Mixture-of-Experts (Mixtral, Qwen2-MoE, DeepSeek-V3, GPT-OSS, Llama 4 text): the compiled step holds every MoE layer in
fixed shapes (moe.py: a decoding step's experts see every token), so it compiles fullgraph=True with official's tokens
and official's number of graphs.

CUDA (marked `cuda`): mode="reduce-overhead" (inductor + CUDA graphs) on both sides, each in its own process (official's
compiled generate segfaulted under CUDA graphs on an H100: a crash there is recorded, not fatal; ours must run), with
the decoding steps after warm-up under torch.cuda.set_sync_debug_mode("error"): no host synchronisation in a step.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Optional

import pytest
import torch
from transformers import AutoModelForCausalLM, CompileConfig, StaticCache

import hf_tiny  # noqa: F401  (registers the Auto classes)
import deepseek_models
import gpt_oss_models
import llama4_models
import smollm3_models
from causal_helpers import left_padded_batch, official_and_converted, tiny_official
from hf_tiny import moe
from fresh_interpreter import clean_env
from markers import cuda_only
from runtime_checks import python_frames

pytestmark = pytest.mark.usefixtures("single_torch_thread")

NEW_TOKENS = 8
LENGTHS = (9, 6, 3)  # a left-padded batch of 3


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return official_and_converted(tiny_official("llama"), tmp_path_factory.mktemp("captured_decoding"))


def settings(**extra) -> dict:
    return dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0, **extra)


class GraphCounter:
    """A compile backend that records each graph dynamo hands it and runs it as traced (CompileConfig deep-copies
    its backend; a function is copied as itself, so the list is this one)."""

    def __init__(self):
        self.graphs = []

        def backend(graph_module, example_inputs):
            self.graphs.append(graph_module)
            return graph_module.forward

        self.backend = backend


def compiled_generate(model, batch: dict, *, fullgraph: bool = True, step_frames: Optional[Counter] = None, **extra):
    """generate() with a static cache and generate's auto-compile (on a CPU: CompileConfig._compile_all_devices, as
    transformers' own tests do). Returns (output, graphs compiled, calls of the compiled step).
    step_frames: counts the Python frames of the compiled step's calls after the first (which compiles)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counter = GraphCounter()
    config = CompileConfig(fullgraph=fullgraph, backend=counter.backend, mode=None)
    config._compile_all_devices = True
    compiled, calls = model.get_compiled_call(config), []

    def counted(*args, **kwargs):  # what generate calls for each decoding step
        calls.append(1)
        if step_frames is None or len(calls) == 1:
            return compiled(*args, **kwargs)
        with python_frames(step_frames):
            return compiled(*args, **kwargs)

    model._compiled_call = counted
    with torch.no_grad():
        out = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], cache_implementation="static",
                             compile_config=config, **settings(**extra))
    return out, len(counter.graphs), len(calls)


@pytest.mark.slow
def test_compiled_static_cache_generate_gives_official_greedy_tokens_with_one_graph(folders):
    official = AutoModelForCausalLM.from_pretrained(folders / "official").eval()
    ours = AutoModelForCausalLM.from_pretrained(folders / "ours").eval()
    batch = left_padded_batch(97, LENGTHS, seed=1)
    with torch.no_grad():
        expected = official.generate(batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=False,
                                     **settings())
    produced, graphs, steps = compiled_generate(ours, batch, do_sample=False)
    assert torch.equal(produced, expected)
    # the prefill runs eagerly; the NEW_TOKENS - 1 decoding steps all run the one graph compiled at the first
    assert steps == NEW_TOKENS - 1 and graphs == 1  # a recompilation would hand the backend another graph
    # negative control: another prompt gives other tokens
    other = left_padded_batch(97, LENGTHS, seed=2)
    assert not torch.equal(compiled_generate(ours, other, do_sample=False)[0][:, -NEW_TOKENS:], expected[:, -NEW_TOKENS:])


def moe_pair(name: str, folder: Path):
    """(official model, hf_tiny's twin): Mixtral, Qwen2-MoE and DeepSeek-V3 through the production converter; GPT-OSS
    and Llama 4 text through their tests' key tables."""
    if name == "gpt_oss":
        official = gpt_oss_models.tiny_official()
        return official, gpt_oss_models.ours_from(official)
    if name == "llama4_text":
        official = llama4_models.tiny_llama4("scout_like")
        return official, llama4_models.ours_for(official)
    if name == "deepseek_v3":
        official = deepseek_models.tiny_deepseek("mla_moe")
    else:
        official = tiny_official(name, num_local_experts=4, num_experts_per_tok=2) if name == "mixtral" else \
            tiny_official(name, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                          shared_expert_intermediate_size=24)
    official_and_converted(official, folder)
    return official, AutoModelForCausalLM.from_pretrained(folder / "ours").eval()


# official's graphs where its generate compiles the step (Llama 4 text: it does not here): the hybrids recompile once,
# at the step where the sliding (GPT-OSS) or chunked (Llama 4) layers' cache is first full, on either side
MOE_GRAPHS = {"mixtral": 1, "qwen2_moe": 1, "deepseek_v3": 1, "gpt_oss": 2, "llama4_text": 2}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MOE_GRAPHS))
def test_moe_decoding_compiles_fullgraph_with_officials_tokens(name, tmp_path):
    official, ours = moe_pair(name, tmp_path)
    batch = left_padded_batch(official.config.vocab_size, LENGTHS, seed=1)
    with torch.no_grad():
        expected = official.generate(batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=False,
                                     **settings())
    produced, graphs, steps = compiled_generate(ours, batch, do_sample=False)
    assert torch.equal(produced, expected)
    assert steps == NEW_TOKENS - 1 and graphs == MOE_GRAPHS[name]
    if name != "llama4_text":
        assert compiled_generate(official, batch, do_sample=False)[1] == graphs


def test_a_second_model_with_other_key_value_heads_compiles_its_step_in_the_same_process(tmp_path):
    """generate's compiled step for Llama (4 heads over 2 key/value heads), then, with no dynamo reset between (a
    process that evaluates or serves two models), SmolLM3's (6 over 3, NoPE and sliding layers): dynamo then holds the
    cache's head count as a symbol, and SDPA's enable_gqa must still get a Python bool (it failed with "must be bool,
    not SymBool"). Both give official's tokens."""
    batch = left_padded_batch(97, (8, 5, 3), seed=1)
    short = dict(max_new_tokens=3, min_new_tokens=3, pad_token_id=0, eos_token_id=None, do_sample=False)
    torch._dynamo.reset()
    models = {"llama": tiny_official("llama"),
              "smollm3": smollm3_models.tiny_smollm3("sliding_nope_biases_tied")}
    for name, model in models.items():
        folder = official_and_converted(model, tmp_path / name)
        official, ours = (AutoModelForCausalLM.from_pretrained(folder / side).eval() for side in ("official", "ours"))
        config = CompileConfig(fullgraph=True, backend=GraphCounter().backend, mode=None)
        config._compile_all_devices = True
        with torch.no_grad():
            expected = official.generate(batch["input_ids"], attention_mask=batch["attention_mask"], **short)
            produced = ours.generate(batch["input_ids"], attention_mask=batch["attention_mask"],
                                     cache_implementation="static", compile_config=config, **short)
        assert torch.equal(produced, expected), name


@pytest.mark.slow
def test_moe_routed_loop_cannot_compile_fullgraph_which_the_fixed_shapes_fix(tmp_path, monkeypatch):
    """Negative control: with the routed loop in the compiled step too (no token count is small enough for the
    fixed shapes), dynamo refuses the routing-sized shapes under fullgraph=True."""
    official, ours = moe_pair("mixtral", tmp_path)
    batch = left_padded_batch(official.config.vocab_size, LENGTHS, seed=1)
    monkeypatch.setattr(moe, "COMPILED_DENSE_MAX_TOKENS", 0)
    with pytest.raises(Exception, match="data-dependent"):
        compiled_generate(ours, batch, do_sample=False)
    produced, graphs, steps = compiled_generate(ours, batch, fullgraph=False, do_sample=False)
    assert steps == NEW_TOKENS - 1 and graphs > 1  # the loop breaks the graph at every MoE layer
    monkeypatch.setattr(moe, "COMPILED_DENSE_MAX_TOKENS", len(LENGTHS) - 1)  # the batch's 3 tokens are one too many
    with pytest.raises(Exception, match="data-dependent"):
        compiled_generate(ours, batch, do_sample=False)


@pytest.mark.slow
def test_compiled_decoding_steps_guards_read_the_cache_without_python(folders):
    """The compiled step's guards are checked at every decoding step, outside the graph: a cache property read in
    the forward through getattr with a default made dynamo guard on it by calling the property in Python at each
    step (StaticCache.is_compileable and a generator frame per cache layer)."""
    ours = AutoModelForCausalLM.from_pretrained(folders / "ours").eval()
    frames = Counter()
    compiled_generate(ours, left_padded_batch(97, LENGTHS, seed=1), do_sample=False, step_frames=frames)
    assert frames["_call_impl"] == NEW_TOKENS - 2  # each step after the first one was recorded
    assert frames["is_compileable"] == 0 and frames["<genexpr>"] == 0
    # negative control: the same recording sees such a guard of a compiled function's getattr with a default
    cache = StaticCache(config=ours.config, max_cache_len=4)
    step = torch.compile(lambda c, x: x + 1 if getattr(c, "is_compileable", False) else x, backend="eager",
                         fullgraph=True)
    step(cache, torch.zeros(1))
    guarded = Counter()
    with python_frames(guarded):
        step(cache, torch.zeros(1))
    assert guarded["is_compileable"] == 1 and guarded["<genexpr>"] == ours.config.num_hidden_layers + 1


@pytest.mark.slow
def test_compiled_static_cache_sampling_gives_official_tokens_with_the_same_seed(folders):
    official = AutoModelForCausalLM.from_pretrained(folders / "official").eval()
    ours = AutoModelForCausalLM.from_pretrained(folders / "ours").eval()
    batch = left_padded_batch(97, LENGTHS, seed=1)
    sampling = dict(do_sample=True, top_k=20, temperature=0.9)
    torch.manual_seed(7)
    with torch.no_grad():
        expected = official.generate(batch["input_ids"], attention_mask=batch["attention_mask"], **settings(**sampling))
    torch.manual_seed(7)
    produced, graphs, steps = compiled_generate(ours, batch, **sampling)
    assert torch.equal(produced, expected) and (steps, graphs) == (NEW_TOKENS - 1, 1)
    torch.manual_seed(8)  # negative control: another seed samples other tokens
    assert not torch.equal(compiled_generate(ours, batch, **sampling)[0], expected)


@pytest.mark.slow
def test_compiled_static_cache_generate_with_flex_attention_gives_official_tokens_with_one_graph(folders):
    """flex_attention: generate hands the compiled step a BlockMask per layer type (create_masks_for_generate),
    which reaches flex_attention inside the one graph as built."""
    official = AutoModelForCausalLM.from_pretrained(folders / "official", attn_implementation="flex_attention").eval()
    ours = AutoModelForCausalLM.from_pretrained(folders / "ours", attn_implementation="flex_attention").eval()
    batch = left_padded_batch(97, LENGTHS, seed=1)
    with torch.no_grad():
        expected = official.generate(batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=False,
                                     cache_implementation="static", **settings())
    produced, graphs, steps = compiled_generate(ours, batch, do_sample=False)
    assert torch.equal(produced, expected)
    assert steps == NEW_TOKENS - 1 and graphs == 1  # a recompilation would hand the backend another graph


@pytest.mark.slow
def test_compiled_generate_returns_official_attentions(folders):
    """What transformers' GenerationTesterMixin.test_generate_compilation_all_outputs asks (CompileConfig's default
    fullgraph=False, eager attention so that weights exist), against official Llama's eager generate with the same
    static cache (weights over all of its slots). The prefill's padding query rows are left out: a query that sees
    no key gets zero weights in hf_tiny, official's softmax spreads it uniformly."""
    official = AutoModelForCausalLM.from_pretrained(folders / "official", attn_implementation="eager").eval()
    ours = AutoModelForCausalLM.from_pretrained(folders / "ours", attn_implementation="eager").eval()
    batch = left_padded_batch(97, LENGTHS, seed=1)
    extra = dict(do_sample=False, output_attentions=True, return_dict_in_generate=True)
    with torch.no_grad():
        expected = official.generate(batch["input_ids"], attention_mask=batch["attention_mask"],
                                     cache_implementation="static", **settings(**extra))
    produced = compiled_generate(ours, batch, fullgraph=False, **extra)[0]
    assert torch.equal(produced.sequences, expected.sequences)
    assert len(produced.attentions) == len(expected.attentions) == NEW_TOKENS
    real_queries = batch["attention_mask"].bool()[:, None, :, None]
    for step, (ours_step, official_step) in enumerate(zip(produced.attentions, expected.attentions)):
        for layer, (got, want) in enumerate(zip(ours_step, official_step)):
            if step == 0:
                got, want = got.masked_fill(~real_queries, 0.0), want.masked_fill(~real_queries, 0.0)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"step {step} layer {layer}")


# ---- CUDA: mode="reduce-overhead" (CUDA graphs) ---------------------------------------------------------------

CAPTURED = r'''
import json, sys
import torch
from pathlib import Path
from transformers import AutoModelForCausalLM, CompileConfig, StaticCache
sys.path[:0] = [sys.argv[3], sys.argv[3] + "/tests/helpers"]
import hf_tiny
from causal_helpers import left_padded_batch

torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="sdpa").cuda().eval()
config = CompileConfig(fullgraph=True, mode="reduce-overhead")
compiled = model.get_compiled_call(config)
calls = {"count": 0, "checked": 0}

def checked(*args, **kwargs):
    """The compiled decoding step; after 3 warm-up calls (CUDA graph recording) under sync debug mode "error"."""
    calls["count"] += 1
    if calls["count"] <= 3:
        return compiled(*args, **kwargs)
    torch.cuda.set_sync_debug_mode("error")
    try:
        return compiled(*args, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        calls["checked"] += 1

model._compiled_call = checked
batch = {k: v.cuda() for k, v in left_padded_batch(97, (9, 6, 3), seed=1).items()}
common = dict(max_new_tokens=int(sys.argv[2]), min_new_tokens=int(sys.argv[2]), pad_token_id=0,
              cache_implementation="static", compile_config=config)
torch._dynamo.utils.counters.clear()
with torch.no_grad():
    greedy = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=False, **common)
    torch.manual_seed(7)
    sampled = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=True, top_k=20,
                             temperature=0.9, **common)
counters = torch._dynamo.utils.counters
print("RESULT " + json.dumps({
    "greedy": greedy.tolist(), "sampled": sampled.tolist(), "calls": calls,
    "graphs": counters["stats"]["unique_graphs"],  # a recompilation compiles another graph
    "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
}))
'''


def run_captured(folder: Path, tmp_path: Path) -> dict:
    """CAPTURED in a fresh process: {"crashed": exit code} when it died (a signal), else its results."""
    import subprocess
    import sys

    env = clean_env()
    tmp_path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run([sys.executable, "-c", CAPTURED, str(folder), str(NEW_TOKENS), str(Path(__file__).parents[2])],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    if result.returncode < 0:
        return {"crashed": result.returncode}
    assert result.returncode == 0, result.stderr[-6000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def mixtral_folders(tmp_path_factory):
    official = tiny_official("mixtral", num_local_experts=4, num_experts_per_tok=2)
    return official_and_converted(official, tmp_path_factory.mktemp("captured_decoding_mixtral"))


@cuda_only
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_cuda_graph_decoding_gives_official_tokens_without_recompiling_or_syncing(family, request, tmp_path):
    """fp32 (TF32 off). Ours must run; official's side is compared where it runs (its compiled generate segfaulted
    under CUDA graphs on an H100 with torch 2.11 / transformers 5.17). Mixtral: the MoE layers' fixed shapes, where
    the routed loop would sync with the host at every expert."""
    folders = request.getfixturevalue("folders" if family == "llama" else "mixtral_folders")
    official = AutoModelForCausalLM.from_pretrained(folders / "official", attn_implementation="sdpa").cuda().eval()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    batch = {k: v.cuda() for k, v in left_padded_batch(97, LENGTHS, seed=1).items()}
    with torch.no_grad():
        eager = official.generate(batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=False,
                                  **settings()).tolist()
    ours = run_captured(folders / "ours", tmp_path / "ours")
    assert "crashed" not in ours, f"hf_tiny's captured generate crashed (exit {ours.get('crashed')})"
    assert ours["greedy"] == eager
    assert ours["graphs"] == 1 and ours["cudagraph_skips"] == 0, ours
    # two generates of NEW_TOKENS - 1 decoding steps each; all but 3 warm-up steps ran under sync debug mode "error"
    assert ours["calls"] == {"count": 2 * (NEW_TOKENS - 1), "checked": 2 * (NEW_TOKENS - 1) - 3}
    theirs = run_captured(folders / "official", tmp_path / "official")
    if "crashed" in theirs:
        pytest.xfail(f"official's captured generate crashed (exit {theirs['crashed']}); ours ran and matched its eager tokens")
    assert ours["greedy"] == theirs["greedy"] and ours["sampled"] == theirs["sampled"]
