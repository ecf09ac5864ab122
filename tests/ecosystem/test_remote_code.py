"""Shipping code: a model saved with save_pretrained loads with AutoModel*.from_pretrained(path,
trust_remote_code=True) in a fresh interpreter where hf_tiny is NOT importable, and computes what it computed
before saving. The shipped .py files import only torch, transformers, the standard library and each other, and
make no network calls."""

from __future__ import annotations

import ast
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from fresh_interpreter import REPO_ROOT, clean_env, run_python

import hf_tiny

# Imports a shipped file may have besides the standard library (and `from .sibling import ...`).
ALLOWED_THIRD_PARTY = {"torch", "transformers"}
# Standard-library modules that talk to the network: shipped code must not import them.
NETWORK_MODULES = {
    "socket", "ssl", "http", "urllib", "ftplib", "smtplib", "xmlrpc", "socketserver", "asyncio",
    "requests", "httpx", "huggingface_hub",
}

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _tiny_models() -> dict[str, tuple[torch.nn.Module, str, dict]]:
    """family -> (model with a large init so outputs are far from zero, Auto class name, padded inputs)."""
    torch.manual_seed(0)
    ids = torch.randint(3, 97, (2, 7))
    right_padded = torch.ones_like(ids)
    right_padded[1, 5:] = 0
    left_padded = torch.ones_like(ids)
    left_padded[1, :2] = 0
    encoder = hf_tiny.TinyEncoderForMaskedLM(
        hf_tiny.TinyEncoderConfig(
            vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=32, initializer_range=0.2,
        )
    )
    causal = hf_tiny.TinyCausalForCausalLM(
        hf_tiny.TinyCausalConfig(
            vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, initializer_range=0.2, pad_token_id=0,
        )
    )
    seq2seq = hf_tiny.TinySeq2SeqForConditionalGeneration(
        hf_tiny.TinySeq2SeqConfig(
            vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=32, initializer_range=0.2,
        )
    )
    return {
        "encoder": (encoder, "AutoModelForMaskedLM", {"input_ids": ids, "attention_mask": right_padded}),
        "causal": (causal, "AutoModelForCausalLM", {"input_ids": ids, "attention_mask": left_padded}),
        "seq2seq": (
            seq2seq,
            "AutoModelForSeq2SeqLM",
            {"input_ids": ids, "attention_mask": right_padded, "decoder_input_ids": ids[:, :4]},
        ),
    }


GENERATES = {"causal", "seq2seq"}


@torch.no_grad()
def _outputs(model, inputs: dict, generate: bool) -> dict[str, torch.Tensor]:
    model.eval()
    result = {"logits": model(**inputs).logits}
    if generate:
        prompt = {k: v for k, v in inputs.items() if k != "decoder_input_ids"}
        result["greedy"] = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    return result


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """family -> (folder written by save_pretrained, Auto class name, inputs, in-process outputs)."""
    root = tmp_path_factory.mktemp("remote_code")
    saved = {}
    for family, (model, auto_class, inputs) in _tiny_models().items():
        folder = root / family
        model.save_pretrained(folder)
        saved[family] = (folder, auto_class, inputs, _outputs(model, inputs, family in GENERATES))
    return saved


ISOLATED_LOAD = """
import json, sys
import torch
import transformers

spec = json.loads(open(sys.argv[1]).read())
results = {}
for family, entry in spec["load"].items():
    auto_class = getattr(transformers, entry["auto_class"])
    model = auto_class.from_pretrained(entry["folder"], trust_remote_code=True).eval()
    module = type(model).__module__
    assert module.startswith("transformers_modules."), f"{family}: class comes from {module}, not the shipped code"
    inputs = torch.load(entry["inputs"], weights_only=True)
    with torch.no_grad():
        out = {"logits": model(**inputs).logits}
        if entry["generate"]:
            prompt = {k: v for k, v in inputs.items() if k != "decoder_input_ids"}
            out["greedy"] = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    out["class"] = f"{module}.{type(model).__name__}"
    results[family] = out
for family, auto_class in spec["other_heads"]:
    model = getattr(transformers, auto_class).from_pretrained(spec["load"][family]["folder"], trust_remote_code=True)
    results[f"{family} as {auto_class}"] = f"{type(model).__module__.split('.')[0]}.{type(model).__name__}"
for missing, folder in spec["broken"].items():
    try:
        transformers.AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True)
    except Exception as error:
        results[missing] = {"error": f"{type(error).__name__}: {error}"}
    else:
        results[missing] = {"error": None}
import socket
try:  # the network block was in force the whole time: a connect attempt fails
    socket.create_connection(("127.0.0.1", 9))
except RuntimeError as error:
    results["network_blocked"] = "network call attempted" in str(error)
torch.save(results, sys.argv[2])
"""

