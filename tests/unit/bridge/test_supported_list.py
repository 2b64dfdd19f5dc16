"""`tools/convert_checkpoint.py --list`: the supported architectures and RoPE types, from the
registry itself, and the README's copy of that list is the tool's output verbatim."""

import re
from pathlib import Path

from helpers.tools import load_tool

from mlrl.bridge import supported_model_types
from mlrl.bridge.arch import ROPE_TYPES

REPO = Path(__file__).resolve().parents[3]


def _tool():
    return load_tool("convert_checkpoint")


def test_list_prints_every_registered_architecture_and_rope_type(capsys):
    assert _tool().main(["--list"]) == 0
    out = capsys.readouterr().out
    for mt in supported_model_types():
        assert re.search(rf"^  {mt}\s+\w+ForCausalLM", out, re.M), (mt, out)
    assert f"rope types: {', '.join(ROPE_TYPES)}" in out
    assert "megatron-bridge" in out and "not installed" in out  # the CPU environment cannot hold it


def test_readme_shows_the_list_as_the_tool_prints_it():
    listing = _tool().list_supported()
    readme = (REPO / "README.md").read_text()
    assert f"```\n{listing}\n```" in readme, "README.md: paste `python tools/convert_checkpoint.py --list` output"


def test_a_command_or_list_is_required(capsys):
    import pytest

    with pytest.raises(SystemExit) as ei:
        _tool().main([])
    assert ei.value.code == 2 and "a command is required" in capsys.readouterr().err
