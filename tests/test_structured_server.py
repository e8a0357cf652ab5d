"""Structured outputs and tool calls through the server: the request fields as the engine's constraint (one per
request, a bad one a 400 naming the field the client used), the hermes parser, replies' tool calls whole and
streamed (a stream cut anywhere reassembles to the unstreamed reply), and end to end with the `openai` client on the
shipped model, whose free text is meaningless outside arithmetic: the grammar alone makes each output valid, which
the tests check with `jsonschema` and `re`, never by string equality.
"""

import json
import re
import types

import jsonschema
import openai
import pytest

from live_server import live_server
from seeds import seeded_rng
from zipage_jax.engine.engine_core import Reported, output_delta
from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.engine.messages import Accepted
from zipage_jax.engine.outputs import CompletionOutput, RequestOutput
from zipage_jax.engine.request_group import ChoiceOutput
from zipage_jax.entrypoints import structured_requests
from zipage_jax.entrypoints.cli_args import parse_args
from zipage_jax.entrypoints.protocol import APIError, ChatCompletionRequest, CompletionRequest
from zipage_jax.entrypoints.reasoning import ReasoningParser
from zipage_jax.entrypoints.serving_chat import ChatView
from zipage_jax.entrypoints.tool_calls import ToolPlan, ToolSettings, array_calls
from zipage_jax.entrypoints.tool_parsers import FunctionCall, HermesParser

TINY_MODEL = "zipage_jax/assets/tiny-reasoner"
AUTO = ToolSettings(auto=True, parser="hermes")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CALC = {"type": "object", "properties": {"op": {"enum": ["add", "mul"]},
                                         "args": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99},
                                                  "minItems": 1, "maxItems": 3}},
        "required": ["op", "args"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "calc", "parameters": CALC}}]
NESTED = {  # objects, arrays, enums, required fields; every part bounded, so a reply fits the small context
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["add", "mul", "sub"]},
        "args": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 1,
                 "maxItems": 3},
        "meta": {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                  "tags": {"type": "array", "items": {"enum": ["x", "y"]},
                                                           "maxItems": 2}},
                 "required": ["ok", "tags"], "additionalProperties": False},
    },
    "required": ["name", "kind", "args", "meta"], "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "What is 12*3?"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


# -- the request's constraint -------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,field,kind", [
    ({"response_format": {"type": "json_object"}}, "response_format", "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": WEATHER, "strict": True}}},
     "response_format", "json"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"grammar": 'start: "yes" | "no"'}}, "structured_outputs", "grammar"),
    ({"structured_outputs": {"json": json.dumps(WEATHER)}}, "structured_outputs", "json"),
    ({"guided_json": WEATHER}, "guided_json", "json"),
    ({"guided_regex": "a+"}, "guided_regex", "regex"),
    ({"guided_choice": ["x", "y", "z"]}, "guided_choice", "choice"),
    ({"guided_grammar": 'root ::= "a" | "b"'}, "guided_grammar", "grammar"),
])
def test_each_field_is_one_constraint_named_by_it(fields, field, kind):
    found = structured_requests.requested(chat(**fields))
    assert [name for name, _ in found] == [field]
    params = structured_requests.compile_constraint(found, "</think>")
    assert params.kind == kind and params.reasoning_end == "</think>"


def test_no_constraint_and_text_format_ask_for_nothing():
    assert structured_requests.requested(chat()) == []
    assert structured_requests.requested(chat(response_format={"type": "text"})) == []
    assert structured_requests.compile_constraint([], None) is None


