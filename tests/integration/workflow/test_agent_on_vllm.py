"""Workflows against a real vLLM CPU server (one engine of `mlrl.rollout.EnginePool`, tiny Llama, fp32),
shared by the module:

1. an agent written only against `openai.AsyncOpenAI` runs through mlrl's recording proxy; every
   completion it saw is recorded with the engine's token ids, logprobs and weight versions: the
   recorded prompt is the chat template of the messages it sent, the recorded output decodes to
   the text it received, the recorded logprobs are those the engine returned to the agent and
   equal HF transformers' logprobs of the same tokens (<= 1e-4), and the trainable samples the
   runner returns carry exactly these numbers;
2. the built-in `rlvr` workflow on `synthetic:copy_digit` produces samples whose logprobs equal HF's.

The vLLM CPU attention backend rejects head_dim 16 (the builtin tiny Llama's), so the module derives
a head_dim-32 variant with the same vocabulary and chat template (as tests/integration/rollout does).
"""

import json
import shutil

import openai
import pytest
import pytest_asyncio
import torch
import transformers

from mlrl.config.schema import RolloutConfig
from mlrl.data import get_dataset
from mlrl.rollout import EnginePool
from mlrl.types import GenerationHyperparameters
from mlrl.workflow import EpisodeRunner, EpisodeStatus, apply_chat_template, build_workflow

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

TOL = 1e-4
G = GenerationHyperparameters(max_new_tokens=6, temperature=1.0)
SEEN: list = []


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from mlrl.modelzoo import resolve_model_dir

    src = resolve_model_dir("builtin:tiny-llama")
    out = tmp_path_factory.mktemp("tiny-llama-hd32")
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("."):
            shutil.copy2(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["head_dim"] = 32
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "transformers_version"})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf(model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return tok, model


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(model_dir, tmp_path_factory):
    cfg = RolloutConfig(
        num_engines=1, max_model_len=256, max_concurrent_requests=16, startup_timeout_s=400, request_timeout_s=400
    )
    p = EnginePool(cfg, model_dir, run_dir=tmp_path_factory.mktemp("engines"))
    try:
        await p.start()
        yield p
    finally:
        await p.shutdown()


@torch.no_grad()
def hf_logprobs(model, prompt, output):
    ids = torch.tensor([list(prompt) + list(output)])
    lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


class CopyAgent:
    """Plain OpenAI-client agent: two chat turns, reward 1 if the second answer is '3'."""

    async def run(self, data, **extra_kwargs):
        client = openai.AsyncOpenAI(base_url=extra_kwargs["base_url"], api_key=extra_kwargs["api_key"],
                                    http_client=extra_kwargs["http_client"], max_retries=0)
        msgs = list(data["messages"])
        first = await client.chat.completions.create(model="default", messages=msgs, max_tokens=6, logprobs=True)
        msgs2 = msgs + [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "copy 3"},
        ]
        second = await client.chat.completions.create(model="default", messages=msgs2, max_tokens=6, logprobs=True)
        SEEN.append([(msgs, first), (msgs2, second)])
        return float(second.choices[0].message.content.strip() == "3")


async def test_openai_agent_through_the_proxy_records_what_the_engine_generated(pool, hf):
    tok, model = hf
    SEEN.clear()
    wf = build_workflow(CopyAgent, tokenizer=tok, gconfig=G)
    runner = EpisodeRunner(wf, pool, max_concurrency=4, episode_timeout_s=300)
    rows = [{"messages": [{"role": "user", "content": f"copy {d}"}], "answer": str(d)} for d in (4, 7)]
    try:
        groups = await runner.run_batch(rows, n=2)
    finally:
        await runner.aclose()
    assert all(e.status == EpisodeStatus.COMPLETED for g in groups for e in g.episodes)
    samples = {tuple(s.tokens): s for g in groups for s in g.samples}
    assert len(SEEN) == 4 and len(samples) <= 8 and sum(len(g.samples) for g in groups) == 8
    checked = 0
    for episode in SEEN:
        for msgs, completion in episode:
            prompt = completion.model_extra["prompt_token_ids"]
            output = completion.choices[0].model_extra["token_ids"]
            assert prompt == apply_chat_template(tok, msgs, add_generation_prompt=True)
            assert tok.decode(output, skip_special_tokens=True) == completion.choices[0].message.content
            seen_lps = [c.logprob for c in completion.choices[0].logprobs.content]
            s = samples[tuple(prompt + output)]                       # the trainable sample of this completion
            assert s.loss_mask == [0] * len(prompt) + [1] * len(output) and s.prompt_len == len(prompt)
            assert s.rollout_logprobs[len(prompt):] == seen_lps       # exactly what the engine returned
            assert s.versions[len(prompt):] == [pool.version] * len(output)
            ref = hf_logprobs(model, prompt, output)
            assert max(abs(a - b) for a, b in zip(seen_lps, ref)) <= TOL
            checked += 1
    assert checked == 8
    assert runner.last_metrics["workflow/num_model_calls"] == 2.0


async def test_rlvr_on_copy_digit_through_the_pool(pool, hf):
    tok, model = hf
    rows = list(get_dataset("synthetic:copy_digit", num_rows=4, seed=3))
    wf = build_workflow("rlvr", tokenizer=tok, gconfig=G, reward="exact_match", reward_workers=1)
    runner = EpisodeRunner(wf, pool, max_concurrency=8, episode_timeout_s=300)
    batch = await runner.run_batch(rows, n=2)
    assert batch.metrics["episodes/completed"] == 8 and batch.metrics["reward_fn/calls"] == 8
    assert batch.metrics["reward_fn/failures"] == 0 and len(batch.samples) == 8
    for g in batch:
        for s in g.samples:
            p = s.prompt_len
            out = s.tokens[p:]
            assert s.tokens[:p] == apply_chat_template(tok, g.data["messages"], add_generation_prompt=True)
            assert 1 <= len(out) <= G.max_new_tokens
            assert max(abs(a - b) for a, b in zip(s.rollout_logprobs[p:], hf_logprobs(model, s.tokens[:p], out))) <= TOL
            assert s.reward == float(tok.decode(out, skip_special_tokens=True).strip() == g.data["answer"])
