"""Tools through the OpenAI HTTP API: the template sees them, ``required`` and a named function are forced by
a grammar (over real engines: a random-weight model calls a tool with valid arguments because it can do
nothing else), ``auto`` calls are parsed out of the text (Hermes and Llama 3 JSON), whole and streamed alike,
with no markup leaking into the content; the official SDK's tool round trip; bad tool requests are 400s."""
from __future__ import annotations

import json
import random
import re

import httpx
import jsonschema
import openai
import pytest
from openai_support import EngineCluster, ScriptedBackend
from pydantic import BaseModel, Field

from engine.sampling.structured import StructuredOutput, to_llguidance
from router.openai_api.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from router.openai_api.tool_parsers import FORMATS, HermesParser, Llama3JsonParser, Parsed, tool_format

QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided \
with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\
\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
LLAMA31_HINT = ('Given the following functions, please respond with a JSON for a function call with its proper '
                'arguments that best answers the given prompt.\n\nRespond in the format {"name": function name, '
                '"parameters": dictionary of argument name and its value}.<|python_tag|>')


class GetWeather(BaseModel):
    city: str = Field(max_length=8)
    unit: str = Field(pattern="^(c|f)$")


class GetTime(BaseModel):
    zone: int = Field(ge=-12, le=14)


TOOLS = [openai.pydantic_function_tool(GetWeather, name="get_weather", description="The weather in a city."),
         openai.pydantic_function_tool(GetTime, name="get_time")]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


# ---- parsers ---------------------------------------------------------------------------------------------

def _streamed(parser, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]], Parsed]:
    out, prev = Parsed(), 0
    for cut in sorted(cuts) + [len(text)]:
        out.add(parser.feed(text[prev:cut]))
        prev = cut
    out.add(parser.finish())
    return out.content or None, [(c.name, c.arguments) for c in parser.calls], out


