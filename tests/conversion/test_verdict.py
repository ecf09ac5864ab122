"""The CLI's last line says what the model card's parity table says: "parity passed" only when every row is within
tolerance; a lossy --dtype whose rows are over it (reported, not failed) says how many, and names the card file the
folder holds."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from conversion.__main__ import main

pytestmark = pytest.mark.usefixtures("single_torch_thread")
VERDICT = re.compile(r"(parity passed: (\d+) run\(s\)|parity: (\d+) of (\d+) runs over tolerance), largest max "
                     r"\|diff\| \S+ \((eager|sdpa), (\w+); tolerance \S+; see ([^)]+)\)\)$")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A random Llama at a large init: bfloat16 rounding moves its logits by more than bfloat16's tolerance."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3)
    folder = tmp_path_factory.mktemp("verdict") / "src"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def convert(source, dst, capsys, *flags) -> tuple[re.Match, list[str]]:
    """(the last line's verdict, the card table's "within tolerance" cells)."""
    assert main([str(source), str(dst), *flags]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    verdict = VERDICT.search(line)
    assert verdict, line
    card = dst / verdict.group(7)
    assert card.is_file(), f"the line names {verdict.group(7)}, which {dst} does not hold"
    cells = [row.strip("|").split("|")[-1].strip() for row in card.read_text().splitlines()
             if row.startswith("| eager") or row.startswith("| sdpa")]
    return verdict, cells


def test_rows_over_tolerance_are_counted_not_passed(source, tmp_path, capsys):
    verdict, cells = convert(source, tmp_path / "bf16", capsys, "--dtype", "bfloat16")
    assert cells.count("NO") == 2, cells  # the card's verdict: both bfloat16 rows over tolerance
    assert verdict.group(3, 4) == ("2", "2") and verdict.group(6) == "bfloat16", verdict.group(0)


def test_rows_within_tolerance_pass(source, tmp_path, capsys):
    verdict, cells = convert(source, tmp_path / "fp32", capsys)
    assert cells == ["yes", "yes"]
    assert verdict.group(2) == "2" and verdict.group(6) == "float32", verdict.group(0)
