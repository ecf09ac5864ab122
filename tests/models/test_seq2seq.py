"""The seq2seq family on its own: config validation, the KV caches (self + cross), encoder_outputs reuse,
encoder and decoder of different depths, padding, backends, saving/loading and bad inputs.

Parity with the official BART / T5 / EncoderDecoderModel lives in conversion/test_bart.py, conversion/test_t5.py and
conversion/test_bert2seq.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM, DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput, BaseModelOutputWithPastAndCrossAttentions, BaseModelOutputWithPooling

from hf_tiny import TinySeq2SeqConfig, TinySeq2SeqForConditionalGeneration, TinySeq2SeqModel
from hf_tiny.transformers_api import enable_activation_checkpointing

SMALL = dict(vocab_size=48, hidden_size=16, num_attention_heads=4, intermediate_size=32, max_position_embeddings=32,
             initializer_range=0.2, hidden_dropout=0.0)
VARIANTS = {
    "bart": dict(num_hidden_layers=2, num_decoder_layers=3),
    "t5": dict(
        num_hidden_layers=1, num_decoder_layers=3, norm_placement="pre", norm_type="rmsnorm", position_embedding_type="relative",
        relative_attention_num_buckets=8, relative_attention_max_distance=16, attention_scale=1.0, mlp_gated=True,
        hidden_act="gelu_new", mlp_bias=False, attention_bias=False, embedding_norm=False, final_norm=True,
        use_padding_idx=False, final_logits_bias=False, scale_decoder_outputs=True, pad_token_id=0, eos_token_id=1,
        bos_token_id=None, decoder_start_token_id=0, head_dim=6,
    ),
    "marian": dict(num_hidden_layers=2, num_decoder_layers=1, position_embedding_type="sinusoidal", position_offset=0,
                   scale_embedding=True, embedding_norm=False, hidden_act="silu"),
    "bert2seq": dict(num_hidden_layers=3, num_decoder_layers=2, type_vocab_size=2, position_offset=0, layer_norm_eps=1e-12,
                     share_encoder_decoder_embeddings=False, lm_head_transform=True, lm_head_bias=True,
                     final_logits_bias=False, pad_token_id=0, bos_token_id=5, eos_token_id=6, decoder_start_token_id=5,
                     num_key_value_heads=2),
}

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def make_model(variant: str, seed: int = 0, **overrides) -> TinySeq2SeqForConditionalGeneration:
    torch.manual_seed(seed)
    model = TinySeq2SeqForConditionalGeneration(TinySeq2SeqConfig(**{**SMALL, **VARIANTS[variant], **overrides}))
    with torch.no_grad():  # norms away from 1/0 and a non-zero logits bias, so that every parameter matters
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
        if model.final_logits_bias is not None:
            model.final_logits_bias.normal_(0.0, 0.5)
    return model.eval()


def encoder_batch(config, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(7, config.vocab_size, (3, 9), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0
    attention_mask[2, 3:] = 0
    return input_ids.masked_fill(attention_mask == 0, config.pad_token_id or 0), attention_mask


def decoder_ids(config, length: int = 6, batch: int = 3, seed: int = 2):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, config.vocab_size, (batch, length), generator=generator)
    ids[:, 0] = config.decoder_start_token_id
    return ids


# ---------------------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------------------


def test_config_constructs_without_arguments_and_round_trips(tmp_path):
    config = TinySeq2SeqConfig()
    assert config.model_type == "hf_tiny_seq2seq" and config.is_encoder_decoder
    assert config.num_decoder_layers == config.num_hidden_layers
    custom = TinySeq2SeqConfig(**SMALL, **VARIANTS["t5"])
    custom.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    strip = lambda c: {k: v for k, v in c.to_dict().items() if k != "_name_or_path"}
    assert type(loaded) is TinySeq2SeqConfig and strip(loaded) == strip(custom)


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"norm_type": "batchnorm"}, "unknown norm_type 'batchnorm'"),
        ({"norm_placement": "sandwich"}, "unknown norm_placement 'sandwich'"),
        ({"position_embedding_type": "rotary"}, "unknown position_embedding_type 'rotary'"),
        ({"hidden_act": "swishy"}, "unknown hidden_act 'swishy'"),
        ({"encoder_hidden_size": 16, "decoder_hidden_size": 24}, "decoder_hidden_size=24"),
        ({"encoder_hidden_size": 12}, "encoder_hidden_size=12"),
        ({"hidden_size": 18}, r"hidden_size \(18\) must be divisible by num_attention_heads \(4\)"),
        ({"num_decoder_layers": 0}, "num_decoder_layers must be a positive integer, got 0"),
        ({"position_offset": -2}, "position_offset must be an integer >= 0, got -2"),
        ({"type_vocab_size": -1}, "type_vocab_size must be an integer >= 0"),
        ({"decoder_start_token_id": 48}, r"decoder_start_token_id must be None or a token id in \[0, 48\), got 48"),
        ({"attention_dropout": 1.5}, "attention_dropout must be a float in"),
        ({"attention_scale": 0}, "attention_scale must be a positive number, got 0"),
        ({"pad_token_id": None}, "use_padding_idx=True needs a pad_token_id"),
        ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be divisible by num_key_value_heads \(3\)"),
    ],
)
def test_config_rejects_bad_values_naming_field_and_value(fields, message):
    with pytest.raises(ValueError, match=message):
        TinySeq2SeqConfig(**{**SMALL, **fields})


def test_config_rejects_non_bool_flags():
    with pytest.raises(TypeError, match="mlp_gated must be True or False, got 'yes'"):
        TinySeq2SeqConfig(**SMALL, mlp_gated="yes")


def test_decoder_view_of_config_reports_decoder_depth():
    """transformers sizes generation caches from get_text_config(decoder=True): it must see the decoder depth."""
    config = TinySeq2SeqConfig(**SMALL, num_hidden_layers=1, num_decoder_layers=4)
    assert config.get_text_config(decoder=True).num_hidden_layers == 4
    assert config.get_text_config(encoder=True).num_hidden_layers == 1
    assert len(DynamicCache(config=config).layers) == 4
    assert config.num_hidden_layers == 1  # the view is a copy


# ---------------------------------------------------------------------------------------------------------------
# caches, encoder_outputs, depths, padding, backends
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cache_matches_full_forward(variant):
    """Prefix then one token at a time through EncoderDecoderCache == one full forward without cache."""
    model = make_model(variant)
    input_ids, attention_mask = encoder_batch(model.config)
    dec = decoder_ids(model.config)
    with torch.no_grad():
        full = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=dec, use_cache=False).logits
        out = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=dec[:, :2], use_cache=True)
        cache = out.past_key_values
        assert isinstance(cache, EncoderDecoderCache) and len(cache.self_attention_cache.layers) == model.config.num_decoder_layers
        cross_keys = cache.cross_attention_cache.layers[0].keys
        steps = [out.logits]
        encoder_outputs = (out.encoder_last_hidden_state,)
        for t in range(2, dec.shape[1]):
            step = model(encoder_outputs=encoder_outputs, attention_mask=attention_mask, decoder_input_ids=dec[:, t : t + 1],
                         past_key_values=cache, use_cache=True)
            steps.append(step.logits)
        # cross-attention K/V were computed once, at the first step, and reused
        assert cache.cross_attention_cache.layers[0].keys is cross_keys
        assert cache.self_attention_cache.get_seq_length() == dec.shape[1]
    incremental = torch.cat(steps, dim=1)
    assert float((incremental - full).abs().max()) <= 1e-5


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_encoder_outputs_reuse(variant):
    model = make_model(variant)
    input_ids, attention_mask = encoder_batch(model.config)
    dec = decoder_ids(model.config)
    with torch.no_grad():
        full = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=dec)
        encoded = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)
        assert isinstance(encoded, BaseModelOutput)
        # any of transformers' encoder outputs (official T5's encoder returns one with past and cross-attentions)
        other_outputs = (BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=encoded.last_hidden_state),
                         BaseModelOutputWithPooling(last_hidden_state=encoded.last_hidden_state))
        for reused in (encoded, (encoded.last_hidden_state,), [encoded.last_hidden_state], *other_outputs):
            again = model(encoder_outputs=reused, attention_mask=attention_mask, decoder_input_ids=dec)
            assert torch.equal(again.logits, full.logits)
    assert torch.equal(full.encoder_last_hidden_state, encoded.last_hidden_state)


def test_generate_refuses_return_dict_by_name():
    """generate passes return_dict itself (official generate refuses it as an unused model kwarg)."""
    model = make_model(sorted(VARIANTS)[0])
    input_ids, attention_mask = encoder_batch(model.config)
    with pytest.raises(ValueError, match="generate\\(\\) got return_dict=False"):
        model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=2, return_dict=False)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("num_beams", (1, 3))
def test_generate_with_cache_equals_without(variant, num_beams):
    """Every variant has encoder and decoder of different depths (T5-style: 1 encoder, 3 decoder layers)."""
    model = make_model(variant)
    assert model.config.num_hidden_layers != model.config.num_decoder_layers
    input_ids, attention_mask = encoder_batch(model.config)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=7, num_beams=num_beams,
                  do_sample=False, eos_token_id=None)
    cached = model.generate(**kwargs)
    uncached = model.generate(**kwargs, use_cache=False)
    assert cached.shape == (3, 8)
    assert (cached[:, 0] == model.config.decoder_start_token_id).all()
    assert cached.tolist() == uncached.tolist()
    encoded = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)
    reused = model.generate(encoder_outputs=encoded, attention_mask=attention_mask, max_new_tokens=7,
                            num_beams=num_beams, do_sample=False, eos_token_id=None)
    assert reused.tolist() == cached.tolist()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_padding_does_not_change_real_positions(variant):
    """A padded row gives the same logits as the same row alone without padding."""
    model = make_model(variant)
    input_ids, attention_mask = encoder_batch(model.config)
    dec = decoder_ids(model.config)
    with torch.no_grad():
        batched = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=dec).logits
        for row in (1, 2):
            length = int(attention_mask[row].sum())
            alone = model(input_ids=input_ids[row : row + 1, :length], decoder_input_ids=dec[row : row + 1]).logits
            assert float((alone[0] - batched[row]).abs().max()) <= 1e-5


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_backends_agree_and_switch_at_run_time(variant):
    model = make_model(variant)
    input_ids, attention_mask = encoder_batch(model.config)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_ids(model.config))
    outputs = {}
    for backend in ("eager", "sdpa"):
        model.set_attn_implementation(backend)
        assert model.config._attn_implementation == backend
        with torch.no_grad():
            outputs[backend] = model(**inputs).logits
    assert float((outputs["eager"] - outputs["sdpa"]).abs().max()) <= 1e-5


def test_outputs_attentions_and_hidden_states():
    model = make_model("t5")
    model.set_attn_implementation("eager")
    input_ids, attention_mask = encoder_batch(model.config)
    out = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_ids(model.config),
                output_attentions=True, output_hidden_states=True)
    config = model.config
    assert len(out.encoder_attentions) == config.num_hidden_layers and len(out.decoder_attentions) == config.num_decoder_layers
    assert len(out.cross_attentions) == config.num_decoder_layers
    assert out.cross_attentions[0].shape == (3, config.num_attention_heads, 6, 9)
    assert len(out.encoder_hidden_states) == config.num_hidden_layers + 1
    assert len(out.decoder_hidden_states) == config.num_decoder_layers + 1
    assert torch.equal(out.decoder_hidden_states[-1], model.model.decoder(
        input_ids=decoder_ids(config), encoder_hidden_states=out.encoder_last_hidden_state,
        encoder_attention_mask=attention_mask).last_hidden_state)
    # padded encoder keys get no cross-attention weight
    assert float(out.cross_attentions[0][2, :, :, 3:].detach().abs().max()) == 0.0


# ---------------------------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------------------------


def test_labels_are_shifted_with_decoder_start_and_loss_is_token_mean():
    model = make_model("bart")
    input_ids, attention_mask = encoder_batch(model.config)
    labels = decoder_ids(model.config, seed=5)
    labels[2, 4:] = -100
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    shifted = model.prepare_decoder_input_ids_from_labels(labels)
    assert (shifted[:, 0] == model.config.decoder_start_token_id).all()
    assert torch.equal(shifted[:, 1:][labels[:, :-1] != -100], labels[:, :-1][labels[:, :-1] != -100])
    assert (shifted[2, 5:] == model.config.pad_token_id).all()
    logits = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=shifted).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    assert torch.allclose(out.loss, expected)
    items = int((labels != -100).sum())
    summed = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, num_items_in_batch=2 * items).loss
    assert torch.allclose(summed, expected / 2)


@pytest.mark.parametrize("use_reentrant", (False, True))
@pytest.mark.parametrize("variant", ("bart", "t5", "marian", "bert2seq"))
def test_gradient_checkpointing_gives_the_same_gradients(variant, use_reentrant):
    """Both checkpointing modes; reentrant used to fail on T5 ("backward through the graph a second time"): its
    relative-position bias, computed once per stack, reached every block hidden inside the mask object."""
    input_ids = labels = None
    grads = []
    for checkpointing in (False, True):
        model = make_model(variant).train()
        if checkpointing:
            enable_activation_checkpointing(model, {"use_reentrant": use_reentrant})
        if input_ids is None:
            input_ids, attention_mask = encoder_batch(model.config)
            labels = decoder_ids(model.config, seed=5)
        model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert "model.encoder.layers.0.self_attn.q_proj.weight" in grads[0]  # gradients reach the encoder
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6), name


# ---------------------------------------------------------------------------------------------------------------
# saving, loading, tying
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ("bart", "bert2seq"))
def test_save_load_keeps_outputs_and_ties(variant, tmp_path):
    from safetensors import safe_open

    model = make_model(variant)
    shared = model.config.share_encoder_decoder_embeddings
    assert model.model.encoder.embed_tokens.weight is model.model.shared.weight
    assert (model.model.decoder.embed_tokens.weight is model.model.shared.weight) is shared
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight
    model.save_pretrained(tmp_path)
    keys = set(safe_open(str(tmp_path / "model.safetensors"), "pt").keys())
    assert "lm_head.weight" not in keys and "model.encoder.embed_tokens.weight" not in keys
    assert ("model.decoder.embed_tokens.weight" in keys) is not shared
    loaded, info = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert type(loaded) is TinySeq2SeqForConditionalGeneration
    assert loaded.lm_head.weight is loaded.model.decoder.embed_tokens.weight
    input_ids, attention_mask = encoder_batch(model.config)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_ids(model.config))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(**inputs).logits, model(**inputs).logits)
    base = TinySeq2SeqModel.from_pretrained(tmp_path)
    assert base.get_encoder() is base.encoder


def test_sinusoidal_table_is_rebuilt_after_loading(tmp_path):
    model = make_model("marian")
    model.save_pretrained(tmp_path)
    loaded = TinySeq2SeqForConditionalGeneration.from_pretrained(tmp_path)
    assert torch.equal(loaded.model.encoder.embed_positions.weight, model.model.encoder.embed_positions.weight)


def test_resize_token_embeddings_resizes_every_table():
    for variant in ("bart", "bert2seq"):
        model = make_model(variant)
        model.resize_token_embeddings(52)
        assert model.model.decoder.embed_tokens.weight.shape[0] == 52 and model.lm_head.weight.shape[0] == 52
        assert model.lm_head.weight is model.model.decoder.embed_tokens.weight
        if model.final_logits_bias is not None:
            assert model.final_logits_bias.shape == (1, 52)
        input_ids, attention_mask = encoder_batch(model.config)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_ids(model.config)).logits
        assert logits.shape[-1] == 52


# ---------------------------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    model = make_model("bart")
    config = model.config
    input_ids, attention_mask = encoder_batch(config)
    dec = decoder_ids(config)
    with pytest.raises(ValueError, match="pass decoder_input_ids .* or labels"):
        model(input_ids=input_ids, attention_mask=attention_mask)
    with pytest.raises(ValueError, match=r"encoder_outputs\[0\] must have shape \[batch, encoder_length, hidden_size=16\], got \(3, 9, 8\)"):
        model(encoder_outputs=(torch.zeros(3, 9, 8),), decoder_input_ids=dec)
    with pytest.raises(ValueError, match=r"encoder_outputs\[0\] must have shape .* got \(3, 16\)"):
        model(encoder_outputs=(torch.zeros(3, 16),), decoder_input_ids=dec)
    with pytest.raises(ValueError, match="encoder_outputs\\[0\\] has batch size 2 but the decoder input has batch size 3"):
        model(encoder_outputs=(torch.zeros(2, 9, 16),), decoder_input_ids=dec)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(3, 9\) but encoder_outputs\[0\] covers \(3, 7\)"):
        model(encoder_outputs=(torch.zeros(3, 7, 16),), attention_mask=attention_mask, decoder_input_ids=dec)
    with pytest.raises(TypeError, match="encoder_outputs must be a ModelOutput with a last_hidden_state or a tuple"):
        model(encoder_outputs=torch.zeros(3, 9, 16), decoder_input_ids=dec)
    with pytest.raises(TypeError, match="must be an EncoderDecoderCache .* got DynamicCache"):
        model(input_ids=input_ids, decoder_input_ids=dec, past_key_values=DynamicCache())
    with pytest.raises(ValueError, match=r"attention_mask has shape \(3, 5\) but the input needs \(3, 9\)"):
        model(input_ids=input_ids, attention_mask=attention_mask[:, :5], decoder_input_ids=dec)
    out_of_vocab = dec.clone()
    out_of_vocab[0, 1] = 48
    with pytest.raises(ValueError, match=r"decoder_input_ids contains token id 48, outside the vocabulary \[0, 48\)"):
        model(input_ids=input_ids, decoder_input_ids=out_of_vocab)
    with pytest.raises(ValueError, match="encoder sequence length .* 40 exceeds max_position_embeddings=32"):
        model(input_ids=torch.full((1, 40), 9), decoder_input_ids=dec[:1])
    with pytest.raises(ValueError, match=r"labels have shape \(3, 4\) but the logits cover \(3, 6\)"):
        model(input_ids=input_ids, decoder_input_ids=dec, labels=dec[:, :4])
    with pytest.raises(ValueError, match="'flash_attention_9' is neither an hf_tiny backend"):
        model.set_attn_implementation("flash_attention_9")


def test_static_cache_is_refused_clearly():
    model = make_model("bart")
    input_ids, attention_mask = encoder_batch(model.config)
    with pytest.raises(ValueError, match="static .* caches are not supported"):
        model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=3, cache_implementation="static")


def test_labels_without_decoder_start_token_id_is_a_clear_error():
    model = make_model("bart", decoder_start_token_id=None)
    input_ids, attention_mask = encoder_batch(model.config)
    with pytest.raises(ValueError, match="decoder_start_token_id is None"):
        model(input_ids=input_ids, attention_mask=attention_mask, labels=torch.randint(7, 48, (3, 5)))


# ---------------------------------------------------------------------------------------------------------------
# CUDA (skipped with a reason without a GPU)
# ---------------------------------------------------------------------------------------------------------------

CUDA_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}  # relative to max |logits|


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", sorted(CUDA_TOLERANCE, key=str))
@pytest.mark.parametrize("backend", ("eager", "sdpa", "flash_attention_2"))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cuda_backends_match_cpu_reference(variant, backend, dtype):
    model = make_model(variant)
    input_ids, attention_mask = encoder_batch(model.config)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_ids(model.config))
    model.set_attn_implementation("eager")
    with torch.no_grad():
        reference = model(**inputs).logits
    model = model.to("cuda", dtype)
    model.set_attn_implementation(backend)
    cuda_inputs = {k: v.cuda() for k, v in inputs.items()}
    if backend == "flash_attention_2" and dtype == torch.float32:  # fp16 / bf16 only on CUDA: a clear error
        with pytest.raises(ValueError, match="float16 or bfloat16"):
            model(**cuda_inputs)
        return
    if backend == "flash_attention_2" and variant == "t5":
        with pytest.raises(ValueError, match="additive"):
            model(**cuda_inputs)
        return
    with torch.no_grad():
        logits = model(**cuda_inputs).logits.float().cpu()
        generated = model.generate(**{k: cuda_inputs[k] for k in ("input_ids", "attention_mask")}, max_new_tokens=4,
                                   do_sample=False)
    assert generated.shape == (3, 5)
    scale = max(1.0, float(reference.abs().max()))
    assert float((logits - reference).abs().max()) <= CUDA_TOLERANCE[dtype] * scale


@pytest.mark.parametrize("variant", ("bart", "marian"))
def test_generate_past_the_decoder_position_limit_is_refused_before_any_step(variant, monkeypatch):
    """max_position_embeddings=32: 32 new tokens feed the decoder 32 tokens (fine), 33 would need position 32.
    The refusal comes up front, not after 32 decoding steps (the decoder is never run)."""
    model = make_model(variant)
    input_ids, attention_mask = encoder_batch(model.config)
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=32, min_new_tokens=32,
                         do_sample=False)
    assert out.shape[1] == 33
    calls = []
    monkeypatch.setattr(model.model.decoder, "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(ValueError) as error:
        model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=33, do_sample=False)
    message = str(error.value)
    assert "max_new_tokens 33" in message and "max_position_embeddings=32" in message and "<= 32" in message
    assert not calls
    long_prompt = torch.full((3, 40), 9)  # generate puts decoder_start_token_id before it: 41 tokens
    with pytest.raises(ValueError, match="decoder prompt .* holds 41 tokens, more than max_position_embeddings=32"):
        model.generate(input_ids=input_ids, decoder_input_ids=long_prompt, max_new_tokens=2, do_sample=False)


def test_t5_relative_positions_generate_past_max_position_embeddings():
    model = make_model("t5")
    input_ids, attention_mask = encoder_batch(model.config)
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=40, min_new_tokens=40,
                         do_sample=False)
    assert out.shape[1] == 41
