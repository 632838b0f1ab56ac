"""Reasoning output and the tool-call formats of model families through the HTTP gateway,
driven by the unmodified `openai` package and LangChain's ChatOpenAI, on a real cluster with
the default model (SmolLM2-135M-Instruct) served with Qwen3's chat template
(`model.chat_template: .../Qwen-Qwen3-0.6B.jinja`, from scripts/setup's llama.cpp templates):
a `<think>` template whose tools are Hermes-style. Other families come in as a request's
chat_template (Llama 3.2, Mistral Nemo, Mistral Small 3.2, gpt-oss): the gateway detects each
one's format from the template (docs/models.md "Reasoning and tool-call formats").

SmolLM2 writes none of these markups by itself, so the calls are produced by tool_choice
"required" / a named function, whose grammar is in each family's own markup; the reasoning
split is checked against the raw text of the same greedy request rendered by a template that
differs only in a comment (so without reasoning parsing), split here by the documented rule.
"""
import json
import os

import pytest

from conftest import http_cluster, openai_client

import openai
import jsonschema

TEMPLATES = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                         "tandem", "templates")
QWEN3 = os.path.join(TEMPLATES, "Qwen-Qwen3-0.6B.jinja")
QUESTION = "What is the weather in Paris?"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                 "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False},
    },
}
TOOLS = [WEATHER, TIME]

# ChatML as SmolLM2 writes it; THINKING differs only in a comment naming the think tags, which
# makes the gateway parse reasoning (the rendered prompt is byte for byte the same)
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
THINKING = CHATML + "{# <think> </think> #}"
# the generation prompt opens the reasoning (DeepSeek-R1's way); R1_LIKE names the closing tag,
# so the gateway parses it, R1_OPEN does not
R1_OPEN = CHATML.replace("<|im_start|>assistant\n{% endif %}",
                         "<|im_start|>assistant\n<think>\n{% endif %}")
R1_LIKE = R1_OPEN + "{# </think> #}"
FEW_SHOT = [
    {"role": "user", "content": "Say A."},
    {"role": "assistant", "content": "<think>\nThe user wants the letter A.\n</think>\n\nA"},
    {"role": "user", "content": "Say B."},
    {"role": "assistant", "content": "<think>\nThe user wants the letter B.\n</think>\n\nB"},
    {"role": "user", "content": "Say C."},
]


def template(name):
    path = os.path.join(TEMPLATES, name)
    if not os.path.exists(path):
        pytest.skip(f"{path} is missing (scripts/setup installs llama.cpp's chat templates)")
    with open(path, encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not os.path.exists(QWEN3):
        pytest.skip(f"{QWEN3} is missing (scripts/setup installs llama.cpp's chat templates)")
    yield from http_cluster(tmp_path_factory, "reasoning", chat_template=QWEN3)


@pytest.fixture(scope="module")
def oai(cluster):
    yield from openai_client(cluster, timeout=300)


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def split_optional(text):
    """The Qwen3 rule of docs/api.md "Reasoning", written independently of the C code."""
    s = text.lstrip(" \t\r\n")
    if not s.startswith("<think>"):
        return "", s
    rest = s[len("<think>"):].lstrip(" \t\r\n")
    end = rest.find("</think>")
    if end < 0:
        return rest, ""
    return rest[:end], rest[end + len("</think>"):].lstrip(" \t\r\n")


def split_inside(text):
    """The DeepSeek-R1 rule: the output begins inside the reasoning."""
    s = text.lstrip(" \t\r\n")
    if s.startswith("<think>"):
        s = s[len("<think>"):].lstrip(" \t\r\n")
    end = s.find("</think>")
    if end < 0:
        return s, ""
    return s[:end], s[end + len("</think>"):].lstrip(" \t\r\n")


def reasoning_of(message):
    # the openai package keeps fields it does not model as extras
    return getattr(message, "reasoning_content", None) or \
        (message.model_extra or {}).get("reasoning_content")


def check_call(call, tools):
    fn = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, fn["parameters"])
    return args


# ---- reasoning ----

