"""Structured outputs and tool calling at the gateway (fake scheduler, real uvicorn, the real
`openai` client): constraints compile to grammars and reach the scheduler, bad ones are 400s
naming the parameter, refused and label-only parameters, logit_bias, and tool calls in OpenAI's
shapes, whole and streamed, for tool_choice required / named / auto (Hermes blocks, a template
with tools, the fallback prompt). The model-side behaviour is tests/e2e/test_structured.py."""
from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

from gateway.tools import HermesParser, Llama3JsonParser, ToolPlan, calls_from_required, parser_for_template
from tests.support.gateway_fakes import Plan

MODEL = "smol-test"
MSG = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
# a Qwen 2.5-style template that renders tools itself (Hermes <tool_call> format)
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}"
    "</tool_response><|im_end|>\n{% elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class City(BaseModel):
    name: str
    population: int


class Answer(BaseModel):
    city: City
    tags: list[str]


def expect_400(call, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    return e.value.body["message"]


@pytest.fixture
def stack(make_stack):
    return make_stack(plan=lambda req: Plan('{"city": {"name": "Paris", "population": 2}, "tags": ["x"]}'))


def test_parse_with_a_pydantic_model_sends_its_schema_as_a_grammar(stack):
    r = stack.client().chat.completions.parse(model=MODEL, messages=MSG, response_format=Answer, max_tokens=50)
    assert r.choices[0].message.parsed == Answer(city=City(name="Paris", population=2), tags=["x"])
    grammar = stack.fake.received[-1].sampling.constraint
    assert grammar and "population" in grammar


def test_every_constraint_form_reaches_the_scheduler(stack):
    c = stack.client()
    c.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={"response_format": {"type": "json_object"}})
    for extra in ({"guided_regex": "[a-z]+"}, {"guided_choice": ["yes", "no"]},
                  {"structured_outputs": {"grammar": 'start: "a" | "b"'}},
                  {"structured_outputs": {"json": {"type": "integer"}}}):
        c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5, extra_body=extra)
    c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5, response_format={"type": "text"})
    grammars = [q.sampling.constraint for q in stack.fake.received]
    assert all(grammars[:5]) and grammars[5] is None and len(set(grammars[:5])) == 5


def test_bad_constraints_are_400s_naming_the_parameter(stack):
    c = stack.client()
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    msg = expect_400(lambda: c.chat.completions.create(model=MODEL, messages=MSG, response_format=bad_schema),
                     "response_format")
    assert "nonsense" in msg
    expect_400(lambda: c.chat.completions.create(model=MODEL, messages=MSG, extra_body={"guided_regex": "[a-"}),
               "guided_regex")
    expect_400(lambda: c.completions.create(model=MODEL, prompt="x",
                                            extra_body={"structured_outputs": {"grammar": "start: ("}}),
               "structured_outputs")
    expect_400(lambda: c.chat.completions.create(model=MODEL, messages=MSG, response_format={"type": "json_object"},
                                                 extra_body={"guided_choice": ["a"]}), "guided_choice")
    expect_400(lambda: c.chat.completions.create(model=MODEL, messages=MSG, response_format={"type": "json_object"},
                                                 extra_body={"ignore_eos": True}), "ignore_eos")
    assert stack.fake.received == []          # nothing was queued


@pytest.mark.parametrize("param,value", [("functions", [{"name": "f", "parameters": {}}]),
                                         ("function_call", "auto"), ("modalities", ["text", "audio"]),
                                         ("audio", {"voice": "alloy", "format": "wav"}),
                                         ("prediction", {"type": "content", "content": "x"})])
def test_output_changing_parameters_we_cannot_honour_are_refused(stack, param, value):
    expect_400(lambda: stack.client().chat.completions.create(model=MODEL, messages=MSG,
                                                              extra_body={param: value}), param)


def test_label_parameters_are_accepted_and_ignored(stack):
    r = stack.client().chat.completions.create(model=MODEL, messages=MSG, max_tokens=50, user="u1",
                                               metadata={"k": "v"}, store=False, service_tier="auto")
    assert r.choices[0].finish_reason == "stop"


def test_logit_bias_reaches_the_scheduler_and_ids_outside_the_vocabulary_are_400(stack, tokenizer):
    c = stack.client()
    c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5, logit_bias={"42": -100, "7": 5.5})
    assert sorted(stack.fake.received[-1].sampling.logit_bias) == [(7, 5.5), (42, -100.0)]
    expect_400(lambda: c.chat.completions.create(model=MODEL, messages=MSG,
                                                 logit_bias={str(tokenizer.vocab_size): 1}), "logit_bias")
    expect_400(lambda: c.chat.completions.create(model=MODEL, messages=MSG, logit_bias={"1": 101}), "logit_bias.1")


