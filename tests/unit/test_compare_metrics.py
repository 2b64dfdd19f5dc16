"""tools/compare_metrics.py: equal runs pass, a differing value, key or step fails, timings are ignored."""

import json

from helpers.tools import load_tool

cm = load_tool("compare_metrics")


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_equal_runs_pass_and_timings_are_ignored(tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", [{"step": 1, "train/loss": 0.5, "timing/step": 1.0, "train/time_s": 0.2,
                                       "reward/std": float("nan")}])
    b = _write(tmp_path / "b.jsonl", [{"step": 1, "train/loss": 0.5, "timing/step": 9.0, "train/time_s": 0.7,
                                       "reward/std": float("nan")}])
    assert cm.main([str(a), str(b)]) == 0
    assert capsys.readouterr().out.strip().endswith("ratio equal_values: 1.000000")


def test_a_differing_value_key_or_step_fails(tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", [{"step": 1, "train/loss": 0.5}, {"step": 2, "train/loss": 0.4}])
    b = _write(tmp_path / "b.jsonl", [{"step": 1, "train/loss": 0.5000001}, {"step": 2, "train/loss": 0.4}])
    assert cm.main([str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "step 1: train/loss: 0.5 != 0.5000001" in out and "step 2" not in out
    c = _write(tmp_path / "c.jsonl", [{"step": 1, "train/loss": 0.5, "reward/mean": 1.0},
                                      {"step": 2, "train/loss": 0.4}])
    assert cm.main([str(a), str(c)]) == 1
    d = _write(tmp_path / "d.jsonl", [{"step": 1, "train/loss": 0.5}])
    assert cm.main([str(a), str(d)]) == 1
    assert cm.main([str(a), str(tmp_path / "missing.jsonl")]) == 2


def test_a_file_that_is_not_a_metrics_jsonl_exits_2_not_1(tmp_path, capsys):
    """1 means "the runs differ": bad input said so too (a SystemExit with a message, a KeyError
    traceback for a line without 'step')."""
    good = tmp_path / "a.jsonl"
    good.write_text(json.dumps({"step": 1, "x": 1.0}) + "\n")
    for i, text in enumerate(['{"x": 1.0}\n', "not json\n" + json.dumps({"step": 1, "x": 1.0}) + "\n", '[1, 2]\n']):
        bad = tmp_path / f"b{i}.jsonl"
        bad.write_text(text)
        assert cm.main([str(good), str(bad)]) == 2
        assert f"b{i}.jsonl:1: not" in capsys.readouterr().err
    binary = tmp_path / "c.jsonl"
    binary.write_bytes(b"\xff\xfe")
    assert cm.main([str(good), str(binary)]) == 2 and "not UTF-8" in capsys.readouterr().err
    torn = tmp_path / "d.jsonl"  # a crashed run's torn last line is left out, as mlrl's own reader does
    torn.write_text(json.dumps({"step": 1, "x": 1.0}) + '\n{"step": 2, "x"')
    assert cm.main([str(good), str(torn)]) == 0
