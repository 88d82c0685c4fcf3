"""``conversion hf-to-megatron --help`` says what --tp / --pp / --ep set: the layout the written
checkpoint is sharded for. Before: 'tensor parallel size to write from'."""

import re

from conversion.cli import build_parser
from megarl.config.keys import schema_problem


def test_layout_help_names_the_written_layout():
    sub = build_parser()._subparsers._group_actions[0].choices["hf-to-megatron"]
    helps = {a.dest: a.help for a in sub._actions}
    for dest in ("tp", "pp", "ep"):
        assert "the written checkpoint is sharded for" in helps[dest]
        assert "to write from" not in helps[dest]


def test_out_help_names_the_key_a_run_starts_from():
    """The help of --out says which run config keys concern the checkpoint: each one it names
    must be a key of the schema (a renamed key fails here)."""
    sub = build_parser()._subparsers._group_actions[0].choices["hf-to-megatron"]
    text = {a.dest: a.help for a in sub._actions}["out"]
    keys = re.findall(r"actor_rollout_ref\.[a-z_.]+[a-z]", text)
    assert "actor_rollout_ref.model.path" in keys and len(keys) == 2
    for key in keys:
        assert schema_problem(key) is None, key