@pytest.mark.parametrize("parser,text,content,calls", [
    (HermesParser, "Hello there!", "Hello there!", []),
    (HermesParser, "Let me check.\n" + HERMES_CALL, "Let me check.",
     [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    (HermesParser, HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", 'Pa\\"}ris') + "\n",
     None, [("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_weather", '{"city": "Pa\\"}ris", "unit": "c"}')]),
    (HermesParser, '<tool_call>{"arguments": {"zone": 2}, "name": "get_time"}</tool_call>', None,
     [("get_time", '{"zone": 2}')]),
    (HermesParser, 'a <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> b',
     'a <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> b', []),
    (HermesParser, "x < y, <tool_call>not json</tool_call>", "x < y, <tool_call>not json</tool_call>", []),
    (HermesParser, '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1', None, [("get_time", '{"zone": 1')]),
    (HermesParser, "ends with <tool", "ends with <tool", []),
    (Llama3JsonParser, '{"name": "get_time", "parameters": {"zone": 3}}', None, [("get_time", '{"zone": 3}')]),
    (Llama3JsonParser, '<|python_tag|>{"name": "get_time", "parameters": {"zone": -1}}; '
                       '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "f"}}', None,
     [("get_time", '{"zone": -1}'), ("get_weather", '{"city": "Oslo", "unit": "f"}')]),
    (Llama3JsonParser, '{"parameters": {"zone": 0}, "name": "get_time"}', None, [("get_time", '{"zone": 0}')]),
    (Llama3JsonParser, 'Sure: {"name": "get_time"}', 'Sure: {"name": "get_time"}', []),
    (Llama3JsonParser, '{"name": "rm_rf", "parameters": {}}', '{"name": "rm_rf", "parameters": {}}', []),
    (HermesParser, '<tool_call>{"name": "get_\\q", "arguments": {}}</tool_call>',          # no JSON string
     '<tool_call>{"name": "get_\\q", "arguments": {}}</tool_call>', []),
    (HermesParser, '<tool_call>{"name": "get\ntime", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "get\ntime", "arguments": {}}</tool_call>', []),
    (Llama3JsonParser, '{"name": "get_\\q", "parameters": {}}', '{"name": "get_\\q", "parameters": {}}', []),
])
def test_parsers_find_the_same_calls_however_the_text_is_split(parser, text, content, calls):
    """Whole, one character at a time, and at random cuts: the same content and calls; the streamed deltas
    reassemble to them, and no piece of content holds call markup."""
    names = ("get_weather", "get_time")
    whole_content, whole_calls = parser(names).parse(text)
    assert (whole_content, [(c.name, c.arguments) for c in whole_calls]) == (content, calls)
    rng = random.Random(0)
    for trial in range(60):
        cuts = list(range(1, len(text))) if trial == 0 else rng.sample(range(1, len(text)), rng.randint(1, 8))
        p = parser(names)
        got_content, got_calls, out = _streamed(p, text, cuts)
        assert (got_content, got_calls) == (content, calls), cuts
        rebuilt: dict[int, list[str]] = {}
        for delta in out.calls:
            if delta.id is not None:
                rebuilt[delta.index] = [delta.name, ""]
            rebuilt[delta.index][1] += delta.arguments
        assert [tuple(rebuilt[i]) for i in sorted(rebuilt)] == calls
        if calls and parser is HermesParser:
            assert "<tool_call" not in (got_content or "")


def test_the_format_comes_from_config_or_the_chat_template():
    assert tool_format("auto", QWEN25_TEMPLATE).name == "hermes"
    assert tool_format("auto", DEFAULT_CHAT_TEMPLATE).name == "hermes"
    assert tool_format("auto", LLAMA31_HINT).name == "llama3_json"
    assert tool_format("auto", "{{ messages }}").name == "hermes"
    assert tool_format("llama3_json", QWEN25_TEMPLATE).name == "llama3_json"
    assert tool_format("none", QWEN25_TEMPLATE) is None
    with pytest.raises(ValueError, match="tool_parser must be one of"):
        tool_format("mistral")


def test_forced_grammars_compile_and_accept_a_call(tiny_model_dir):
    """Each format's grammar (with the parameters' `$defs` hoisted) is valid and accepts what its parser reads."""
    import llguidance

    from engine import EngineArgs
    tok = EngineArgs(tiny_model_dir).load_tokenizer()
    tokenizer = llguidance.LLTokenizer(tok.to_json(), n_vocab=tok.vocab_size, eos_token=1)

    class Inner(BaseModel):
        x: int = Field(ge=0, le=9)

    class Outer(BaseModel):
        items: list[Inner] = Field(max_length=2)
    nested = openai.pydantic_function_tool(Outer, name="nested")["function"]["parameters"]
    assert "$defs" in nested
    tools = [("nested", nested), ("get_time", SCHEMAS["get_time"])]
    for name, text in (("hermes", '<tool_call>\n{"name": "nested", "arguments": {"items": [{"x": 3}]}}\n</tool_call>'
                                  '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>'),
                       ("llama3_json", '{"name": "nested", "parameters": {"items": []}}; '
                                       '{"name": "get_time", "parameters": {"zone": -3}}')):
        grammar = FORMATS[name].grammar(tools, parallel=True)
        to_llguidance(StructuredOutput(grammar=grammar))
        ids = tok.encode(text, add_special_tokens=False)
        matcher = llguidance.LLMatcher(tokenizer, to_llguidance(StructuredOutput(grammar=grammar)))
        assert matcher.consume_tokens(ids), (name, matcher.get_error())
        assert matcher.is_accepting()
        single = llguidance.LLMatcher(tokenizer, to_llguidance(StructuredOutput(
            grammar=FORMATS[name].grammar(tools[1:], parallel=False))))
        assert not single.consume_tokens(ids)          # the other tool, and one call only


# ---- the template --------------------------------------------------------------------------------------

def test_tools_and_tool_messages_render_as_transformers_renders_them(tmp_path, tiny_model_dir):
    """tools, an assistant's tool_calls (arguments as a JSON string, as OpenAI sends them) and tool results
    give transformers' apply_chat_template(tools=...) text, for Qwen2.5's template and the default one."""
    import shutil

    from router.openai_api.inputs import template_messages
    from router.openai_api.protocol import ChatMessage
    transformers = pytest.importorskip("transformers")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}
    conversation = [{"role": "system", "content": "Be brief."}, *ASK,
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"}]
    ours = template_messages([ChatMessage.model_validate(m) for m in conversation])
    theirs = [dict(m) for m in conversation]
    theirs[2] = {**theirs[2], "content": "", "tool_calls": [{**call, "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]}      # as vLLM hands them over
    for source in (QWEN25_TEMPLATE, DEFAULT_CHAT_TEMPLATE):
        model_dir = tmp_path / str(hash(source))
        model_dir.mkdir()
        shutil.copy(f"{tiny_model_dir}/tokenizer.json", model_dir)
        (model_dir / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
            "chat_template": source}))
        hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        expected = hf.apply_chat_template(theirs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        text = ChatTemplate.from_model_dir(str(model_dir)).render(ours, tools=TOOLS)
        assert text == expected
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in text
        assert "<tool_response>\n21 C, sunny\n</tool_response>" in text and '"name": "get_time"' in text


def test_a_tool_use_template_serves_requests_with_tools(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "plain{{ tools is none }}"},
        {"name": "tool_use", "template": "tools:{{ tools | length }}"}]}))
    template = ChatTemplate.from_model_dir(str(tmp_path))
    assert template.render(ASK) == "plainTrue"
    assert template.render(ASK, tools=TOOLS) == "tools:2"


