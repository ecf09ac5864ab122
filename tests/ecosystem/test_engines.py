"""Engine-ready attention: every attention module calls an attention *interface* the way transformers' models do,
so transformers' continuous batching (`generate_batch`, a paged cache filled inside the attention function),
flex_attention and any function registered with `AttentionInterface.register` run hf_tiny models; flash runs on
CPU with PyTorch's kernel."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, GenerationConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import hf_tiny  # noqa: F401
from causal_helpers import left_padded_batch, max_diff, real_logits, small_paged_cache, tiny_official
from conversion import llama

pytestmark = pytest.mark.usefixtures("single_torch_thread")

TOLERANCE = 1e-5
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [30, 31]]
NEW_TOKENS = 8
# official family -> overrides: plain GQA, and per-layer sliding windows with their own RoPE (the paged cache keeps
# one allocation per layer type there)
MODELS = {
    "llama": ("llama", dict()),
    "gemma3": (
        "gemma3_text",
        dict(head_dim=16, num_hidden_layers=4, sliding_window=4,
             layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    ),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def converted(request, tmp_path_factory):
    family, overrides = MODELS[request.param]
    official = tiny_official(family, **overrides)
    root = tmp_path_factory.mktemp(request.param)
    official.save_pretrained(root / "src")
    llama.convert(root / "src", root / "ours")
    return official, AutoModelForCausalLM.from_pretrained(root / "ours").eval()


def greedy_one_by_one(model, prompts):
    return [
        model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                       max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        for prompt in prompts
    ]


@pytest.mark.parametrize("implementation", ["sdpa", "eager", "paged|eager"])
def test_continuous_batching_gives_each_request_the_tokens_of_its_own_generate(converted, implementation):
    official, ours = converted
    ours.set_attn_implementation("sdpa")
    expected = greedy_one_by_one(ours, PROMPTS)
    assert expected == greedy_one_by_one(official, PROMPTS)  # and those are official's
    ours.set_attn_implementation(implementation)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    results = ours.generate_batch(inputs=PROMPTS, generation_config=config, continuous_batching_config=small_paged_cache())
    ours.set_attn_implementation("sdpa")
    assert len(results) == len(PROMPTS)
    for index, prompt in enumerate(PROMPTS):
        result = next(r for r in results.values() if list(r.prompt_ids) == prompt)
        assert result.error is None, result.error
        assert list(result.generated_tokens) == expected[index], (implementation, prompt)


def test_flex_attention_equals_sdpa_on_a_left_padded_batch(converted, static_flex_compilation):
    _, ours = converted
    batch = left_padded_batch(ours.config.vocab_size)
    ours.set_attn_implementation("sdpa")
    expected = real_logits(ours, batch)
    ours.set_attn_implementation("flex_attention")
    try:  # within 1e-5 relative to the logits' scale (flex accumulates in another order)
        assert max_diff(real_logits(ours, batch), expected) <= TOLERANCE * max(1.0, float(expected.abs().max()))
    finally:
        ours.set_attn_implementation("sdpa")


def test_a_function_registered_with_transformers_is_called_once_per_layer(converted):
    """The attention interface a user registers receives transformers' arguments (module attributes included) and
    its output is used: here it is transformers' own sdpa, counted."""
    _, ours = converted
    calls = []

    def counting_sdpa(module, query, key, value, attention_mask, **kwargs):
        calls.append((module.layer_idx, module.num_key_value_groups, module.is_causal, module.scaling))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("counting_sdpa", counting_sdpa)
    AttentionMaskInterface.register("counting_sdpa", sdpa_mask)  # transformers' rule: a mask only when registered
    batch = left_padded_batch(ours.config.vocab_size)
    ours.set_attn_implementation("sdpa")
    expected = real_logits(ours, batch)
    ours.set_attn_implementation("counting_sdpa")
    try:
        produced = real_logits(ours, batch)
    finally:
        ours.set_attn_implementation("sdpa")
    config = ours.config
    assert [call[0] for call in calls] == list(range(config.num_hidden_layers))
    heads = config.num_attention_heads // config.num_key_value_heads
    assert all(call[1:] == (heads, True, ours.model.layers[0].self_attn.scaling) for call in calls)
    assert max_diff(produced, expected) <= TOLERANCE


