"""tools/convert_checkpoint.py refuses bad inputs in one line (exit 2) before any rank starts: a
config.json that is not JSON names the file, --tp/--pp/--ep 0 is refused (it was read as "not
given"), and --max-shard-size must be a positive size. tools/compare_hf_megatron.py's pre-check
names a broken config.json too."""

import pytest
from helpers.tools import load_tool

from mlrl.modelzoo import resolve_model_dir


@pytest.mark.parametrize("args,message", [
    (["--tp", "0"], "--tp/--pp/--ep must be >= 1, got 0/1/1"),
    (["--ep", "0"], "--tp/--pp/--ep must be >= 1, got 1/1/0"),
])
def test_a_zero_layout_is_refused(tmp_path, capsys, args, message):
    src = resolve_model_dir("builtin:tiny-llama")
    code = load_tool("convert_checkpoint").main(["hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "o"), *args])
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("where", ["same", "parent"])
def test_an_output_that_is_or_holds_the_input_is_refused_force_or_not(tmp_path, capsys, where):
    """--force replaces the output folder whole: --out X --hf X (or --out a parent of X) deleted the input."""
    import shutil

    src = tmp_path / "models" / "hf"
    shutil.copytree(resolve_model_dir("builtin:tiny-llama"), src)
    out = src if where == "same" else src.parent
    code = load_tool("convert_checkpoint").main(["hf-to-mcore", "--hf", str(src), "--out", str(out), "--force"])
    err = capsys.readouterr().err
    assert code == 2 and f"--out {out}: {'is' if where == 'same' else 'holds'} the input --hf {src}" in err, err
    assert (src / "config.json").is_file() and any(src.glob("*.safetensors"))


def test_a_config_json_that_is_not_json_is_named(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{bad")
    code = load_tool("convert_checkpoint").main(["hf-to-mcore", "--hf", str(tmp_path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and f"--hf {tmp_path}: config.json is not valid JSON" in err and "Traceback" not in err, err


@pytest.mark.parametrize("size", ["0", "0MB", "0.0000001KB", "5XB", "inf", "1e400GB"])
def test_the_shard_size_must_be_a_positive_size(tmp_path, capsys, size):
    code = load_tool("convert_checkpoint").main(["mcore-to-hf", "--ckpt", str(tmp_path), "--out", str(tmp_path / "o"),
                                                 "--max-shard-size", size])
    assert code == 2 and f"--max-shard-size {size!r}: expected a positive size" in capsys.readouterr().err


def test_the_parity_tools_precheck_names_a_broken_config_json(tmp_path):
    from types import SimpleNamespace

    (tmp_path / "config.json").write_text("{bad")
    args = SimpleNamespace(hf_dir=str(tmp_path), tp=1, pp=1, ep=1, samples=2, random_tokens=None)
    why = load_tool("compare_hf_megatron")._precheck(args)
    assert why is not None and why.startswith(f"--hf-dir: {tmp_path}/config.json is not valid JSON"), why
