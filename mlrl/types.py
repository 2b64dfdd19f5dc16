"""Named types for everything that crosses a seam: generation requests/responses, the
Step / Trajectory / Episode tree a workflow produces, and the trainable `Sample`.

Pure Python (no torch, no megatron, no vllm) so every package can import it. Token-level
fields are plain `list[int]` / `list[float]` of one length per sample; shapes are given as
[T] (tokens of one sample), [P] (prompt tokens) and [R] (response tokens).

Invariants kept here:
- a `ModelResponse` records the weight version of every output token (`output_versions`,
  [R]); partial rollouts interrupted by a weight sync therefore carry mixed versions;
- a `Sample` has `len(tokens) == len(loss_mask) == len(rollout_logprobs) == len(versions)`;
  prompt positions have loss_mask 0, logprob 0.0 and version -1.
"""

from __future__ import annotations

import enum
import numbers
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

Row = dict[str, Any]
"""One dataset row: `{"messages": [...], "answer": ..., **metadata}` (see mlrl.data.rows); every
key reaches the workflow and the reward function."""


# Sample.metadata keys written by the advantage estimators (mlrl.algorithms.advantages) and read
# by the packer (mlrl.experience.packing) and the update (mlrl.update):
TOKEN_ADVANTAGES_KEY = "token_advantages"  # per-token advantages ([T] list, 0.0 on non-policy tokens)
RETURNS_KEY = "returns"  # GAE: per-token value targets R_t = A_t + V_t ([T] list), the critic's regression target


class StopReason(str, enum.Enum):
    """Why one generation ended (vLLM's finish_reason, plus our own)."""

    STOP = "stop"            # EOS or a stop string / token
    LENGTH = "length"        # max_new_tokens or context length reached
    ABORT = "abort"          # aborted by the caller
    INTERRUPT = "interrupt"  # interrupted and not resumed (the pool closed, or no engine was left):
    #                          the partial tokens of a request that did not finish, with the error
    ERROR = "error"          # the request failed (message in ModelResponse.error)

    @property
    def unfinished(self) -> bool:
        """The request did not end on its own (error, abort, interruption): its tokens are not an
        answer to score or train. Every workflow's check of a failed request uses this."""
        return self in (StopReason.ERROR, StopReason.ABORT, StopReason.INTERRUPT)


@dataclass
class GenerationHyperparameters:
    """Sampling parameters of one request (AReaL's names)."""

    n_samples: int = 1               # samples per prompt produced by one call (workflows usually loop instead)
    max_new_tokens: int = 64         # upper bound on generated tokens
    min_new_tokens: int = 0          # EOS is suppressed before this many tokens (0 = off)
    temperature: float = 1.0         # 0 = greedy
    top_p: float = 1.0               # 1.0 = off
    top_k: int = -1                  # -1 = off
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens besides EOS
    stop: list[str] = field(default_factory=list)            # stop strings
    greedy: bool = False  # shorthand for temperature 0
    seed: int | None = None  # this request's sampling seed (vLLM per-request RNG); None = the engine's shared RNG

    def new(self, **kw: Any) -> "GenerationHyperparameters":
        d = dict(self.__dict__)
        d.update(kw)
        return GenerationHyperparameters(**d)

    def plus_stop(self, stop: Any) -> list[str]:
        """This config's stop strings (the run's rollout.sampling.stop) followed by a call's own
        (a string or a list), without repeats: a call adds stop strings, it never drops the run's."""
        own = [stop] if isinstance(stop, str) else list(stop or [])
        return list(self.stop) + [x for x in own if x not in self.stop]

    def new_with_stop_and_pad_token_ids(self, tokenizer: Any) -> "GenerationHyperparameters":
        """AReaL's helper: add the tokenizer's EOS and PAD ids to the stop tokens."""
        ids = list(self.stop_token_ids)
        for tid in (getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "pad_token_id", None)):
            if tid is not None and tid not in ids:
                ids.append(tid)
        return self.new(stop_token_ids=ids)