def test_negative_control_a_registered_function_that_drops_the_mask_is_caught(converted):
    _, ours = converted

    def maskless_sdpa(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, key, value, None, **{**kwargs, "is_causal": False})

    AttentionInterface.register("maskless_sdpa", maskless_sdpa)
    AttentionMaskInterface.register("maskless_sdpa", sdpa_mask)
    batch = left_padded_batch(ours.config.vocab_size)
    ours.set_attn_implementation("sdpa")
    expected = real_logits(ours, batch)
    ours.set_attn_implementation("maskless_sdpa")
    try:
        assert max_diff(real_logits(ours, batch), expected) > 100 * TOLERANCE
    finally:
        ours.set_attn_implementation("sdpa")


def test_a_function_without_a_mask_builder_gets_no_mask_like_vllms(converted):
    """transformers hands attention_mask=None to functions with no AttentionMaskInterface entry (vLLM's, TGI's:
    they mask from their own metadata), and so do we: no mask is built, is_causal comes from the module."""
    _, ours = converted
    seen = []

    def own_metadata_sdpa(module, query, key, value, attention_mask, **kwargs):
        seen.append((attention_mask, kwargs.get("is_causal")))
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)

    AttentionInterface.register("own_metadata_sdpa", own_metadata_sdpa)
    length = ours.config.sliding_window or 9  # within the window: the sliding layers see every earlier token
    ids = torch.randint(3, ours.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    ours.set_attn_implementation("sdpa")
    with torch.no_grad():
        expected = ours(ids).logits
        ours.set_attn_implementation("own_metadata_sdpa")
        try:
            produced = ours(ids).logits
        finally:
            ours.set_attn_implementation("sdpa")
    assert seen and all(mask is None and is_causal is True for mask, is_causal in seen)
    assert max_diff(produced, expected) <= TOLERANCE  # unpadded: causal attention needs no mask tensor


def test_unknown_attention_name_lists_ours_and_the_registered():
    model = hf_tiny.TinyCausalForCausalLM(hf_tiny.TinyCausalConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match=r"'flash_attention_9' is neither an hf_tiny backend \(\['eager', "
                                         r"'flash_attention_2', 'hf_tiny_flash', 'sdpa'\]\).*registered: .*flex_attention.*paged\|eager"):
        model.set_attn_implementation("flash_attention_9")
    with pytest.raises(ValueError, match="neither an hf_tiny backend"):
        AutoModelForCausalLM.from_config(model.config, attn_implementation="nope")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_attention_2_on_cpu_equals_sdpa_and_generates_the_same_tokens(converted, dtype):
    """Full attention: flash_attention_2 on CPU (PyTorch's flash kernel) against sdpa. Sliding-window layers:
    PyTorch's flash kernel takes no window, so flash_attention_2 on CPU refuses them with a clear error, and the
    same comparison runs our Triton kernel (hf_tiny_flash, which flash_attention_2 uses on CUDA without the
    flash-attn package): interpreted on CPU, compiled on a GPU."""
    _, ours = converted
    sliding = "sliding_attention" in ours.config.layer_types
    implementation, device = "flash_attention_2", torch.device("cpu")
    model = ours.to(dtype)
    batch = left_padded_batch(model.config.vocab_size)
    try:
        if sliding:
            model.set_attn_implementation("flash_attention_2")
            with pytest.raises(ValueError, match="padding and causal masks only.*sliding window"):
                real_logits(model, batch)
            implementation = "hf_tiny_flash"
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            model.to(device)
            batch = {k: v.to(device) for k, v in batch.items()}
        model.set_attn_implementation("sdpa")
        expected = real_logits(model, batch).float()
        settings = dict(attention_mask=batch["attention_mask"], max_new_tokens=6, do_sample=False, pad_token_id=0,
                        eos_token_id=None)
        expected_tokens = model.generate(batch["input_ids"], **settings)
        model.set_attn_implementation(implementation)
        # fp32: within 1e-5 relative to the logits' scale (the kernels accumulate in other orders; 1.1e-5 absolute
        # on logits of 6.7 was seen on one machine); bf16: within 5 %
        scale = float(expected.abs().max())
        tolerance = TOLERANCE * max(1.0, scale) if dtype == torch.float32 else 5e-2 * scale
        assert max_diff(real_logits(model, batch).float(), expected) <= tolerance
        if dtype == torch.float32:
            assert torch.equal(model.generate(batch["input_ids"], **settings), expected_tokens)
    finally:
        model.set_attn_implementation("sdpa")
        model.to("cpu", torch.float32)


@pytest.mark.parametrize("style", ["bart", "t5"])
def test_flex_attention_on_seq2seq_equals_sdpa_or_refuses_t5s_bias(style, static_flex_compilation):
    """BART (padding, causal decoder without a mask, cross-attention): flex equals sdpa. T5's relative position
    bias is additive: a clear error instead of a kernel that cannot apply it."""
    config = hf_tiny.TinySeq2SeqConfig.from_style(style, vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                  num_attention_heads=4, intermediate_size=48, max_position_embeddings=32)
    torch.manual_seed(0)
    model = hf_tiny.TinySeq2SeqForConditionalGeneration(config).eval()
    input_ids, decoder_ids = torch.randint(3, 64, (2, 9)), torch.randint(3, 64, (2, 6))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, 5:] = 0
    outputs = {}
    for implementation in ("sdpa", "flex_attention"):
        model.set_attn_implementation(implementation)
        if style == "t5" and implementation == "flex_attention":
            with pytest.raises(ValueError, match="flex_attention.*additive bias.*T5.*'sdpa' or 'eager'"):
                model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_ids)
            return
        with torch.no_grad():
            outputs[implementation] = model(input_ids=input_ids, attention_mask=attention_mask,
                                            decoder_input_ids=decoder_ids).logits
    assert max_diff(outputs["flex_attention"], outputs["sdpa"]) <= TOLERANCE