@pytest.mark.parametrize("fields,param,fragment", [
    ({"guided_regex": "a(b"}, "guided_regex", "guided_regex: invalid regular expression"),
    ({"guided_json": {"type": "foo"}}, "guided_json", "guided_json: invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"required": "a"}}}},
     "response_format", "response_format: invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "response_format", "schema"),
    ({"guided_grammar": "start: nothing"}, "guided_grammar", "invalid grammar"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "not supported"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "one structured output"),
])
def test_a_bad_constraint_is_a_400_naming_the_clients_field(fields, param, fragment):
    with pytest.raises(APIError) as error:
        structured_requests.compile_constraint(structured_requests.requested(chat(**fields)), None)
    assert error.value.status == 400 and error.value.param == param and fragment in error.value.message


def test_logit_bias_keys_become_token_ids():
    assert structured_requests.logit_bias(CompletionRequest(prompt="x", logit_bias={"5": 10, "50256": -100})) == \
        {5: 10.0, 50256: -100.0}
    assert structured_requests.logit_bias(CompletionRequest(prompt="x", logit_bias={})) is None
    with pytest.raises(APIError) as error:
        structured_requests.logit_bias(CompletionRequest(prompt="x", logit_bias={"-3": 1}))
    assert error.value.param == "logit_bias"


# -- tool choice ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,settings,param,fragment", [
    ({"tools": TOOLS}, ToolSettings(), "tool_choice", '"auto" tool choice requires --enable-auto-tool-choice'),
    ({"tools": TOOLS, "tool_choice": "auto"}, ToolSettings(), "tool_choice", "--tool-call-parser"),
    ({"tool_choice": "required"}, AUTO, "tool_choice", "`tools` must be set"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, AUTO, "tool_choice",
     "does not match"),
    ({"tools": []}, AUTO, "tools", "empty"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 1}}}],
      "tool_choice": "none"}, AUTO, "tools", "tools[0].function.parameters: invalid JSON schema"),
])
def test_tool_choice_is_checked_as_vllm_checks_it(fields, settings, param, fragment):
    with pytest.raises(APIError) as error:
        ToolPlan.of(chat(**fields), settings)
    assert error.value.status == 400 and error.value.param == param and fragment in error.value.message


def test_tool_modes_and_their_constraints():
    assert ToolPlan.of(chat(), ToolSettings()) is None
    assert ToolPlan.of(chat(tools=TOOLS, tool_choice="none"), ToolSettings()).constraint() is None
    assert ToolPlan.of(chat(tools=TOOLS), AUTO).mode == "auto"
    named = ToolPlan.of(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "calc"}}), AUTO)
    assert named.constraint() == ("tool_choice", {"json": CALC})
    field, kwargs = ToolPlan.of(chat(tools=TOOLS, tool_choice="required"), ToolSettings()).constraint()
    schema = kwargs["json"]
    assert field == "tool_choice" and schema["minItems"] == 1
    good = [{"name": "calc", "parameters": {"op": "add", "args": [1, 2]}},
            {"name": "weather", "parameters": {"city": "Oslo", "unit": "c"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "calc", "parameters": {"city": "Oslo", "unit": "c"}}], [{"name": "other"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert structured_requests.compile_constraint([(field, kwargs)], None).kind == "json"


def test_required_hoists_the_tools_defs_to_where_their_references_resolve():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/point"}}, "required": ["p"],
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}}}
    _, kwargs = ToolPlan.of(chat(tools=[tool], tool_choice="required"), ToolSettings()).constraint()
    assert "point" in kwargs["json"]["$defs"]
    jsonschema.validate([{"name": "f", "parameters": {"p": {"x": 1}}}], kwargs["json"])
    structured_requests.compile_constraint([("tool_choice", kwargs)], None)


def test_settings_need_a_parser_for_auto():
    with pytest.raises(ValueError, match="tool-call-parser"):
        ToolSettings(auto=True)
    with pytest.raises(ValueError, match="tool_call_parser"):
        ToolSettings(parser="nope")
    _, args = parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    with pytest.raises(SystemExit):
        parse_args(["--enable-auto-tool-choice"])


def test_template_messages_carry_tool_calls_with_their_arguments_as_objects():
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"op": "add", "args": [1]}'}}
    body = chat(messages=[*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "c1", "content": "1"}])
    assistant, tool = (m.as_template_message() for m in body.messages[1:])
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"op": "add", "args": [1]}
    assert tool == {"role": "tool", "content": "1", "tool_call_id": "c1"}


