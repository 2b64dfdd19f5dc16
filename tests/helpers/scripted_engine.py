"""`ScriptedEngine`: a deterministic stand-in for the rollout pool in unit tests (never a server).
Test-only, so it lives under tests/ (it used to ship inside the mlrl package); workflow, loop
and compat tests all drive episodes with it.

It answers `agenerate(ModelRequest)` with tokens chosen by a script, logprobs that are a fixed
function of (token, position), and the engine's current weight version on every token, so tests
can check exactly what reached the trainable samples. It honours `max_new_tokens` (-> LENGTH)
and the EOS / stop token ids (-> STOP); a script that raises yields a response with
stop_reason ERROR, like a failed request in the real pool.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

from mlrl.types import ModelRequest, ModelResponse, StopReason

Script = Callable[[list[int], int], list[int]]


def scripted_logprob(token: int, position: int) -> float:
    """The logprob ScriptedEngine reports for `token` at output `position` (deterministic, < 0)."""
    return -0.05 - 0.01 * (token % 13) - 0.001 * position


class ScriptedEngine:
    """Deterministic engine. `script(input_ids, call_index) -> output token ids` (EOS included if
    the output should stop); the default script emits three tokens derived from the prompt and EOS."""

    def __init__(
        self,
        script: Script | None = None,
        *,
        eos_token_id: int = 2,
        vocab_size: int = 80,
        version: int = 0,
        delay_s: float = 0.0,
        name: str = "scripted",
    ):
        self.script = script or self._default_script
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.version = version
        self.delay_s = delay_s
        self.name = name
        self.requests: list[ModelRequest] = []
        self.responses: list[ModelResponse] = []
        self._calls = itertools.count()

    def _default_script(self, input_ids: list[int], call: int) -> list[int]:
        base = sum(input_ids) + call
        return [4 + (base + 7 * i) % (self.vocab_size - 4) for i in range(3)] + [self.eos_token_id]

    @classmethod
    def from_text(cls, tokenizer: Any, reply: Callable[[str], str], **kw: Any) -> "ScriptedEngine":
        """An engine answering the decoded prompt with `reply(prompt_text)`, tokenized, then EOS."""

        def script(input_ids: list[int], call: int) -> list[int]:
            text = reply(tokenizer.decode(input_ids, skip_special_tokens=True))
            return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]

        return cls(script, eos_token_id=tokenizer.eos_token_id, vocab_size=len(tokenizer), **kw)

    def get_version(self) -> int:
        return self.version

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        call = next(self._calls)
        self.requests.append(req)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        try:
            planned = list(self.script(list(req.input_ids), call))
        except Exception as e:  # a failed request, as the pool reports it
            resp = ModelResponse(
                input_tokens=list(req.input_ids),
                stop_reason=StopReason.ERROR,
                error=f"{type(e).__name__}: {e}",
                rid=req.rid,
                engine=self.name,
            )
            self.responses.append(resp)
            return resp
        stops = {self.eos_token_id, *req.gconfig.stop_token_ids}
        out: list[int] = []
        reason = StopReason.LENGTH
        for tok in planned:
            if len(out) >= req.gconfig.max_new_tokens:
                break
            out.append(int(tok))
            if tok in stops and len(out) >= req.gconfig.min_new_tokens:
                reason = StopReason.STOP
                break
        else:
            if len(out) < req.gconfig.max_new_tokens:
                reason = StopReason.STOP  # the script ended its output without EOS
        resp = ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=out,
            output_logprobs=[scripted_logprob(t, i) for i, t in enumerate(out)],
            output_versions=[self.version] * len(out),
            stop_reason=reason,
            rid=req.rid,
            engine=self.name,
        )
        self.responses.append(resp)
        return resp
