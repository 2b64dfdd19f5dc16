"""`multi_turn`: the model answers, the environment scores it and replies, the model tries again —
AReaL's MultiTurnWorkflow, with the environment's reply pluggable.

One episode is one growing token sequence: [prompt][answer 1][feedback 1][answer 2]...
Invariants: the loss mask is 1 exactly on tokens the model generated (answers), 0 on the prompt
and on every environment turn; each turn's request extends the previous sequence token for token
(the feedback turn is appended as the chat template's token delta, so nothing is re-tokenized);
the episode reward is the last turn's reward times `turn_discount ** (turns - 1)`.

The episode ends when the reward is positive, the environment has nothing more to say
(`feedback_fn` returns None), `max_turns` is reached, or the next turn would exceed
`max_total_tokens`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from mlrl.reward import AsyncRewardWrapper, import_from_string, reward_data
from mlrl.types import GenerationHyperparameters, Sample, SampleStatus, StopReason, TerminationReason
from mlrl.workflow.api import (
    EpisodeOutput,
    InferenceEngine,
    ModelRequest,
    RolloutWorkflow,
    apply_chat_template,
    is_evaluation,
)
from mlrl.workflow.builtin.rlvr import make_reward
from mlrl.workflow.registry import register_workflow

DEFAULT_FEEDBACK = (
    "Your answer is either wrong or not parsable to the reward function. You may misunderstand the original "
    "question. Please carefully read the original question, check the previous errors, and try to answer it again."
)

FeedbackFn = Callable[[dict[str, Any], str, float, int], "str | None"]


class EngineError(RuntimeError):
    """An engine request of the episode failed or was aborted: the episode fails (the runner's
    EngineError for workflows that return samples)."""


@register_workflow("multi_turn")
class MultiTurnWorkflow(RolloutWorkflow):
    """Answer, get feedback, retry. `feedback_fn(data, completion, reward, turn) -> str | None`
    (a callable or dotted path) replaces the fixed retry message; None ends the episode."""

    def __init__(
        self,
        reward_fn: Any,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        max_turns: int = 3,
        turn_discount: float = 1.0,
        feedback: str = DEFAULT_FEEDBACK,
        feedback_fn: FeedbackFn | str | None = None,
        max_total_tokens: int | None = None,
        reward_timeout_s: float = 15.0,
        reward_workers: int | None = None,
        eval_gconfig: GenerationHyperparameters | None = None,
    ):
        if max_turns <= 0:
            raise ValueError(f"multi_turn: max_turns must be positive, got {max_turns}")
        if not 0.0 < turn_discount <= 1.0:
            raise ValueError(f"multi_turn: turn_discount must be in (0, 1], got {turn_discount}")
        if tokenizer is None:
            raise ValueError("multi_turn needs the model's tokenizer")
        self.tokenizer = tokenizer
        self.gconfig = gconfig.new(n_samples=1)
        self.eval_gconfig = (eval_gconfig or gconfig).new(n_samples=1)
        self.max_turns = max_turns
        self.turn_discount = turn_discount
        self.feedback = feedback
        self.feedback_fn = import_from_string(feedback_fn) if isinstance(feedback_fn, str) else feedback_fn
        self.max_total_tokens = max_total_tokens
        self.reward: AsyncRewardWrapper = make_reward(reward_fn, reward_timeout_s, reward_workers)
        self._anchor = apply_chat_template(tokenizer, [{"role": "assistant", "content": "x"}])
        # what the template writes after an assistant turn's content (ChatML: <|im_end|> "\n"): the
        # common tail of two renderings that differ only in the content
        other = apply_chat_template(tokenizer, [{"role": "assistant", "content": "y"}])
        tail = 0
        while tail < min(len(self._anchor), len(other)) and self._anchor[-1 - tail] == other[-1 - tail]:
            tail += 1
        # where the token right after the content (ChatML's <|im_end|>) is: a turn ended by it is cut there
        self._closer_at = len(self._anchor) - tail
        self._closer = self._anchor[self._closer_at] if tail else None
        self._delta_cache: dict[tuple[str, int | None], list[int]] = {}

    def _cut(self, end: int | None) -> int:
        """Where the next turn's delta starts in the anchor (an assistant turn "x") for a turn that
        ended at token `end`: after the template's last EOS, or after the token the template writes
        right after the content (ChatML's "\n" after <|im_end|> then belongs to the delta, or the
        sequence would lack it); the anchor's end if the template never writes `end` there."""
        a = self._anchor
        if end is not None and end == self.tokenizer.eos_token_id and end in a:
            return len(a) - a[::-1].index(end)
        return self._closer_at + 1 if end is not None and end == self._closer else len(a)

    def feedback_ids(self, text: str, end: int | None = None) -> list[int]:
        """Tokens the chat template puts between an assistant turn that ended at token `end` (default:
        the tokenizer's EOS) and the next assistant turn when the user says `text` (computed once
        per distinct text and end)."""
        end = self.tokenizer.eos_token_id if end is None else end
        if (text, end) not in self._delta_cache:
            msgs = [{"role": "assistant", "content": "x"}, {"role": "user", "content": text}]
            full = apply_chat_template(self.tokenizer, msgs, add_generation_prompt=True)
            cut = self._cut(end)
            if full[:cut] != self._anchor[:cut]:
                raise ValueError("multi_turn: the chat template re-renders earlier turns when a user turn is added; "
                                 "it cannot be extended token for token")
            self._delta_cache[(text, end)] = full[cut:]
        return self._delta_cache[(text, end)]

    def _end_of_turn(self, output: list[int], gconfig: GenerationHyperparameters) -> tuple[list[int], int | None]:
        """What closes a finished turn before the feedback, and the token it ends at. A turn that
        ended at EOS, or at one of sampling's stop_token_ids that the chat template itself writes
        after an assistant turn's content (a chat model's <|im_end|> whose tokenizer's EOS is
        <|endoftext|>), is closed by that token; any other turn (length, a stop string, another stop
        id, one the template writes only elsewhere: a "," of its system prompt, a role marker) gets
        the EOS the template would have written."""
        eos = self.tokenizer.eos_token_id
        last = output[-1] if output else None
        if last is not None and (last == eos or (last in gconfig.stop_token_ids and last == self._closer)):
            return [], last
        return ([eos] if eos is not None else []), eos

    def next_feedback(self, data: dict[str, Any], completion: str, reward: float, turn: int) -> str | None:
        if self.feedback_fn is not None:
            return self.feedback_fn(data, completion, reward, turn)
        return None if reward > 0 else self.feedback

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> EpisodeOutput:
        if "messages" not in data:
            raise KeyError(f"multi_turn: the row has no 'messages' (keys: {sorted(data)})")
        input_ids = apply_chat_template(self.tokenizer, data["messages"], add_generation_prompt=True)
        seq: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        versions: list[int] = []
        session = uuid.uuid4().hex
        discount, reward, turn = 1.0, 0.0, 0
        reason = TerminationReason.MAX_TURNS_EXCEEDED
        last_stop = StopReason.STOP
        gconfig = self.eval_gconfig if is_evaluation() else self.gconfig
        while True:
            req = ModelRequest(input_ids=list(input_ids), gconfig=gconfig, session_id=session, tokenizer=self.tokenizer)
            resp = await engine.agenerate(req)
            if resp.stop_reason.unfinished:
                # its tokens (partial, or none) are not an answer: nothing to score, train or continue from
                raise EngineError(f"multi_turn: engine request {resp.rid} (turn {turn + 1}) ended with "
                                  f"{resp.stop_reason.value}: {resp.error}")
            if resp.input_tokens[: len(seq)] != seq:
                raise RuntimeError("multi_turn: the engine's input tokens do not extend the episode's sequence")
            new_prompt = resp.input_tokens[len(seq):]
            seq += new_prompt + resp.output_tokens
            logprobs += [0.0] * len(new_prompt) + list(resp.output_logprobs)
            mask += [0] * len(new_prompt) + [1] * resp.output_len
            versions += [-1] * len(new_prompt) + list(resp.output_versions)
            last_stop = resp.stop_reason
            turn += 1
            prompt = self.tokenizer.decode(input_ids, skip_special_tokens=True)
            completion = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            reward = await self.reward(prompt, completion, resp.input_tokens, resp.output_tokens, **reward_data(data))
            text = self.next_feedback(data, completion, reward, turn)
            if text is None:
                reason = TerminationReason.ENV_DONE
                break
            if turn >= self.max_turns:
                break
            close, end = self._end_of_turn(resp.output_tokens, gconfig)
            nxt = list(input_ids) + list(resp.output_tokens) + close + self.feedback_ids(text, end)
            if self.max_total_tokens is not None and len(nxt) + gconfig.max_new_tokens > self.max_total_tokens:
                reason = TerminationReason.MAX_PROMPT_LENGTH_EXCEEDED
                break
            input_ids = nxt
            discount *= self.turn_discount
        first = next((i for i, m in enumerate(mask) if m), len(mask))
        sample = Sample(
            tokens=seq,
            loss_mask=mask,
            rollout_logprobs=logprobs,
            versions=versions,
            reward=float(reward * discount),
            prompt_len=first,
            status=SampleStatus.TRUNCATED if last_stop == StopReason.LENGTH else SampleStatus.COMPLETED,
            metadata={"num_turns": turn},
        )
        return EpisodeOutput(samples=[sample], termination_reason=reason, is_correct=reward > 0,
                             metrics={"num_turns": float(turn)})
