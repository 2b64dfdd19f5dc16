"""The calculator-agent demo's pieces (examples/calculator_agent.py, `builtin:tiny-llama-tools`,
`synthetic:calc_multiply` / `calc_multiply_traces`): the SFT traces' prompts are the agent's prompts
token for token, every trace word is in the tiny vocabulary, the rendered call parses back into the
call, the tool answers bad calls with text, and one episode through the proxy trains the tool turn
and the final answer."""

import pytest
from helpers.scripted_engine import ScriptedEngine

from examples.calculator_agent import MULTIPLY, run_tool
from mlrl.data.synthetic import CALC_TOOL_SHARE, TASKS, generate
from mlrl.types import GenerationHyperparameters
from mlrl.workflow import EpisodeRunner, EpisodeStatus, apply_chat_template, build_workflow, load_hf_tokenizer
from mlrl.workflow.agent_proxy.tool_calls import detect_format, parse_tool_calls


@pytest.fixture(scope="module")
def tok():
    return load_hf_tokenizer("builtin:tiny-llama-tools")


def test_traces_call_the_tool_in_a_quarter_with_the_questions_digits():
    rows = generate("calc_multiply_traces", "train", num_rows=2000)
    calls = [r for r in rows if len(r["messages"]) == 5]
    assert abs(len(calls) / len(rows) - CALC_TOOL_SHARE) < 0.03
    for r in calls:
        _, a, b = r["messages"][1]["content"].split()
        (call,) = r["messages"][2]["tool_calls"]
        assert call["function"]["arguments"] == {"a": int(a), "b": int(b)}
        assert r["messages"][3]["content"] == r["messages"][4]["content"] == r["answer"] == str(int(a) * int(b))
    direct = [r for r in rows if len(r["messages"]) == 3]
    wrong = sum(r["messages"][2]["content"] != r["answer"] for r in direct)
    assert wrong / len(direct) > 0.9  # the direct answers are guesses: the tool is the way to the reward


def test_the_sft_prompt_is_the_agents_prompt_and_every_word_is_in_the_vocabulary(tok):
    assert detect_format(tok.chat_template) == "hermes"
    for r in generate("calc_multiply_traces", "train", num_rows=200):
        system, user = r["messages"][:2]
        sft_prompt = apply_chat_template(tok, [system, user], add_generation_prompt=True)
        agent_prompt = apply_chat_template(tok, [user], add_generation_prompt=True, tools=[MULTIPLY])
        assert sft_prompt == agent_prompt
        full = apply_chat_template(tok, r["messages"])
        assert tok.unk_token_id not in full, tok.decode(full)
    for r in generate("calc_multiply", "train", num_rows=100):
        assert tok.unk_token_id not in tok(r["answer"], add_special_tokens=False)["input_ids"]


def test_the_rendered_call_parses_back_into_the_call(tok):
    r = next(r for r in generate("calc_multiply_traces", "train", num_rows=50) if len(r["messages"]) == 5)
    prompt = apply_chat_template(tok, r["messages"][:2], add_generation_prompt=True)
    upto_call = apply_chat_template(tok, r["messages"][:3])
    call_text = tok.decode(upto_call[len(prompt):], skip_special_tokens=True)
    parsed = parse_tool_calls(call_text, "hermes")
    assert parsed.error is None and len(parsed.calls) == 1
    f = parsed.calls[0]["function"]
    assert f["name"] == "multiply" and run_tool(f["name"], f["arguments"]) == r["answer"]


@pytest.mark.parametrize("name,arguments,expected", [
    ("multiply", '{"a": 7, "b": 8}', "56"),
    ("multiply", '{"a": 7}', "error KeyError"),
    ("multiply", '{"a": 7, "b": "x"}', "error ValueError"),
    ("multiply", "not json", "error JSONDecodeError"),
    ("add", '{"a": 1, "b": 2}', "unknown tool add"),
])
def test_the_tool_answers_bad_calls_with_text(name, arguments, expected):
    assert run_tool(name, arguments) == expected


def _script(tok, use_tool: bool):
    def reply(prompt: str) -> str:
        _, a, b = prompt.split("user : ")[1].split(" . ")[0].split()
        if "tool :" in prompt:  # the tool's result came back: answer with it
            return prompt.rsplit("tool : ", 1)[1].split(" . ")[0]
        if use_tool:
            return '<tool_call>{"name":"multiply","arguments":{"a": ' + a + ' ,"b": ' + b + ' }}</tool_call>'
        return "12"
    return ScriptedEngine.from_text(tok, reply)


@pytest.mark.parametrize("use_tool", [True, False])
async def test_an_episode_through_the_proxy(tok, use_tool):
    eng = _script(tok, use_tool)
    # what launch/calc_agent_cpu.yaml's workflow section builds
    wf = build_workflow("examples.calculator_agent.CalculatorAgent", kwargs={"export_style": "individual"},
                        tokenizer=tok, gconfig=GenerationHyperparameters(max_new_tokens=8), reward="exact_match")
    runner = EpisodeRunner(wf, eng, max_concurrency=1, episode_timeout_s=20)
    row = TASKS["calc_multiply"].render((7, 8))
    try:
        (g,) = await runner.run_batch([row], n=1)
    finally:
        await runner.aclose()
    m = runner.last_metrics
    assert [e.status for e in g.episodes] == [EpisodeStatus.COMPLETED]
    if use_tool:  # two model calls, both trained with the final answer's reward
        assert m["workflow/num_tool_calls"] == 1.0 and m["workflow/num_model_calls"] == 2.0
        assert g.rewards == [1.0, 1.0]
        second = tok.decode(eng.responses[1].input_tokens, skip_special_tokens=True)
        assert "tool : 56 ." in second
    else:
        assert m["workflow/num_tool_calls"] == 0.0 and m["workflow/num_model_calls"] == 1.0 and g.rewards == [0.0]
