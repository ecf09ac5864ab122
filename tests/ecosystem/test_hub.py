"""push_to_hub end to end with huggingface_hub's real client against an in-memory Hub on 127.0.0.1
(tests/helpers/hub_server.py), then from_pretrained from the Hub in a fresh interpreter without hf_tiny; plus the model
card that travels with save_pretrained / push_to_hub (hf_tiny/hub.py)."""

from __future__ import annotations

import json
import re
import socket

import pytest
import torch
import yaml
from fresh_interpreter import clean_env, run_python
from hub_server import NAMESPACE, FakeHub
from safetensors.torch import load_file

import hf_tiny
from hf_tiny.hub import (
    card_tags,
    carry_model_card,
    check_repo_id,
    is_hf_tiny_card,
    retarget_card,
)

REPO = f"{NAMESPACE}/tiny-encoder"
REPO_VIA_SAVE = f"{NAMESPACE}/tiny-encoder-via-save"
WORDS = [
    "the", "a", "cat", "dog", "sat", "on", "mat", "hub", "push", "tiny", "model",
    "is", "was", "and", "of", "to", "in", ".", ",", "!", "?",
]

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture
def fake_hub():
    hub = FakeHub()
    hub.start()
    host, port = hub._server.server_address[:2]
    assert host == "127.0.0.1"
    yield hub
    hub.stop()
    with pytest.raises(OSError):  # the server is gone once the test is over
        socket.create_connection((host, port), timeout=2).close()


@pytest.fixture(scope="module")
def converted_encoder(tmp_path_factory):
    """A tiny official BertForMaskedLM + WordPiece tokenizer, converted by the production converter (which
    measures parity and writes the model card)."""
    from transformers import BertConfig, BertForMaskedLM, BertTokenizer

    from conversion import bert

    root = tmp_path_factory.mktemp("hub_src")
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = list("abcdefghijklmnopqrstuvwxyz") + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    vocab = {token: index for index, token in enumerate(specials + WORDS + pieces)}
    tokenizer = BertTokenizer(vocab=vocab)
    torch.manual_seed(0)
    official = BertForMaskedLM(
        BertConfig(
            vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=64, initializer_range=0.2,
        )
    )
    official.save_pretrained(root / "official")
    tokenizer.save_pretrained(root / "official")
    (root / "official" / "README.md").write_text("---\nlicense: apache-2.0\n---\n# a tiny BERT for the Hub tests\n")
    result = bert.convert(root / "official", root / "converted", base_model="hf-tiny-tests/tiny-bert")
    return root / "converted", result


PUSH = """
import json, sys
import hf_tiny
from transformers import AutoModelForMaskedLM, AutoTokenizer

src, work = sys.argv[1], sys.argv[2]
model = AutoModelForMaskedLM.from_pretrained(src)
commit = model.push_to_hub("tiny-encoder", tags=["pushed-by-test"])
AutoTokenizer.from_pretrained(src).push_to_hub("__REPO__")
# the other way in: save_pretrained(push_to_hub=True) saves locally, then uploads that folder
model.save_pretrained(work + "/saved", push_to_hub=True, repo_id="tiny-encoder-via-save")
print(json.dumps({"commit_url": str(commit), "repo_url": str(commit.repo_url)}))
"""

PULL = """
import sys
import torch
from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer

repo, repo_via_save, out = sys.argv[1], sys.argv[2], sys.argv[3]
model = AutoModelForMaskedLM.from_pretrained(repo, trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained(repo)
batch = dict(tokenizer(["the cat sat on the mat .", "a tiny model"], padding=True, return_tensors="pt"))
with torch.no_grad():
    logits = model(**batch).logits
base = AutoModel.from_pretrained(repo_via_save, trust_remote_code=True)
torch.save(
    {
        "state": {name: tensor.clone() for name, tensor in model.state_dict().items()},
        "batch": batch,
        "logits": logits,
        "classes": [f"{type(m).__module__}.{type(m).__name__}" for m in (model, base)],
    },
    out,
)
"""


def _front_matter(card: str) -> dict:
    match = re.match(r"\A---\n(.*?)\n---\n", card, re.DOTALL)
    assert match, "README.md has no YAML front matter"
    return yaml.safe_load(match.group(1))


def _parity_rows(card: str) -> list[str]:
    return re.findall(r"^\| (?:eager|sdpa|flash_attention_2) \|.*\|$", card, re.MULTILINE)


