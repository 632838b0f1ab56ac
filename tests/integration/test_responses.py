"""OpenAI's Responses API (/v1/responses) through the router's HTTP gateway, driven by the
unmodified `openai` package and the `openai-agents` SDK against a real cluster with the default
model (SmolLM2-135M-Instruct) and the built-in `chatml` template (tools in the Hermes format).

/v1/responses is a front of the chat path: every answer here is compared with the chat
completion of the same conversation (greedy, so equal text and equal prompt tokens), streamed
and not; tool calls are forced (tool_choice "required" or a named function: the grammar path)
so the round trip asserts real calls, not the small model's luck. The store is per router:
previous_response_id, GET and DELETE; with two routers the other one answers 404 saying so.
"""
import json
import os

import pytest

from conftest import http_cluster, openai_client

try:
    import openai
except ImportError:  # pragma: no cover - a setup problem, reported as a failure
    pytest.fail("the `openai` package is missing: run scripts/setup", pytrace=False)

import jsonschema

QUESTION = "What is the weather in Paris?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"],
    },
}


def chat_tool(t):
    return {"type": "function", "function": {k: t[k] for k in ("name", "description",
                                                                "parameters")}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from http_cluster(tmp_path_factory, "responses", chat_template="chatml")


@pytest.fixture(scope="module")
def oai(cluster):
    yield from openai_client(cluster, timeout=300)


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def chat_text(oai, model, messages, n, **kw):
    r = oai.chat.completions.create(model=model, messages=messages, max_tokens=n, temperature=0,
                                    **kw)
    return r


def message_text(resp):
    items = [o for o in resp.output if o.type == "message"]
    assert len(items) == 1, resp.output
    return "".join(c.text for c in items[0].content if c.type == "output_text")


def test_string_input_answers_as_chat(oai, model):
    r = oai.responses.create(model=model, input="Name a colour.", max_output_tokens=12,
                             temperature=0)
    c = chat_text(oai, model, [{"role": "user", "content": "Name a colour."}], 12)
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.model == model
    assert r.output_text == c.choices[0].message.content
    assert message_text(r) == r.output_text
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    want = "incomplete" if c.choices[0].finish_reason == "length" else "completed"
    assert r.status == want
    msg = r.output[0]
    assert msg.role == "assistant" and msg.id.startswith("msg_") and msg.status == want


def test_items_and_instructions_answer_as_chat(oai, model):
    items = [{"role": "developer", "content": "You are a kind robot."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "My name is Ann."}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hello Ann!"}]},
             {"role": "user", "content": "What is my name?"}]
    msgs = [{"role": "system", "content": "You are a kind robot."},
            {"role": "user", "content": "My name is Ann."},
            {"role": "assistant", "content": "Hello Ann!"},
            {"role": "user", "content": "What is my name?"}]
    r = oai.responses.create(model=model, input=items, max_output_tokens=10, temperature=0)
    c = chat_text(oai, model, msgs, 10)
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens
    # instructions: the system message before the input
    r = oai.responses.create(model=model, instructions="You are a kind robot.", input=items[1:],
                             max_output_tokens=10, temperature=0)
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.instructions == "You are a kind robot."
    # several parts: joined as the chat path joins chat's text parts
    parts = [{"type": "input_text", "text": "My name is Ann."},
             {"type": "input_text", "text": "What is my name?"}]
    r = oai.responses.create(model=model, input=[{"role": "user", "content": parts}],
                             max_output_tokens=10, temperature=0)
    c = chat_text(oai, model, [{"role": "user", "content": [
        {"type": "text", "text": p["text"]} for p in parts]}], 10)
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens


def collect(stream):
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_stream_equals_the_whole_answer(oai, model):
    kw = dict(model=model, input="Write one sentence about the sea.", max_output_tokens=16,
              temperature=0)
    whole = oai.responses.create(**kw)
    events = collect(oai.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.id.startswith(
        "resp_")
    end = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert types[-1] == end
    for t in ("response.output_item.added", "response.content_part.added",
              "response.output_text.done", "response.content_part.done",
              "response.output_item.done"):
        assert types.count(t) == 1, (t, types)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    done = [e for e in events if e.type == "response.output_text.done"][0]
    assert done.text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    # the SDK's accumulating helper (it wants response.completed: an answer that ends itself)
    kw = dict(model=model, input="Say hello.", max_output_tokens=60, temperature=0)
    whole = oai.responses.create(**kw)
    assert whole.status == "completed"
    with oai.responses.stream(**kw) as s:
        for _ in s:
            pass
        acc = s.get_final_response()
    assert acc.output_text == whole.output_text


def test_max_output_tokens_ends_incomplete(oai, model):
    r = oai.responses.create(model=model, input="Count from one to fifty in words.",
                             max_output_tokens=4, temperature=0)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 4
    assert r.output[0].status == "incomplete"
    events = collect(oai.responses.create(model=model, input="Count from one to fifty in words.",
                                          max_output_tokens=4, temperature=0, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == r.output_text


def test_function_call_round_trip(oai, model):
    # one call (parallel_tool_calls false: the grammar ends after it)
    r = oai.responses.create(model=model, input=QUESTION, tools=[WEATHER],
                             tool_choice="required", parallel_tool_calls=False,
                             max_output_tokens=60, temperature=0)
    assert r.status == "completed" and r.parallel_tool_calls is False
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1, r.output
    call = calls[0]
    assert call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # as chat's answer: the same call
    c = chat_text(oai, model, [{"role": "user", "content": QUESTION}], 60,
                  tools=[chat_tool(WEATHER)], tool_choice="required", parallel_tool_calls=False)
    assert c.choices[0].message.tool_calls[0].function.arguments == call.arguments
    # streamed: the same call, its arguments in deltas
    events = collect(oai.responses.create(model=model, input=QUESTION, tools=[WEATHER],
                                          tool_choice="required", parallel_tool_calls=False,
                                          max_output_tokens=60, temperature=0, stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and done[0].arguments == call.arguments
    assert events[-1].response.output[-1].name == "get_weather"
    # the second turn: the call and its output as items, or the same through
    # previous_response_id: one prompt, one answer
    out = {"type": "function_call_output", "call_id": call.call_id, "output": "22 C, sunny"}
    items = [{"role": "user", "content": QUESTION}] + [o.model_dump(exclude_none=True)
                                                       for o in r.output] + [out]
    second = oai.responses.create(model=model, input=items, tools=[WEATHER],
                                  max_output_tokens=20, temperature=0)
    chained = oai.responses.create(model=model, previous_response_id=r.id, input=[out],
                                   tools=[WEATHER], max_output_tokens=20, temperature=0)
    assert chained.usage.input_tokens == second.usage.input_tokens > r.usage.input_tokens
    assert chained.output_text == second.output_text
    assert [o.type for o in chained.output] == [o.type for o in second.output]
    assert chained.previous_response_id == r.id
    chat = chat_text(oai, model, [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "22 C, sunny"}], 20,
        tools=[chat_tool(WEATHER)])
    assert chat.usage.prompt_tokens == second.usage.input_tokens
    assert (chat.choices[0].message.content or "") == second.output_text


def test_named_function_choice(oai, model):
    r = oai.responses.create(model=model, input=QUESTION, tools=[WEATHER],
                             tool_choice={"type": "function", "name": "get_weather"},
                             max_output_tokens=60, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    assert r.tool_choice.name == "get_weather"


SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
          "required": ["city", "population"], "additionalProperties": False}


def test_text_format_json_schema(oai, model):
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}}
    r = oai.responses.create(model=model, input="Give a city and its population as JSON.",
                             text=fmt, max_output_tokens=60, temperature=0)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"
    events = collect(oai.responses.create(model=model, input="Give a city and its population "
                                          "as JSON.", text=fmt, max_output_tokens=60,
                                          temperature=0, stream=True))
    assert events[-1].response.output_text == r.output_text


def test_previous_response_id_chains_and_store(oai, model):
    r1 = oai.responses.create(model=model, input="My name is Ann.", max_output_tokens=8,
                              temperature=0)
    r2 = oai.responses.create(model=model, previous_response_id=r1.id,
                              input="What is my name?", max_output_tokens=8, temperature=0)
    c = chat_text(oai, model, [{"role": "user", "content": "My name is Ann."},
                               {"role": "assistant", "content": r1.output_text},
                               {"role": "user", "content": "What is my name?"}], 8)
    assert r2.usage.input_tokens == c.usage.prompt_tokens
    assert r2.output_text == c.choices[0].message.content
    # a third turn chains through both
    r3 = oai.responses.create(model=model, previous_response_id=r2.id, input="Thanks.",
                              max_output_tokens=4, temperature=0)
    assert r3.usage.input_tokens > r2.usage.input_tokens + r2.usage.output_tokens
    # GET returns the stored response; DELETE removes it
    got = oai.responses.retrieve(r2.id)
    assert got.id == r2.id and got.output_text == r2.output_text
    deleted = oai.responses.delete(r3.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.retrieve(r3.id)
    assert r3.id in str(e.value)
    # unknown and unstored ids: 404 naming the id and the field
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model=model, previous_response_id="resp_nosuch", input="hi",
                             max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    assert "resp_nosuch" in e.value.body["message"] and "per router" in e.value.body["message"]
    nostore = oai.responses.create(model=model, input="hi", max_output_tokens=2, store=False)
    assert nostore.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=model, previous_response_id=nostore.id, input="hi",
                             max_output_tokens=2)


@pytest.mark.parametrize("kw, param", [
    (dict(input=[{"type": "web_search_call", "id": "ws_1", "status": "completed"}]),
     "input[0].type"),
    (dict(input=[{"role": "user", "content": "hi"}, {"type": "file_search_call", "id": "f"}]),
     "input[1].type"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image",
                                               "image_url": "http://x/y.png"}]}]),
     "input[0].content[0].type"),
    (dict(input="hi", tools=[{"type": "web_search"}]), "tools[0].type"),
    (dict(input="hi", tools=[WEATHER, {"type": "file_search", "vector_store_ids": ["v"]}]),
     "tools[1].type"),
    (dict(input="hi", tools=[chat_tool(WEATHER)]), "tools[0].name"),
    (dict(input="hi", tool_choice={"type": "web_search_preview"}, tools=[WEATHER]),
     "tool_choice.type"),
    (dict(input="hi", text={"format": {"type": "yaml"}}), "text.format.type"),
    (dict(input="hi", text={"format": {"type": "json_schema", "name": "x"}}),
     "text.format.schema"),
    (dict(input="hi", text={"format": {"type": "json_schema", "name": "x", "schema": "{}"}}),
     "text.format.schema"),
    (dict(input="hi", temperature=-1), "temperature"),
    (dict(input="hi", max_output_tokens=-1), "max_output_tokens"),
    (dict(input=[{"role": "wizard", "content": "hi"}]), "input[0].role"),
    (dict(input=[{"type": "function_call_output", "output": "x"}]), "input[0].call_id"),
    # members left out: once a NULL read by the type-name helper (the router crashed)
    (dict(input=[{"role": "user"}]), "input[0].content"),
    (dict(input=[{"role": "user", "content": "hi"}, {"type": "message", "role": "user"}]),
     "input[1].content"),
    (dict(input=[{"type": "function_call_output", "call_id": "c1"}]), "input[0].output"),
    # tool_choice in the Responses shape ({type, name}), not the chat one the message once gave
    (dict(input="hi", tools=[WEATHER], tool_choice={"type": "function"}), "tool_choice.name"),
    (dict(input="hi", tools=[WEATHER], tool_choice="always"), "tool_choice"),
    (dict(input=[]), "input"),
])
def test_bad_input_names_the_field(oai, model, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=model, **kw)
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["message"].startswith(param), e.value.body
    if param.startswith("tool_choice"):
        assert '"function": {' not in e.value.body["message"], e.value.body  # chat's shape