# -- the hermes parser ---------------------------------------------------------------------------------------------
HERMES = '<tool_call>\n{"name": "calc", "arguments": {"op": "add", "args": [1, 2]}}\n</tool_call>'


def test_hermes_extracts_a_complete_call():
    assert HermesParser().extract(HERMES) == (None, [FunctionCall("calc", '{"op": "add", "args": [1, 2]}')])


def test_hermes_extracts_several_calls_after_text_and_an_unclosed_last():
    text = ("Let me see. " + HERMES + "\n" +
            '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "unit": "c"}}')
    content, calls = HermesParser().extract(text)
    assert content == "Let me see. " and [c.name for c in calls] == ["calc", "weather"]
    assert json.loads(calls[1].arguments) == {"city": "Oslo", "unit": "c"}


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "calc", "arguments": {"op": </tool_call>',
    '<tool_call>\n{"arguments": {}}\n</tool_call>',
    HERMES + '<tool_call>not json</tool_call>',
    "plain <tool text",
])
def test_hermes_leaves_malformed_calls_as_content(text):
    assert HermesParser().extract(text) == (text, [])


def test_hermes_scan_holds_a_partial_tag_and_sends_closed_calls():
    parser = HermesParser()
    assert parser.scan("hello <tool_") == (len("hello "), [])
    assert parser.scan("hello " + HERMES[:30]) == (len("hello "), [])
    assert parser.scan("hi " + HERMES + "<tool_call>{") == (3, [FunctionCall("calc", '{"op": "add", "args": [1, 2]}')])


def test_array_calls_reads_complete_items_only():
    text = '[{"name": "calc", "parameters": {"op": "add", "args": [1]}}, {"name": "weather", "parameters": {"ci'
    calls, closed = array_calls(text)
    assert [c.name for c in calls] == ["calc"] and not closed
    calls, closed = array_calls('[{"name": "a]}", "parameters": {"s": "\\"}]"}}]')
    assert closed and calls == [FunctionCall("a]}", '{"s": "\\"}]"}')]


# -- replies, whole and streamed -----------------------------------------------------------------------------------
def view(fields: dict, settings=AUTO, reasoning: str | None = None, prompt: str = "<|im_start|>assistant\n"):
    serving = types.SimpleNamespace(reasoning=ReasoningParser(reasoning) if reasoning else None, token_text=str)
    body = chat(**fields)
    return ChatView(serving, body, [Accepted(2)], prompt, ToolPlan.of(body, settings))


def finished(reply: str, finish: str = "stop") -> ChoiceOutput:
    output = ChoiceOutput()
    completion = CompletionOutput(0, reply, list(range(len(reply))), None, None, finish)
    output.apply(output_delta(RequestOutput("r", None, [1, 2], [completion], True), Reported()))
    return output


def streamed(fields: dict, reply: str, cuts: list[int], finish: str = "stop", **kw) -> dict:
    """The message and finish reason the deltas of ``reply`` cut at ``cuts`` reassemble to."""
    stream = view(fields, **kw).stream(0)
    output, reported, calls = ChoiceOutput(), Reported(), {}
    content, reasoning, finish_reason = "", "", None
    for i, end in enumerate(cuts + [len(reply)]):
        last = i == len(cuts)
        completion = CompletionOutput(0, reply[:end], list(range(end)), None, None, finish if last else None)
        output.apply(output_delta(RequestOutput("r", None, [1, 2], [completion], last), reported))
        chunk = stream.chunk(output)
        if chunk is None:
            continue
        delta = chunk["delta"]
        content += delta.get("content", "")
        reasoning += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:  # a call's first delta: its id, type and name
                assert call["index"] not in calls and call["type"] == "function"
                calls[call["index"]] = {"name": call["function"]["name"], "arguments": ""}
            calls[call["index"]]["arguments"] += call["function"].get("arguments", "")
        finish_reason = chunk["finish_reason"]
    return {"content": content or None, "reasoning": reasoning or None, "finish_reason": finish_reason,
            "calls": [calls[i] for i in sorted(calls)]}


