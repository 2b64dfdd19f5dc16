import torch
import transformers

from mlrl.ckpt_files.hf_folder import write_hf_folder
from mlrl.modelzoo import resolve_model_dir


def _buckets(model, per_bucket=3):
    items = list(model.state_dict().items())
    items = [(k, v) for k, v in items if k != "lm_head.weight"]  # tied: HF does not store it
    for i in range(0, len(items), per_bucket):
        yield items[i:i + per_bucket]


def test_streamed_export_loads_in_transformers_sharded(tmp_path):
    src = resolve_model_dir("builtin:tiny-llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    out = write_hf_folder(_buckets(model), tmp_path / "hf", src, max_shard_bytes=40_000)
    assert (out / "model.safetensors.index.json").is_file()  # small shards -> several files
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(back(ids).logits, model(ids).logits)
    assert not list(tmp_path.glob(".*.tmp"))


def test_duplicate_tensor_is_an_error(tmp_path):
    import pytest

    t = torch.zeros(2)
    with pytest.raises(ValueError, match="produced twice"):
        write_hf_folder([[("a", t)], [("a", t)]], tmp_path / "o", tmp_path)


def test_kept_tensors_dtype_is_what_config_json_says(tmp_path):
    """--dtype keep (or a model whose config declares no dtype): the tensors keep the checkpoint's
    dtype, and config.json must say it, or transformers / vLLM load them as the source's (fp32
    training of a bf16 model came back bf16)."""
    import json

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16"}))
    t = torch.ones(4, dtype=torch.float32)
    out = write_hf_folder([[("a", t), ("b", t.clone())]], tmp_path / "kept", src)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    out = write_hf_folder([[("a", t)]], tmp_path / "cast", src, dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    mixed = write_hf_folder([[("a", t), ("b", t.to(torch.float16))]], tmp_path / "mixed", src)
    assert json.loads((mixed / "config.json").read_text())["dtype"] == "bfloat16"  # no one dtype: left as it was
