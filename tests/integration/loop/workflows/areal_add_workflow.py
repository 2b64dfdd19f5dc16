"""The workflow of AReaL's "add a workflow" guide as its users write it, with only the imports
changed to mlrl. With transformers 5, `tokenizer.apply_chat_template(..., tokenize=True)` returns a
BatchEncoding, so `list(input_ids)` is `['input_ids', 'attention_mask']`: every episode fails (mlrl's
ModelRequest refuses a list of str, naming it). tests/integration/loop/test_failing_episodes.py
runs it through `python -m mlrl.launch`: the run must stop with exit 1 and that error."""

import uuid

from mlrl.workflow import ModelRequest, RolloutWorkflow


class AddWorkflow(RolloutWorkflow):
    def __init__(self, reward_fn, gconfig, tokenizer):
        self.reward_fn = reward_fn
        self.gconfig = gconfig
        self.tokenizer = tokenizer

    async def arun_episode(self, engine, data):
        input_ids = self.tokenizer.apply_chat_template(data["messages"], tokenize=True, add_generation_prompt=True)
        req = ModelRequest(rid=uuid.uuid4().hex, input_ids=list(input_ids), gconfig=self.gconfig.new(n_samples=1))
        resp = await engine.agenerate(req)
        completion = self.tokenizer.decode(resp.output_tokens)
        reward = self.reward_fn(None, completion, resp.input_tokens, resp.output_tokens, **data)
        return {"input_ids": resp.input_tokens + resp.output_tokens, "rewards": reward}
