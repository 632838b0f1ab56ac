"""OpenAI tool calling through the router's HTTP gateway, driven by the unmodified `openai`
package (and LangChain's ChatOpenAI when langchain-openai is in the venv) against a real
cluster with the default model (SmolLM2-135M-Instruct, a ChatML model) served with the
built-in `chatml` template (`model.chat_template: chatml`): tools are rendered in the Hermes
format, docs/api.md "Tool calling", with SmolLM2's default system message when a chat has
none. (SmolLM2's own GGUF template, the default otherwise, never names `tools`: Tandem then
writes them into the messages in the same format, without that default system message;
test_chat_template.py checks it.)

The prompt is checked token for token: the test renders the Hermes text itself and counts its
tokens with `tandem tokenize --special`, and the greedy answer equals `tandem generate -m
--chat … --tools FILE`. tool_choice "required" / a named function are grammar-constrained
(tdm_json_schema_to_gbnf_rule and the engine's masks): every call returned is valid JSON that
matches the function's parameters (checked with jsonschema).
"""
import json
import os
import subprocess

import pytest

from conftest import BINARIES, MODEL, http_cluster, openai_client, reference

try:
    import openai
except ImportError:  # pragma: no cover - a setup problem, reported as a failure
    pytest.fail("the `openai` package is missing: run scripts/setup", pytrace=False)

import jsonschema

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QUESTION = "What is the weather in Paris?"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False},
    },
}
TOOLS = [WEATHER, TIME]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from http_cluster(tmp_path_factory, "tools", chat_template="chatml")


@pytest.fixture(scope="module")
def oai(cluster):
    yield from openai_client(cluster, timeout=300)


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


@pytest.fixture(scope="module")
def grammar(oai, model):
    """tool_choice "required" is accepted (the grammar path is in the build)."""
    r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                    tools=TOOLS, tool_choice="required", max_tokens=1)
    assert r.choices[0].finish_reason == "length"
    return True


# ---- the Hermes rendering, written independently of the C code ----

def tool_json(tool):
    """A tool as the gateway forwards it (name, description, parameters) and Jinja's tojson
    writes it."""
    fn = tool["function"]
    norm = {"name": fn["name"]}
    for k in ("description", "parameters"):
        if k in fn:
            norm[k] = fn[k]
    return json.dumps({"type": "function", "function": norm}, ensure_ascii=False)


def hermes_prompt(messages, tools):
    sys_text = DEFAULT_SYSTEM
    if messages and messages[0]["role"] == "system":
        sys_text, messages = messages[0]["content"], messages[1:]
    out = "<|im_start|>system\n" + sys_text
    if tools:
        out += ("\n\n# Tools\n\nYou may call one or more functions to assist with the user "
                "query.\n\nYou are provided with function signatures within <tools></tools> XML "
                "tags:\n<tools>")
        out += "".join("\n" + tool_json(t) for t in tools)
        out += ("\n</tools>\n\nFor each function call, return a json object with function name "
                "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")
    out += "<|im_end|>\n"
    i = 0
    while i < len(messages):
        m = messages[i]
        if m["role"] == "tool":
            out += "<|im_start|>user"
            while i < len(messages) and messages[i]["role"] == "tool":
                out += "\n<tool_response>\n" + messages[i]["content"] + "\n</tool_response>"
                i += 1
            out += "<|im_end|>\n"
            continue
        if m.get("tool_calls"):
            out += "<|im_start|>assistant" + ("\n" + m["content"] if m.get("content") else "")
            for c in m["tool_calls"]:
                args = json.dumps(json.loads(c["function"]["arguments"]), ensure_ascii=False)
                out += ("\n<tool_call>\n{\"name\": \"" + c["function"]["name"] +
                        "\", \"arguments\": " + args + "}\n</tool_call>")
            out += "<|im_end|>\n"
        else:
            out += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
        i += 1
    return out + "<|im_start|>assistant\n"