# ---- over a scripted model (fixed text) ----------------------------------------------------------------------

@pytest.fixture
def scripted(serve):
    """Factory: a router over a backend that answers ``reply`` → its openai client."""
    clients = []

    def start(reply: str, **kwargs):
        running = serve(ScriptedBackend(max_model_len=4096, replies=(reply,)), http_port=0, model_name="m", **kwargs)
        client = openai.OpenAI(base_url=running.server.http_url + "/v1", api_key="x", max_retries=0, timeout=10)
        clients.append(client)
        return client
    yield start
    for c in clients:
        c.close()


def test_auto_parses_hermes_calls_whole_and_streamed(scripted):
    client = scripted("I will look it up.\n" + HERMES_CALL)
    whole = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=200)
    [choice] = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will look it up."
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}
    raw = list(client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=200, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in raw if c.choices)
    assert content == "I will look it up." and "<" not in content
    deltas = [d for c in raw if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    first = deltas[0]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (0, "function",
                                                                                        "get_weather", "")
    assert first.id.startswith("call_") and all(d.id is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert raw[-1].choices[0].finish_reason == "tool_calls"
    with client.chat.completions.stream(model="m", messages=ASK, tools=TOOLS, max_tokens=200) as stream:
        final = stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert isinstance(streamed.function.parsed_arguments, GetWeather)       # strict tools: the SDK parses them


def test_auto_parses_llama3_json_calls(scripted):
    text = '{"name": "get_time", "parameters": {"zone": 2}}; {"name": "get_weather", "parameters": ' \
           '{"city": "Oslo", "unit": "f"}}'
    client = scripted(text, tool_parser="llama3_json")
    out = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=200)
    message = out.choices[0].message
    assert message.content is None and out.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_time", {"zone": 2}), ("get_weather", {"city": "Oslo", "unit": "f"})]
    plain = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=200)
    assert plain.choices[0].message.content == text and plain.choices[0].message.tool_calls is None


@pytest.mark.parametrize("reply", [
    '<tool_call>\n{"name": "get_\\q", "arguments": {}}\n</tool_call>',    # a name that is no JSON string
    '<tool_call>\n{"name": "get\ttime", "arguments": {}}\n</tool_call>',
    "<tool_call>" + "[" * 1100 + "]" * 1100 + "</tool_call>",               # deeper than json.loads goes
])
def test_a_malformed_call_in_the_text_is_content_whole_and_streamed(scripted, reply):
    client = scripted(reply)
    whole = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=2500)
    [choice] = whole.choices
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (reply, None, "stop")
    raw = list(client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=2500, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in raw if c.choices) == reply
    assert raw[-1].choices[0].finish_reason == "stop"