def whole(fields: dict, reply: str, finish: str = "stop", **kw) -> dict:
    choice = view(fields, **kw).choice(0, finished(reply, finish))
    message = choice["message"]
    for call in message["tool_calls"]:
        assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
    return {"content": message["content"], "reasoning": message.get("reasoning_content"),
            "finish_reason": choice["finish_reason"], "calls": [call["function"] for call in message["tool_calls"]]}


NAMED = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "calc"}}}
REPLIES = [  # (request fields, reasoning parser, reply, finish, the reply's content, calls and finish reason)
    ({"tools": TOOLS}, None, "Let me see. " + HERMES, "stop",
     "Let me see. ", [("calc", '{"op": "add", "args": [1, 2]}')], "tool_calls"),
    ({"tools": TOOLS}, None, HERMES + "\n" + HERMES.replace("calc", "calc"), "stop", None,
     [("calc", '{"op": "add", "args": [1, 2]}')] * 2, "tool_calls"),
    ({"tools": TOOLS}, None, "no call <tool here", "stop", "no call <tool here", [], "stop"),
    ({"tools": TOOLS}, None, "a" + HERMES[:-5], "length", "a" + HERMES[:-5], [], "length"),
    ({"tools": TOOLS, "parallel_tool_calls": False}, None, HERMES + HERMES, "stop", None,
     [("calc", '{"op": "add", "args": [1, 2]}')], "tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required"}, None,
     '[{"name": "weather", "parameters": {"city": "O\\"slo", "unit": "c"}}, {"name": "calc", "parameters": '
     '{"op":"mul","args":[3]}}]', "stop", None,
     [("weather", '{"city": "O\\"slo", "unit": "c"}'), ("calc", '{"op": "mul", "args": [3]}')], "tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required"}, None,
     '[{"name": "calc", "parameters": {"op": "add", "args": [1]}}, {"name": "wea', "length", None,
     [("calc", '{"op": "add", "args": [1]}')], "length"),
    (NAMED, None, '{"op": "add", "args": [7]}', "stop", None, [("calc", '{"op": "add", "args": [7]}')], "stop"),
    (NAMED, "qwen3", '<think>1+1</think>{"op":"add","args":[2]}', "stop", None,
     [("calc", '{"op":"add","args":[2]}')], "stop"),
    (NAMED, "qwen3", "<think>never done", "length", None, [], "length"),
    ({"tools": TOOLS, "tool_choice": "none"}, None, HERMES, "stop", HERMES, [], "stop"),
    ({"tools": TOOLS}, "deepseek_r1", "hmm " + HERMES[:11] + "</think>ok " + HERMES, "stop", "ok ",
     [("calc", '{"op": "add", "args": [1, 2]}')], "tool_calls"),
]


@pytest.mark.parametrize("fields,reasoning,reply,finish,content,calls,finish_reason", REPLIES)
def test_a_reply_and_its_stream_cut_anywhere_give_the_same_calls(fields, reasoning, reply, finish, content, calls,
                                                                 finish_reason):
    want = whole(fields, reply, finish, reasoning=reasoning)
    assert (want["content"], want["finish_reason"]) == (content, finish_reason)
    assert [(c["name"], c["arguments"]) for c in want["calls"]] == calls
    rng = seeded_rng()
    cut_sets = [[cut] for cut in range(len(reply) + 1)] + [list(range(len(reply) + 1))]
    cut_sets += [sorted(rng.choice(len(reply) + 1, size=min(6, len(reply)), replace=False).tolist())
                 for _ in range(10)]
    for cuts in cut_sets:
        assert streamed(fields, reply, cuts, finish, reasoning=reasoning) == want, cuts


def test_a_named_functions_arguments_stream_as_they_come():
    stream = view(NAMED).stream(0)
    output, reported, deltas = ChoiceOutput(), Reported(), []
    reply = '{"op": "add", "args": [7]}'
    for end in range(1, len(reply) + 1):
        last = end == len(reply)
        completion = CompletionOutput(0, reply[:end], list(range(end)), None, None, "stop" if last else None)
        output.apply(output_delta(RequestOutput("r", None, [1, 2], [completion], last), reported))
        deltas.append(stream.chunk(output)["delta"])
    first, *rest = deltas
    assert first["tool_calls"][0]["function"] == {"name": "calc", "arguments": "{"}
    assert all(d["tool_calls"] == [{"index": 0, "function": {"arguments": reply[i + 1]}}] for i, d in enumerate(rest))


