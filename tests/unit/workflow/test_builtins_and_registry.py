"""Registry lookup / construction, and the built-in rlvr and multi_turn workflows on a scripted engine."""

import pytest
from _wf_helpers import last_user_word
from helpers.scripted_engine import ScriptedEngine, scripted_logprob

from mlrl.config.schema import WorkflowConfig
from mlrl.types import GenerationHyperparameters, SampleStatus, TerminationReason
from mlrl.workflow import (
    EpisodeOutput,
    RolloutWorkflow,
    apply_chat_template,
    build_workflow,
    build_workflow_from_config,
    get_workflow,
    list_workflows,
    load_hf_tokenizer,
    register_workflow,
)
from mlrl.workflow.builtin.agent import OpenAIAgentWorkflow
from mlrl.workflow.builtin.multi_turn import MultiTurnWorkflow
from mlrl.workflow.builtin.rlvr import RLVRWorkflow

G = GenerationHyperparameters(max_new_tokens=6)
ROW = {"messages": [{"role": "user", "content": "copy 7"}], "answer": "7"}


class Counting(RolloutWorkflow):
    built = 0

    def __init__(self, tokenizer, factor=1.0):
        Counting.built += 1
        self.tokenizer, self.factor = tokenizer, factor

    async def arun_episode(self, engine, data):
        return None


class Agent:
    async def run(self, data, **extra_kwargs):
        return 1.0


def test_registry_names_paths_and_injection(tok):
    assert {"rlvr", "multi_turn", "openai_agent"} <= set(list_workflows())
    register_workflow("unit_counting")(Counting)
    wf = build_workflow("unit_counting", kwargs={"factor": 2.0}, tokenizer=tok, gconfig=G)
    assert isinstance(wf, Counting) and wf.tokenizer is tok and wf.factor == 2.0
    wf2 = build_workflow(f"{__name__}.Counting", tokenizer=tok)
    assert isinstance(wf2, Counting)
    assert get_workflow("rlvr") is RLVRWorkflow
    agent_wf = build_workflow(f"{__name__}.Agent", tokenizer=tok, gconfig=G)
    assert isinstance(agent_wf, OpenAIAgentWorkflow) and isinstance(agent_wf.agent, Agent)


def test_registry_errors():
    with pytest.raises(ValueError, match="unknown workflow 'nope'.*rlvr"):
        get_workflow("nope")
    with pytest.raises(ValueError, match="neither a RolloutWorkflow"):
        build_workflow("collections.OrderedDict")
    with pytest.raises(ValueError, match="already registered"):
        register_workflow("rlvr")(Counting)
    with pytest.raises(ValueError, match="could not be built.*reward_fn"):
        build_workflow("rlvr", tokenizer=object())


def test_build_from_config_uses_reward_settings(tok):
    cfg = WorkflowConfig(name="rlvr", reward="gsm8k", reward_timeout_s=7.0, reward_workers=1)
    wf = build_workflow_from_config(cfg, tokenizer=tok, gconfig=G)
    assert isinstance(wf, RLVRWorkflow)
    assert wf.reward.timeout == 7.0 and wf.reward.max_workers == 1 and wf.reward.reward_fn.__name__ == "gsm8k_reward"


async def test_rlvr_sample_is_exactly_what_the_engine_produced(tok):
    eng = ScriptedEngine.from_text(tok, last_user_word, version=5)
    wf = RLVRWorkflow("exact_match", G, tok, reward_workers=1)
    s = await wf.arun_episode(eng, ROW)
    prompt = apply_chat_template(tok, ROW["messages"], add_generation_prompt=True)
    out = eng.responses[0].output_tokens
    assert tok.decode(out, skip_special_tokens=True) == "7"
    assert s.tokens == prompt + out and s.prompt_len == len(prompt)
    assert s.loss_mask == [0] * len(prompt) + [1] * len(out)
    assert s.rollout_logprobs[len(prompt):] == [scripted_logprob(t, i) for i, t in enumerate(out)]
    assert s.versions == [-1] * len(prompt) + [5] * len(out)
    assert s.reward == 1.0 and s.status == SampleStatus.COMPLETED
    bad = ScriptedEngine.from_text(tok, lambda p: "3 3 3 3 3 3 3")
    s2 = await wf.arun_episode(bad, ROW)
    assert s2.reward == 0.0 and s2.status == SampleStatus.TRUNCATED and sum(s2.loss_mask) == 6


