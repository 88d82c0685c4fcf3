"""``conversion hf-to-megatron --help`` says what --tp / --pp / --ep set: the layout the written
checkpoint is sharded for. Before: 'tensor parallel size to write from'."""

from conversion.cli import build_parser


def test_layout_help_names_the_written_layout():
    sub = build_parser()._subparsers._group_actions[0].choices["hf-to-megatron"]
    helps = {a.dest: a.help for a in sub._actions}
    for dest in ("tp", "pp", "ep"):
        assert "the written checkpoint is sharded for" in helps[dest]
        assert "to write from" not in helps[dest]
