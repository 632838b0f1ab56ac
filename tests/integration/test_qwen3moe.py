"""A mixture-of-experts model (qwen3moe: QK-norm attention, 8 experts of which 2 per token)
through a cluster, disaggregated (a prefill and a decode node) and colocated (a decode node that
prefills itself): greedy and seeded outputs, plain and chat, and several requests in one batch,
equal `tandem generate -m` byte for byte. The engine is bitwise batch invariant with experts too
(each expert's GEMM runs over the rows routed to it, and a row's experts are added in its top-k
order), so what a node computes in a batch is what one process computes alone.

The model is the golden test's miniature (`tandem model synth --arch qwen3moe --type F16
--seed 3`, SmolLM2's vocabulary, random weights: the text means nothing), made here.
"""
import subprocess

import pytest

from conftest import BINARIES, MODEL, Cluster, reference
from tandem_client import Result, prompt_request

REQUESTS = [
    dict(prompt="The capital of France is", max_tokens=24),
    dict(prompt="def fibonacci(n):", max_tokens=24),
    dict(prompt="Once upon a time,", max_tokens=24, temperature=0.8, seed=7),
    dict(chat="Name three rivers in Europe.", max_tokens=24),
    dict(chat="Write a haiku about snow.", max_tokens=16, temperature=0.9, seed=11),
    dict(prompt=" ".join(f"Line {i}: the clerks counted {i * 7} barrels." for i in range(40)),
         max_tokens=12),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3moe") / "qwen3moe-tiny-f16.gguf")
    subprocess.run([BINARIES["tandem"], "model", "synth", "--arch", "qwen3moe", "--type", "F16",
                    "--seed", "3", "--vocab", MODEL, "-o", path], check=True,
                   capture_output=True)
    return path


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def cluster(request, model, tmp_path_factory):
    n_prefill = 1 if request.param == "disaggregated" else 0
    c = Cluster(str(tmp_path_factory.mktemp(f"qwen3moe-{request.param}")), n_prefill=n_prefill,
                n_decode=1, memory_budget="512MiB", model=model)
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


def test_outputs_match_single_process(cluster, model):
    refs = [reference(prompt=r.get("prompt"), chat=r.get("chat"), max_tokens=r["max_tokens"],
                      temperature=r.get("temperature", 0.0), seed=r.get("seed"), model=model)
            for r in REQUESTS]
    cl = cluster.client()
    results = {cl.start(to_request(r)): Result() for r in REQUESTS}
    cl.collect(results, timeout_s=600)
    cl.close()
    for (call, res), r, ref in zip(results.items(), REQUESTS, refs):
        assert res.status == "OK", (r, res)
        assert res.final.usage.completion_tokens > 0, (r, res)
        assert res.text == ref, (r, res.text, ref)
    cluster.wait_idle(2.0)