# A shipped file deleted from a saved encoder folder -> what the error must say. transformers reports an auto_map
# target as "OSError: FOLDER does not appear to have a file named X.py" and a file those import as
# "FileNotFoundError: [Errno 2] No such file or directory: 'FOLDER/X.py'".
MISSING_FILE_ERRORS = {
    "modeling_encoder.py": "OSError: {folder} does not appear to have a file named modeling_encoder.py",
    "configuration_encoder.py": "OSError: {folder} does not appear to have a file named configuration_encoder.py",
    "layers.py": "FileNotFoundError: [Errno 2] No such file or directory: '{folder}/layers.py'",
}


# A folder saved from one head loads into the family's other heads, as an official folder does: (family, Auto class)
# -> the class it gives.
OTHER_HEADS = {
    ("encoder", "AutoModel"): "transformers_modules.TinyEncoderModel",
    ("encoder", "AutoModelForSequenceClassification"): "transformers_modules.TinyEncoderForSequenceClassification",
    ("causal", "AutoModel"): "transformers_modules.TinyCausalModel",
    ("causal", "AutoModelForSequenceClassification"): "transformers_modules.TinyCausalForSequenceClassification",
    ("seq2seq", "AutoModel"): "transformers_modules.TinySeq2SeqModel",
}


@pytest.fixture(scope="module")
def isolated_results(saved_models, tmp_path_factory):
    """One fresh hf_tiny-free interpreter (network blocked, offline) loads every family and every broken folder."""
    work = tmp_path_factory.mktemp("isolated")
    spec = {"load": {}, "broken": {}, "other_heads": [list(key) for key in OTHER_HEADS]}
    for family, (folder, auto_class, inputs, _) in saved_models.items():
        torch.save(inputs, work / f"{family}_inputs.pt")
        spec["load"][family] = {
            "folder": str(folder),
            "auto_class": auto_class,
            "inputs": str(work / f"{family}_inputs.pt"),
            "generate": family in GENERATES,
        }
    for missing in MISSING_FILE_ERRORS:
        broken = work / f"without_{missing[:-3]}"
        shutil.copytree(saved_models["encoder"][0], broken)
        (broken / missing).unlink()
        spec["broken"][missing] = str(broken)
    (work / "spec.json").write_text(json.dumps(spec))
    env = clean_env({"HF_HOME": str(work / "hf_home"), "HF_HUB_OFFLINE": "1"})
    run_python(
        ISOLATED_LOAD, cwd=work, env=env, isolated=True, block_network=True,
        args=(str(work / "spec.json"), str(work / "out.pt")),
    )
    return torch.load(work / "out.pt", weights_only=True), spec


@pytest.mark.slow
@pytest.mark.parametrize("family", ["encoder", "causal", "seq2seq"])
def test_saved_model_loads_as_remote_code_without_hf_tiny(saved_models, isolated_results, family):
    results, _ = isolated_results
    assert results.get("network_blocked") is True  # the loads above ran with every socket connect refused
    _, _, _, expected = saved_models[family]
    got = results[family]
    assert got["class"].startswith("transformers_modules."), got["class"]
    diff = (got["logits"] - expected["logits"]).abs().max().item()
    # same code, same weights, same CPU: the shipped copy computes the same numbers as the library
    assert diff <= 1e-6, f"{family}: remote-code logits differ from in-process ones by {diff}"
    assert expected["logits"].abs().max() > 1.0  # large init: a broken load could not hide in tiny numbers
    if family in GENERATES:
        assert torch.equal(got["greedy"], expected["greedy"]), family


@pytest.mark.slow
@pytest.mark.parametrize("family, auto_class", sorted(OTHER_HEADS))
def test_saved_model_loads_into_the_family_s_other_heads_without_hf_tiny(isolated_results, family, auto_class):
    """save_pretrained names every Auto class of the family in auto_map (transformers' own save names only the saved
    class's); before, AutoModel on a saved TinyCausalForCausalLM failed 'Unrecognized configuration class'."""
    results, _ = isolated_results
    assert results[f"{family} as {auto_class}"] == OTHER_HEADS[family, auto_class]


@pytest.mark.slow
@pytest.mark.parametrize("missing", sorted(MISSING_FILE_ERRORS))
def test_missing_code_file_is_a_clear_error(isolated_results, missing):
    results, spec = isolated_results
    expected = MISSING_FILE_ERRORS[missing].format(folder=spec["broken"][missing])
    assert results[missing]["error"] is not None, f"loading a folder without {missing} succeeded"
    assert results[missing]["error"].startswith(expected), results[missing]["error"]


def test_saved_folder_has_auto_map_and_every_code_file(saved_models):
    for family, (folder, auto_class, _, _) in saved_models.items():
        config = json.loads((folder / "config.json").read_text())
        module, class_name = config["auto_map"][auto_class].split(".")
        assert (folder / f"{module}.py").is_file(), (family, module)
        assert class_name.startswith("Tiny")
        config_module = config["auto_map"]["AutoConfig"].split(".")[0]
        assert (folder / f"{config_module}.py").is_file()
        shipped = {p.name for p in folder.glob("*.py")}
        needed = _relative_import_closure(REPO_ROOT / "hf_tiny" / f"{module}.py")
        assert needed <= shipped, f"{family}: missing code files {sorted(needed - shipped)}"
        # the shipped copies are the library's files, byte for byte
        for name in shipped:
            assert (folder / name).read_bytes() == (REPO_ROOT / "hf_tiny" / name).read_bytes(), name