async def test_multi_turn_feedback_loop_masks_only_model_tokens(tok):
    # wrong, wrong, right: three model turns, two feedback turns.
    answers = iter(["1", "2", "7"])
    eng = ScriptedEngine.from_text(tok, lambda p: next(answers), version=2)
    wf = MultiTurnWorkflow(
        "exact_match", G, tok, max_turns=5, turn_discount=0.5, feedback="try again", reward_workers=1
    )
    out = await wf.arun_episode(eng, ROW)
    assert isinstance(out, EpisodeOutput) and out.termination_reason == TerminationReason.ENV_DONE and out.is_correct
    (s,) = out.samples
    assert s.reward == 1.0 * 0.5**2 and out.metrics["num_turns"] == 3.0
    r1, r2, r3 = eng.responses
    assert r3.input_tokens[: len(r2.input_tokens)] == r2.input_tokens  # each turn extends the last
    assert s.tokens == r3.input_tokens + r3.output_tokens
    trained = [t for t, m in zip(s.tokens, s.loss_mask) if m]
    assert trained == r1.output_tokens + r2.output_tokens + r3.output_tokens
    feedback = apply_chat_template(
        tok,
        [{"role": "assistant", "content": "x"}, {"role": "user", "content": "try again"}],
        add_generation_prompt=True,
    )[len(apply_chat_template(tok, [{"role": "assistant", "content": "x"}])) :]
    i = len(r1.input_tokens) + len(r1.output_tokens)
    assert s.tokens[i : i + len(feedback)] == feedback and s.loss_mask[i : i + len(feedback)] == [0] * len(feedback)
    assert [v for v, m in zip(s.versions, s.loss_mask) if not m] == [-1] * (len(s.tokens) - len(trained))


async def test_a_failed_engine_request_fails_the_multi_turn_episode(tok):
    """An engine request that ended in error (a timeout keeps its partial tokens) is no answer: it was
    scored and trained, and an empty one left an EOS the engine never produced in the next prompt."""
    from mlrl.workflow import EpisodeRunner, EpisodeStatus

    def second_turn_fails(input_ids, call):
        if call == 1:
            raise RuntimeError("request timed out")
        return list(tok("1", add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]

    eng = ScriptedEngine(second_turn_fails, eos_token_id=tok.eos_token_id, vocab_size=len(tok))
    wf = MultiTurnWorkflow("exact_match", G, tok, max_turns=3, feedback="try again", reward_workers=1)
    runner = EpisodeRunner(wf, eng, max_concurrency=1, episode_timeout_s=20)
    try:
        (g,) = await runner.run_batch([ROW], n=1)
    finally:
        await runner.aclose()
    (e,) = g.episodes
    assert e.status == EpisodeStatus.ERROR and not g.samples
    assert e.info["error"]["error_type"] == "EngineError" and "(turn 2) ended with error" in \
        e.info["error"]["error_message"]


async def test_multi_turn_turn_limit_and_env_stop(tok):
    eng = ScriptedEngine.from_text(tok, lambda p: "1")
    wf = MultiTurnWorkflow("exact_match", G, tok, max_turns=2, reward_workers=1)
    out = await wf.arun_episode(eng, ROW)
    assert out.termination_reason == TerminationReason.MAX_TURNS_EXCEEDED and out.samples[0].reward == 0.0
    assert len(eng.responses) == 2 and not out.is_correct

    stop_after_one = MultiTurnWorkflow("exact_match", G, tok, max_turns=4, reward_workers=1,
                                       feedback_fn=lambda data, completion, reward, turn: None)
    out2 = await stop_after_one.arun_episode(ScriptedEngine.from_text(tok, lambda p: "1"), ROW)
    assert out2.termination_reason == TerminationReason.ENV_DONE and out2.metrics["num_turns"] == 1.0

    capped = MultiTurnWorkflow("exact_match", G, tok, max_turns=4, max_total_tokens=16, reward_workers=1)
    out3 = await capped.arun_episode(ScriptedEngine.from_text(tok, lambda p: "1"), ROW)
    assert out3.termination_reason == TerminationReason.MAX_PROMPT_LENGTH_EXCEEDED


def test_multi_turn_argument_checks(tok):
    with pytest.raises(ValueError, match="max_turns"):
        MultiTurnWorkflow("exact_match", G, tok, max_turns=0)
    with pytest.raises(ValueError, match="turn_discount"):
        MultiTurnWorkflow("exact_match", G, tok, turn_discount=0.0)


@pytest.mark.parametrize("thinking", [None, False, True])
def test_enable_thinking_reaches_the_chat_template_false_included(tok, thinking):
    """workflow.kwargs.enable_thinking: false must reach the template (Qwen3's then renders an empty
    think block); None leaves the template's default."""
    seen = []

    class Recording:  # the model's tokenizer, recording what its template is asked
        def __getattr__(self, name):
            return getattr(tok, name)

        def apply_chat_template(self, *args, **kw):
            seen.append(kw.get("enable_thinking", "absent"))
            return tok.apply_chat_template(*args, **kw)

    wf = RLVRWorkflow("exact_match", G, Recording(), enable_thinking=thinking, reward_workers=1)
    assert wf.prompt_ids(ROW)
    assert seen == ["absent" if thinking is None else thinking]


def test_multi_turn_feedback_continues_a_chatml_conversation_token_for_token():
    """ChatML (SmolLM2, Qwen): a turn ends at the <|im_end|> the model samples; the template's "\n"
    after it opens the feedback turn. Prompt + answer + EOS + feedback_ids must equal the template's
    own rendering of the three turns."""
    smol = load_hf_tokenizer("builtin:smollm2-135m-instruct")
    wf = MultiTurnWorkflow("exact_match", G, smol, feedback="try again", reward_workers=1)
    user = [{"role": "user", "content": "copy 3"}]
    answer = smol("4", add_special_tokens=False)["input_ids"]
    built = apply_chat_template(smol, user, add_generation_prompt=True) + answer + [smol.eos_token_id] \
        + wf.feedback_ids("try again")
    want = apply_chat_template(smol, [*user, {"role": "assistant", "content": "4"},
                                      {"role": "user", "content": "try again"}], add_generation_prompt=True)
    assert built == want, (smol.decode(built), smol.decode(want))


class _EosIsEndOfText:
    """A ChatML tokenizer whose EOS is <|endoftext|> (a base model's), so a chat run stops turns at
    <|im_end|> through rollout.sampling.stop_token_ids."""

    def __init__(self, tok):
        self._tok = tok
        self.eos_token_id = tok.convert_tokens_to_ids("<|endoftext|>")

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, *args, **kw):
        return self._tok(*args, **kw)

    def __len__(self):
        return len(self._tok)


