"""Written files follow the umask, as the files official save_pretrained writes with open() do (config.json:
0o666 less the umask; folders 0o777 less it), in every writer: forward and reverse conversion (weights, config,
card, tokenizer and sentence-transformers files), and hf_tiny's save_pretrained, atomic or in place.

safetensors 0.8 writes through a temporary file created 0600 and renamed into place (safetensors#782), so a plain
`safetensors.torch.save_file`, and official save_pretrained's model.safetensors with it, ignore the umask; ours
set the mode a plain write would have had. Copies (shutil.copy2 / copytree keep the source's modes) get it too.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM

import hf_tiny
from conversion import bert

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def modes(folder: Path) -> dict[str, int]:
    """{relative path: mode} of a folder and everything under it."""
    found = {".": mode(folder)}
    for root, folders, files in os.walk(folder):
        for name in folders + files:
            path = Path(root) / name
            found[str(path.relative_to(folder))] = mode(path)
    return found


def official_source(tmp_path: Path) -> tuple[Path, int, int]:
    """An official BERT folder saved by save_pretrained, with a tokenizer file and a sentence-transformers module
    folder whose files are read-only (0o444, as a pip-installed or read-only checkout may have them); returns
    (folder, the mode save_pretrained gave its config.json, the mode it gave the folder)."""
    torch.manual_seed(0)
    official = BertForMaskedLM(BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=24, max_position_embeddings=16))
    src = tmp_path / "src"
    official.save_pretrained(src)
    (src / "vocab.txt").write_text("\n".join(f"[unused{i}]" for i in range(40)))
    (src / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 16}))
    for path in (src / "vocab.txt", src / "modules.json", src / "1_Pooling" / "config.json"):
        path.chmod(0o444)
    return src, mode(src / "config.json"), mode(src)


def assert_modes(folder: Path, file_mode: int, folder_mode: int, keep: dict | None = None) -> None:
    """Every file file_mode and every folder folder_mode, except the paths of `keep` ({path: mode})."""
    keep = keep or {}
    wrong = {path: oct(found) for path, found in modes(folder).items()
             if found != keep.get(path, folder_mode if (folder / path).is_dir() else file_mode)}
    assert not wrong, f"expected files {oct(file_mode)} and folders {oct(folder_mode)}: {wrong}"


def test_official_save_pretrained_follows_the_umask_in_its_other_files(umask, tmp_path):
    """What the comparisons below take as the standard: config.json and the folder as a plain write makes them."""
    _, file_mode, folder_mode = official_source(tmp_path)
    assert (file_mode, folder_mode) == (0o666 & ~umask, 0o777 & ~umask)


def test_conversion_both_ways_follows_the_umask(umask, tmp_path):
    src, file_mode, folder_mode = official_source(tmp_path)
    bert.convert(src, tmp_path / "ours")
    for name in ("model.safetensors", "config.json", "README.md", "vocab.txt", "1_Pooling/config.json"):
        assert (tmp_path / "ours" / name).is_file(), name
    assert_modes(tmp_path / "ours", file_mode, folder_mode)
    bert.convert_back(tmp_path / "ours", tmp_path / "back")
    assert (tmp_path / "back" / "model.safetensors").is_file()
    assert_modes(tmp_path / "back", file_mode, folder_mode)


def test_save_pretrained_follows_the_umask_atomic_over_a_folder_and_in_place(umask, tmp_path, monkeypatch):
    src, file_mode, folder_mode = official_source(tmp_path)
    bert.convert(src, tmp_path / "ours")
    model = hf_tiny.TinyEncoderForMaskedLM.from_pretrained(tmp_path / "ours")

    model.save_pretrained(tmp_path / "saved")  # atomic, into a new folder
    assert (tmp_path / "saved" / "model.safetensors").is_file() and (tmp_path / "saved" / "README.md").is_file()
    assert_modes(tmp_path / "saved", file_mode, folder_mode)

    # atomic over an existing folder: what the save writes follows the umask, what it carries over keeps its mode
    private = tmp_path / "saved" / "notes.txt"
    private.write_text("kept")
    private.chmod(0o600)
    model.save_pretrained(tmp_path / "saved")
    assert_modes(tmp_path / "saved", file_mode, folder_mode, keep={"notes.txt": 0o600})

    # in place (the working directory is inside the destination, which cannot be renamed away)
    inside = tmp_path / "in_place"
    inside.mkdir()
    (inside / "notes.txt").write_text("kept")
    (inside / "notes.txt").chmod(0o600)
    monkeypatch.chdir(inside)
    model.save_pretrained(inside)
    assert (inside / "model.safetensors").is_file()
    assert_modes(inside, file_mode, folder_mode, keep={"notes.txt": 0o600})
