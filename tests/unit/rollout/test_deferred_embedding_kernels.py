"""During a weight sync the embeddings' kernel packing is deferred to the end of the update
(`refresh_embedding_kernels` runs it once), and restored afterwards, failure or not."""

import contextlib

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


def test_an_update_that_never_finished_does_not_leave_the_head_deferred(monkeypatch):
    """The sync failed on another engine: this engine got start + its weights but no finish, and the
    retry starts again. Before, the first attempt's deferral (the instance's no-op) stayed for the
    rest of the run, so the LM head was never packed again and the engine computed its logits with
    the kernel packed from old weights."""
    import vllm.model_executor.model_loader.reload as reload

    calls = []
    monkeypatch.setattr(UnquantizedEmbeddingMethod, "process_weights_after_loading",
                        lambda self, layer: calls.append(layer))
    monkeypatch.setattr(reload, "initialize_layerwise_reload", lambda model: None)
    monkeypatch.setattr(reload, "finalize_layerwise_reload", lambda model, cfg: None)
    model = torch.nn.Module()
    model.embed = torch.nn.Module()
    model.embed.quant_method = UnquantizedEmbeddingMethod()
    engine = worker_ext.MlrlWeightTransferEngine.__new__(worker_ext.MlrlWeightTransferEngine)
    engine.model, engine.vllm_config, engine.model_config, engine._update = model, None, None, None
    monkeypatch.setattr(worker_ext.vllm_compat, "weight_update_config", lambda cfg: contextlib.nullcontext())
    engine.start_weight_update()   # attempt 1: never finished here
    engine.start_weight_update()   # the retry
    assert "process_weights_after_loading" in vars(model.embed.quant_method)  # deferred for this attempt
    engine._worker_index = lambda: 0  # (no vLLM parallel config in this stand-in)
    engine._finish_weight_update()
    assert engine.last_report["refreshed"] == ["embed"]
    assert "process_weights_after_loading" not in vars(model.embed.quant_method)
    assert calls == [model.embed]  # packed from the new weights
    # and a deferral left in place cannot stop the refresh itself
    worker_ext.defer_embedding_kernels(model)
    assert worker_ext.refresh_embedding_kernels(model) == ["embed"] and len(calls) == 2
