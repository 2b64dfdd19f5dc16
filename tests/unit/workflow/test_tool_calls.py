"""Tool calls: the parsers of the two formats, and the proxy returning OpenAI `tool_calls` to a real
`openai.AsyncOpenAI` agent that runs the tool and sends a `tool` message back."""

import json

import openai
import pytest
from helpers.scripted_engine import ScriptedEngine
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from mlrl.types import GenerationHyperparameters
from mlrl.workflow import EpisodeRunner, EpisodeStatus, build_workflow
from mlrl.workflow.agent_proxy.proxy import OpenAIProxy, shared_http_client
from mlrl.workflow.agent_proxy.tool_calls import detect_format, parse_tool_calls

# --- parsers ---------------------------------------------------------------------------------------


def _fn(call):
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def test_hermes_calls_with_leading_text():
    text = ('Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call>\n'
            '<tool_call>{"name": "calc", "arguments": "{\\"expr\\": \\"4*5\\"}"}</tool_call>')
    p = parse_tool_calls(text, "hermes")
    assert p.error is None and p.content == "Let me compute."
    assert [_fn(c) for c in p.calls] == [("calc", {"expr": "2+3"}), ("calc", {"expr": "4*5"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in p.calls)
    assert len({c["id"] for c in p.calls}) == 2
    assert parse_tool_calls("just an answer: 5", "hermes").calls == []


@pytest.mark.parametrize("text, why", [
    ('<tool_call>{"name": "calc", "arguments": {"expr": </tool_call>', "Expecting value"),
    ('<tool_call>{"arguments": {}}</tool_call>', "no function name"),
    ('<tool_call>{"name": "calc", "arguments": {"expr": "1"}}', "not closed"),
    ('<tool_call>{"name": "calc", "arguments": [1]}</tool_call>', "must be a JSON object"),
])
def test_malformed_hermes_calls_come_back_as_text_with_the_reason(text, why):
    p = parse_tool_calls(text, "hermes")
    assert p.calls == [] and p.content == text and why in p.error


def test_llama3_json_calls():
    p = parse_tool_calls('<|python_tag|>{"name": "calc", "parameters": {"expr": "a;b"}}; {"name": "now", '
                         '"parameters": {}}', "llama3_json")
    assert p.error is None and p.content is None
    assert [_fn(c) for c in p.calls] == [("calc", {"expr": "a;b"}), ("now", {})]
    assert parse_tool_calls("The answer is 5.", "llama3_json").calls == []
    bad = parse_tool_calls('{"name": "calc", "parameters": {"expr"}', "llama3_json")
    assert bad.calls == [] and bad.content.startswith("{") and bad.error.startswith("llama3_json")
    # an escaped quote does not end its string: braces and ';' after it are still inside (valid calls
    # came back as text, counted as parse failures)
    code = 'print(\\"}};{\\")'  # JSON text of the string: print(\"}};{\")
    p = parse_tool_calls('{"name": "python", "parameters": {"code": "' + code + '"}}; {"name": "now", '
                         '"parameters": {"s": "a\\"b\\\\"}}', "llama3_json")
    assert p.error is None, p.error
    assert [_fn(c) for c in p.calls] == [("python", {"code": 'print("}};{")'}), ("now", {"s": 'a"b\\'})]


def test_format_detection_and_none():
    assert detect_format("... <tool_call> ...") == "hermes"
    assert detect_format("{% if tools %}<|python_tag|>{% endif %}") == "llama3_json"
    assert detect_format("{{ m['content'] }}") is None
    text = '<tool_call>{"name": "calc", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text, None).content == text and parse_tool_calls(text, None).calls == []


# --- through the proxy -----------------------------------------------------------------------------

# Qwen2.5's template, reduced: tools in the system turn, calls as <tool_call> JSON, results as
# <tool_response> in a user turn.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }} {% endfor %}"
    "call as <tool_call>{json}</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for tc in m.tool_calls %}<tool_call>{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALC_PARAMS = {"type": "object", "properties": {"expr": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate +, *", "parameters": CALC_PARAMS}}]


@pytest.fixture(scope="module")
def byte_tok():
    """A byte-level tokenizer (any text round-trips) with the Hermes-style template above."""
    chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                additional_special_tokens=["<|im_start|>"])
    t.chat_template = HERMES_TEMPLATE
    return t


def _reply(prompt: str) -> str:
    """The scripted model: call the calculator, then answer with the tool's result."""
    if "<tool_response>" in prompt:
        return "The result is " + prompt.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0]
    if "MALFORMED" in prompt:
        return '<tool_call>{"name": "calc", "arguments": {"expr": </tool_call>'
    return 'Computing.<tool_call>{"name": "calc", "arguments": {"expr": "6*7"}}</tool_call>'


