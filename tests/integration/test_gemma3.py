"""Gemma 3 270M (sliding-window layers, QK-norm, GeGLU, a 262,144-token SentencePiece
vocabulary) through a cluster, disaggregated (a prefill and a decode node) and colocated (a
decode node that prefills itself): greedy and seeded outputs, plain and chat, and a prompt
longer than the 512-token window, equal `tandem generate -m` byte for byte.

The 270M file is the base model, so the chat answers are not sensible; what is checked is that
the cluster computes exactly what one process computes. `scripts/setup --model gemma3-270m`
installs the model (scripts/test does); without it these tests skip, saying so.
"""
import os

import pytest

from conftest import Cluster, reference
from tandem_client import Result, prompt_request

CACHE = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.environ["HOME"], ".cache")
GEMMA = os.environ.get("TANDEM_GEMMA3_MODEL") or os.path.join(
    CACHE, "tandem", "models", "gemma-3-270m-q4_k_m.gguf")

LONG = " ".join(
    f"Paragraph {i}: the river town kept its ledgers in a stone house by the bridge, and every "
    f"spring the clerks counted {i * 7} barrels of salt, {i * 3} bales of wool and the boats "
    "that passed under the arches on their way to the sea." for i in range(1, 17))

REQUESTS = [
    dict(prompt="The capital of France is", max_tokens=24),
    dict(prompt="def fibonacci(n):", max_tokens=24),
    dict(prompt="Once upon a time,", max_tokens=24, temperature=0.8, seed=7),
    dict(chat="Name three rivers in Europe.", max_tokens=24),
    dict(chat="Write a haiku about snow.", max_tokens=16, temperature=0.9, seed=11),
    dict(prompt=LONG + "\nThe clerks counted", max_tokens=12),
]


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def cluster(request, tmp_path_factory):
    if not os.path.exists(GEMMA):
        pytest.skip(f"{GEMMA} is missing: run scripts/setup --model gemma3-270m")
    n_prefill = 1 if request.param == "disaggregated" else 0
    c = Cluster(str(tmp_path_factory.mktemp(f"gemma3-{request.param}")), n_prefill=n_prefill,
                n_decode=1, memory_budget="1GiB", model=GEMMA)
    c.start(timeout_s=180)
    yield c
    codes = c.stop()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])


def to_request(r):
    sp = {"temperature": r.get("temperature", 0.0)}
    if r.get("seed") is not None:
        sp["seed"] = r["seed"]
    if "chat" in r:
        return prompt_request(chat=[("user", r["chat"])], max_tokens=r["max_tokens"], **sp)
    return prompt_request(prompt=r["prompt"], max_tokens=r["max_tokens"], **sp)


def test_outputs_match_single_process(cluster):
    refs = [reference(prompt=r.get("prompt"), chat=r.get("chat"), max_tokens=r["max_tokens"],
                      temperature=r.get("temperature", 0.0), seed=r.get("seed"), model=GEMMA)
            for r in REQUESTS]
    cl = cluster.client()
    results = {cl.start(to_request(r)): Result() for r in REQUESTS}
    cl.collect(results, timeout_s=600)
    cl.close()
    for (call, res), r, ref in zip(results.items(), REQUESTS, refs):
        assert res.status == "OK", (r, res)
        assert res.text == ref, (r, res.text, ref)
    long_prompt = [res for res, r in zip(results.values(), REQUESTS) if r is REQUESTS[-1]][0]
    assert long_prompt.final.usage.prompt_tokens > 512  # past the sliding window
    cluster.wait_idle(2.0)