# -- end to end: the openai client against the shipped model ----------------------------------------------------
TOOLS_TEMPLATE = ("{%- if tools %}{{- '<|im_start|>system\\ntools: ' + (tools | map(attribute='function.name') | join(', '))"
                  " + '<|im_end|>\\n' }}{%- endif %}"
                  "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                  "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                  "{%- endif %}")  # the shipped model's template, with the tools' names in a system turn (the whole
# tools would not fit its context)


@pytest.fixture(scope="module")
def live():
    engine = LLMEngine.from_kwargs(TINY_MODEL, max_num_seqs=32, page_size=16, max_model_len=512,
                                   max_num_batched_tokens=256, dtype="float32", max_num_prefill_seqs=8,
                                   num_gpu_pages_override=1024)
    with live_server(engine, enable_auto_tool_choice=True, tool_call_parser="hermes",
                     chat_template=TOOLS_TEMPLATE) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return live.client()


def test_json_schema_output_validates_in_20_of_20(client):
    reply = client.chat.completions.create(
        model="tiny-reasoner", messages=MESSAGES, n=20, temperature=1.0, seed=1, max_tokens=400,
        response_format={"type": "json_schema", "json_schema": {"name": "op", "schema": NESTED, "strict": True}})
    assert len(reply.choices) == 20
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), NESTED)


def test_guided_choice_is_one_of_the_three(client):
    options = ["apple pie", "banana", "cherry"]
    reply = client.chat.completions.create(model="tiny-reasoner", messages=MESSAGES, n=8, temperature=1.0, seed=2,
                                           max_tokens=50, extra_body={"guided_choice": options})
    for choice in reply.choices:
        assert choice.message.content in options and choice.finish_reason == "stop"


def test_regex_output_matches(client):
    pattern = r"[A-Z][a-z]{2,5}-[0-9]{3}(\.[0-9])?"
    reply = client.completions.create(model="tiny-reasoner", prompt="Code: ", n=8, temperature=1.0, seed=3,
                                      max_tokens=50, extra_body={"structured_outputs": {"regex": pattern}})
    for choice in reply.choices:
        assert re.fullmatch(pattern, choice.text), choice.text


def test_required_tool_call_arguments_validate_against_the_tools_parameters(client):
    reply = client.chat.completions.create(model="tiny-reasoner", messages=MESSAGES, tools=TOOLS,
                                           tool_choice="required", n=4, temperature=1.0, seed=4, max_tokens=400)
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def reassembled(stream) -> tuple[list[tuple[str, str]], str]:
    calls, finish = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.type == "function" and call.index not in calls
                    calls[call.index] = [call.function.name, ""]
                calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_streamed_tool_calls_reassemble_to_the_unstreamed_ones(client, tool_choice):
    kw = dict(model="tiny-reasoner", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, temperature=1.0,
              seed=5, max_tokens=400)
    whole = client.chat.completions.create(**kw).choices[0]
    calls, finish = reassembled(client.chat.completions.create(stream=True, **kw))
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert finish == whole.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    if tool_choice != "required":
        (name, arguments), = calls
        assert name == "weather"
        jsonschema.validate(json.loads(arguments), WEATHER)


def test_auto_tool_choice_gives_the_template_the_tools_and_parses_the_reply(live, client):
    kw = dict(model="tiny-reasoner", messages=MESSAGES, temperature=0, max_tokens=8)
    plain = client.chat.completions.create(**kw)
    auto = client.chat.completions.create(tools=TOOLS, **kw)
    added = len("system\ntools: weather, calc\n") + 2  # one token a character, and <|im_start|>, <|im_end|>
    assert auto.usage.prompt_tokens == plain.usage.prompt_tokens + added
    assert auto.choices[0].message.tool_calls == [] and auto.choices[0].finish_reason == "length"
    counted = live.post("/tokenize", json={"model": "tiny-reasoner", "messages": MESSAGES, "tools": TOOLS}).json()
    assert counted["count"] == auto.usage.prompt_tokens


