"""Several writers (one per pipeline stage) + one finalize make one HF folder; the checks of
finalize (duplicates across writers, names vs config.json, dtype in config) and its atomicity."""

import json
import os

import pytest
import torch
import transformers

from mlrl.ckpt_files.hf_folder import INDEX_FILE, ShardWriter, finalize_hf_folder, temp_dir_for
from mlrl.modelzoo import resolve_model_dir


def _stage_items(model):
    items = [(k, v) for k, v in model.state_dict().items() if k != "lm_head.weight"]  # tied
    half = len(items) // 2
    return items[:half], items[half:]


def test_two_stage_writers_make_one_loadable_folder(tmp_path):
    src = resolve_model_dir("builtin:tiny-llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    out = tmp_path / "hf"
    tmp = temp_dir_for(out)
    maps = []
    for stage, items in enumerate(_stage_items(model)):
        w = ShardWriter(tmp, f"stage{stage:03d}", max_shard_bytes=60_000)
        for i in range(0, len(items), 2):
            w.add(items[i:i + 2])
        maps.append(json.loads(json.dumps(w.close())))  # shard maps cross processes as JSON
    assert all(len(m) > 1 for m in maps)
    finalize_hf_folder(
        tmp, out, maps, src, expected_names=[k for k, _ in model.state_dict().items() if k != "lm_head.weight"]
    )
    index = json.loads((out / INDEX_FILE).read_text())
    n = len(sum((list(m) for m in maps), []))
    assert sorted(set(index["weight_map"].values())) == [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]
    assert (out / "config.json").read_text() == (src / "config.json").read_text()
    assert not tmp.exists()
    assert oct(os.stat(out / "model-00001-of-{:05d}.safetensors".format(n)).st_mode & 0o044) == oct(
        0o044
    )  # not owner-only
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(back(ids).logits, model(ids).logits)


def test_finalize_refuses_incomplete_or_duplicated_streams(tmp_path):
    src = resolve_model_dir("builtin:tiny-llama")
    t = torch.zeros(2)
    for maps_items, expected, match in [
        ([[("a", t)], [("a", t)]], None, "written twice"),
        ([[("a", t)], [("b", t)]], ["a", "b", "c"], "1 missing"),
        ([[("a", t)], [("b", t)]], ["a"], "1 unexpected"),
    ]:
        out = tmp_path / "o"
        tmp = temp_dir_for(out)
        maps = []
        for stage, items in enumerate(maps_items):
            w = ShardWriter(tmp, f"s{stage}")
            w.add(items)
            maps.append(w.close())
        with pytest.raises(ValueError, match=match):
            finalize_hf_folder(tmp, out, maps, src, expected_names=expected)
        assert not out.exists()  # nothing half-written appears


def test_dtype_is_written_into_the_config_and_old_export_replaced(tmp_path):
    src = resolve_model_dir("builtin:tiny-llama")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.txt").write_text("previous export")
    tmp = temp_dir_for(out)
    w = ShardWriter(tmp, "s", dtype=torch.bfloat16)
    w.add([("w", torch.ones(3))])
    finalize_hf_folder(tmp, out, [w.close()], src, dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".hf.*"))
