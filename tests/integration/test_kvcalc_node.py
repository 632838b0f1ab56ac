"""`tandem kvcalc -m MODEL --memory SIZE` against a decode node started with that memory_budget:
the node's KV pool has exactly the blocks kvcalc says the budget buys. kvcalc measures the
weights and engine scratch with the node's own function (tdm_node_measure_engine), so the
K-quant repack (copies larger than the file's bytes) counts in both."""
import json
import os
import subprocess

import pytest

from conftest import BINARIES, MODEL, Cluster
from tandem_client import pb

MODELS = os.path.dirname(MODEL)


@pytest.mark.parametrize("model", [MODEL, os.path.join(MODELS, "gemma-3-270m-q4_k_m.gguf")])
def test_kvcalc_pool_blocks_equal_the_nodes(tmp_path, model):
    if not os.path.exists(model):
        pytest.skip(f"{model} is not in the model cache (scripts/setup)")
    out = subprocess.run([BINARIES["tandem"], "kvcalc", "-m", model, "--memory", "768MiB",
                          "--threads", "1", "--json"], capture_output=True, text=True, check=True)
    plan = json.loads(out.stdout)
    assert plan["scratch_bytes"] > 0, plan
    c = Cluster(str(tmp_path), n_prefill=0, n_decode=1, memory_budget="768MiB", threads=1,
                model=model).start()
    try:
        cl = c.client()
        try:
            st, msg, resp = cl.unary(pb.METHOD_STATUS, pb.StatusRequest(), pb.ClusterStatus)
            assert st == "OK", (st, msg)
        finally:
            cl.close()
        node = [n for n in resp.nodes if n.node_id == "decode-0"][0]
        assert node.kv_blocks_total == plan["pool_blocks"], (node.kv_blocks_total, plan)
    finally:
        c.stop()