@pytest.mark.parametrize("stop", ["<|im_end|>", ".", ",", "Ċ", "<|im_start|>"])
async def test_a_turn_ended_by_a_stop_token_id_the_template_writes_continues_as_the_template(stop):
    """A turn that ended at a stop_token_ids token the template writes after an assistant turn's
    content (<|im_end|>, the tokenizer's EOS being <|endoftext|>) is closed by it: the next turn's
    prompt is the template's own rendering of the conversation, without an EOS the template never
    writes. A turn ended by another stop id is closed by the EOS, as at a length stop: one the
    template never writes ("."), or writes only elsewhere (the "," of SmolLM2's default system
    prompt, the "\n" after a role name, a role marker)."""
    smol = load_hf_tokenizer("builtin:smollm2-135m-instruct")
    tok = _EosIsEndOfText(smol)
    end = smol.convert_tokens_to_ids(stop)
    stop_at_im_end = stop == "<|im_end|>"
    if stop in (",", "Ċ", "<|im_start|>"):  # the case: the template writes it, but not after the content
        assert end in apply_chat_template(smol, [{"role": "assistant", "content": "x"}])
    answer = list(smol("4", add_special_tokens=False)["input_ids"]) + [end]
    eng = ScriptedEngine(lambda ids, call: answer, eos_token_id=tok.eos_token_id, vocab_size=len(smol))
    g = G.new(stop_token_ids=[end])
    wf = MultiTurnWorkflow("exact_match", g, tok, max_turns=2, feedback="try again", reward_workers=1)
    user = [{"role": "user", "content": "copy 3"}]
    await wf.arun_episode(eng, {"messages": user, "answer": "3"})
    _, second = eng.responses
    if stop_at_im_end:
        want = apply_chat_template(smol, [*user, {"role": "assistant", "content": "4"},
                                          {"role": "user", "content": "try again"}], add_generation_prompt=True)
    else:  # "4" + the stop token, then the EOS the workflow closes it with, then the template's delta after it
        first = apply_chat_template(smol, user, add_generation_prompt=True)
        x = [{"role": "assistant", "content": "x"}]
        delta = apply_chat_template(smol, [*x, {"role": "user", "content": "try again"}],
                                    add_generation_prompt=True)[len(apply_chat_template(smol, x)):]
        want = first + answer + [tok.eos_token_id] + delta
    assert second.input_tokens == want, (smol.decode(second.input_tokens), smol.decode(want))


async def test_rlvr_fails_a_sample_whose_request_was_interrupted_and_not_resumed(tok):
    """The pool answers INTERRUPT, with the partial tokens, when it closed (or had no engine left)
    before an interrupted request could continue: not an answer. It was scored and trained."""
    from mlrl.types import ModelResponse, StopReason
    from mlrl.workflow import EpisodeStatus

    answer = list(tok("7", add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]

    class Closing:
        async def agenerate_group(self, req):
            return [ModelResponse(input_tokens=list(req.input_ids), output_tokens=answer, output_logprobs=[-0.1] * 2,
                                  output_versions=[0] * 2, stop_reason=StopReason.STOP, rid="r:0"),
                    ModelResponse(input_tokens=list(req.input_ids), output_tokens=answer[:1], output_logprobs=[-0.1],
                                  output_versions=[0], stop_reason=StopReason.INTERRUPT, rid="r:1",
                                  error="EnginePool is shut down")]

    wf = RLVRWorkflow("exact_match", G, tok, reward_workers=0)
    done, cut = await wf.arun_group(Closing(), ROW, 2)
    assert done.status == EpisodeStatus.COMPLETED and done.samples[0].reward == 1.0
    assert cut.status == EpisodeStatus.ERROR and not cut.samples
    assert "ended with interrupt: EnginePool is shut down" in cut.info["error"]["error_message"]
    assert [r.unfinished for r in StopReason] == [r in ("error", "abort", "interrupt") for r in StopReason]
