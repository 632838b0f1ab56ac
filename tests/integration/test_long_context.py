"""Serving past the default context: `model.max_context` (issue 40). Without it a cluster serves
min(4,096, the trained context); with it, up to the trained context (SmolLM2's 8,192). A prompt
longer than 4,096 tokens is answered as `tandem generate -m --ctx 8192` answers it, the limit is
the configured one, and a value past the trained context stops the daemon naming the key.
"""
import json
import os
import random
import subprocess

import pytest

from conftest import BINARIES, http_cluster, reference
from test_http import request

CTX = 8192  # SmolLM2-135M's trained context
WORDS = ("river stone garden window paper music winter summer yellow orange purple silver "
         "market island forest desert valley bridge castle village doctor teacher farmer "
         "kitchen letter camera pencil bottle ticket rabbit turtle dragon engine rocket").split()


def words(n, seed):
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def n_tokens(port, text):
    st, _, body = request(port, "POST", "/tokenize", {"prompt": text, "add_special_tokens": True})
    assert st == 200, body
    return json.loads(body)["count"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from http_cluster(tmp_path_factory, "long_context",
                            extra_model=f"  max_context: {CTX}\n")


def test_models_list_the_configured_context(cluster):
    st, _, body = request(cluster.port, "GET", "/v1/models")
    assert st == 200, body
    assert json.loads(body)["data"][0]["max_model_len"] == CTX


def test_status_shows_the_configured_context(cluster):
    """`tandem status`'s table names the one model's served context (the JSON always did)."""
    out = subprocess.run([BINARIES["tandem"], "status", "--router", cluster.client_ep],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert f", context {CTX} tokens" in first, out.stdout


def test_prompt_past_4096_tokens_equals_the_reference(cluster):
    prompt = words(4400, seed=7)
    n = n_tokens(cluster.port, prompt)
    assert 4096 < n < CTX - 16, n
    st, _, body = request(cluster.port, "POST", "/v1/completions",
                          {"prompt": prompt, "max_tokens": 8, "temperature": 0}, timeout=600)
    assert st == 200, body
    out = json.loads(body)
    assert out["usage"]["prompt_tokens"] == n
    assert out["usage"]["completion_tokens"] == 8
    assert out["choices"][0]["text"] == reference(prompt=prompt, max_tokens=8,
                                                  extra=["--ctx", str(CTX)])


def test_the_limit_is_the_configured_context(cluster):
    prompt = words(8300, seed=8)  # at least 8,192 tokens: nothing left for output
    n = n_tokens(cluster.port, prompt)
    assert n >= CTX, n
    st, _, body = request(cluster.port, "POST", "/v1/completions",
                          {"prompt": prompt, "max_tokens": 4})
    assert st == 400, body
    err = json.loads(body)["error"]
    assert str(CTX) in err["message"], err
    # within the context, but prompt + max_tokens past it: refused naming max_tokens
    prompt = words(4400, seed=9)
    st, _, body = request(cluster.port, "POST", "/v1/completions",
                          {"prompt": prompt, "max_tokens": CTX})
    assert st == 400, body
    err = json.loads(body)["error"]
    assert err["param"] == "max_tokens" and str(CTX) in err["message"], err


def test_past_the_trained_context_is_refused(tmp_path):
    cfg = tmp_path / "too-long.yaml"
    with open(cluster_config_of(tmp_path), encoding="utf-8") as f:
        text = f.read()
    cfg.write_text(text.replace(f"max_context: {CTX}", f"max_context: {CTX + 1}"))
    p = subprocess.run([BINARIES["router"], "--config", str(cfg)], capture_output=True,
                       timeout=120, env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    assert p.returncode != 0
    err = p.stderr.decode()
    assert "max_context" in err and str(CTX + 1) in err and str(CTX) in err, err


def test_too_short_is_refused_naming_max_context(tmp_path):
    cfg = tmp_path / "too-short.yaml"
    with open(cluster_config_of(tmp_path), encoding="utf-8") as f:
        text = f.read()
    cfg.write_text(text.replace(f"max_context: {CTX}", "max_context: 1"))
    p = subprocess.run([BINARIES["router"], "--config", str(cfg)], capture_output=True,
                       timeout=120, env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    assert p.returncode != 0
    err = p.stderr.decode()
    assert "max_context 1 is too short: at least 2 tokens" in err, err


def cluster_config_of(tmp_path):
    """A config like the fixture's (one model with max_context CTX), on free ports."""
    from conftest import Cluster
    return Cluster(str(tmp_path / "c"), n_prefill=0, n_decode=1,
                   extra_model=f"  max_context: {CTX}\n").config