def test_logit_bias_of_100_makes_greedy_output_that_token(live, client):
    token = live.post("/tokenize", json={"prompt": "Z", "add_special_tokens": False}).json()["tokens"][0]
    reply = client.completions.create(model="tiny-reasoner", prompt="1+1=", temperature=0, max_tokens=5,
                                      logit_bias={str(token): 100})
    assert reply.choices[0].text == "ZZZZZ"


BAD = [  # (path, body fields, param, message fragment)
    ("/v1/chat/completions", {"guided_regex": "a(b"}, "guided_regex", "invalid regular expression"),
    ("/v1/completions", {"guided_json": {"type": "nope"}}, "guided_json", "invalid JSON schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": 5}}}}}}, "response_format",
     "invalid JSON schema"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format", "response_format"),
    ("/v1/completions", {"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs",
     "invalid grammar"),
    ("/v1/chat/completions", {"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "one structured output"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required", "guided_regex": "b"}, "tool_choice",
     "one structured output"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"minimum": "x"}}}}}]}, "tools",
     "tools[0].function.parameters"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", "does not match"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ("/v1/completions", {"logit_bias": {"100000": 1}}, "logit_bias", "logit_bias"),
]


@pytest.mark.parametrize("path,fields,param,fragment", BAD)
def test_bad_structured_input_is_a_400_naming_it(live, path, fields, param, fragment):
    body = {"model": "tiny-reasoner", "max_tokens": 4, **fields}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": MESSAGES})
    r = live.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"] and error["type"] == "invalid_request_error"


def test_without_the_flags_auto_is_vllms_400_and_a_reasoning_parser_starts_the_constraint_after_thinking():
    engine = LLMEngine.from_kwargs(TINY_MODEL, max_num_seqs=2, page_size=16, max_model_len=128,
                                   max_num_batched_tokens=64, dtype="float32", num_gpu_pages_override=64)
    queued, add_request = [], engine.add_request

    def recording(request_id, prompt, params=None, **kw):
        queued.append(params)
        return add_request(request_id, prompt, params, **kw)

    engine.add_request = recording
    with live_server(engine, reasoning_parser="qwen3") as server:
        client = server.client()
        with pytest.raises(openai.BadRequestError, match="requires --enable-auto-tool-choice"):
            client.chat.completions.create(model="tiny-reasoner", messages=MESSAGES, tools=TOOLS)
        assert not queued
        for include_reasoning, end in ((True, "</think>"), (False, None)):  # vLLM: hidden thinking is not waited for
            client.chat.completions.create(model="tiny-reasoner", messages=MESSAGES, max_tokens=2,
                                           extra_body={"guided_choice": ["a", "b"],
                                                       "include_reasoning": include_reasoning})
            assert queued.pop().structured_outputs.reasoning_end == end
        client.completions.create(model="tiny-reasoner", prompt="x", max_tokens=2, extra_body={"guided_regex": "a+"})
        assert queued.pop().structured_outputs.reasoning_end == "</think>"  # vLLM's reasoner acts on every route


def test_json_whitespace_fields_reach_the_constraint():
    compact = structured_requests.compile_constraint(structured_requests.requested(chat(guided_json=WEATHER)), None)
    assert json.loads(compact.json_layout)["whitespace_flexible"] is False  # json.dumps' layout by default
    free = chat(structured_outputs={"json": WEATHER, "disable_any_whitespace": False})
    assert json.loads(structured_requests.compile_constraint(structured_requests.requested(free), None).json_layout) \
        == {"whitespace_flexible": True}
    body = chat(guided_json=WEATHER, guided_whitespace_pattern=" ?")
    found = structured_requests.with_whitespace(structured_requests.requested(body), body)
    assert structured_requests.compile_constraint(found, None).whitespace_pattern == " ?"
