"""A seeded request whose prompt vLLM prefills in several steps (chunked prefill: more prompt
tokens than --max-num-batched-tokens) on a real CPU engine. vLLM samples a token at every partial
step, discards it and rewinds the request's generator by a Philox offset, which a CPU generator
lacks: before mlrl.rollout.worker_ext.rewind_seeded_generators_on_cpu the engine died
("CPU Generator does not use offset") at the first such step of any run with
rollout.sampling.seed, e.g. an evaluation of 64 SmolLM2 prompts x 8. Now the generator's state is
restored instead, so the request draws exactly what an unsplit prompt draws."""

import dataclasses

import pytest
import pytest_asyncio
import transformers

from mlrl.config.schema import RolloutConfig
from mlrl.rollout import EnginePool, EngineServer
from mlrl.types import GenerationHyperparameters, ModelRequest

CHUNK = 32  # --max-num-batched-tokens: a prompt of ~116 tokens takes 4 prefill steps, 3 of them discarding a sample
BLOCK = 32  # --block-size (the CPU default, 128, would cache none of the prompt): 3 of its blocks are cached


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(vllm_tiny_llama, tmp_path_factory):
    def small_steps(i, spec):
        return EngineServer(dataclasses.replace(spec, extra_args=[*spec.extra_args, "--max-num-batched-tokens",
                                                                  str(CHUNK), "--max-num-seqs", str(CHUNK),
                                                                  "--block-size", str(BLOCK)]))

    cfg = RolloutConfig(num_engines=1, max_model_len=256, startup_timeout_s=400, request_timeout_s=400)
    p = EnginePool(cfg, vllm_tiny_llama, run_dir=tmp_path_factory.mktemp("chunked"), server_factory=small_steps)
    await p.start()
    yield p
    await p.shutdown()


def _prompt(model_dir, text):
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_seeded_chunked_prompt_samples_as_an_unsplit_one(pool, vllm_tiny_llama):
    prompt = _prompt(vllm_tiny_llama, "copy the digits " + "1 2 3 4 5 6 7 8 9 " * 12)
    assert len(prompt) > 3 * CHUNK

    def req(seed):
        return ModelRequest(input_ids=prompt, gconfig=GenerationHyperparameters(max_new_tokens=16, seed=seed))

    seeds = (11, 12, 13)
    chunked = [await pool.agenerate(req(s)) for s in seeds]  # the first: every step of the prompt sampled, discarded
    assert all(r.error is None and r.output_len > 0 for r in chunked), [r.error for r in chunked]
    # the prompt's full blocks are cached now: each request prefills its last len % BLOCK tokens in one step and
    # discards nothing, i.e. samples as an unsplit prompt; the chunked first requests must have drawn the same
    assert 0 < len(prompt) % BLOCK < CHUNK
    cached = [await pool.agenerate(req(s)) for s in seeds]
    assert [r.output_tokens for r in cached] == [r.output_tokens for r in chunked]
    assert len({tuple(r.output_tokens) for r in chunked}) > 1  # the seeds matter (the check above can fail)