class CalculatorAgent:
    """An OpenAI-client agent with one tool; reward 1 when the final answer has the right number."""

    async def run(self, data, **kw):
        c = openai.AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"], http_client=kw["http_client"],
                               max_retries=0)
        msgs = list(data["messages"])
        first = await c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        m = first.choices[0].message
        if not m.tool_calls:
            return 0.0
        assert first.choices[0].finish_reason == "tool_calls"
        msgs.append(m.model_dump(exclude_none=True))
        for tc in m.tool_calls:
            expr = json.loads(tc.function.arguments)["expr"]
            a, b = expr.split("*")
            msgs.append({"role": "tool", "tool_call_id": tc.id, "content": str(int(a) * int(b))})
        second = await c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        return float(second.choices[0].message.content == f"The result is {data['answer']}")


async def _episode(tok, content, **kw):
    eng = ScriptedEngine.from_text(tok, _reply)
    wf = build_workflow(CalculatorAgent, kwargs=kw, tokenizer=tok, gconfig=GenerationHyperparameters(max_new_tokens=80))
    runner = EpisodeRunner(wf, eng, max_concurrency=1, episode_timeout_s=20)
    try:
        (g,) = await runner.run_batch([{"messages": [{"role": "user", "content": content}], "answer": "42"}], n=1)
    finally:
        await runner.aclose()
    return g, runner.last_metrics, eng


async def test_the_agent_calls_a_tool_through_the_proxy_and_gets_its_answer_trained(byte_tok):
    g, m, eng = await _episode(byte_tok, "what is 6*7?")
    assert [e.status for e in g.episodes] == [EpisodeStatus.COMPLETED] and g.rewards == [1.0, 1.0]  # both calls
    assert m["workflow/num_tool_call_parse_failures"] == 0.0 and m["workflow/num_tool_calls"] == 1.0
    r1, r2 = eng.responses
    # the tool call was rendered back into the second prompt from the agent's assistant message
    # (arguments as an object), followed by the tool's result
    second_prompt = byte_tok.decode(r2.input_tokens)
    assert '<tool_call>{"name": "calc", "arguments": {"expr": "6*7"}}</tool_call>' in second_prompt
    assert "<tool_response>42</tool_response>" in second_prompt and "Tools: calc" in second_prompt
    # both completions are trained on the engine's own tokens
    assert sorted(len(s.tokens) for s in g.samples) == sorted(len(r.input_tokens) + r.output_len for r in (r1, r2))


async def test_a_malformed_call_is_text_and_counted_and_none_turns_parsing_off(byte_tok):
    g, m, _ = await _episode(byte_tok, "MALFORMED please")
    assert [e.status for e in g.episodes] == [EpisodeStatus.COMPLETED] and g.rewards == [0.0]
    assert m["workflow/num_tool_call_parse_failures"] == 1.0 and m["workflow/num_tool_calls"] == 0.0
    # tool_call_format=none: the well-formed call stays text, the agent sees no tool_calls
    g2, m2, eng2 = await _episode(byte_tok, "what is 6*7?", tool_call_format="none")
    assert g2.rewards == [0.0] and len(eng2.responses) == 1 and m2["workflow/num_tool_call_parse_failures"] == 0.0


def test_an_unknown_format_is_refused_before_any_episode(byte_tok):
    with pytest.raises(ValueError, match="tool_call_format: expected one of auto, hermes, llama3_json, none"):
        OpenAIProxy(byte_tok, tool_call_format="xml")


async def test_proxy_returns_tool_calls_only_when_the_request_has_tools(byte_tok):
    p = OpenAIProxy(byte_tok, default_gconfig=GenerationHyperparameters(max_new_tokens=80))
    assert p.tool_call_format == "hermes"  # auto: the template teaches <tool_call>
    await p.start()
    try:
        s = p.start_session(ScriptedEngine.from_text(byte_tok, _reply))
        c = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, http_client=shared_http_client(),
                               max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        plain = await c.chat.completions.create(model="m", messages=msgs)
        assert plain.choices[0].message.tool_calls is None and "<tool_call>" in plain.choices[0].message.content
        called = await c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        (tc,) = called.choices[0].message.tool_calls
        assert tc.function.name == "calc" and json.loads(tc.function.arguments) == {"expr": "6*7"}
        assert called.choices[0].message.content == "Computing." and called.choices[0].finish_reason == "tool_calls"
    finally:
        await p.aclose()