@pytest.mark.slow
def test_push_to_hub_then_from_pretrained_without_hf_tiny(fake_hub, converted_encoder, tmp_path):
    converted, conversion = converted_encoder
    env = clean_env(fake_hub.client_env(str(tmp_path)))

    push = PUSH.replace("__REPO__", REPO)
    pushed = run_python(push, cwd=tmp_path, env=env, isolated=False, args=(str(converted), str(tmp_path)))
    urls = json.loads(pushed.stdout.strip().splitlines()[-1])
    assert urls["repo_url"] == f"{fake_hub.url}/{REPO}"

    # --- what the repo holds
    files = fake_hub.files(REPO)
    config = json.loads(fake_hub.read(REPO, "config.json"))
    assert config["model_type"] == "hf_tiny_encoder"
    assert config["auto_map"]["AutoModelForMaskedLM"] == "modeling_encoder.TinyEncoderForMaskedLM"
    assert config["auto_map"]["AutoConfig"] == "configuration_encoder.TinyEncoderConfig"
    local_code = {p.name for p in converted.glob("*.py")}
    assert {"modeling_encoder.py", "configuration_encoder.py", "modeling_base.py", "layers.py", "hub.py"} <= local_code
    for name in local_code:
        assert fake_hub.read(REPO, name) == (converted / name).read_bytes(), name
    assert files["model.safetensors"].lfs_sha256 is not None, "weights must go through LFS as on the Hub"
    assert {"tokenizer.json", "tokenizer_config.json"} <= files.keys()

    card = fake_hub.read(REPO, "README.md").decode()
    meta = _front_matter(card)
    assert meta["library_name"] == "transformers"
    assert meta["license"] == "apache-2.0"
    assert meta["base_model"] == "hf-tiny-tests/tiny-bert"
    assert meta["pipeline_tag"] == "fill-mask"
    assert {"hf_tiny", "custom_code", "bert", "pushed-by-test"} <= set(meta["tags"])
    assert f'from_pretrained("{REPO}"' in card and str(converted) not in card
    # the parity numbers measured at conversion travel verbatim
    source_rows = _parity_rows((converted / "README.md").read_text())
    assert source_rows and _parity_rows(card) == source_rows
    assert len(source_rows) == len(conversion["parity"])
    assert all(row.endswith("| yes |") for row in source_rows)

    via_save = fake_hub.files(REPO_VIA_SAVE)
    assert {"config.json", "model.safetensors", "modeling_encoder.py", "README.md"} <= via_save.keys()
    via_save_card = fake_hub.read(REPO_VIA_SAVE, "README.md").decode()
    assert is_hf_tiny_card(via_save_card) and f'from_pretrained("{REPO_VIA_SAVE}"' in via_save_card

    # --- download with from_pretrained in an interpreter that cannot import hf_tiny
    run_python(PULL, cwd=tmp_path, env=env, isolated=True, args=(REPO, REPO_VIA_SAVE, str(tmp_path / "pulled.pt")))
    pulled = torch.load(tmp_path / "pulled.pt", weights_only=True)
    assert all(name.startswith("transformers_modules.") for name in pulled["classes"]), pulled["classes"]
    assert pulled["classes"][1].endswith("TinyEncoderModel")

    from transformers import AutoModelForMaskedLM

    local = AutoModelForMaskedLM.from_pretrained(converted).eval()
    local_state = local.state_dict()
    assert pulled["state"].keys() == local_state.keys()
    for name, tensor in local_state.items():
        assert torch.equal(pulled["state"][name], tensor), name
    on_disk = load_file(converted / "model.safetensors")
    for name, tensor in on_disk.items():
        assert torch.equal(pulled["state"][name], tensor), name
    with torch.no_grad():
        logits = local(**pulled["batch"]).logits
    diff = (pulled["logits"] - logits).abs().max().item()
    assert diff <= 1e-6, f"downloaded model's logits differ by {diff}"
    assert pulled["batch"]["attention_mask"].min() == 0  # a padded batch

    assert fake_hub.unhandled == []
    methods = {method for method, _ in fake_hub.requests}
    assert {"POST", "PUT", "HEAD", "GET"} <= methods  # create/commit, LFS upload, metadata, download


def test_push_without_repo_id_is_a_clear_error(converted_encoder, monkeypatch):
    import transformers.utils.hub as transformers_hub
    from transformers import AutoModelForMaskedLM

    def no_hub():
        raise AssertionError("push_to_hub reached the Hub API with a bad repo id")

    monkeypatch.setattr(transformers_hub, "hf_api", no_hub)
    model = AutoModelForMaskedLM.from_pretrained(converted_encoder[0])
    with pytest.raises(ValueError, match=r"push_to_hub needs a repo_id .* got repo_id=None"):
        model.push_to_hub()
    for bad in (None, "", "   ", 42):
        with pytest.raises(ValueError, match=re.escape(f"got repo_id={bad!r}")):
            model.push_to_hub(bad)
    with pytest.raises(ValueError, match=r"'name' or 'namespace/name', got repo_id='a/b/c'"):
        model.push_to_hub("a/b/c")
    assert check_repo_id("someone/model") == "someone/model"