def test_chat_validator_speaks_responses_names(oai, model):
    # a range check of the chat path, in the Responses request's names
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=model, input="hi", tools=[dict(WEATHER, name="")])
    assert e.value.body["param"].startswith("tools[0].name"), e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=model, input=[{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": None}])
    assert e.value.body["param"].startswith("input[1]"), e.value.body


def test_agents_sdk_runs_a_function_tool(cluster, model):
    """openai-agents (pinned in scripts/setup) with its default OpenAIResponsesModel: the
    model is made to call the tool (tool_choice required), the tool runs, and its result is
    the agent's final output (stop_on_first_tool)."""
    os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
    try:
        import agents
    except ImportError:
        pytest.fail("the `openai-agents` package is missing: run scripts/setup", pytrace=False)
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool

    seen = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return f"22 C and sunny in {city}"

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{cluster.port}/v1",
                                api_key="unused", max_retries=0, timeout=300)
    agent = Agent(name="weather", instructions="You answer questions about the weather.",
                  model=OpenAIResponsesModel(model=model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0,
                                               parallel_tool_calls=False, max_tokens=100),
                  tools=[get_weather], tool_use_behavior="stop_on_first_tool")
    result = Runner.run_sync(agent, QUESTION, max_turns=2)
    assert len(seen) == 1 and isinstance(seen[0], str) and seen[0]
    assert result.final_output == f"22 C and sunny in {seen[0]}"
    assert agents.__version__


def test_response_ids_are_per_router(tmp_path):
    """Two routers sharing the node pools (test_routers.py's Routers): a response stored by
    router A is unknown to router B, which answers 404 saying that ids are per router; A still
    continues it."""
    from test_routers import Routers

    rs = Routers(str(tmp_path)).start()
    clients = {r: openai.OpenAI(base_url=f"http://127.0.0.1:{rs.http[r]}/v1", api_key="unused",
                                max_retries=0, timeout=300) for r in "AB"}
    try:
        model = clients["A"].models.list().data[0].id
        first = clients["A"].responses.create(model=model, input="My name is Ann.",
                                              max_output_tokens=4, temperature=0)
        with pytest.raises(openai.NotFoundError) as e:
            clients["B"].responses.create(model=model, previous_response_id=first.id,
                                          input="What is my name?", max_output_tokens=4)
        assert e.value.body["param"] == "previous_response_id"
        assert first.id in e.value.body["message"]
        assert "per router" in e.value.body["message"]
        with pytest.raises(openai.NotFoundError) as e:
            clients["B"].responses.retrieve(first.id)
        assert "per router" in e.value.body["message"]
        follow = clients["A"].responses.create(model=model, previous_response_id=first.id,
                                               input="What is my name?", max_output_tokens=4,
                                               temperature=0)
        assert follow.status in ("completed", "incomplete")
        assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
        assert clients["A"].responses.retrieve(first.id).id == first.id
    finally:
        for c in clients.values():
            c.close()
        codes = rs.stop()
    assert all(rc == 0 for rc in codes.values()), (codes, [rs.tail(n) for n in codes])


# ChatML as SmolLM2 writes it, with a comment naming the think tags: the chat path then parses
# reasoning (test_reasoning.py's THINKING), and a few-shot chat makes the model write it
THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
            "{# <think> </think> #}")