def test_bad_tool_requests_are_400s_naming_the_problem(scripted):
    client = scripted("Hello")
    url = str(client.base_url)
    cases = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}},
         r"tool_choice\.function\.name: 'get_stock' is not among the tools \(get_weather, get_time\)", "tool_choice"),
        ({"tool_choice": "required"}, r"tool_choice: set tools", "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         r"cannot be combined with response_format", "tool_choice"),
        ({"tools": TOOLS + TOOLS[:1]}, r"tools\[2\]\.function\.name: 'get_weather' is offered twice", "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, r"tools\[0\]\.function\.name", "tools"),
        ({"tools": [{"type": "function", "function": {"name": "u", "parameters": {
            "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}],
          "tool_choice": "required"}, r"tools\[0\]\.function\.parameters: .*uniqueItems", "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, r"tool_choice", "tool_choice"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
         r"messages\[0\]\.tool_calls: only assistant messages", "messages"),
    ]
    for extra, message, param in cases:
        r = httpx.post(f"{url}chat/completions", json={"model": "m", "messages": ASK, "max_tokens": 5, **extra},
                       timeout=10)
        assert r.status_code == 400, (extra, r.text)
        assert re.search(message, r.json()["error"]["message"]), r.json()
        assert r.json()["error"]["param"] == param
    assert client.chat.completions.create(model="m", messages=ASK, max_tokens=5).choices[0].message.content == "Hello"


def test_call_arguments_too_deep_for_json_go_back_to_the_template_as_text(scripted):
    client = scripted("Hello")
    deep = "[" * 1100 + "]" * 1100
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": deep}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    out = client.chat.completions.create(model="m", messages=messages, max_tokens=5)
    assert out.choices[0].message.content == "Hello"
    r = httpx.post(str(client.base_url).removesuffix("v1/") + "tokenize", json={"messages": messages}, timeout=10)
    assert r.status_code == 200, r.text
    assert json.dumps(deep) in bytes(t for t in r.json()["tokens"] if t < 256).decode()


def test_a_server_without_a_tool_parser_refuses_tools_unless_choice_is_none(scripted):
    client = scripted("Hello", tool_parser="none")
    with pytest.raises(openai.BadRequestError, match="model.tool_parser: none"):
        client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=5)
    out = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=5)
    assert out.choices[0].message.content == "Hello"


# ---- over real engines: forced calls and the round trip ---------------------------------------------------------

@pytest.fixture(scope="module")
def engines(loop_thread, tiny_model_dir):
    cluster = EngineCluster(tiny_model_dir, loop_thread)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def qwen(engines):
    """A router with Qwen2.5's chat template (hermes, detected) over the real engines."""
    server = engines.serve(chat_template=ChatTemplate(QWEN25_TEMPLATE))
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="x", max_retries=0, timeout=60)
    yield server, client
    client.close()


def _check_calls(calls, names=SCHEMAS) -> None:
    for call in calls:
        assert call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_choices_force_valid_calls(qwen):
    """A random-weight model calls a tool with valid arguments: one call (parallel off), one or more (on), the
    named function; greedy and seeded."""
    _, client = qwen
    common = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=300)
    seeds = [dict(temperature=0.0)] + [dict(temperature=1.0, seed=s) for s in range(3)]
    for sampling in seeds:
        one = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **common, **sampling)
        [choice] = one.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls)
        named = client.chat.completions.create(
            tool_choice={"type": "function", "function": {"name": "get_time"}}, **common, **sampling)
        assert named.choices[0].finish_reason == "tool_calls"
        assert {c.function.name for c in named.choices[0].message.tool_calls} == {"get_time"}
        _check_calls(named.choices[0].message.tool_calls)
    many = client.chat.completions.create(tool_choice="required", n=4, seed=5, temperature=1.0, **common)
    for choice in many.choices:     # one call after another until the model stops (or max_tokens cuts the last)
        calls = choice.message.tool_calls
        assert calls and choice.finish_reason in ("tool_calls", "length")
        _check_calls(calls if choice.finish_reason == "tool_calls" else calls[:-1])
    assert any(len(c.message.tool_calls) > 1 for c in many.choices)


