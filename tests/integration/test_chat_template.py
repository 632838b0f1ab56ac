"""Chat templates through a real cluster with the default model (SmolLM2-135M-Instruct), whose
GGUF carries its own Jinja tokenizer.chat_template: the router renders chats with it (compiled
once at start), and the tokens are those of the built-in ChatML path it replaced (`tandem
tokenize --chat --chat-template chatml`). A request's own chat_template and
chat_template_kwargs are applied (/v1/chat/completions and /tokenize), and a template's
failures are HTTP 400 naming the field: a syntax error or a render limit with the template's
line:column, raise_exception with the template's own message. docs/api.md "Chat templates".
"""
import json
import re
import subprocess

import pytest

from conftest import BINARIES, MODEL, http_cluster, reference
from test_http import request

CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a color."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "How are you? \u2014 \u201cfine\u201d"}],
]

CONTENT_ONLY = "{% for m in messages %}{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from http_cluster(tmp_path_factory, "chat_template")


def post(cluster, path, body):
    status, _, raw = request(cluster.port, "POST", path, body)
    return status, json.loads(raw)


def cli_tokenize(*args):
    out = subprocess.run([BINARIES["tandem"], "tokenize", "-m", MODEL, *args],
                         capture_output=True, check=True)
    return [int(t) for t in out.stdout.split()]


def builtin_chatml_ids(messages, tmp_path):
    """The ids the built-in ChatML path gives: the rendering tdm_chat_apply writes (SmolLM2's
    default system message when the chat has none), tokenized as a prompt."""
    text = ""
    if messages[0]["role"] != "system":
        text += ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                 "Hugging Face<|im_end|>\n")
    for m in messages:
        text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    text += "<|im_start|>assistant\n"
    path = tmp_path / "prompt.txt"
    path.write_bytes(text.encode("utf-8"))
    return cli_tokenize("--special", "-f", str(path))


def test_models_name_the_gguf_template(cluster):
    status, _, raw = request(cluster.port, "GET", "/api/status")
    assert status == 200
    assert re.search(r'"chat_template":\s*"gguf"', raw.decode("utf-8")), raw


def test_gguf_template_gives_the_builtin_chatml_tokens(cluster, tmp_path):
    for messages in CHATS:
        status, v = post(cluster, "/tokenize", {"messages": messages})
        assert status == 200, v
        assert v["tokens"] == builtin_chatml_ids(messages, tmp_path), messages
        status, r = post(cluster, "/v1/chat/completions",
                         {"messages": messages, "max_tokens": 4, "temperature": 0})
        assert status == 200, r
        assert r["usage"]["prompt_tokens"] == len(v["tokens"])
    # the one-turn CLI path agrees too: the model's own template and the built-in name
    assert cli_tokenize("--chat", "Hi") == cli_tokenize("--chat", "Hi", "--chat-template", "chatml")


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def test_tools_reach_a_template_that_renders_none(cluster, tmp_path):
    """SmolLM2's GGUF template never names `tools`: they are written into the system message
    in the Hermes format, so with a system message the tokens are the built-in ChatML's."""
    messages = [{"role": "system", "content": "Be terse."},
                {"role": "user", "content": "Weather in Oslo?"}]
    status, v = post(cluster, "/tokenize", {"messages": messages, "tools": TOOLS})
    assert status == 200, v
    tools_block = ("# Tools\n\nYou may call one or more functions to assist with the user "
                   "query.\n\nYou are provided with function signatures within <tools></tools> "
                   "XML tags:\n<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>\n\nFor each "
                   "function call, return a json object with function name and arguments within "
                   "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                   "\"arguments\": <args-json-object>}\n</tool_call>")
    hermes = [{"role": "system", "content": "Be terse.\n\n" + tools_block}, messages[1]]
    assert v["tokens"] == builtin_chatml_ids(hermes, tmp_path)
    status, r = post(cluster, "/v1/chat/completions",
                     {"messages": messages, "tools": TOOLS, "max_tokens": 4, "temperature": 0})
    assert status == 200, r
    assert r["usage"]["prompt_tokens"] == len(v["tokens"])