FEW_SHOT = [
    {"role": "user", "content": "Say A."},
    {"role": "assistant", "content": "<think>\nThe user wants the letter A.\n</think>\n\nA"},
    {"role": "user", "content": "Say B."},
    {"role": "assistant", "content": "<think>\nThe user wants the letter B.\n</think>\n\nB"},
    {"role": "user", "content": "Say C."},
]


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "thinking.jinja"
    path.write_text(THINKING)
    yield from http_cluster(tmp_path_factory, "responses-thinking", chat_template=str(path))


def test_reasoning_items_as_chat_reasoning(thinking):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{thinking.port}/v1", api_key="unused",
                           max_retries=0, timeout=300)
    try:
        model = client.models.list().data[0].id
        c = client.chat.completions.create(model=model, messages=FEW_SHOT, max_tokens=40,
                                           temperature=0)
        msg = c.choices[0].message
        want_r = (msg.model_extra or {}).get("reasoning_content")
        assert want_r, msg  # the few-shot pattern is followed
        r = client.responses.create(model=model, input=FEW_SHOT, max_output_tokens=40,
                                    temperature=0)
        assert [o.type for o in r.output] == ["reasoning", "message"]
        assert r.output[0].id.startswith("rs_")
        assert "".join(p.text for p in r.output[0].content) == want_r
        assert r.output_text == (msg.content or "")
        assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
        # streamed: reasoning_text deltas, then output_text deltas, the same split
        events = collect(client.responses.create(model=model, input=FEW_SHOT,
                                                 max_output_tokens=40, temperature=0,
                                                 stream=True))
        got_r = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        got_c = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert (got_r, got_c) == (want_r, msg.content or "")
        added = [e.item.type for e in events if e.type == "response.output_item.added"]
        assert added == ["reasoning", "message"]
        final = events[-1].response
        assert final.usage.output_tokens_details.reasoning_tokens == \
            r.usage.output_tokens_details.reasoning_tokens
        # the reasoning item goes back as the assistant message's reasoning_content
        follow = client.responses.create(model=model, previous_response_id=r.id,
                                         input="Say D.", max_output_tokens=4, temperature=0)
        chat = client.chat.completions.create(
            model=model, max_tokens=4, temperature=0,
            messages=FEW_SHOT + [{"role": "assistant", "content": msg.content or "",
                                  "reasoning_content": want_r},
                                 {"role": "user", "content": "Say D."}])
        assert follow.usage.input_tokens == chat.usage.prompt_tokens
        assert follow.output_text == (chat.choices[0].message.content or "")
    finally:
        client.close()