def tool_stack(make_stack, text: str, **kw):
    return make_stack(plan=lambda req: Plan(text), **kw)


def streamed_calls(stream) -> tuple[dict, str, str]:
    """{index: {"id", "name", "arguments"}}, the content, the finish_reason of a streamed choice;
    checks OpenAI's fragment order (id, type and name first, then argument pieces)."""
    calls, content, reason = {}, "", None
    for ch in stream:
        for c in ch.choices:
            content += c.delta.content or ""
            reason = c.finish_reason or reason
            for tc in c.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.type == "function" and tc.function.name, tc
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments or ""
    return calls, content, reason


def test_required_constrains_to_the_tools_and_returns_tool_calls(make_stack):
    s = tool_stack(make_stack, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    r = s.client().chat.completions.create(model=MODEL, messages=MSG, tools=[WEATHER, TIME], tool_choice="required",
                                           max_tokens=60)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    grammar = s.fake.received[-1].sampling.constraint
    assert "get_weather" in grammar and "get_time" in grammar
    calls, content, reason = streamed_calls(s.client().chat.completions.create(
        model=MODEL, messages=MSG, tools=[WEATHER], tool_choice="required", max_tokens=60, stream=True))
    assert reason == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris"})]


def test_a_named_function_is_constrained_to_its_parameters_and_streams_its_arguments(make_stack):
    s = tool_stack(make_stack, '{"city": "Oslo"}')
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = s.client().chat.completions.create(model=MODEL, messages=MSG, tools=[WEATHER, TIME], tool_choice=choice,
                                           max_tokens=60)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    assert "city" in s.fake.received[-1].sampling.constraint
    calls, _, reason = streamed_calls(s.client().chat.completions.create(
        model=MODEL, messages=MSG, tools=[WEATHER], tool_choice=choice, max_tokens=60, stream=True))
    assert reason == "tool_calls" and json.loads(calls[0]["arguments"]) == {"city": "Oslo"}


def test_tool_choice_errors(stack):
    c = stack.client()
    expect_400(lambda: c.chat.completions.create(model=MODEL, messages=MSG, tool_choice="required"), "tool_choice")
    expect_400(lambda: c.chat.completions.create(
        model=MODEL, messages=MSG, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
        "tool_choice")


def test_auto_without_template_support_uses_the_fallback_prompt_and_hermes_blocks(make_stack, tokenizer):
    s = tool_stack(make_stack, 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
                               '</tool_call>')
    r = s.client().chat.completions.create(model=MODEL, messages=MSG, tools=[WEATHER], max_tokens=60)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Checking."
    assert json.loads(ch.message.tool_calls[0].function.arguments) == {"city": "Rome"}
    req = s.fake.received[-1]
    assert req.sampling.constraint is None
    prompt = tokenizer.decode(req.prompt_token_ids, skip_special_tokens=False)
    assert "get_weather" in prompt and "<tool_call>" in prompt
    calls, content, reason = streamed_calls(s.client().chat.completions.create(
        model=MODEL, messages=MSG, tools=[WEATHER], max_tokens=60, stream=True))
    assert content == "Checking." and reason == "tool_calls" and calls[0]["name"] == "get_weather"


def test_auto_with_a_template_that_has_tools_renders_them_and_tool_results(make_stack, tokenizer):
    s = tool_stack(make_stack, "It is sunny in Rome.", chat_template=TOOL_TEMPLATE)
    history = MSG + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 25C"}]
    r = s.client().chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=60)
    assert r.choices[0].message.content == "It is sunny in Rome." and r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls
    prompt = tokenizer.decode(s.fake.received[-1].prompt_token_ids, skip_special_tokens=False)
    assert '<tools>{"type": "function"' in prompt and "<tool_response>sunny, 25C</tool_response>" in prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>' in prompt


def test_parsers_read_their_formats():
    text = 'a<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "g"}</tool_call>'
    content, calls = HermesParser().extract(text)
    assert content == "a" and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert HermesParser().extract("no calls <tool_call>{broken") == ("no calls <tool_call>{broken", [])
    assert HermesParser().hold_from("abc<tool_") == 3 and HermesParser().hold_from("abc") == 3
    content, calls = Llama3JsonParser().extract('{"name": "f", "parameters": {"y": "z"}}; '
                                                '{"name": "g", "parameters": {}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"y": "z"}), ("g", {})]
    assert Llama3JsonParser().extract("Hello") == ("Hello", [])
    assert isinstance(parser_for_template("{{ '<|python_tag|>' }} ipython"), Llama3JsonParser)
    assert isinstance(parser_for_template(TOOL_TEMPLATE), HermesParser)
    assert calls_from_required('[{"name": "f", "arguments": {}}') is None           # cut by max_tokens
    assert ToolPlan("required", []).answer('[{"name": "f"', "length") == ('[{"name": "f"', [], "length")