def test_reasoning_is_split_as_the_rule_says(oai, model):
    kw = dict(model=model, messages=FEW_SHOT, max_tokens=40, temperature=0)
    raw = oai.chat.completions.create(extra_body={"chat_template": CHATML}, **kw)
    text = raw.choices[0].message.content
    assert reasoning_of(raw.choices[0].message) is None
    assert "</think>" in text, text  # the few-shot pattern is followed
    want_r, want_c = split_optional(text)
    r = oai.chat.completions.create(extra_body={"chat_template": THINKING}, **kw)
    msg = r.choices[0].message
    assert reasoning_of(msg) == (want_r or None), (text, msg)
    assert (msg.content or "") == want_c
    assert r.usage.completion_tokens == raw.usage.completion_tokens
    # streamed: reasoning_content deltas, then content deltas, reassemble to the same
    got_r, got_c, order = "", "", []
    for ch in oai.chat.completions.create(extra_body={"chat_template": THINKING}, stream=True,
                                          **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        rc = (d.model_extra or {}).get("reasoning_content")
        if rc:
            got_r += rc
            order.append("r")
        if d.content:
            got_c += d.content
            order.append("c")
    assert (got_r, got_c) == (want_r, want_c)
    assert order == sorted(order, reverse=True)  # no reasoning after the content began
    # include_reasoning false (vLLM): the reasoning is left out, the answer kept
    r = oai.chat.completions.create(extra_body={"chat_template": THINKING,
                                                "include_reasoning": False}, **kw)
    assert reasoning_of(r.choices[0].message) is None
    assert (r.choices[0].message.content or "") == want_c


def test_deepseek_r1_output_begins_inside_the_reasoning(oai, model):
    # the generation prompt ends "<think>\n": everything up to "</think>" is reasoning
    msgs = [{"role": "user", "content": "Count from one to ten."}]
    kw = dict(model=model, messages=msgs, max_tokens=24, temperature=0)
    raw = oai.chat.completions.create(extra_body={"chat_template": R1_OPEN}, **kw)
    text = raw.choices[0].message.content
    r = oai.chat.completions.create(extra_body={"chat_template": R1_LIKE}, **kw)
    want_r, want_c = split_inside(text)
    assert reasoning_of(r.choices[0].message) == (want_r or None)
    assert (r.choices[0].message.content or "") == want_c
    if "</think>" not in text:  # never closed: all of it is reasoning, content null
        assert r.choices[0].message.content is None and reasoning_of(r.choices[0].message)


def test_structured_output_comes_after_the_reasoning(oai, model):
    # the grammar lets a reasoning section opened by "<think>" run to "</think>", then the JSON
    # schema applies
    schema = {"type": "object", "properties": {"letter": {"type": "string", "maxLength": 3}},
              "required": ["letter"], "additionalProperties": False}
    r = oai.chat.completions.create(
        model=model, messages=FEW_SHOT, max_tokens=200, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "l", "schema": schema}},
        extra_body={"chat_template": THINKING})
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop", r
    jsonschema.validate(json.loads(msg.content), schema)
    assert "</think>" not in msg.content and "<think>" not in msg.content
    if reasoning_of(msg):
        assert "</think>" not in reasoning_of(msg)


def test_qwen3_template_with_thinking_off(oai, model):
    # enable_thinking false: the prompt holds an empty think block; the output is content
    r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}],
                                    max_tokens=8, temperature=0,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reasoning_of(r.choices[0].message) is None
    assert r.choices[0].message.content


def test_reasoning_effort_is_passed_or_refused(oai, model):
    msgs = [{"role": "user", "content": "Hi!"}]
    # Qwen3's template does not read it: 400 naming the field
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=msgs, max_tokens=4,
                                    reasoning_effort="high")
    assert e.value.body["param"] == "reasoning_effort", e.value.body
    assert "does not read reasoning_effort" in e.value.body["message"]
    # gpt-oss's does: the template renders it ("Reasoning: high")
    gpt_oss = template("openai-gpt-oss-120b.jinja")
    r = oai.chat.completions.create(model=model, messages=msgs, max_tokens=4,
                                    reasoning_effort="high",
                                    extra_body={"chat_template": gpt_oss})
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=msgs, max_tokens=4,
                                    extra_body={"reasoning_effort": "extreme",
                                                "chat_template": gpt_oss})
    assert e.value.body["param"] == "reasoning_effort"


# ---- tool calls per family ----