def count_tokens(text, tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_bytes(text.encode("utf-8"))
    out = subprocess.run([BINARIES["tandem"], "tokenize", "-m", MODEL, "--special", "-f",
                          str(path)], capture_output=True, check=True)
    return len(out.stdout.split())


ROUND_TRIP = [
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_time", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "14:05"}]},
]


def flat(messages):
    """messages with content parts joined (as the gateway joins them)."""
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(p["text"] for p in m["content"])
        out.append(m)
    return out


# ---- tests ----

def test_prompt_renders_tools_calls_and_results(oai, model, tmp_path):
    # the tools in the system message, the assistant's calls and the tool results: exactly the
    # Hermes text, token for token
    for messages, tools in [([{"role": "user", "content": QUESTION}], TOOLS),
                            (ROUND_TRIP, TOOLS), (ROUND_TRIP, None)]:
        r = oai.chat.completions.create(model=model, messages=messages, tools=tools,
                                        max_tokens=8, temperature=0)
        want = count_tokens(hermes_prompt(flat(messages), tools), tmp_path)
        assert r.usage.prompt_tokens == want, (messages, tools)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_auto_and_none_answer_as_the_single_process(oai, model, tmp_path):
    # the greedy answer equals `tandem generate -m --chat --tools`; tool_choice none renders
    # the tools too (OpenAI / vLLM) and only skips the parsing
    tools_file = tmp_path / "tools.json"
    tools_file.write_text(json.dumps([json.loads(tool_json(t)) for t in TOOLS]))
    ref = reference(chat=QUESTION, max_tokens=40,
                    extra=["--tools", str(tools_file), "--chat-template", "chatml"])
    msgs = [{"role": "user", "content": QUESTION}]
    none = oai.chat.completions.create(model=model, messages=msgs, tools=TOOLS,
                                       tool_choice="none", max_tokens=40, temperature=0)
    assert none.choices[0].message.content == ref
    assert none.choices[0].message.tool_calls is None
    auto = oai.chat.completions.create(model=model, messages=msgs, tools=TOOLS,
                                       max_tokens=40, temperature=0)
    assert auto.usage.prompt_tokens == none.usage.prompt_tokens
    if "<tool_call>" not in ref:  # this model answers in words here: nothing to parse
        assert auto.choices[0].message.content == ref
        assert auto.choices[0].message.tool_calls is None
        assert auto.choices[0].finish_reason == none.choices[0].finish_reason
    # streamed: the same content, chunk by chunk
    chunks = list(oai.chat.completions.create(model=model, messages=msgs, tools=TOOLS,
                                              max_tokens=40, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (auto.choices[0].message.content or "")
    assert chunks[-1].choices[0].finish_reason == auto.choices[0].finish_reason


def test_round_trip_with_a_tool_reply(oai, model):
    r = oai.chat.completions.create(model=model, messages=ROUND_TRIP, tools=TOOLS,
                                    max_tokens=24, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the legacy functions / function_call and role "function" are the same request
    legacy = [ROUND_TRIP[0],
              {"role": "assistant", "content": None,
               "function_call": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
              {"role": "function", "name": "get_weather", "content": "22 C, sunny"}]
    modern = [ROUND_TRIP[0],
              {"role": "assistant", "content": None, "tool_calls": [ROUND_TRIP[1]["tool_calls"][0]]},
              {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}]
    a = oai.chat.completions.create(model=model, messages=legacy,
                                    functions=[t["function"] for t in TOOLS], max_tokens=16,
                                    temperature=0)
    b = oai.chat.completions.create(model=model, messages=modern, tools=TOOLS, max_tokens=16,
                                    temperature=0)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    assert a.choices[0].message.content == b.choices[0].message.content


def test_bad_tool_requests_name_the_field(oai, model):
    msgs = [{"role": "user", "content": "hi"}]
    bad_name = [WEATHER, {"type": "function", "function": {"name": "no spaces allowed"}}]
    cases = [
        (dict(tools=bad_name), "tools[1].function.name"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice"),
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
        (dict(tools=TOOLS, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object"}}}), "response_format"),
        (dict(tools=TOOLS, parallel_tool_calls="yes"), "parallel_tool_calls"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=model, messages=msgs, max_tokens=4, **kw)
        assert e.value.status_code == 400 and e.value.param == param, (kw, e.value)
        assert param.split("[")[0] in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, max_tokens=4, messages=[
            {"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}])
    assert e.value.param == "messages[1].tool_call_id"


def check_call(call, tools):
    assert call.type == "function" and call.id.startswith("call_")
    fn = {t["function"]["name"]: t["function"] for t in tools}[call.function.name]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, fn["parameters"])
    return args


def test_required_and_named_calls_are_constrained(oai, model, grammar):
    msgs = [{"role": "user", "content": QUESTION}]
    for seed in (None, 1, 2):
        # greedy: room for the 8 calls the grammar allows at most (SmolLM2 repeats its call;
        # 8 take about 460 tokens)
        kw = dict(temperature=0, max_tokens=1000) if seed is None else \
            dict(temperature=1.0, seed=seed, max_tokens=200)
        r = oai.chat.completions.create(model=model, messages=msgs, tools=TOOLS,
                                        tool_choice="required", **kw)
        c = r.choices[0]
        # the grammar ends after at most 8 calls: greedy SmolLM2 used to repeat its call until
        # max_tokens and now ends with the calls (sampled runs may still be cut inside a call:
        # get_weather's schema allows any extra property)
        assert c.finish_reason in ("tool_calls", "length"), c
        if seed is None:
            assert c.finish_reason == "tool_calls", c
        if c.finish_reason == "tool_calls":
            assert 1 <= len(c.message.tool_calls) <= 8 and c.message.content is None
        # every call returned before a cut at max_tokens is whole and valid; a call cut inside
        # its arguments is the last, with the arguments generated so far (as streamed)
        calls = c.message.tool_calls or []
        for k, call in enumerate(calls):
            if k == len(calls) - 1 and c.finish_reason == "length":
                assert call.function.name in ("get_weather", "get_time"), call
                continue
            check_call(call, TOOLS)
        assert not c.message.content, c
    named = {"type": "function", "function": {"name": "get_time"}}
    r = oai.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice=named,
                                    parallel_tool_calls=False, max_tokens=200, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_time"
    assert "city" in check_call(calls[0], TOOLS)


def test_streamed_tool_call_deltas_reassemble(oai, model, grammar):
    # one call (parallel_tool_calls false): the grammar ends the output after it, so the run
    # finishes with tool_calls whatever the model would have gone on to call
    msgs = [{"role": "user", "content": QUESTION}]
    kw = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=200,
              temperature=0)
    whole = oai.chat.completions.create(model=model, messages=msgs, **kw)
    chunks = list(oai.chat.completions.create(model=model, messages=msgs, stream=True, **kw))
    calls = {}
    for ch in chunks:
        for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            c = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert c["id"] is None
                c["id"], c["name"] = d.id, d.function.name
            c["arguments"] += d.function.arguments or ""
    finish = whole.choices[0].finish_reason
    assert chunks[-1].choices[0].finish_reason == finish == "tool_calls", whole
    want = whole.choices[0].message.tool_calls
    assert [calls[i]["name"] for i in sorted(calls)] == [c.function.name for c in want]
    for i, c in enumerate(want):
        assert json.loads(calls[i]["arguments"]) == json.loads(c.function.arguments)


def streamed_calls(chunks):
    """The calls (name, arguments) and content reassembled from streamed chunks, and the
    finish reason."""
    calls, content, finish = {}, "", None
    for ch in chunks:
        if not ch.choices:
            continue
        choice = ch.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"name": None, "arguments": ""})
            if d.function.name:
                c["name"] = d.function.name
            c["arguments"] += d.function.arguments or ""
    return [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], content, finish


def test_call_cut_by_max_tokens_is_not_content(oai, model, grammar):
    # required with parallel calls, greedy: SmolLM2 repeats its call; max_tokens just past the
    # first call cuts the second one (in its tag, name or arguments). The whole first call is
    # in tool_calls, none of the cut call's markup is content, finish_reason stays "length",
    # and the stream says the same (a constrained call cut inside its arguments keeps the
    # arguments streamed so far, both ways: docs/api.md "Tool calling")
    msgs = [{"role": "user", "content": QUESTION}]
    kw = dict(tools=TOOLS, tool_choice="required", temperature=0)
    one = oai.chat.completions.create(model=model, messages=msgs, parallel_tool_calls=False,
                                      max_tokens=200, **kw)
    assert one.choices[0].finish_reason == "tool_calls", one
    first = one.choices[0].message.tool_calls[0]
    t1 = one.usage.completion_tokens
    for extra in (2, 6, 12, 20, 35):
        n = t1 + extra
        r = oai.chat.completions.create(model=model, messages=msgs, max_tokens=n, **kw)
        c = r.choices[0]
        assert c.finish_reason == "length" and r.usage.completion_tokens == n, (extra, c)
        assert not c.message.content, (extra, c.message.content)  # no raw <tool_call> text
        got = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
        assert got[0] == (first.function.name, first.function.arguments), (extra, got)
        for call in c.message.tool_calls[:-1]:
            check_call(call, TOOLS)
        chunks = list(oai.chat.completions.create(model=model, messages=msgs, max_tokens=n,
                                                  stream=True, **kw))
        s_calls, s_content, s_finish = streamed_calls(chunks)
        assert (s_calls, s_content, s_finish) == (got, "", "length"), (extra, s_calls, got)
    # the Responses API: the first call as a function_call item, no message with the markup
    flat_tools = [dict(type="function", **t["function"]) for t in TOOLS]
    r = oai.responses.create(model=model, input=QUESTION, tools=flat_tools,
                             tool_choice="required", max_output_tokens=t1 + 6, temperature=0)
    assert r.status == "incomplete", r
    assert [o.type for o in r.output if o.type != "function_call"] == [], r.output
    assert r.output[0].name == first.function.name, r.output


# ---- LangChain ----

def chat_model(cluster, model):
    lc = pytest.importorskip("langchain_openai",
                             reason="langchain-openai is not in the venv (scripts/setup pins it)")
    return lc.ChatOpenAI(base_url=f"http://127.0.0.1:{cluster.port}/v1", api_key="unused",
                         model=model, temperature=0, max_tokens=64, max_retries=0, timeout=300)


def test_langchain_bind_tools_round_trip(cluster, model):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    llm = chat_model(cluster, model)
    bound = llm.bind_tools(TOOLS)
    first = bound.invoke([HumanMessage(QUESTION)])
    assert isinstance(first, AIMessage)
    # the reply of a tool, sent back as LangChain does it
    call = {"name": "get_weather", "args": {"city": "Paris"}, "id": "call_1", "type": "tool_call"}
    reply = bound.invoke([HumanMessage(QUESTION), AIMessage(content="", tool_calls=[call]),
                          ToolMessage(content="22 C, sunny", tool_call_id="call_1")])
    assert isinstance(reply, AIMessage) and isinstance(reply.content, str)


def test_langchain_required_and_structured_output(cluster, model, grammar):
    from langchain_core.messages import HumanMessage
    from pydantic import BaseModel
    llm = chat_model(cluster, model)
    msg = llm.bind_tools(TOOLS, tool_choice="required").invoke([HumanMessage(QUESTION)])
    assert msg.tool_calls and msg.tool_calls[0]["name"] in ("get_weather", "get_time")

    class Weather(BaseModel):
        city: str
        celsius: int

    out = llm.with_structured_output(Weather, method="function_calling").invoke(QUESTION)
    assert isinstance(out, Weather)


def test_langchain_structured_output_json_schema_and_json_mode(cluster, model, grammar):
    # with_structured_output's other two methods: response_format json_schema (LangChain parses
    # it into the model) and json_mode (response_format json_object, parsed as a dict)
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=24)
        country: str = Field(max_length=24)

    lc = chat_model(cluster, model)
    lc.max_tokens = 200
    out = lc.with_structured_output(City, method="json_schema").invoke(
        "Describe Paris as JSON with its name and country.")
    assert isinstance(out, City) and out.name and out.country
    got = lc.with_structured_output(method="json_mode").invoke(
        "Return a JSON object with the keys name and country for Paris.")
    assert isinstance(got, dict)
