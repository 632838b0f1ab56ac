"""vLLM request fields (tests/vllm_request_fields.tsv, every public field of vLLM 0.33.0's
ChatCompletionRequest and CompletionRequest): each is sent with its sample value to a real
cluster; applied and ignored ones are answered 200, refused ones 400 whose error.param names
the field (and whose message does too), as docs/api.md's rule says: a field that would change
the answer is applied or refused, never silently dropped. The refused fields' neutral values
(false, 0, null, vLLM's defaults) are accepted.
"""
import json
import os

import pytest

from conftest import http_cluster
from tandem_client import SOURCE_DIR
from test_http import request

LIST = os.path.join(SOURCE_DIR, "tests", "vllm_request_fields.tsv")
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
BASE = {"chat": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        "completions": {"prompt": "Hi", "max_tokens": 2}}


def rows():
    out = []
    with open(LIST, encoding="utf-8") as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            endpoint, name, status, body, note = line.rstrip("\n").split("\t")
            out.append((endpoint, name, status, json.loads(body), note))
    return out


ROWS = rows()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from http_cluster(tmp_path_factory, "vllm_fields")


@pytest.fixture(scope="module")
def served(cluster):
    status, _, raw = request(cluster.port, "GET", "/v1/models")
    assert status == 200
    return json.loads(raw)["data"][0]["id"]


def test_the_list_is_whole():
    assert len(ROWS) == 125
    names = {(e, n) for e, n, *_ in ROWS}
    assert len(names) == len(ROWS)
    for endpoint, name, status, body, note in ROWS:
        assert status in ("applied", "ignored", "refused"), (endpoint, name)
        assert name in body, (endpoint, name)
        assert status != "ignored" or note, (endpoint, name)


@pytest.mark.parametrize("endpoint,name,status,body,note", ROWS,
                         ids=[f"{r[0]}-{r[1]}" for r in ROWS])
def test_field(cluster, served, endpoint, name, status, body, note):
    payload = dict(BASE[endpoint])
    payload.update({k: (served if v == "$MODEL" else v) for k, v in body.items()})
    code, _, raw = request(cluster.port, "POST", PATHS[endpoint], payload)
    if status == "refused":
        assert code == 400, raw
        err = json.loads(raw)["error"]
        assert err["param"] == name, err
        assert name in err["message"], err
    else:
        assert code == 200, raw


NEUTRAL = {"use_beam_search": False, "watermarking": False, "skip_special_tokens": True,
           "truncation_side": "left", "priority": 0,
           "return_token_ids": False, "cache_salt": None, "kv_transfer_params": None,
           "include_reasoning": True, "documents": [], "add_special_tokens": False}


@pytest.mark.parametrize("name,value", sorted(NEUTRAL.items()))
def test_refused_fields_accept_their_neutral_values(cluster, name, value):
    code, _, raw = request(cluster.port, "POST", PATHS["chat"], dict(BASE["chat"], **{name: value}))
    assert code == 200, raw