def test_flex_attention_causal_without_padding_is_causal(static_flex_compilation):
    """No padding: our causal mask is implicit (is_causal, no tensor); flex must still get the causal pattern."""
    official = tiny_official("llama")
    ours = hf_tiny.TinyCausalForCausalLM(hf_tiny.TinyCausalConfig(**{
        k: v for k, v in official.config.to_dict().items() if k in hf_tiny.TinyCausalConfig().to_dict()
        and k not in ("architectures", "model_type", "transformers_version")}))
    ours.load_state_dict(official.state_dict(), strict=False)
    ours.eval()
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ours(ids).logits
        ours.set_attn_implementation("flex_attention")
        assert max_diff(ours(ids).logits, expected) <= TOLERANCE * max(1.0, float(expected.abs().max()))


@pytest.mark.parametrize("module", ["layers.Attention", "mla.LatentAttention"])
def test_attention_forward_shows_vllm_one_interface_call_in_its_source(module):
    """vLLM's Transformers backend finds a model's attention layers by reading each module's forward source: a
    local assigned from ALL_ATTENTION_FUNCTIONS.get_interface(...) and exactly one call of it, with scaling=.
    Moving that call into a helper method made every vLLM engine refuse the model ("does not dispatch through the
    Transformers attention interface"); this reads the source the same way (written here, not vLLM's code)."""
    import ast
    import importlib
    import inspect
    import textwrap

    module_name, class_name = module.split(".")
    cls = getattr(importlib.import_module(f"hf_tiny.{module_name}"), class_name)
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    names = {
        target.id
        for node in ast.walk(tree) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Attribute) and isinstance(node.value.func.value, ast.Name)
        and node.value.func.value.id == "ALL_ATTENTION_FUNCTIONS"
        for target in node.targets if isinstance(target, ast.Name)
    }
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id in names]
    assert len(calls) == 1, f"{module}.forward must call the attention interface exactly once, found {len(calls)}"
    assert [kw.arg for kw in calls[0].keywords if kw.arg == "scaling"] == ["scaling"]


def test_chunked_layers_are_refused_by_a_function_that_takes_no_mask():
    """Llama 4's chunked layers keep each token in its chunk through the mask alone; a function without a mask
    builder (vLLM's, TGI's) would attend over every token, silently (as official Llama 4 does there): refused, naming
    the chunk size. Control: sdpa runs, and the chunks matter (with attention over every token the logits differ)."""
    from llama4_models import ours_for, tiny_llama4

    ours = ours_for(tiny_llama4("scout_like")).eval()
    AttentionInterface.register("own_metadata_sdpa", lambda module, q, k, v, mask, **kw: sdpa_attention_forward(
        module, q, k, v, None, **kw))
    ids = torch.randint(3, ours.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        chunked = ours(ids).logits
        ours.set_attn_implementation("own_metadata_sdpa")
        try:
            with pytest.raises(ValueError, match=r"chunked attention \(attention_chunk_size=5\) keeps each token "
                               r"inside its chunk through the mask, which attn_implementation='own_metadata_sdpa'"):
                ours(ids)
        finally:
            ours.set_attn_implementation("sdpa")
        ours.config.layer_types = ["full_attention" if t == "chunked_attention" else t for t in ours.config.layer_types]
        assert max_diff(ours(ids).logits, chunked) > 100 * TOLERANCE