@dataclass
class ModelRequest:
    """One generation request: prompt token ids in."""

    input_ids: list[int]                                     # [P]
    gconfig: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)  # request id (unique; used for abort and de-duplication)
    session_id: str | None = None  # multi-turn conversation id: requests with one id stick to one engine (prefix cache)
    metadata: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None           # AReaL's field: lets engines decode text for stop strings

    def __post_init__(self) -> None:
        self.input_ids = token_ids(self.input_ids, "ModelRequest.input_ids")


def token_ids(value: Any, name: str) -> list[int]:
    """`value` as a flat list of Python ints, from what workflow code passes as prompt ids: a list
    or tuple of ints, a tensor or numpy array (1-D, or one row), or a `BatchEncoding` / dict with
    `input_ids` (what `tokenizer(...)` and `apply_chat_template(..., tokenize=True)` return).
    Anything else raises TypeError here, in the caller's own frame, naming the type and the first
    bad value, rather than failing later inside the engine."""
    if type(value) is list and all(type(v) is int for v in value):
        return value                                   # the common case: nothing to convert
    if isinstance(value, Mapping):
        if "input_ids" not in value:
            raise TypeError(f"{name}: got a {type(value).__name__} without an 'input_ids' key "
                            f"(keys: {sorted(map(str, value))[:8]}); pass token ids")
        value = value["input_ids"]
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        value = tolist()                               # torch.Tensor, numpy.ndarray
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name}: got text ({type(value).__name__} {str(value)[:40]!r}), expected token ids "
                        "(list[int]): tokenize it first, e.g. tokenizer(text)['input_ids']")
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name}: expected token ids (list[int], a tensor, or a BatchEncoding), got "
                        f"{type(value).__name__}")
    if len(value) == 1 and isinstance(value[0], (list, tuple)):
        value = value[0]                               # a batch of one row: [[ids]]
    out = []
    for i, v in enumerate(value):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool):
            raise TypeError(f"{name}: expected token ids (list[int]); element {i} is "
                            f"{type(v).__name__} {str(v)[:40]!r}")
        out.append(int(v))
    return out


@dataclass
class ModelResponse:
    """What the engine produced for one request."""

    input_tokens: list[int]                                  # [P]
    output_tokens: list[int] = field(default_factory=list)  # [R]
    output_logprobs: list[float] = field(
        default_factory=list
    )  # [R] logprob of each sampled token under the sampling distribution
    output_versions: list[int] = field(default_factory=list)    # [R] weight version that produced each token
    stop_reason: StopReason = StopReason.STOP
    text: str = ""                  # decoded output, when the engine returns it (mlrl's vLLM pool answers with
    #                                 tokens only: decode output_tokens with the tokenizer)
    latency: float = 0.0            # seconds, request sent -> last token
    error: str | None = None        # set when stop_reason == ERROR
    engine: str | None = None       # which engine answered (for tests / metrics)
    rid: str | None = None

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)


class TerminationReason(str, enum.Enum):
    """How an episode ended (rLLM's enum)."""

    MAX_PROMPT_LENGTH_EXCEEDED = "max_prompt_length_exceeded"
    MAX_RESPONSE_LENGTH_EXCEEDED = "max_response_length_exceeded"
    ENV_DONE = "env_done"
    MAX_TURNS_EXCEEDED = "max_turns_exceeded"
    TIMEOUT = "timeout"
    UNKNOWN = "unknown"
    ERROR = "error"


@dataclass
class Step:
    """One model call inside a trajectory, with what the environment answered."""

    chat_completions: list[dict[str, Any]] = field(default_factory=list)  # messages sent (OpenAI format)
    thought: str = ""
    action: Any = None
    observation: Any = None
    model_response: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    reward: float = 0.0
    done: bool = False
    mc_return: float = 0.0          # Monte-Carlo return from this step (filled by the workflow)
    prompt_ids: list[int] = field(default_factory=list)     # [P_i]
    response_ids: list[int] = field(default_factory=list)   # [R_i]
    logprobs: list[float] = field(default_factory=list)     # [R_i]
    versions: list[int] = field(default_factory=list)       # [R_i]
    advantage: float | None = None


