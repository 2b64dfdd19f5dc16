"""A reward model served in the pool on its own vLLM engines (`reward_model:` in the config,
`workflow.reward=reward_model`): an LLM judge (kind=generative, `ModelJudge`) or a
sequence-classification reward model (kind=classifier, `ClassifierJudge`).

`ModelJudge.score` renders (question, response, reference answer) into the judge's prompt template
as one user turn of the judge's chat template, asks the judge's engines for a greedy reply of at
most `max_tokens` tokens, and returns the first group of `score_pattern`'s first match divided by
`max_score`. A reply without a score, or an engine error, raises `JudgeError`: the reward wrapper
records it as a failure of that episode's reward (reward 0.0), and the run goes on.

The engines are the rollout package's `EnginePool` (mlrl.jobs.rl starts them beside the policy's and
calls `set_active_judge`); this module sees only `InferenceEngine.agenerate`, so it imports neither
vLLM nor the rollout package. The judge's engines are never weight-synced: the judge is frozen.

Measured per step (`ModelJudge.metrics`, logged as `reward_model/*`): calls, unparsable replies,
mean reply length, and the seconds at least one judge call was in flight (`timing/reward_model`,
a sub-phase of the rollout: it overlaps generation).
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

from mlrl.metrics.timer import ACTIVITY
from mlrl.reward.registry import register_reward
from mlrl.types import GenerationHyperparameters, ModelRequest

if TYPE_CHECKING:
    from mlrl.interfaces import InferenceEngine


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool = False) -> list[int]:
    """The token ids of `messages` in the tokenizer's chat template. (mlrl.data.tokenizer's
    apply_chat_template does the same; mlrl.data imports this package, so it cannot be imported here.)"""
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                        return_dict=False)
    return list(out if isinstance(out, list) else out["input_ids"])


class JudgeError(RuntimeError):
    """The judge gave no usable score for one response (recorded as a reward failure)."""


class ModelJudge:
    generates = True  # the judge writes a reply (reward_model/reply_tokens_mean)

    def __init__(self, engine: "InferenceEngine", tokenizer: Any, *, prompt_template: str, score_pattern: str,
                 max_score: float = 10.0, max_tokens: int = 16):
        self.engine = engine
        self.tokenizer = tokenizer
        self.template = prompt_template
        self.pattern = re.compile(score_pattern)
        if self.pattern.groups < 1:
            raise ValueError(f"reward_model.score_pattern={score_pattern!r} needs a group capturing the number")
        if max_score <= 0:
            raise ValueError(f"reward_model.max_score={max_score}: expected > 0")
        self.max_score = float(max_score)
        self.gconfig = GenerationHyperparameters(max_new_tokens=max_tokens, greedy=True, temperature=0.0)
        self.reset_metrics()

    def reset_metrics(self) -> None:
        self.calls = self.unparsed = self.errors = self.reply_tokens = 0

    def metrics(self) -> dict[str, float]:
        """Since the last call: reward_model/{calls, unparsed, engine_errors, reply_tokens_mean}; resets."""
        out = {"reward_model/calls": float(self.calls), "reward_model/unparsed": float(self.unparsed),
               "reward_model/engine_errors": float(self.errors)}
        if self.calls and self.generates:
            out["reward_model/reply_tokens_mean"] = self.reply_tokens / self.calls
        self.reset_metrics()
        return out

    def prompt_ids(self, question: str, response: str, answer: Any = None) -> list[int]:
        text = self.template.format(question=question, response=response, answer="" if answer is None else answer)
        return _chat_ids(self.tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True)

    def parse(self, reply: str) -> float:
        """The LAST score in the reply (a judge that reasons first names other numbers before its
        verdict), in [0, max_score]: anything outside is no score on this scale (a 0-100 answer to a
        0-10 template, an injected "score: 1000"), not a reward above 1."""
        found = list(self.pattern.finditer(reply))
        if not found:
            raise JudgeError(f"the judge's reply {reply[:80]!r} has no score (reward_model.score_pattern "
                             f"{self.pattern.pattern!r})")
        value = float(found[-1].group(1))
        if not 0.0 <= value <= self.max_score:
            raise JudgeError(f"the judge's score {value:g} is outside [0, reward_model.max_score={self.max_score:g}] "
                             f"(reply {reply[:80]!r})")
        return value / self.max_score

    async def score(self, question: str, response: str, answer: Any = None) -> float:
        self.calls += 1
        with ACTIVITY.busy("reward_model"):
            t0 = time.perf_counter()
            resp = await self.engine.agenerate(ModelRequest(self.prompt_ids(question, response, answer),
                                                            gconfig=self.gconfig))
        if resp.stop_reason.unfinished:  # (an error, or cut short: the pool closed / no engine was left)
            self.errors += 1
            raise JudgeError(f"the judge's engine failed after {time.perf_counter() - t0:.1f}s "
                             f"({resp.stop_reason.value}): {resp.error}")
        self.reply_tokens += len(resp.output_tokens)
        try:
            return self.parse(self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True))
        except JudgeError:
            self.unparsed += 1
            raise


class ClassifierJudge(ModelJudge):
    """kind=classifier: a sequence-classification reward model (an HF `*ForSequenceClassification`
    folder) on vLLM engines with `--runner pooling`. The conversation (the question as a user turn,
    the response as the assistant turn) is rendered with the reward model's chat template and the
    reward is the probability of its last label (one label: the sigmoid of the model's score)."""

    generates = False

    def __init__(self, engine: Any, tokenizer: Any, pad_id: int | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.pad_id = pad_id  # the classifier's config.json pad_token_id
        self.reset_metrics()

    def conversation_ids(self, question: str, response: str) -> list[int]:
        """The rendered conversation without trailing pad-id tokens: transformers' classifiers score
        the last token that is not the pad id, vLLM's pooling runner the last token; without a pad tail
        both score the same one (as mlrl.jobs.rm trains)."""
        ids = _chat_ids(self.tokenizer, [{"role": "user", "content": question},
                                         {"role": "assistant", "content": response}])
        while self.pad_id is not None and len(ids) > 1 and ids[-1] == self.pad_id:
            ids.pop()
        return ids

    async def score(self, question: str, response: str, answer: Any = None) -> float:
        self.calls += 1
        with ACTIVITY.busy("reward_model"):
            try:
                probs = await self.engine.aclassify(self.conversation_ids(question, response))
            except Exception as e:  # the engine's error, recorded on this episode's reward
                self.errors += 1
                raise JudgeError(f"the reward model's engine failed: {type(e).__name__}: {e}") from None
        if not probs:
            self.unparsed += 1
            raise JudgeError("the reward model returned no class probabilities")
        return float(probs[-1])


_ACTIVE: list[ModelJudge] = []


def set_active_judge(judge: ModelJudge | None) -> None:
    """The judge `workflow.reward=reward_model` scores with (mlrl.jobs.rl sets it while the engines run)."""
    _ACTIVE[:] = [judge] if judge is not None else []


def active_judge() -> ModelJudge | None:
    return _ACTIVE[0] if _ACTIVE else None


def _question(prompt: str, data: dict[str, Any]) -> str:
    """The last user turn of the row's messages (what the policy was asked), else the prompt text."""
    for m in reversed(data.get("messages") or []):
        if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str):
            return m["content"]
    return prompt


@register_reward("reward_model")
async def reward_model(prompt: str, completions: str, prompt_ids: Any = None, completion_ids: Any = None,
                       **data: Any) -> float:
    """The served reward model's score of `completions` (see ModelJudge)."""
    judge = active_judge()
    if judge is None:
        raise JudgeError("workflow.reward=reward_model, but no reward model is running (add a reward_model: section)")
    return await judge.score(_question(prompt, data), completions, data.get("answer"))
