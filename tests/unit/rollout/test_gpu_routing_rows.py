"""Router replay on GPU: vLLM returns each request's routed experts with its answer, kept by token
sequence until the loop fetches them. Two samples of a group with the same answer (common for short
answers) each get the rows of their own request; the second was left without rows (and failed)."""

import json

import numpy as np

from mlrl.config.schema import RolloutConfig
from mlrl.rollout import server
from mlrl.rollout.client import Segment
from mlrl.rollout.pool import EnginePool, EngineState
from mlrl.types import GenerationHyperparameters, ModelRequest


class SameAnswer:
    """Every sample of a group answers [7, 2]; sample i's rows are filled with i."""

    async def generate_n(self, prompt, g, n, **kw):
        return [Segment(tokens=[7, 2], logprobs=[-0.1, -0.1], versions=[0, 0], finish="stop",
                        routed_experts=np.full((len(prompt) + 1, 2, 2), i, np.uint8)) for i in range(n)]


async def test_identical_answers_each_get_their_own_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(server, "_on_gpu", lambda: True)  # vLLM's own capture: rows come back with the answer
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 50}))
    pool = EnginePool(RolloutConfig(num_engines=1), tmp_path, capture_routing=True, command=["unused"])
    e = pool.engines[0]
    e.client, e.state, pool._started = SameAnswer(), EngineState.READY, True
    group = ModelRequest(input_ids=[1, 5, 6], gconfig=GenerationHyperparameters(n_samples=2))
    resps = await pool.agenerate_group(group)
    rows = await pool.fetch_routing([r.input_tokens + r.output_tokens for r in resps])
    assert sorted(None if r is None else int(r.max()) for r in rows) == [0, 1]  # one each (newest first)
    assert await pool.fetch_routing([resps[0].input_tokens + resps[0].output_tokens]) == [None]  # each taken once
