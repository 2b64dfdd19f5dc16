"""rLLM compatibility: termination handling, reward shaping / Monte-Carlo returns (hand-computed),
correctness and metrics, commit/collect, and Episode -> Samples through the runner."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
from _wf_helpers import last_user_word
from helpers.scripted_engine import ScriptedEngine

from mlrl.types import GenerationHyperparameters, TerminationReason
from mlrl.workflow import EpisodeRunner, EpisodeStatus, build_workflow
from mlrl.workflow.compat.rllm import (
    Action,
    BaseAgent,
    BaseEnv,
    Episode,
    MultiTurnWorkflow,
    RLLMWorkflowAdapter,
    Step,
    TerminationEvent,
    Trajectory,
    Workflow,
    trajectory_to_samples,
)

G = GenerationHyperparameters(max_new_tokens=6)
EXEC = ThreadPoolExecutor(2)


class EchoAgent(BaseAgent):
    def __init__(self):
        self._traj = Trajectory()
        self.messages = []

    def update_from_env(self, observation, reward, done, info, **kw):
        if observation is None or observation == {}:
            if self._traj.steps:
                self._traj.steps[-1].reward, self._traj.steps[-1].done = reward, done
            return
        self.messages.append({"role": "user", "content": observation})
        self._traj.steps.append(Step(observation=observation))

    def update_from_model(self, response, **kw):
        self.messages.append({"role": "assistant", "content": response})
        step = self._traj.steps[-1]
        step.chat_completions, step.model_response, step.action = list(self.messages), response, Action(response)
        return step.action

    def reset(self):
        self._traj, self.messages = Trajectory(), []

    @property
    def chat_completions(self):
        return list(self.messages)

    @property
    def trajectory(self):
        return self._traj


class CopyEnv(BaseEnv):
    """Observation 'copy <answer>'; reward 1 and done when the action equals the answer, else asks again."""

    def __init__(self, **kw):
        self.task = None

    def reset(self, task=None):
        self.task = task or self.task
        return self.task["question"], {}

    def step(self, action):
        correct = action.action.strip() == self.task["answer"]
        return (None if correct else self.task["question"]), float(correct), correct, {}

    @staticmethod
    def from_dict(info):
        return CopyEnv()


class Shaped(Workflow):
    """Hand-made trajectory with step rewards [1, 0, 2] and a trailing empty step."""

    async def run(self, task, uid, **kw):
        self.reset(task, uid)
        steps = [
            Step(chat_completions=[{"role": "user", "content": str(i)}], reward=r)
            for i, r in enumerate([1.0, 0.0, 2.0])
        ]
        self.commit(name="solver", trajectory=Trajectory(steps=steps + [Step()]))
        raise TerminationEvent(TerminationReason.ENV_DONE)


async def test_reward_shaping_and_monte_carlo_returns_match_hand_computation():
    wf = Shaped(rollout_engine=None, executor=EXEC, gamma=0.9, reward_bonus_coeff=0.5)
    ep = await wf.run_with_termination_handling({"q": 1}, "task:0")
    (traj,) = ep.trajectories
    assert traj.reward == 3.0                       # sum of the raw step rewards
    assert len(traj.steps) == 3                     # trailing step without chat_completions dropped
    # shaping on raw rewards: [1, 0 + .5*(0-1), 2 + .5*(2-0)] = [1, -0.5, 3]; MC returns with gamma .9:
    # G3 = 3, G2 = -0.5 + .9*3 = 2.2, G1 = 1 + .9*2.2 = 2.98
    assert [s.reward for s in traj.steps] == pytest.approx([2.98, 2.2, 3.0])
    assert ep.termination_reason == TerminationReason.ENV_DONE and ep.is_correct and ep.metrics == {"solver_acc": 3.0}
    assert ep.id == "task:0" and ep.task == {"q": 1}
    plain = Shaped(rollout_engine=None, executor=EXEC)
    (t2,) = (await plain.run_with_termination_handling({}, "u")).trajectories
    assert [s.reward for s in t2.steps] == [1.0, 0.0, 2.0]  # gamma 0 / bonus 0: unchanged


class Sleepy(Workflow):
    def __init__(self, mode, **kw):
        super().__init__(**kw)
        self.mode, self.agent = mode, EchoAgent()

    async def run(self, task, uid, **kw):
        self.reset(task, uid)
        self.agent.update_from_env("copy 1", 0, False, {})
        self.agent.update_from_model("1")
        if self.mode == "sleep":
            await asyncio.sleep(10)
        if self.mode == "raise":
            raise ZeroDivisionError("env exploded")
        if self.mode == "episode":
            return Episode(id=uid, task=task, is_correct=True, metrics={"x_acc": 1.0})


@pytest.mark.parametrize("mode,reason", [("sleep", TerminationReason.TIMEOUT), ("raise", TerminationReason.ERROR),
                                         ("none", TerminationReason.UNKNOWN)])
async def test_termination_paths(mode, reason):
    wf = Sleepy(mode, rollout_engine=None, executor=EXEC, timeout=0.2 if mode == "sleep" else 1e6)
    wf.timeout = 0.2 if mode == "sleep" else wf.timeout
    ep = await wf.run_with_termination_handling({"q": 1}, "u:0")
    assert ep.termination_reason == reason
    assert len(ep.trajectories) == 1 and ep.trajectories[0].steps[0].model_response == "1"  # partial work collected
    if mode == "raise":
        err = ep.info["error"]
        assert (
            err["error_type"] == "ZeroDivisionError"
            and err["error_message"] == "env exploded"
            and "Traceback" in err["traceback"]
        )
    ep2 = await Sleepy("episode", rollout_engine=None, executor=EXEC).run_with_termination_handling({}, "u:1")
    assert ep2.metrics == {"x_acc": 1.0} and ep2.termination_reason is None  # returned episodes are taken as is


def test_commit_and_collect():
    wf = Sleepy("none", rollout_engine=None, executor=EXEC)
    wf.reset({}, "u")
    wf.agent.update_from_env("copy 2", 0, False, {})
    wf.agent.update_from_model("2")
    wf.commit(name="first", agent=wf.agent, reset=True)
    assert wf.agent.trajectory.steps == []
    wf.agent.update_from_env("copy 3", 0, False, {})
    wf.agent.update_from_model("3")
    names = [t.name for t in wf.collect_trajectories().trajectories]
    assert names == ["first", "default"]
    with pytest.raises(ValueError, match="exactly one"):
        wf.commit()


def test_trajectory_to_samples_modes():
    s1 = Step(prompt_ids=[1, 2], response_ids=[3], logprobs=[-0.1], versions=[5], reward=0.0, chat_completions=[{}])
    s2 = Step(
        prompt_ids=[1, 2, 3, 9], response_ids=[4], logprobs=[-0.2], versions=[6], reward=1.0, chat_completions=[{}]
    )
    s3 = Step(prompt_ids=[7], response_ids=[8], logprobs=[-0.3], versions=[6], reward=2.0, chat_completions=[{}])
    traj = Trajectory(name="agent", steps=[s1, s2, s3], reward=3.0)
    merged, alone = trajectory_to_samples(traj, traj.steps, "trajectory")
    assert (
        merged.tokens == [1, 2, 3, 9, 4]
        and merged.loss_mask == [0, 0, 1, 0, 1]
        and merged.versions == [-1, -1, 5, -1, 6]
    )
    assert merged.rollout_logprobs == [0, 0, -0.1, 0, -0.2] and merged.reward == 3.0 and merged.prompt_len == 2
    assert alone.tokens == [7, 8] and alone.reward == 3.0 and merged.metadata["group_suffix"] == "agent"
    per_step = trajectory_to_samples(traj, traj.steps, "step")
    assert [s.reward for s in per_step] == [0.0, 1.0, 2.0] and len(per_step[1].tokens) == 5


class SolverJudge(Workflow):
    """Two roles: two solver trajectories and a judge trajectory (rLLM's solver-judge shape)."""

    async def run(self, task, uid, **kw):
        self.reset(task, uid)
        trajs = []
        for name in ("solver", "solver", "judge"):
            msgs = [{"role": "user", "content": task["question"]}]
            out = await self.rollout_engine.get_model_response(msgs, application_id=uid)
            r = float(out.content == task["answer"]) if name == "solver" else 0.5
            trajs.append(
                Trajectory(name=name, steps=[Step(chat_completions=msgs, model_output=out, reward=r)], reward=r)
            )
        return Episode(
            id=uid, task=task, trajectories=trajs, is_correct=True, metrics={"solver_acc": 1.0, "judge_acc": 0.0}
        )


async def test_adapter_groups_by_trajectory_name_and_keeps_tokens(tok):
    eng = ScriptedEngine.from_text(tok, last_user_word, version=9)
    wf = build_workflow(SolverJudge, tokenizer=tok, gconfig=G)
    assert isinstance(wf, RLLMWorkflowAdapter)
    runner = EpisodeRunner(wf, eng, max_concurrency=2, episode_timeout_s=20)
    (g,) = await runner.run_batch([{"question": "copy 5", "answer": "5"}], n=2)
    await runner.aclose()
    ids = sorted({s.group_id for s in g.samples})
    assert ids == [f"{g.group_id}:judge", f"{g.group_id}:solver"]
    solver = [s for s in g.samples if s.group_id.endswith(":solver")]
    assert len(solver) == 4 and all(s.reward == 1.0 for s in solver)
    assert tok.decode(solver[0].tokens) == "user : copy 5 . assistant : 5 </s>" and solver[0].versions[-2:] == [9, 9]
    m = runner.last_metrics
    assert m["workflow/solver_acc"] == 1.0 and m["workflow/judge_acc"] == 0.0


async def test_agent_env_multi_turn_workflow_and_error_episodes(tok):
    answers = iter(["1", "4"] * 10)
    eng = ScriptedEngine.from_text(tok, lambda p: next(answers))
    wf = build_workflow(
        MultiTurnWorkflow,
        kwargs={"agent_cls": EchoAgent, "env_cls": CopyEnv, "max_steps": 3, "gamma": 0.5},
        tokenizer=tok,
        gconfig=G,
    )
    runner = EpisodeRunner(wf, eng, max_concurrency=1, episode_timeout_s=20)
    e = await runner.run_episode({"question": "copy 4", "answer": "4"})
    assert e.status == EpisodeStatus.COMPLETED and e.termination_reason == TerminationReason.ENV_DONE and e.is_correct
    # step mode (gamma > 0): rewards are MC returns of [0, 1]: [0.5, 1.0]
    assert [s.reward for s in e.samples] == [0.5, 1.0]
    assert (
        tok.decode(e.samples[1].tokens[: e.samples[1].prompt_len])
        == "user : copy 4 . assistant : 1 . user : copy 4 . assistant :"
    )

    class Broken(Workflow):
        async def run(self, task, uid, **kw):
            raise RuntimeError("no env")

    bad = EpisodeRunner(build_workflow(Broken, tokenizer=tok), eng, episode_timeout_s=5)
    e2 = await bad.run_episode({"q": 1})
    assert e2.status == EpisodeStatus.ERROR and e2.info["error"]["error_message"] == "no env"
    assert "RuntimeError" in e2.info["error"]["traceback"]


class _SlowFirst(ScriptedEngine):
    """Call k answers ["7", "3", "5"][k]; the first call finishes last."""

    async def agenerate(self, req):
        resp = await super().agenerate(req)
        await asyncio.sleep([0.3, 0.1, 0.2][(len(self.requests) - 1) % 3])
        return resp


class _Solvers(Workflow):
    """n attempts of one problem at once, steps recorded from text (update_from_model style)."""

    async def run(self, task, uid, **kw):
        msgs = [{"role": "user", "content": task["question"]}]
        outs = await asyncio.gather(*(self.rollout_engine.get_model_response(msgs) for _ in range(3)))
        for out in outs:  # trajectories in the order the attempts were made
            st = Step(chat_completions=msgs + [{"role": "assistant", "content": out.text}],
                      model_response=out.text, reward=float(out.text == task["answer"]))
            self.commit(name="solver", trajectory=Trajectory(steps=[st]))


async def test_text_only_steps_of_attempts_at_one_prompt_get_their_own_tokens(tok):
    """The calls of attempts at one prompt come back in completion order: matched on the messages
    alone, a step got another attempt's tokens under its own reward (the right answer was trained
    with reward 0 and a wrong one with 1)."""
    answers = ["7", "3", "5"]
    eng = _SlowFirst(lambda ids, call: list(tok(answers[call % 3], add_special_tokens=False)["input_ids"])
                     + [tok.eos_token_id], eos_token_id=tok.eos_token_id, vocab_size=len(tok))
    wf = build_workflow(_Solvers, tokenizer=tok, gconfig=G)
    try:
        g = await EpisodeRunner(wf, eng).run_group({"question": "copy 7", "answer": "7"}, 1)
    finally:
        await wf.aclose()
    trained = {tok.decode([t for t, m in zip(s.tokens, s.loss_mask) if m], skip_special_tokens=True): s.reward
               for s in g.samples}
    assert trained == {"7": 1.0, "3": 0.0, "5": 0.0}


def test_a_step_without_engine_logprobs_is_flagged():
    """0.0 stood in for the missing logprobs unflagged: rollout_is weighed against them silently."""
    st = Step(prompt_ids=[5, 6], response_ids=[7, 8], reward=1.0)
    (s,) = trajectory_to_samples(Trajectory(steps=[st]), [st], "step")
    assert s.metadata.get("missing_logprobs") is True
    st.logprobs = [-0.5, -0.25]
    (s,) = trajectory_to_samples(Trajectory(steps=[st]), [st], "step")
    assert "missing_logprobs" not in s.metadata and s.rollout_logprobs[-2:] == [-0.5, -0.25]


async def test_a_calls_own_stop_adds_to_the_runs_stop_strings(tok):
    """rollout.sampling.stop stays on an rLLM agent's call that names stop strings of its own, and
    on a Trinity workflow's model call (both adapters merge as the proxy does)."""
    from types import SimpleNamespace

    from mlrl.workflow.compat.rllm import MlrlRolloutEngine
    from mlrl.workflow.compat.trinity import ModelWrapper

    run = GenerationHyperparameters(max_new_tokens=6, stop=["</answer>"], stop_token_ids=[5])
    eng = ScriptedEngine.from_text(tok, last_user_word)
    rllm = MlrlRolloutEngine(tok, run, eng)
    await rllm.get_model_response([{"role": "user", "content": "copy 7"}], stop="x")
    await rllm.get_model_response([{"role": "user", "content": "copy 7"}])
    assert [(r.gconfig.stop, r.gconfig.stop_token_ids) for r in eng.requests] == [
        (["</answer>", "x"], [5]), (["</answer>"], [5])]
    trinity = ModelWrapper(SimpleNamespace(tokenizer=tok, gconfig=run))
    g, n = trinity._gconfig({"stop": ["</answer>", "y"], "n": 2})
    assert (g.stop, g.stop_token_ids, n) == (["</answer>", "y"], [5], 2)
    assert run.plus_stop(None) == ["</answer>"]
