"""vLLM's chat rendering and streaming fields through a real cluster with the default model
(SmolLM2-135M-Instruct, its GGUF's ChatML Jinja template): add_generation_prompt,
continue_final_message (the rendering cut after the last assistant message's content, as
transformers' apply_chat_template does), echo on chat (the last message's content first) and
stream_options.continuous_usage_stats (every chunk carries the usage so far). docs/api.md.
"""
import json

import pytest

from conftest import http_cluster
from test_http import request, sse_events

SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
          "Hugging Face<|im_end|>\n")
USER = "Name three colors."
PARTIAL = "Sure! The first color is"
CONTINUE = [{"role": "user", "content": USER}, {"role": "assistant", "content": PARTIAL}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from http_cluster(tmp_path_factory, "chat_fields")


def post(cluster, path, body):
    status, _, raw = request(cluster.port, "POST", path, body)
    return status, (json.loads(raw) if path != "stream" else raw)


def tokens_of_text(cluster, text):
    status, v = post(cluster, "/tokenize", {"prompt": text})
    assert status == 200, v
    return v["tokens"]


def test_add_generation_prompt(cluster):
    msgs = [{"role": "user", "content": USER}]
    _, with_gp = post(cluster, "/tokenize", {"messages": msgs})
    _, without = post(cluster, "/tokenize", {"messages": msgs, "add_generation_prompt": False})
    rendered = SYSTEM + f"<|im_start|>user\n{USER}<|im_end|>\n"
    assert with_gp["tokens"] == tokens_of_text(cluster, rendered + "<|im_start|>assistant\n")
    assert without["tokens"] == tokens_of_text(cluster, rendered)
    # the chat endpoint renders the same way: its prompt is the /tokenize count
    status, r = post(cluster, "/v1/chat/completions",
                     {"messages": msgs, "max_tokens": 2, "add_generation_prompt": False})
    assert status == 200, r
    assert r["usage"]["prompt_tokens"] == without["count"]


def test_continue_final_message_renders_the_open_message(cluster):
    body = {"messages": CONTINUE, "add_generation_prompt": False, "continue_final_message": True}
    status, v = post(cluster, "/tokenize", body)
    assert status == 200, v
    text = SYSTEM + f"<|im_start|>user\n{USER}<|im_end|>\n<|im_start|>assistant\n{PARTIAL}"
    assert v["tokens"] == tokens_of_text(cluster, text)
    # trailing whitespace of the message is dropped when the template keeps it (transformers
    # cuts after the stripped content unless the rendering holds it unchanged)
    spaced = [CONTINUE[0], {"role": "assistant", "content": PARTIAL + "  "}]
    status, v2 = post(cluster, "/tokenize", dict(body, messages=spaced))
    assert status == 200, v2
    assert v2["tokens"] == tokens_of_text(cluster, text + "  ")
    # the model continues it: greedy output equals the completion of the same text
    status, chat = post(cluster, "/v1/chat/completions",
                        dict(body, max_tokens=12, temperature=0))
    assert status == 200, chat
    status, comp = post(cluster, "/v1/completions",
                        {"prompt": text, "max_tokens": 12, "temperature": 0})
    assert status == 200, comp
    assert chat["choices"][0]["message"]["content"] == comp["choices"][0]["text"]
    assert chat["usage"]["prompt_tokens"] == v["count"]


def test_continue_final_message_with_a_request_template(cluster):
    tmpl = ("{% for m in messages %}[{{ m.role }}]: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]:{% endif %}")
    status, v = post(cluster, "/tokenize", {
        "messages": CONTINUE, "chat_template": tmpl, "add_generation_prompt": False,
        "continue_final_message": True})
    assert status == 200, v
    assert v["tokens"] == tokens_of_text(cluster, f"[user]: {USER}\n[assistant]: {PARTIAL}")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_continue_final_message_refusals(cluster, path):
    status, e = post(cluster, path, {"messages": CONTINUE, "continue_final_message": True})
    assert status == 400, e
    assert e["error"]["param"] == "continue_final_message"
    assert "add_generation_prompt" in e["error"]["message"]
    status, e = post(cluster, path, {"messages": CONTINUE[:1], "continue_final_message": True,
                                     "add_generation_prompt": False})
    assert status == 400, e
    assert e["error"]["param"] == "continue_final_message"
    assert "messages[0]" in e["error"]["message"] and "assistant" in e["error"]["message"]
    status, e = post(cluster, path, {"messages": CONTINUE, "add_generation_prompt": "no"})
    assert status == 400 and e["error"]["param"] == "add_generation_prompt", e


def test_chat_echo(cluster):
    body = {"messages": CONTINUE, "add_generation_prompt": False, "continue_final_message": True,
            "max_tokens": 8, "temperature": 0}
    status, plain = post(cluster, "/v1/chat/completions", body)
    assert status == 200, plain
    status, echoed = post(cluster, "/v1/chat/completions", dict(body, echo=True))
    assert status == 200, echoed
    out = plain["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == PARTIAL + out
    # streamed: the echo is the first content delta, after the role chunk
    status, _, raw = request(cluster.port, "POST", "/v1/chat/completions",
                             dict(body, echo=True, stream=True))
    assert status == 200
    chunks = [json.loads(e) for e in sse_events(raw) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant"
    assert deltas[1] == {"content": PARTIAL}
    assert "".join(d.get("content") or "" for d in deltas) == PARTIAL + out
    # a last message of the user's role is not echoed (the answer is the assistant's)
    status, r = post(cluster, "/v1/chat/completions",
                     {"messages": CONTINUE[:1], "echo": True, "max_tokens": 4, "temperature": 0})
    assert status == 200, r
    assert not r["choices"][0]["message"]["content"].startswith(USER)


def stream_chunks(cluster, body):
    status, _, raw = request(cluster.port, "POST", "/v1/chat/completions", body)
    assert status == 200, raw
    return [json.loads(e) for e in sse_events(raw) if e != "[DONE]"]


def test_continuous_usage_stats(cluster):
    body = {"messages": [{"role": "user", "content": USER}], "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = stream_chunks(cluster, body)
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 10
    prompt = final["usage"]["prompt_tokens"]
    seen = 0
    for c in chunks[:-1]:
        u = c["usage"]
        assert u["prompt_tokens"] == prompt, c
        assert u["total_tokens"] == prompt + u["completion_tokens"], c
        assert u["completion_tokens"] >= seen, c
        seen = u["completion_tokens"]
    assert chunks[0]["usage"]["completion_tokens"] == 0  # the role chunk
    assert seen == 10
    # vLLM: continuous_usage_stats without include_usage adds nothing
    chunks = stream_chunks(cluster, dict(body, stream_options={"continuous_usage_stats": True}))
    assert all("usage" not in c or c["usage"] is None for c in chunks)
    # include_usage alone: null on every chunk but the last
    chunks = stream_chunks(cluster, dict(body, stream_options={"include_usage": True}))
    assert all(c["usage"] is None for c in chunks[:-1])
    status, e = post(cluster, "/v1/chat/completions",
                     dict(body, stream_options={"continuous_usage_stats": 1}))
    assert status == 400 and e["error"]["param"] == "stream_options.continuous_usage_stats", e


def test_tokenize_keeps_its_own_add_special_tokens(cluster):
    """/tokenize's add_special_tokens is its BOS switch, not vLLM's chat generation field that
    /v1/chat/completions refuses when true."""
    msgs = [{"role": "user", "content": USER}]
    for flag in (True, False):
        status, v = post(cluster, "/tokenize", {"messages": msgs, "add_special_tokens": flag})
        assert status == 200, v
    status, e = post(cluster, "/v1/chat/completions",
                     {"messages": msgs, "max_tokens": 1, "add_special_tokens": True})
    assert status == 400 and e["error"]["param"] == "add_special_tokens", e
