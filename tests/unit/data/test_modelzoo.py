"""Builtin models materialise into a complete HF folder whoever asks first, a trainer rank > 0
included (transformers' save_pretrained writes nothing there), and a folder marked complete
without its weights is rebuilt rather than handed out."""

import torch.distributed as dist

from mlrl import modelzoo


def _weights(folder):
    return sorted(p.name for p in folder.iterdir() if p.name in ("config.json", "model.safetensors", ".complete"))


def test_a_nonzero_rank_materialises_a_complete_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("MLRL_CACHE", str(tmp_path))
    # this process looks like torch.distributed rank 1, to transformers and to mlrl alike
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    folder = modelzoo.resolve_model_dir("builtin:tiny-llama")
    assert _weights(folder) == [".complete", "config.json", "model.safetensors"]


def test_a_folder_marked_complete_without_weights_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("MLRL_CACHE", str(tmp_path))
    broken = tmp_path / "models" / "tiny-llama"
    broken.mkdir(parents=True)
    (broken / ".complete").write_text("ok\n")
    (broken / "tokenizer.json").write_text("{}")
    folder = modelzoo.resolve_model_dir("builtin:tiny-llama")
    assert folder == broken and _weights(folder) == [".complete", "config.json", "model.safetensors"]
