"""hf_tiny reads the causal config's optional mechanisms through their typed tables (`config.moe.n_group`), never
by a field's name (issue 43, item 4): no `field_value(config, "...")`, no `getattr(config, "num_local_experts", 0)`,
and no `config.floor_scale`, an attribute a config holds only while its mechanism is in use. Only the tables
themselves (hf_tiny/causal_mechanisms.py, moe.py's Moe) name the fields, as their own attributes."""

from __future__ import annotations

import ast
from pathlib import Path

from causal_config_snapshots import NEWER_OPTIONAL_FIELDS, OPTIONAL_FIELDS  # every optional field, written out

from hf_tiny import TinyCausalConfig
from hf_tiny.causal_mechanisms import mechanism_views

EVERY_OPTIONAL_FIELD = (*OPTIONAL_FIELDS, *NEWER_OPTIONAL_FIELDS)
HF_TINY = Path(__file__).resolve().parents[2] / "hf_tiny"
# The other families' own files: their configs are other classes, whose fields may share a name (the seq2seq
# config's use_padding_idx is a plain field).
OTHER_FAMILIES = {
    "configuration_encoder.py", "modeling_encoder.py", "encoder_embeddings.py", "encoder_layers.py",
    "encoder_head_layers.py", "configuration_seq2seq.py", "modeling_seq2seq.py", "seq2seq_stack.py",
}

NAME_READERS = {"getattr", "hasattr", "field_value"}


def _is_config(node: ast.expr) -> bool:
    """`config`, `self.config`, `model.config`, ...: an expression that names a config."""
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return name in ("config", "cfg")


def name_reads(source: str) -> list[str]:
    """Each place in `source` that reads an optional field by its name, as 'line N: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in NAME_READERS:
            reader = getattr(node.func, "id", getattr(node.func, "attr", None))
            named = [arg.value for arg in node.args if isinstance(arg, ast.Constant) and arg.value in EVERY_OPTIONAL_FIELD]
            if reader == "field_value" or named:
                found.append(f"line {node.lineno}: {reader}(... {named})")
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in EVERY_OPTIONAL_FIELD:
            found.append(f"line {node.lineno}: [{node.slice.value!r}]")
        elif isinstance(node, ast.Attribute) and node.attr in EVERY_OPTIONAL_FIELD and _is_config(node.value):
            found.append(f"line {node.lineno}: config.{node.attr}")
    return found


def test_the_tables_hold_exactly_the_optional_fields():
    held = [name for view in mechanism_views(TinyCausalConfig).values() for name in view.table.field_names()]
    assert len(held) == len(set(held)), "a field in two tables"
    assert set(held) == set(EVERY_OPTIONAL_FIELD)


def test_hf_tiny_reads_no_optional_field_by_name():
    offenders = {
        path.name: reads
        for path in sorted(HF_TINY.glob("*.py"))
        if path.name not in OTHER_FAMILIES and (reads := name_reads(path.read_text()))
    }
    assert not offenders, offenders


def test_the_scan_finds_each_kind_of_name_read():
    """Negative control: the reads the old code made are each found."""
    source = (
        "a = field_value(config, 'nope_layers')\n"
        "b = getattr(self.config, 'mla_absorb', False)\n"
        "c = model.config.mtp_loss_weight\n"
        "d = values['num_local_experts']\n"
        "e = config.moe.num_local_experts\n"  # typed: fine
        "f = spec.n_group\n"  # a module's own spec, not the config: fine
    )
    assert [read.split(":")[0] for read in name_reads(source)] == ["line 1", "line 2", "line 3", "line 4"]