@dataclass
class Trajectory:
    """A named sequence of steps (one agent's view of an episode)."""

    name: str = "default"
    steps: list[Step] = field(default_factory=list)
    reward: float = 0.0             # sum of step rewards unless a workflow sets it otherwise
    info: dict[str, Any] = field(default_factory=dict)
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    task: Any = None


@dataclass
class Episode:
    """Everything one task produced."""

    id: str = ""
    task: Any = None
    termination_reason: TerminationReason | None = None
    is_correct: bool = False
    trajectories: list[Trajectory] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


class SampleStatus(str, enum.Enum):
    """Fate of one trainable sample (slime's Sample.Status)."""

    COMPLETED = "completed"
    TRUNCATED = "truncated"   # hit max_new_tokens
    ABORTED = "aborted"
    FAILED = "failed"         # the episode errored or timed out: kept for metrics, not trained on


OVERLONG_PENALTY_KEY = "overlong_penalty"  # Sample.metadata: the DAPO overlong penalty added to the reward


@dataclass
class Sample:
    """One trainable sequence: prompt + response tokens with per-token bookkeeping."""

    tokens: list[int]                  # [T] prompt followed by response(s)
    loss_mask: list[int]               # [T] 1 where the token was generated by the policy and is trained on
    rollout_logprobs: list[float]      # [T] engine logprob of each policy token (0.0 elsewhere)
    versions: list[int]                # [T] weight version that produced each token (-1 for non-policy tokens)
    reward: float = 0.0
    prompt_len: int = 0                # P: number of leading prompt tokens
    group_id: str = ""                 # samples of one prompt share it (GRPO group)
    advantage: float = 0.0             # filled by the algorithm (sequence-level; token-level variants broadcast it)
    status: SampleStatus = SampleStatus.COMPLETED
    metadata: dict[str, Any] = field(default_factory=dict)
    routed_experts: Any = None  # MoE router replay: numpy [m, layers, top_k] uint8/uint16, the experts the
    #                             engine routed positions 0..m-1 to (m = len(tokens) - 1: the last token is never fed)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for name in ("loss_mask", "rollout_logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Sample.{name} has length {len(getattr(self, name))}, expected len(tokens)={n}")

    @property
    def num_loss_tokens(self) -> int:
        return int(sum(self.loss_mask))

    @property
    def task_reward(self) -> float:
        """The reward as the workflow scored it: `reward` less the DAPO overlong penalty the loop adds
        before training (algorithm.overlong_buffer; recorded in metadata["overlong_penalty"]). The
        rollout metrics (reward/mean, accuracy) report this one, whenever they are computed."""
        return float(self.reward) - min(0.0, float(self.metadata.get(OVERLONG_PENALTY_KEY, 0.0)))

    @property
    def oldest_version(self) -> int:
        """Smallest known weight version among policy tokens (-1 if none is known): used by the
        staleness filter. An unknown version (-1: a workflow result without versions) is left out,
        not taken as the minimum, which hid the known versions beside it."""
        vs = [v for v, m in zip(self.versions, self.loss_mask) if m and v >= 0]
        return min(vs) if vs else -1


class EpisodeStatus(str, enum.Enum):
    """How the runner records one episode."""

    COMPLETED = "completed"
    REJECTED = "rejected"   # the workflow returned None (or no samples)
    TIMEOUT = "timeout"     # the per-episode timeout fired
    ERROR = "error"         # the workflow raised, or an engine request failed


@dataclass
class EpisodeOutput:
    """A workflow result with the episode-level facts a bare list of samples cannot carry."""

    samples: list[Sample] = field(default_factory=list)
    status: EpisodeStatus = EpisodeStatus.COMPLETED
    termination_reason: TerminationReason | None = None
    is_correct: bool | None = None          # None = derive from the reward (> 0)
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)   # "error": {error_message, error_type, traceback}