def test_store_evicts_the_least_recently_used(tmp_path_factory):
    """router.responses_store_max 2: a third stored response evicts the least recently used
    one (a GET counts as a use), whose id is then 404; store false takes no room."""
    for c in http_cluster(tmp_path_factory, "responses-store",
                          extra_router="  responses_store_max: 2\n"):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{c.port}/v1", api_key="unused",
                               max_retries=0, timeout=300)
        try:
            model = client.models.list().data[0].id
            ids = [client.responses.create(model=model, input=f"Say {w}.", max_output_tokens=2,
                                           temperature=0).id for w in ("one", "two")]
            client.responses.retrieve(ids[0])  # ids[1] is now the least recently used
            client.responses.create(model=model, input="hi", max_output_tokens=2, store=False)
            ids.append(client.responses.create(model=model, input="Say three.",
                                               max_output_tokens=2, temperature=0).id)
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(ids[1])
            assert client.responses.retrieve(ids[0]).id == ids[0]
            assert client.responses.retrieve(ids[2]).id == ids[2]
            with pytest.raises(openai.NotFoundError) as e:
                client.responses.create(model=model, previous_response_id=ids[1], input="hi",
                                        max_output_tokens=2)
            assert "evicted" in e.value.body["message"]
        finally:
            client.close()


