"""Recorded model calls of one agent episode (`Interaction`) and how they become samples.

The OpenAI-compatible proxy appends one `Interaction` per completion it serves, holding the exact
token ids the engine saw and produced, with their logprobs and weight versions — never
re-tokenized text, so training sees what the policy sampled.

Rewards (AReaL's semantics): the agent's return value sets the reward of the last completion
(a float) or of named completions (a dict {completion id: reward}); `apply_reward_discount`
then walks the completions in reverse creation order, `r_i <- r_i + turn_discount * r_{i+1}`
(unset rewards count as 0). Export styles: `individual` (one sample per completion) and
`concat` (a completion whose input extends an earlier completion's prompt+output token for token
is merged into it; only the leaves are exported, loss mask 1 on every model-generated span).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from mlrl.types import GenerationHyperparameters, ModelResponse, Sample, SampleStatus, StopReason
from mlrl.workflow.samples import interaction_to_sample

logger = logging.getLogger(__name__)


@dataclass
class Interaction:
    """One completion served by the proxy (AReaL's InteractionWithTokenLogpReward, reduced)."""

    id: str
    model_response: ModelResponse
    messages: list[dict[str, Any]] | None = None   # chat request (None for /v1/completions)
    prompt: str | None = None                      # completions request text
    text: str = ""                                 # decoded output returned to the agent
    reward: float | None = None
    gconfig: GenerationHyperparameters | None = None
    created: float = field(default_factory=time.time)
    own_reward: float | None = None                # the reward set on it, before apply_reward_discount

    @property
    def seq(self) -> list[int]:
        return list(self.model_response.input_tokens) + list(self.model_response.output_tokens)


class InteractionLog:
    """The completions of one session, in creation order."""

    def __init__(self) -> None:
        self._items: dict[str, Interaction] = {}
        self._discounted = False

    def add(self, inter: Interaction) -> None:
        if inter.id in self._items:
            raise ValueError(f"duplicate completion id {inter.id!r}")
        self._items[inter.id] = inter

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items.values())

    def get(self, cid: str) -> Interaction | None:
        return self._items.get(cid)

    def as_dict(self) -> dict[str, Interaction]:
        return dict(self._items)

    @property
    def last(self) -> Interaction | None:
        return next(reversed(self._items.values()), None) if self._items else None

    def set_reward(self, cid: str, reward: float) -> None:
        """Reward of completion `cid`; a completion id with n>1 choices sets all its choices."""
        targets = [i for k, i in self._items.items() if k == cid or k.startswith(f"{cid}:")]
        if not targets:
            raise KeyError(f"no completion with id {cid!r} in this session (have: {list(self._items)[:5]}...)")
        for t in targets:
            t.reward = float(reward)

    def set_last_reward(self, reward: float) -> None:
        last = self.last
        if last is None:
            raise ValueError("set_last_reward: the agent made no model call in this episode")
        last.reward = float(reward)

    def apply_reward_discount(self, turn_discount: float = 1.0) -> None:
        """r_i <- r_i + turn_discount * r_{i+1}, in reverse creation order (once per session)."""
        if self._discounted:
            raise RuntimeError("apply_reward_discount may be applied only once per session")
        self._discounted = True
        items = list(self._items.values())
        if items and items[-1].reward is None:
            logger.warning("the last completion of the episode has no reward; using 0.0")
        running = 0.0
        for inter in reversed(items):
            inter.own_reward = inter.reward
            running = running * turn_discount + (inter.reward or 0.0)
            inter.reward = running

    def template_splits(self) -> int:
        """Completions after the first whose input does not extend any earlier completion's
        prompt + output token for token. The agent's history was rendered into other tokens than
        the engine produced (a chat template that is not append-only, e.g. Qwen3's, which drops
        earlier reasoning blocks), so such a completion cannot continue an earlier sample: `concat`
        starts a new sample with it rather than train on tokens the engine never saw."""
        seen: list[list[int]] = []
        splits = 0
        for inter in self._items.values():
            resp = inter.model_response
            inp = list(resp.input_tokens)
            if seen and not any(len(s) <= len(inp) and inp[: len(s)] == s for s in seen):
                splits += 1
            seen.append(inp + list(resp.output_tokens))
        return splits

    def export_samples(self, style: str = "individual") -> list[Sample]:
        if style == "individual":
            return [interaction_to_sample(k, v) for k, v in self._items.items()]
        if style == "concat":
            return _concat(list(self._items.values()))
        raise ValueError(f"export style must be 'individual' or 'concat', got {style!r}")


def _concat(items: list[Interaction]) -> list[Sample]:
    merged: dict[str, Sample] = {}   # interaction id -> sample covering it and its ancestors
    has_child: set[str] = set()
    for inter in items:
        resp = inter.model_response
        inp = list(resp.input_tokens)
        parent = None
        for prev in reversed(items[: items.index(inter)]):
            s = merged[prev.id]
            if len(s.tokens) <= len(inp) and inp[: len(s.tokens)] == s.tokens:
                parent = prev
                break
        out = list(resp.output_tokens)
        r = len(out)
        if parent is None:
            base = Sample(tokens=[], loss_mask=[], rollout_logprobs=[], versions=[])
        else:
            base = merged[parent.id]
            has_child.add(parent.id)
        extra = inp[len(base.tokens):]
        merged[inter.id] = Sample(
            tokens=base.tokens + extra + out,
            loss_mask=base.loss_mask + [0] * len(extra) + [1] * r,
            rollout_logprobs=base.rollout_logprobs + [0.0] * len(extra) + [float(x) for x in resp.output_logprobs],
            versions=base.versions + [-1] * len(extra) + [int(v) for v in resp.output_versions],
            reward=float(inter.reward or 0.0),
            prompt_len=base.prompt_len if parent is not None else len(inp),
            status=SampleStatus.TRUNCATED if resp.stop_reason == StopReason.LENGTH else SampleStatus.COMPLETED,
            metadata={"interaction_id": inter.id, "merged_turns": base.metadata.get("merged_turns", 0) + 1},
        )
    dropped = [i.id for i in items if i.id in has_child and (i.own_reward or 0.0) != 0.0]
    if dropped:  # AReaL's semantics: a merged sample is trained with its leaf's reward
        logger.warning("concat export: reward(s) set on %d completion(s) that a later one extends (%s) are not "
                       "trained: each merged sample takes its last completion's reward; export_style=individual "
                       "keeps them", len(dropped), ", ".join(dropped[:3]))
    return [s for k, s in merged.items() if k not in has_child]
