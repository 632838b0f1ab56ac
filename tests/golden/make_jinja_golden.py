#!/usr/bin/env python3
"""make_jinja_golden.py - jinja2 3.1.6's renderings of llama.cpp's 70 chat templates.

Renders every models/templates/*.jinja of the llama-cpp-python 0.3.36 sdist (what scripts/setup
extracts into ${XDG_CACHE_HOME:-$HOME/.cache}/tandem/templates/) over a fixed set of
conversations, with a jinja2 environment set up as transformers' apply_chat_template sets it up
(ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols, its tojson override,
raise_exception and strftime_now globals), and writes tests/golden/jinja_chat.json: per template
its SHA-256, per conversation the output or the exception's message. tests/unit/test_jinja.c
renders the same with tandem/jinja.h and compares byte for byte.

usage: make_jinja_golden.py TEMPLATE_DIR [OUT.json]
(pip install 'Jinja2==3.1.6'; TEMPLATE_DIR: scripts/setup's ~/.cache/tandem/templates)
"""
import datetime
import hashlib
import json
import os
import sys

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

BOS = "<s>"
EOS = "</s>"
NOW = datetime.datetime(2026, 1, 2, 3, 4, 5)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}]

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}

CONVERSATIONS = [
    ("system_user", {"messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello! How are you?"}]}, [True, False]),
    ("multi_turn", {"messages": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "2+2 is 4."},
        {"role": "user", "content": "And times 3 — in “words”?"}]}, [True, False]),
    ("tools_offered", {"messages": [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "What's the weather in Paris?"}], "tools": TOOLS}, [True]),
    ("tool_call", {"messages": [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
         "content": "{\"temperature\": 21, \"sky\": \"clear\"}"}], "tools": TOOLS}, [True]),
    ("reasoning", {"messages": [
        {"role": "user", "content": "Is 17 prime?"},
        {"role": "assistant", "content": "Yes, 17 is prime.",
         "reasoning_content": "17 has no divisors between 2 and 4."},
        {"role": "user", "content": "And 21?"}]}, [True]),
    ("user_only", {"messages": [{"role": "user", "content": "Hi"}]}, [True, False]),
    ("content_parts", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Describe"},
                                     {"type": "text", "text": "this"}]}]}, [True]),
    ("parallel_calls", {"messages": [
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": "Checking both.", "tool_calls": [
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {
                "city": "Oslo", "days": 3, "scale": 1.5, "metric": True, "extra": [1, None]}}},
            {"id": "call_3", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "snow"},
        {"role": "tool", "tool_call_id": "call_3", "content": "sun"}], "tools": TOOLS}, [True]),
]


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override (utils/chat_template_utils.py)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def strftime_now(fmt):
    return NOW.strftime(fmt)


class Generation(Extension):
    """transformers' AssistantTracker without tracking: {% generation %} renders its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def environment():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, Generation])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def render(env, source, context):
    try:
        return {"output": env.from_string(source).render(**context)}
    except jinja2.exceptions.TemplateError as e:
        return {"error": str(e)}
    except Exception as e:  # a template bug jinja2 reports as a Python error
        return {"error": "%s: %s" % (type(e).__name__, e)}


JINJA2_VERSION = "3.1.6"


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    if jinja2.__version__ != JINJA2_VERSION:
        print("warning: jinja2 %s installed, the golden file is made with %s"
              % (jinja2.__version__, JINJA2_VERSION), file=sys.stderr)
    tdir = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__),
                                                              "jinja_chat.json")
    env = environment()
    templates = []
    for name in sorted(os.listdir(tdir)):
        if not name.endswith(".jinja"):
            continue
        with open(os.path.join(tdir, name), "rb") as f:
            raw = f.read()
        source = raw.decode("utf-8")
        cases = []
        for cname, conv, gens in CONVERSATIONS:
            for gen in gens:
                ctx = dict(conv, add_generation_prompt=gen, bos_token=BOS, eos_token=EOS)
                case = {"conversation": cname, "add_generation_prompt": gen}
                case.update(render(env, source, ctx))
                cases.append(case)
        templates.append({"name": name, "sha256": hashlib.sha256(raw).hexdigest(),
                          "cases": cases})
    doc = {"jinja2": jinja2.__version__, "bos_token": BOS, "eos_token": EOS,
           "now": NOW.isoformat(), "conversations": [
               {"name": n, "context": c} for n, c, _ in CONVERSATIONS], "templates": templates}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print("%s: %d templates, %d renderings" % (out, len(templates),
                                              sum(len(t["cases"]) for t in templates)))


if __name__ == "__main__":
    main()
