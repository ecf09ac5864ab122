"""examples/finetune_*.py --work-dir: a converted hf_tiny folder given there is reused as it is (it used to be
converted again into a nested WORK_DIR/NAME folder, 517 MB inside the user's model folder)."""

from __future__ import annotations

import json

import pytest

import trainer_runs  # noqa: F401  (puts examples/ on sys.path)
import finetune_common as common


def _converter(calls):
    def convert(src, dst):
        calls.append((src, dst))
        dst.mkdir(parents=True)
        (dst / "config.json").write_text(json.dumps({"model_type": "hf_tiny_encoder"}))

    return convert


def test_a_converted_folder_given_as_work_dir_is_reused_as_it_is(tmp_path):
    calls = []
    mine = tmp_path / "my_model"
    mine.mkdir()
    (mine / "config.json").write_text(json.dumps({"model_type": "hf_tiny_encoder"}))
    assert common.converted(mine, "minilm", _converter(calls), tmp_path / "src") == mine
    assert not calls and sorted(p.name for p in mine.iterdir()) == ["config.json"]


def test_an_empty_work_dir_is_converted_into_once_then_reused(tmp_path):
    calls = []
    folder = common.converted(tmp_path / "work", "minilm", _converter(calls), tmp_path / "src")
    assert folder == tmp_path / "work" / "minilm" and len(calls) == 1
    assert common.converted(tmp_path / "work", "minilm", _converter(calls), tmp_path / "src") == folder
    assert len(calls) == 1


def test_a_work_dir_holding_another_model_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(SystemExit, match="model_type='bert', not a converted hf_tiny checkpoint"):
        common.converted(tmp_path, "minilm", _converter([]), tmp_path / "src")
