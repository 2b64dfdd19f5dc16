"""The calculator-agent demo learns (issue 34 item 3): examples/calculator_agent.py, an agent written
only against `openai.AsyncOpenAI`, trained through mlrl's recording proxy on real vLLM engines and
the Megatron trainer.

1. SFT (launch/calc_agent_sft_cpu.yaml): the warm start calls the multiply tool in about a quarter
   of its replies (Hermes `<tool_call>`, parsed by the proxy into OpenAI `tool_calls`) and guesses
   a number otherwise.
2. GRPO (launch/calc_agent_cpu.yaml, model.init_from = the SFT export): the exact-match reward of
   the final answer pays only when the tool was called with the question's digits, so the tool-call
   rate and the reward must rise together: from the warm start's rates (first steps) to most
   episodes calling the tool (last steps). Parse failures stay rare and the trainer/engine logprob
   gap stays at float32 rounding (the two-call episodes are trained on the engine's own tokens).
"""

from pathlib import Path

import pytest
from helpers.launching import launch, metrics

SFT_STEPS = 400
SFT = ["--config", "launch/calc_agent_sft_cpu.yaml", "logging.progress_bar=false", f"trainer.total_steps={SFT_STEPS}"]
RL_STEPS = 20
RL = ["--config", "launch/calc_agent_cpu.yaml", "logging.progress_bar=false", f"trainer.total_steps={RL_STEPS}",
      "rollout.startup_timeout_s=600"]


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("calc_agent")
    launch(root / "sft", *SFT)
    export = root / "sft" / "hf" / f"step_{SFT_STEPS:06d}"
    assert (export / "config.json").exists()
    launch(root / "rl", *RL, f"model.init_from={export}")
    return {"sft": root / "sft", "rl": root / "rl"}


def test_rl_learns_to_call_the_tool(runs):
    rows = metrics(runs["rl"])
    assert len(rows) == RL_STEPS
    first, last = rows[:3], rows[-3:]
    calls0, calls1 = _mean(first, "workflow/num_tool_calls"), _mean(last, "workflow/num_tool_calls")
    acc0, acc1 = _mean(first, "reward/accuracy"), _mean(last, "reward/accuracy")  # episodes answered right
    trace = [(round(r["workflow/num_tool_calls"], 2), round(r["reward/accuracy"], 2)) for r in rows]
    # measured (seeds 1-3; 32x4 and 8x16 samples): calls 0.23-0.29 -> 0.96-0.98, accuracy 0.23-0.29 -> 0.80-0.92
    assert 0.1 < calls0 < 0.5 and acc0 < 0.45, trace     # the warm start: about a quarter call the tool
    assert calls1 > 0.85 and acc1 > 0.7, trace           # RL: almost every episode calls it, most are right
    assert calls1 - calls0 > 0.4 and acc1 - acc0 > 0.4, trace
    assert max(r["workflow/num_tool_call_parse_failures"] for r in last) < 0.1, trace
    assert max(r["train/mismatch/logprob_gap"] for r in rows) < 1e-5
