"""Structured output through the cluster, driven by unmodified clients: the official `openai`
package's `chat.completions.parse` with Pydantic models (nested, enums, lists, optionals,
recursive, unions, formats), `response_format` json_object, vLLM's guided_* and
structured_outputs fields, greedy equality with `tandem generate -m MODEL --json-schema`, and
every bad input refused with 400 naming the field.

A result that finishes with `stop` must validate with the `jsonschema` package; one cut at
max_tokens finishes with `length`, which `parse` refuses (LengthFinishReasonError): it is
counted (at most 10 %) and never returned as parsed. Needs `openai` and `jsonschema` in the venv
scripts/setup makes.
"""
import concurrent.futures
import datetime
import enum
import json
import os
import re
import subprocess
from typing import List, Literal, Optional, Union

import pytest

from conftest import BINARIES, MODEL, http_cluster, openai_client
from test_http import request

try:
    import jsonschema
    import openai
    import pydantic
except ImportError:  # pragma: no cover - a setup problem, reported as a failure
    pytest.fail("`openai` and `jsonschema` are needed: run scripts/setup (it installs them into "
                "~/.cache/tandem/venv, the python ctest uses)", pytrace=False)

MAX_TOKENS = 512


# ---- the models (>= 10) ----

class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0, le=130)


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Paint(pydantic.BaseModel):
    color: Color
    coats: int = pydantic.Field(ge=1, le=5)


class Address(pydantic.BaseModel):
    street: str = pydantic.Field(max_length=32)
    city: str = pydantic.Field(max_length=24)