def test_save_pretrained_carries_the_model_card(converted_encoder, tmp_path):
    from transformers import AutoModelForMaskedLM

    converted, _ = converted_encoder
    source = (converted / "README.md").read_text()
    model = AutoModelForMaskedLM.from_pretrained(converted)
    model.save_pretrained(tmp_path / "copy")
    card = (tmp_path / "copy" / "README.md").read_text()
    assert _front_matter(card) == _front_matter(source)
    assert _parity_rows(card) == _parity_rows(source)
    assert f'from_pretrained("{tmp_path / "copy"}"' in card

    # saving over the folder it came from leaves the card alone
    model.save_pretrained(converted)
    assert (converted / "README.md").read_text() == source


@pytest.mark.parametrize("change", ["another head", "fine-tuned", "fused optimizer step", "quantized"])
def test_a_card_that_no_longer_describes_the_model_is_not_carried(converted_encoder, tmp_path, change):
    """The card claims the converted weights and their parity: saved from another head, after a training step or
    quantized it would describe other numbers, so it is not carried (transformers / Trainer write theirs). Moving the
    model (`.to()`) keeps it. Before, every save carried it."""
    from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification, BitsAndBytesConfig

    converted, _ = converted_encoder
    if change == "another head":
        model = AutoModelForSequenceClassification.from_pretrained(converted, num_labels=2)
    elif change == "quantized":
        pytest.importorskip("bitsandbytes")
        model = AutoModelForMaskedLM.from_pretrained(converted, quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    elif change == "fused optimizer step":  # Trainer's default optimizer on 5.24; it writes without bumping _version
        model = AutoModelForMaskedLM.from_pretrained(converted)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        ids = torch.randint(3, model.config.vocab_size, (2, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        versions = [p._version for p in model.parameters()]
        optimizer.step()
        assert [p._version for p in model.parameters()] == versions  # what the card's check cannot rely on alone
    else:
        model = AutoModelForMaskedLM.from_pretrained(converted).to(torch.float64).to(torch.float32)
        (tmp_path / "moved").mkdir()
        assert carry_model_card(model, tmp_path / "moved") is not None  # moved, not changed: the card holds
        with torch.no_grad():
            next(model.parameters()).add_(0.01)  # an optimizer step, in place
    model.save_pretrained(tmp_path / "saved")
    readme = tmp_path / "saved" / "README.md"
    assert not readme.exists() or "converted from" not in readme.read_text()


def test_a_sparse_fused_step_ends_the_card_though_no_sampled_element_moved(converted_encoder, tmp_path):
    """Trainer's default optimizer (fused AdamW, no weight decay) on the embeddings alone moves only the rows a batch
    touched, and writes without bumping _version: the card's sampled elements did not move, and it was carried over
    a fine-tuned model. Any optimizer step over the model's parameters now ends it."""
    from transformers import AutoModelForMaskedLM

    from hf_tiny.hub import _parameter_states

    converted, _ = converted_encoder
    model = AutoModelForMaskedLM.from_pretrained(converted)
    model.requires_grad_(False)
    embeddings = model.get_input_embeddings().weight.requires_grad_(True)
    before = embeddings.detach().clone()
    optimizer = torch.optim.AdamW([embeddings], lr=1e-2, weight_decay=0.0, fused=True)
    # a loss on the encoder's states: gradients on the rows of these ids only (the tied MLM head would reach all),
    # rows the card's 16 sampled elements are not in
    rows, width = embeddings.shape
    sampled = {int(i) // width for i in torch.arange(16) * (rows * width - 1) // 15}
    ids = torch.tensor([[row for row in range(3, rows) if row not in sampled][:4]])
    model.base_model(input_ids=ids)[0].square().sum().backward()
    optimizer.step()
    assert not torch.equal(embeddings.detach(), before)  # trained ...
    assert model._hf_tiny_loaded_weights == _parameter_states(model)  # ... where the sample cannot see it
    model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved" / "README.md").exists()
    # the control: a model no optimizer stepped keeps its card
    AutoModelForMaskedLM.from_pretrained(converted).save_pretrained(tmp_path / "unchanged")
    assert "converted from" in (tmp_path / "unchanged" / "README.md").read_text()


def test_a_readme_of_someone_else_in_the_target_folder_is_left_as_it_is(converted_encoder, tmp_path):
    """Official save_pretrained never writes README.md: a user's or Trainer's card already in the target folder
    stays. An earlier hf_tiny card there is replaced by this model's (and push_to_hub still replaces transformers'
    generic card)."""
    from transformers import AutoModelForMaskedLM

    model = AutoModelForMaskedLM.from_pretrained(converted_encoder[0])
    theirs = "---\nlicense: mit\ntags:\n- mine\n---\n# my notes on this model\n"
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "README.md").write_text(theirs)
    model.save_pretrained(tmp_path / "target")
    assert (tmp_path / "target" / "README.md").read_text() == theirs
    # an hf_tiny card there (a copy of the source's): this model's card, pointed at the new folder
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "README.md").write_text((converted_encoder[0] / "README.md").read_text())
    model.save_pretrained(tmp_path / "ours")
    assert f'from_pretrained("{tmp_path / "ours"}"' in (tmp_path / "ours" / "README.md").read_text()


def test_model_without_hf_tiny_card_gets_none(tmp_path):
    """A model built from a config has no measured parity: nothing is invented for it."""
    config = hf_tiny.TinyEncoderConfig(
        vocab_size=11, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8
    )
    model = hf_tiny.TinyEncoderModel(config)
    model.save_pretrained(tmp_path / "fresh")
    assert not (tmp_path / "fresh" / "README.md").exists()
    # a folder with a README that is not an hf_tiny card: not carried either
    (tmp_path / "fresh" / "README.md").write_text("---\nlicense: mit\ntags:\n- other\n---\n# someone else's card\n")
    reloaded = hf_tiny.TinyEncoderModel.from_pretrained(tmp_path / "fresh")
    assert carry_model_card(reloaded, tmp_path / "elsewhere_does_not_matter") is None


def test_retarget_card_points_snippets_and_adds_tags(converted_encoder):
    source = (converted_encoder[0] / "README.md").read_text()
    assert is_hf_tiny_card(source)
    tags = card_tags(source)
    card = retarget_card(source, "me/new-model", ["extra-tag", tags[0]])
    assert card_tags(card) == tags + ["extra-tag"]
    assert card.count('from_pretrained("me/new-model"') == source.count(".from_pretrained(") >= 2
    assert _front_matter(card)["tags"] == tags + ["extra-tag"]
    with pytest.raises(ValueError, match="no block-style 'tags:' list"):
        retarget_card("---\nlicense: mit\n---\n# card\n", None, ["x"])


def _http(hub: FakeHub, method: str, path: str, body: bytes = b"", token: bool = True):
    import urllib.error
    import urllib.request

    headers = {"Authorization": "Bearer hf_dummy"} if token else {}
    request = urllib.request.Request(hub.url + path, data=body or None, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_fake_hub_rejects_what_the_hub_rejects(fake_hub):
    """The server under the push test must not be more lenient than the Hub where the client relies on errors."""
    create = json.dumps({"name": "strict", "organization": None}).encode()
    assert _http(fake_hub, "POST", "/api/repos/create", create, token=False)[0] == 401
    assert _http(fake_hub, "POST", "/api/repos/create", create)[0] == 200
    assert _http(fake_hub, "POST", "/api/repos/create", create)[0] == 409  # exists: push_to_hub passes exist_ok
    repo = f"{NAMESPACE}/strict"

    status, headers, _ = _http(fake_hub, "HEAD", f"/{NAMESPACE}/missing/resolve/main/config.json")
    assert (status, headers["X-Error-Code"]) == (404, "RepoNotFound")
    status, headers, _ = _http(fake_hub, "HEAD", f"/{repo}/resolve/nope/config.json")
    assert (status, headers["X-Error-Code"]) == (404, "RevisionNotFound")
    status, headers, _ = _http(fake_hub, "HEAD", f"/{repo}/resolve/main/config.json")
    assert (status, headers["X-Error-Code"]) == (404, "EntryNotFound")
    assert headers["X-Repo-Commit"] == fake_hub.repos[repo].branches["main"]  # the client caches the miss per commit

    sha = "0" * 64
    assert _http(fake_hub, "PUT", f"/lfs-upload/{sha}", b"not the content of that hash")[0] == 400
    commit = b"\n".join(
        json.dumps(line).encode()
        for line in (
            {"key": "header", "value": {"summary": "lfs pointer to nothing"}},
            {"key": "lfsFile", "value": {"path": "model.safetensors", "algo": "sha256", "oid": sha, "size": 3}},
        )
    )
    assert _http(fake_hub, "POST", f"/api/models/{repo}/commit/main", commit)[0] == 422
    assert _http(fake_hub, "POST", f"/api/models/{repo}/commit/main", commit, token=False)[0] == 401
    bad_card = json.dumps({"content": "---\nlicense: [unclosed\n---\n# card\n", "repoType": "model"}).encode()
    status, _, body = _http(fake_hub, "POST", "/api/validate-yaml", bad_card)
    assert status == 400 and b"not valid YAML" in body
    assert set(fake_hub.files(repo)) == {".gitattributes"}  # nothing above got in
