"""Bind here, advertise there (router.node_advertise, nodes[].kv_advertise): the layout of the
container deployments (deploy/compose.yaml, deploy/k8s), where every daemon binds the wildcard
address and the others reach it by a host name, since ZeroMQ binds no host names. Here the
router and the decode node bind 0.0.0.0 and advertise `localhost`: the nodes must register
through the name, the decode node must register its advertised KV endpoint, and the prefill
node must ship KV pages to it, giving the same text as a single process.
"""
import re

import pytest

from conftest import Cluster, reference
from tandem_client import prompt_request


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(str(tmp_path))
    with open(c.config) as f:
        text = f.read()
    node_port = c.node_ep.rsplit(":", 1)[1]
    text = text.replace(f"  node_endpoint: {c.node_ep}\n",
                        f"  node_endpoint: tcp://0.0.0.0:{node_port}\n"
                        f"  node_advertise: tcp://localhost:{node_port}\n")
    kv = re.search(r"    kv_endpoint: tcp://127\.0\.0\.1:(\d+)\n", text)
    c.kv_port = kv.group(1)
    text = text.replace(kv.group(0), f"    kv_endpoint: tcp://0.0.0.0:{c.kv_port}\n"
                                     f"    kv_advertise: tcp://localhost:{c.kv_port}\n")
    # wildcard binds without CURVE keys: allowed only with security.insecure (logged at start)
    text += "security:\n  insecure: true\n"
    with open(c.config, "w") as f:
        f.write(text)
    c.start()
    yield c
    codes = c.stop()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])


def test_nodes_reach_advertised_names(cluster):
    cl = cluster.client()
    try:
        for prompt in ("The capital of France is", "Once upon a time"):
            res = cl.generate(prompt_request(prompt=prompt, max_tokens=12, temperature=0.0))
            assert res.status == "OK", res
            assert res.text == reference(prompt=prompt, max_tokens=12)
    finally:
        cl.close()
    # The router stored the advertised KV endpoint, and both nodes went through the name.
    with open(cluster.logs["router"]) as f:
        router_log = f.read()
    assert f"kv_endpoint=tcp://localhost:{cluster.kv_port}" in router_log, router_log
    with open(cluster.logs["decode-0"]) as f:
        decode_log = f.read()
    assert f"kv=tcp://localhost:{cluster.kv_port}" in decode_log, decode_log
    node_port = cluster.node_ep.rsplit(":", 1)[1]
    assert f"router=tcp://localhost:{node_port}" in decode_log, decode_log
    assert "security.insecure is true" in router_log and "security.insecure is true" in decode_log
