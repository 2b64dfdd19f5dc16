"""During a weight sync the embeddings' kernel packing is deferred to the end of the update
(`refresh_embedding_kernels` runs it once), and restored afterwards, failure or not."""

import pytest
import torch

pytest.importorskip("vllm")

from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from mlrl.rollout import worker_ext


def test_embedding_processing_is_deferred_then_restored(monkeypatch):
    calls = []
    monkeypatch.setattr(UnquantizedEmbeddingMethod, "process_weights_after_loading",
                        lambda self, layer: calls.append(layer))
    model = torch.nn.Module()
    model.embed = torch.nn.Module()
    model.embed.quant_method = UnquantizedEmbeddingMethod()
    model.other = torch.nn.Linear(2, 2)

    deferred = worker_ext.defer_embedding_kernels(model)
    assert deferred == [model.embed.quant_method]
    model.embed.quant_method.process_weights_after_loading(model.embed)  # what vLLM's layer-wise reload calls
    assert calls == []
    assert worker_ext.defer_embedding_kernels(model) == []  # already deferred: nothing twice
    worker_ext.restore_embedding_kernels(deferred)
    assert worker_ext.refresh_embedding_kernels(model) == ["embed"]
    assert calls == [model.embed]  # packed once, at the end of the update