FAMILIES = {
    "qwen3-hermes": None,  # the cluster's template
    "llama3.2-json": "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "mistral-nemo": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "mistral-small-3.2-args": "Mistral-Small-3.2-24B-Instruct-2506.jinja",
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_required_calls_per_family(oai, model, family):
    extra = {"chat_template": template(FAMILIES[family])} if FAMILIES[family] else {}
    msgs = [{"role": "user", "content": QUESTION}]
    kw = dict(model=model, messages=msgs, tools=TOOLS, max_tokens=400, extra_body=extra)
    # default parallel_tool_calls: the grammar ends after at most 8 calls, so the run ends
    # with the calls, never by running into max_tokens
    for sampling in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        r = oai.chat.completions.create(tool_choice="required", **kw, **sampling)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        assert 1 <= len(c.message.tool_calls) <= 8 and c.message.content is None
        for call in c.message.tool_calls:
            check_call(call, TOOLS)
        if family.startswith("mistral"):
            assert all(len(call.id) == 9 and call.id.isalnum() for call in c.message.tool_calls)
    # a named function: exactly that one call
    named = {"type": "function", "function": {"name": "get_time"}}
    r = oai.chat.completions.create(tool_choice=named, temperature=0, **kw)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_time"
    check_call(calls[0], TOOLS)
    # streamed: the deltas reassemble to the same calls
    kw["parallel_tool_calls"] = False
    whole = oai.chat.completions.create(tool_choice="required", temperature=0, **kw)
    got = {}
    finish = None
    for ch in oai.chat.completions.create(tool_choice="required", temperature=0, stream=True,
                                          **kw):
        if not ch.choices:
            continue
        finish = ch.choices[0].finish_reason or finish
        for d in ch.choices[0].delta.tool_calls or []:
            g = got.setdefault(d.index, {"name": None, "arguments": ""})
            if d.function.name:
                g["name"] = d.function.name
            g["arguments"] += d.function.arguments or ""
    want = whole.choices[0].message.tool_calls
    assert finish == whole.choices[0].finish_reason == "tool_calls"
    assert len(want) == 1 and [got[i]["name"] for i in sorted(got)] == [want[0].function.name]
    assert json.loads(got[0]["arguments"]) == json.loads(want[0].function.arguments)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_langchain_round_trip_per_family(cluster, model, family):
    import langchain_openai as lc  # pinned by scripts/setup; missing, the test fails (never skips)
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    extra = {"chat_template": template(FAMILIES[family])} if FAMILIES[family] else {}
    llm = lc.ChatOpenAI(base_url=f"http://127.0.0.1:{cluster.port}/v1", api_key="unused",
                        model=model, temperature=0, max_tokens=200, max_retries=0, timeout=300,
                        extra_body=extra)
    bound = llm.bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False)
    first = bound.invoke([HumanMessage(QUESTION)])
    assert isinstance(first, AIMessage) and len(first.tool_calls) == 1, first
    call = first.tool_calls[0]
    assert call["name"] in ("get_weather", "get_time") and isinstance(call["args"]["city"], str)
    # the call goes back in the history with its result, as LangChain sends it; the family's
    # template renders it (Mistral's checks the 9-character id)
    reply = llm.bind_tools(TOOLS).invoke([HumanMessage(QUESTION), first,
                                          ToolMessage(content="22 C, sunny",
                                                      tool_call_id=call["id"])])
    assert isinstance(reply, AIMessage)


def test_reasoning_of_past_turns_reaches_the_template(oai, model):
    # an assistant message's reasoning_content goes to the template (protocol 2.2): a template
    # that renders it sees more prompt tokens; the Qwen3 template drops it for past turns
    reads = ("{% for m in messages %}{{ m.content }}{{ m.reasoning_content or '' }}\n{% endfor %}")
    msgs = [{"role": "user", "content": "Say A."},
            {"role": "assistant", "content": "A", "reasoning_content": "The user wants A."},
            {"role": "user", "content": "Say B."}]
    bare = [dict(m) for m in msgs]
    del bare[1]["reasoning_content"]
    with_r = oai.chat.completions.create(model=model, messages=msgs, max_tokens=1,
                                         extra_body={"chat_template": reads})
    without = oai.chat.completions.create(model=model, messages=bare, max_tokens=1,
                                          extra_body={"chat_template": reads})
    assert with_r.usage.prompt_tokens > without.usage.prompt_tokens + 3
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, max_tokens=1, messages=[
            {"role": "user", "content": "x", "reasoning_content": "y"}])
    assert e.value.body["param"] == "messages[0].reasoning_content"


def test_mistral_format_keeps_control_tokens_text(oai, model):
    # Mistral's [TOOL_CALLS] is a control token in its own vocabulary, so with its format the
    # gateway asks for control tokens' text (GenerateRequest.render_special); SmolLM2's
    # <|im_start|> (id 1, a control token) shows the plumbing: forced by logit_bias, its text is
    # kept with Mistral tools and left out otherwise; the end of generation adds none either way
    kw = dict(model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=3,
              temperature=0, logit_bias={"1": 100})
    nemo = template("mistralai-Mistral-Nemo-Instruct-2407.jinja")
    r = oai.chat.completions.create(tools=TOOLS, extra_body={"chat_template": nemo}, **kw)
    assert r.choices[0].message.content == "<|im_start|>" * 3, r
    assert not r.choices[0].message.tool_calls
    r = oai.chat.completions.create(extra_body={"chat_template": nemo}, **kw)
    assert r.choices[0].message.content == "", r