class Company(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    address: Address


class Tags(pydantic.BaseModel):
    tags: List[pydantic.constr(max_length=12)] = pydantic.Field(min_length=1, max_length=4)


class Profile(pydantic.BaseModel):
    nickname: Optional[str] = pydantic.Field(max_length=16)
    score: Optional[float]


class Node(pydantic.BaseModel):
    value: int = pydantic.Field(ge=0, le=99)
    children: List["Node"] = pydantic.Field(max_length=2)


class Answer(pydantic.BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


class Item(pydantic.BaseModel):
    sku: str = pydantic.Field(max_length=8)
    qty: int = pydantic.Field(ge=1, le=9)


class Order(pydantic.BaseModel):
    items: List[Item] = pydantic.Field(min_length=1, max_length=3)
    paid: bool


class Circle(pydantic.BaseModel):
    kind: Literal["circle"]
    radius: int = pydantic.Field(ge=1, le=100)


class Square(pydantic.BaseModel):
    kind: Literal["square"]
    side: int = pydantic.Field(ge=1, le=100)


class Drawing(pydantic.BaseModel):
    shape: Union[Circle, Square]


class Event(pydantic.BaseModel):
    title: str = pydantic.Field(max_length=24)
    day: datetime.date


MODELS = [
    (Person, "a person"),
    (Paint, "a paint job"),
    (Company, "a company and its address"),
    (Tags, "tags for a photo of a beach"),
    (Profile, "a game profile"),
    (Node, 'the node {"value": 7, "children": []}'),  # a 135M model nests free trees forever
    (Answer, "whether the sky is blue"),
    (Order, "a shop order"),
    (Drawing, "a shape"),
    (Event, "a birthday party"),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from http_cluster(tmp_path_factory, "structured")


@pytest.fixture(scope="module")
def oai(cluster):
    yield from openai_client(cluster, timeout=600)


def messages(what):
    return [{"role": "system", "content": "You answer with JSON only."},
            {"role": "user", "content": f"Describe {what} as JSON."}]


def parse_one(oai, model, what, temperature, seed):
    """(finish_reason, parsed or None, raw content); a cut answer is (length, None, None)."""
    try:
        r = oai.chat.completions.parse(model="", messages=messages(what), response_format=model,
                                       temperature=temperature, seed=seed,
                                       max_tokens=MAX_TOKENS)
    except openai.LengthFinishReasonError:
        return "length", None, None
    ch = r.choices[0]
    return ch.finish_reason, ch.message.parsed, ch.message.content


def test_parse_pydantic_models(oai):
    """Ten models at temperature 0 and at 1.0 with a seed, concurrently (continuous batching):
    each finished answer parses and validates; cut ones are few and never parsed."""
    jobs = []
    for model, what in MODELS:
        jobs.append((model, what, 0.0, None))
        jobs.append((model, what, 1.0, 1000 + len(jobs)))
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(lambda j: parse_one(oai, *j), jobs))
    cut = 0
    for (model, what, temperature, seed), (finish, parsed, content) in zip(jobs, results):
        if finish == "length":
            cut += 1
            continue
        assert finish == "stop", (model.__name__, finish, content)
        assert isinstance(parsed, model), (model.__name__, content)
        jsonschema.validate(json.loads(content), model.model_json_schema())
    assert cut <= len(jobs) // 10, f"{cut} of {len(jobs)} answers cut at {MAX_TOKENS} tokens"


def test_json_object_mode(oai):
    for temperature, seed in ((0.0, None), (1.0, 7)):
        r = oai.chat.completions.create(model="", messages=messages("a cat"),
                                        response_format={"type": "json_object"},
                                        temperature=temperature, seed=seed, max_tokens=MAX_TOKENS)
        ch = r.choices[0]
        if ch.finish_reason == "stop":
            assert isinstance(json.loads(ch.message.content), dict), ch.message.content


def test_streamed_equals_whole(oai):
    """A streamed constrained answer reassembles to the non-streamed one (greedy)."""
    kw = dict(model="", messages=messages("a person"), temperature=0.0, max_tokens=MAX_TOKENS,
              response_format={"type": "json_schema",
                               "json_schema": {"name": "p", "schema": dict(
                                   Person.model_json_schema(), additionalProperties=False)}})
    whole = oai.chat.completions.create(**kw).choices[0]
    parts, finish = [], None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert "".join(parts) == whole.message.content
    assert finish == whole.finish_reason, (finish, whole.message.content)
    if finish == "stop":
        Person.model_validate_json(whole.message.content)


def test_vllm_fields(oai):
    """guided_choice, guided_regex, guided_grammar and structured_outputs (extra_body, as vLLM's
    users send them)."""
    def ask(extra, max_tokens=32):
        r = oai.chat.completions.create(model="", messages=messages("the weather"),
                                        temperature=1.0, seed=3, max_tokens=max_tokens,
                                        extra_body=extra)
        return r.choices[0].finish_reason, r.choices[0].message.content
    assert ask({"guided_choice": ["sunny", "rainy", "cloudy"]}) in (
        ("stop", "sunny"), ("stop", "rainy"), ("stop", "cloudy"))
    finish, text = ask({"guided_regex": "[0-9]{3}-[a-z]{2,4}"})
    assert finish == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
    finish, text = ask({"guided_grammar": 'root ::= "It is " ("hot" | "cold") "."'})
    assert finish == "stop" and text in ("It is hot.", "It is cold."), text
    finish, text = ask({"structured_outputs": {"choice": ["a", "b"]}})
    assert finish == "stop" and text in ("a", "b"), text
    schema = {"type": "object", "properties": {"t": {"type": "integer"}}, "required": ["t"],
              "additionalProperties": False}
    finish, text = ask({"guided_json": schema}, MAX_TOKENS)
    if finish == "stop":
        jsonschema.validate(json.loads(text), schema)


def test_cut_at_max_tokens_is_length(oai):
    """A constraint the model cannot finish in max_tokens ends with `length`, never a claimed
    success: parse() refuses it."""
    r = oai.chat.completions.create(model="", messages=messages("a company"), max_tokens=4,
                                    temperature=0.0,
                                    response_format={"type": "json_schema", "json_schema": {
                                        "name": "c", "schema": Company.model_json_schema()}})
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.LengthFinishReasonError):
        oai.chat.completions.parse(model="", messages=messages("a company"), max_tokens=4,
                                   temperature=0.0, response_format=Company)


def test_greedy_same_in_one_process_and_cluster(cluster, oai, tmp_path):
    """`tandem generate -m MODEL --json-schema F` (one process), the same through the router
    (`tandem generate --json-schema F`) and through HTTP give the same text."""
    person = dict(Person.model_json_schema(), additionalProperties=False)
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(person))
    chat = "Describe a person as JSON."
    common = ["--chat", chat, "-n", "96", "--temperature", "0", "--json-schema", str(schema)]
    env = dict(os.environ, OMP_WAIT_POLICY="passive")
    local = subprocess.run([BINARIES["tandem"], "generate", "-m", MODEL, "-t", "1"] + common,
                           capture_output=True, check=True, env=env)
    routed = subprocess.run([BINARIES["tandem"], "generate", "--router", cluster.client_ep] +
                            common, capture_output=True, check=True, env=env)
    assert local.stdout == routed.stdout, (local.stdout, routed.stdout)
    assert b"finish: stop" in local.stderr, local.stderr
    Person.model_validate_json(local.stdout)
    r = oai.chat.completions.create(model="", messages=[{"role": "user", "content": chat}],
                                    max_tokens=96, temperature=0.0,
                                    extra_body={"guided_json": person})
    assert r.choices[0].message.content + "\n" == local.stdout.decode("utf-8")


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": 5}}}},
     "response_format", "type"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "propertyNames": {"maxLength": 3}}}}},
     "response_format", "propertyNames"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar", "line 1"),
    ({"guided_grammar": 'root ::= "a" root'}, "guided_grammar", "root"),
    ({"guided_regex": "(ab"}, "guided_regex", "regex"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex",
     "conflicts with response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice",
     "conflicts"),
    ({"guided_choice": ["a", 1]}, "guided_choice", "guided_choice[1]"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"guided_json": 7}, "guided_json", "JSON Schema"),
    ({"structured_outputs": {"regexp": "[0-9]+"}}, "structured_outputs.regexp", "not supported"),
    ({"structured_outputs": {}}, "structured_outputs", "give one of"),
]


@pytest.mark.parametrize("extra,param,has", BAD)
def test_bad_input_is_400_naming_the_field(cluster, extra, param, has):
    body = dict({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}, **extra)
    status, _, raw = request(cluster.port, "POST", "/v1/chat/completions", body)
    err = json.loads(raw)
    assert status == 400, err
    assert err["error"]["param"] == param, err
    assert has in err["error"]["message"], err