# What every family's modeling code runs: the base model class (with the tested-range warning of transformers_api),
# attention, its flash dispatch and Triton kernel, masks, the layers, the runtime with its in-place forms and memory
# plan, saving with its model card, the step preparation and the config checks.
SHARED_CODE_FILES = {
    "attention.py", "engines.py", "flash.py", "flash_triton.py", "hub.py", "io_utils.py", "layers.py", "masks.py",
    "memory_fit.py", "modeling_base.py", "rope.py", "runtime.py", "runtime_forms.py", "saving.py", "step.py",
    "transformers_api.py", "validation.py",
}
# Each family's saved folder, written out by hand: a module a family starts to import is added here on purpose. An
# encoder folder once carried the causal configuration (and through it mla.py and moe.py) because the encoder
# config imported its layer-type check from there (issue 41, item 6).
EXPECTED_CODE_FILES = {
    "encoder": SHARED_CODE_FILES | {
        "configuration_encoder.py", "modeling_encoder.py", "encoder_embeddings.py", "encoder_layers.py",
        "encoder_head_layers.py", "layer_types.py",
    },
    "seq2seq": SHARED_CODE_FILES | {
        "configuration_seq2seq.py", "modeling_seq2seq.py", "seq2seq_stack.py", "chunked_loss.py",
    },
    "causal": SHARED_CODE_FILES | {
        "configuration_causal.py", "causal_mechanisms.py", "layer_types.py", "modeling_causal.py", "chunked_loss.py",
        "mla.py", "moe.py", "mtp.py", "liger.py",
    },
}


@pytest.mark.parametrize("family", sorted(EXPECTED_CODE_FILES))
def test_saved_folder_carries_exactly_its_family_code(saved_models, family):
    """No family ships another's code (the folders still load: test_saved_model_loads_as_remote_code_...)."""
    shipped = {path.name for path in saved_models[family][0].glob("*.py")}
    expected = EXPECTED_CODE_FILES[family]
    assert shipped == expected, f"{family}: extra {sorted(shipped - expected)}, missing {sorted(expected - shipped)}"


def _relative_import_closure(path: Path) -> set[str]:
    """File names reached from `path` through `from .x import ...`, computed from the library sources."""
    seen, todo = set(), [path]
    while todo:
        current = todo.pop()
        if current.name in seen:
            continue
        seen.add(current.name)
        for node in ast.walk(ast.parse(current.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                # `from . import x` is not followed by transformers' copier: listing x here makes the test fail
                modules = [node.module] if node.module else [alias.name for alias in node.names]
                todo.extend(current.parent / f"{module}.py" for module in modules)
    return seen


def _top_level_imports(source: str) -> tuple[set[str], list[str]]:
    """(absolute top-level module names a file needs, relative import targets). Imports inside a `try:` block
    are optional (the file works without them) and are skipped, as transformers' own check_imports does."""
    absolute, relative = set(), []

    def visit(node) -> None:
        if isinstance(node, ast.Try):
            for child in node.handlers + node.orelse + node.finalbody:
                visit(child)
            return
        if isinstance(node, ast.Import):
            absolute.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                absolute.add(node.module.split(".")[0])
            else:
                assert node.level == 1, f"only single-dot relative imports ship: from {'.' * node.level}{node.module}"
                relative.append(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
            "import_module",
            "__import__",
        ):
            raise AssertionError(f"dynamic import at line {node.lineno}: shipped code must import statically")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return absolute, relative


def test_shipped_code_imports_only_torch_transformers_and_stdlib(saved_models):
    for family, (folder, _, _, _) in saved_models.items():
        for path in sorted(folder.glob("*.py")):
            absolute, relative = _top_level_imports(path.read_text())
            third_party = {name for name in absolute if name not in sys.stdlib_module_names and name != "__future__"}
            where = f"{family}/{path.name}"
            assert third_party <= ALLOWED_THIRD_PARTY, f"{where} imports {sorted(third_party - ALLOWED_THIRD_PARTY)}"
            assert not absolute & NETWORK_MODULES, f"{where} imports network modules {sorted(absolute & NETWORK_MODULES)}"
            assert "hf_tiny" not in absolute and "conversion" not in absolute, path.name
            for module in relative:
                assert (folder / f"{module}.py").is_file(), f"{path.name} imports .{module}, which was not shipped"


def test_import_check_rejects_a_forbidden_import():
    """Negative control for the check above: it must notice a third-party or network import."""
    source = (
        "import numpy\nfrom .layers import x\n"
        "def f():\n    from urllib.request import urlopen\n"
        "try:\n    import flash_attn\nexcept ImportError:\n    flash_attn = None\n"
    )
    absolute, relative = _top_level_imports(source)
    assert absolute - sys.stdlib_module_names == {"numpy"}  # the optional flash_attn (in try:) is not required
    assert absolute & NETWORK_MODULES == {"urllib"}  # found inside a function body too
    assert relative == ["layers"]