def test_sdk_round_trip_with_parsed_arguments(qwen):
    """parse() with strict pydantic tools → a call with parsed arguments → the assistant message and a tool
    result go back (through the template: /tokenize shows them) → a final answer."""
    server, client = qwen
    first = client.chat.completions.parse(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=300, seed=2, temperature=0.8)
    message = first.choices[0].message
    [call] = message.tool_calls
    assert isinstance(call.function.parsed_arguments, (GetWeather, GetTime))
    conversation = [*ASK, message, {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"}]
    final = client.chat.completions.create(model="tiny", messages=conversation, tools=TOOLS, max_tokens=8,
                                           temperature=0.0)
    assert final.choices[0].message.role == "assistant" and final.choices[0].finish_reason in ("stop", "length")
    body = {"model": "tiny", "tools": TOOLS,
            "messages": [*ASK, message.model_dump(exclude_unset=True), conversation[-1]]}
    tokens = httpx.post(server.http_url + "/tokenize", json=body, timeout=10).json()["tokens"]
    prompt = httpx.post(server.http_url + "/detokenize", json={"tokens": tokens}, timeout=10).json()["prompt"]
    arguments = json.dumps(json.loads(call.function.arguments), ensure_ascii=False)
    assert f'<tool_call>\n{{"name": "{call.function.name}", "arguments": {arguments}}}\n</tool_call>' in prompt
    assert "<tool_response>\n21 C, sunny\n</tool_response>" in prompt


def test_auto_call_in_generated_text_whole_and_streamed_alike(qwen):
    """A model whose text holds a Hermes call (here forced by guided_regex): auto parses it; the same seeded
    request streamed through the SDK's stream helper reassembles to the same call."""
    _, client = qwen
    regex = (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
             r'\{"city": "[a-z]{1,8}", "unit": "[cf]"\}\}\n</tool_call>')
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=120, temperature=0.9, seed=4,
                  extra_body={"guided_regex": regex})
    whole = client.chat.completions.create(**kwargs)
    [choice] = whole.choices
    assert choice.message.content == "Checking." and choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    _check_calls([call])
    with client.chat.completions.stream(**kwargs) as stream:
        contents = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert "".join(contents) == "Checking."
    [streamed] = final.choices[0].message.tool_calls
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert final.choices[0].finish_reason == "tool_calls"


def test_llama3_json_calls_are_forced_in_its_format(engines):
    server = engines.serve(chat_template=ChatTemplate(DEFAULT_CHAT_TEMPLATE), tool_parser="llama3_json")
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                             max_tokens=300, seed=1, temperature=1.0, logprobs=True)
    [choice] = out.choices
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    _check_calls(choice.message.tool_calls)
    text = "".join(t.token for t in choice.logprobs.content)           # what the model wrote: the bare JSON
    assert text.startswith('{"name": "') and "<tool_call>" not in text


@pytest.mark.parametrize("special", [True, False], ids=["special-tags", "plain-tags"])
def test_special_call_tags_are_kept_in_the_text_the_parser_reads(tmp_path, tiny_model_dir, special):
    """A tokenizer that holds <tool_call> as one special token would drop it from the decoded reply
    (skip_special_tokens): a request with tools then decodes keeping special tokens, unless it says
    otherwise or asks for no calls."""
    import shutil

    from tokenizers import Tokenizer as HFTokenizer

    from engine.tokenizer import Tokenizer
    from router.openai_api.inputs import chat_input
    from router.openai_api.protocol import ChatCompletionRequest
    from router.openai_api.tools import tool_request
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    if special:
        hf = HFTokenizer.from_file(str(model / "tokenizer.json"))
        hf.add_special_tokens(["<tool_call>", "</tool_call>"])
        hf.save(str(model / "tokenizer.json"))
    tokenizer = Tokenizer(str(model))
    assert FORMATS["hermes"].tags_are_special(tokenizer) is special
    tool = {"type": "function", "function": {"name": "get_time", "parameters": SCHEMAS["get_time"]}}

    def skip(**extra):
        body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Time?"}], max_tokens=8,
                                     **extra)
        inp = chat_input(body, ChatTemplate(DEFAULT_CHAT_TEMPLATE), tokenizer, 4096, {}, "r", (),
                         tool_request(body, FORMATS["hermes"]))
        return inp.params.skip_special_tokens
    assert skip(tools=[tool]) is not special
    assert skip(tools=[tool], tool_choice="none") is True
    assert skip(tools=[tool], skip_special_tokens=True) is True
    assert skip() is True
    reply = tokenizer.decode(tokenizer.encode('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
                                              add_special_tokens=False), skip_special_tokens=skip(tools=[tool]))
    _, calls = HermesParser(["get_time"]).parse(reply)
    assert [c.name for c in calls] == ["get_time"]