def test_greedy_answer_equals_the_single_process(cluster):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    status, r = post(cluster, "/v1/chat/completions",
                     {"messages": msgs, "max_tokens": 12, "temperature": 0})
    assert status == 200, r
    ref = reference(chat=msgs[0]["content"], max_tokens=12)
    assert r["choices"][0]["message"]["content"] == ref


def test_request_template_and_kwargs(cluster):
    msgs = [{"role": "user", "content": "Paris"}]
    status, v = post(cluster, "/tokenize", {"messages": msgs, "chat_template": CONTENT_ONLY})
    assert status == 200, v
    assert v["tokens"] == cli_tokenize("--special", "Paris")
    body = {"messages": msgs, "chat_template": "{{ greeting }}" + CONTENT_ONLY,
            "chat_template_kwargs": {"greeting": "Hello "}}
    status, v = post(cluster, "/tokenize", body)
    assert status == 200, v
    assert v["tokens"] == cli_tokenize("--special", "Hello Paris")
    status, r = post(cluster, "/v1/chat/completions", dict(body, max_tokens=2, temperature=0))
    assert status == 200, r
    assert r["usage"]["prompt_tokens"] == len(v["tokens"])
    # the same template again (the router's cache) gives the same prompt
    status, r2 = post(cluster, "/v1/chat/completions", dict(body, max_tokens=2, temperature=0))
    assert status == 200 and r2["usage"]["prompt_tokens"] == r["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("extra,param,has", [
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "must be an object"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs", "must be an object"),
    ({"chat_template": 3}, "chat_template", "must be a string"),
    ({"chat_template": "x" * (256 * 1024 + 1)}, "chat_template", "262144"),
    ({"chat_template": "ok\n{{ messages[0].content + }}"}, "chat_template", "chat_template: 2:"),
    ({"chat_template": "{{ raise_exception('no thanks') }}"}, "messages", "no thanks"),
    ({"chat_template": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}\n{{ f(0) }}"}, "messages",
     ":"),
])
def test_template_errors_are_400(cluster, path, extra, param, has):
    body = dict({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, **extra)
    status, v = post(cluster, path, body)
    assert status == 400, v
    assert v["error"]["param"] == param, v
    assert has in v["error"]["message"], v


# Templates that once overflowed the router's stack (long operator chains; filter arguments
# nested inside recursive macro calls) or held its loop: each is a 400, and the router keeps
# answering.
DEEP = [
    ("{{ 1" + "+1" * 80000 + " }}", "chat_template", "nested too deeply"),
    ("{{ 1" + "|abs" * 20000 + " }}", "chat_template", "nested too deeply"),
    ("{% macro f(n) %}{{ " + "x|default(" * 190 + "f(n+1)" + ")" * 190
     + " }}{% endmacro %}{{ f(0) }}", "messages", "recursion limit"),
    # and one that blocked the router's loop for minutes: work on big values costs steps
    ("{% set s='x'*1000000 %}{% for i in range(100000) %}{% if 'y' in s %}{% endif %}"
     "{% endfor %}ok", "messages", "step limit"),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("template,param,has", DEEP)
def test_deep_templates_are_400_and_the_router_survives(cluster, path, template, param, has):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "chat_template": template}
    status, v = post(cluster, path, body)
    assert status == 400, v
    assert v["error"]["param"] == param, v
    assert has in v["error"]["message"], v
    status, v = post(cluster, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200, v


def test_raise_exception_and_empty_prompt_read_the_same_on_both_paths(cluster):
    msgs = [{"role": "user", "content": "Hi"}]
    for path in ["/v1/chat/completions", "/tokenize"]:
        status, v = post(cluster, path, {"messages": msgs, "max_tokens": 2,
                                         "chat_template": "{{ raise_exception('no way') }}"})
        assert status == 400 and v["error"]["param"] == "messages", v
        assert v["error"]["message"] == "no way", v
    status, v = post(cluster, "/v1/chat/completions",
                     {"messages": msgs, "max_tokens": 2, "chat_template": "{% if 0 %}x{% endif %}"})
    assert status == 400 and v["error"]["param"] == "messages", v
    assert "chat template rendered an empty prompt" in v["error"]["message"], v