# text, a call, text again (after reasoning), few-shot through the plain template: the parsers
# split it into four items, which stream=false, the stream's items, response.completed and the
# stored response give alike, in the order written
CALL_SHOT = ("<think>\nThe user asks about {city}.\n</think>\n\nLet me check. <tool_call>\n"
             '{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>\n'
             "One moment.")
FEW_SHOT_CALL = [
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": CALL_SHOT.format(city="Rome")},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": CALL_SHOT.format(city="Oslo")},
    {"role": "user", "content": "Weather in Lima?"},
    {"role": "assistant", "content": CALL_SHOT.format(city="Lima")},
    {"role": "user", "content": "Weather in Paris?"},
]


def without_ids(item):
    return {k: v for k, v in item.items() if k not in ("id", "call_id")}


def test_interleaved_items_same_streamed_or_not(thinking):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{thinking.port}/v1", api_key="unused",
                           max_retries=0, timeout=300)
    try:
        model = client.models.list().data[0].id
        kw = dict(model=model, input=FEW_SHOT_CALL, tools=[WEATHER], max_output_tokens=80,
                  temperature=0)
        whole = client.responses.create(**kw).model_dump(exclude_none=True)
        out = whole["output"]
        assert [o["type"] for o in out] == ["reasoning", "message", "function_call",
                                            "message"], out
        assert out[1]["content"][0]["text"] == "Let me check."
        assert out[2]["name"] == "get_weather"
        assert json.loads(out[2]["arguments"]) == {"city": "Paris"}
        assert out[3]["content"][0]["text"] == "One moment."
        assert [o["id"].split("_")[0] for o in out] == ["rs", "msg", "fc", "msg"]
        assert len({o["id"] for o in out}) == 4
        # the stored response is the answer, ids and call_ids included
        assert client.responses.retrieve(whole["id"]).model_dump(exclude_none=True)["output"] \
            == out
        events = collect(client.responses.create(stream=True, **kw))
        added = [e for e in events if e.type == "response.output_item.added"]
        done = [e.item.model_dump(exclude_none=True) for e in events
                if e.type == "response.output_item.done"]
        assert [e.output_index for e in added] == list(range(4))
        assert [e.item.id for e in added] == [d["id"] for d in done]
        final = events[-1].response.model_dump(exclude_none=True)
        assert events[-1].type == "response.completed"
        assert final["output"] == done
        assert client.responses.retrieve(final["id"]).model_dump(exclude_none=True)["output"] \
            == done
        # the same items as stream=false, the ids apart (another response: other ids)
        assert [without_ids(d) for d in done] == [without_ids(o) for o in out]
        # the stored conversations are the same: the same prompt follows either
        follow = [client.responses.create(model=model, previous_response_id=rid,
                                          input="Weather in Rome?", tools=[WEATHER],
                                          max_output_tokens=4, temperature=0)
                  for rid in (whole["id"], final["id"])]
        assert follow[0].usage.input_tokens == follow[1].usage.input_tokens
        assert follow[0].output_text == follow[1].output_text
    finally:
        client.close()
