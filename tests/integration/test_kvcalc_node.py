"""`tandem kvcalc -m MODEL --memory SIZE` against a decode node started with that memory_budget:
the node's KV pool has exactly the blocks kvcalc says the budget buys. kvcalc measures the
weights and engine scratch with the node's own function (tdm_node_measure_engine), so the
K-quant repack (copies larger than the file's bytes) counts in both."""
import json
import os
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from conftest import BINARIES, MODEL, Cluster, http_port, reference
from tandem_client import Result, pb, prompt_request

MODELS = os.path.dirname(MODEL)
GEMMA = os.path.join(MODELS, "gemma-3-270m-q4_k_m.gguf")


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


def kvcalc(model, *args):
    out = subprocess.run([BINARIES["tandem"], "kvcalc", "-m", model, "--memory", "768MiB",
                          "--threads", "1", "--json", *args], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def test_gemma_layer_groups_kvcalc_equals_the_node_and_outputs_are_unchanged(tmp_path):
    """Gemma 3 (five of every six layers see the last 512 tokens) on a decode node without
    prefill nodes: the node allocates KV per layer group, and `tandem kvcalc` at 8k and 32k
    contexts plans exactly its pool (blocks of one group's 3 layers; the node serves 8k,
    `max_context`, and the engine's scratch grows with the context); a prompt past the window,
    greedy and seeded, gives the single-process full-allocation output (`tandem generate`)."""
    if not os.path.exists(GEMMA):
        pytest.skip(f"{GEMMA} is not in the model cache (scripts/setup)")
    p8, p32 = kvcalc(GEMMA, "--context", "8192"), kvcalc(GEMMA, "--context", "32768")
    full = kvcalc(GEMMA, "--context", "8192", "--all-layers")
    assert p8["layer_groups"] == p32["layer_groups"] == 6, p8
    assert full["layer_groups"] == 1, full
    # 1 full-attention group of 512 blocks + 5 window groups of 33 at 8k; 2048 + 5 x 33 at 32k
    assert p8["blocks_per_sequence"] == 512 + 5 * 33, p8
    assert p32["blocks_per_sequence"] == 2048 + 5 * 33, p32
    assert p8["block_bytes"] * 6 == full["block_bytes"], (p8, full)
    # the prompt-logprobs reserve in the scratch grows with the context: (32768 - 8192) x 184 B
    assert p32["scratch_bytes"] - p8["scratch_bytes"] == (32768 - 8192) * 184, (p8, p32)
    assert p8["pool_blocks"] > p32["pool_blocks"], (p8, p32)
    assert p8["max_sequences"] > full["max_sequences"], (p8, full)
    c = Cluster(str(tmp_path), n_prefill=0, n_decode=1, memory_budget="768MiB", threads=1,
                model=GEMMA, extra_model="  max_context: 8192\n").start()
    try:
        node = c.nodes()["decode-0"]
        assert node.kv_blocks_total == p8["pool_blocks"], (node.kv_blocks_total, p8)
        assert node.kv_layer_groups == 6, node
        doc = json.loads(subprocess.run([BINARIES["tandem"], "status", "--json", "--router",
                                         c.client_ep], capture_output=True, text=True,
                                        check=True).stdout)
        assert [n["kv_layer_groups"] for n in doc["nodes"]] == [6], doc["nodes"]
        # the dashboard's plan of the node's own pool: the same blocks, the groups' formula,
        # once the dashboard's status (polled every second) has the node registered
        base = f"http://127.0.0.1:{http_port(c)}"
        end = time.time() + 120
        while True:
            with urllib.request.urlopen(base + "/api/status", timeout=30) as resp:
                st = json.loads(resp.read())
            seen = [n for n in st["nodes"] if n["node_id"] == "decode-0"]
            if seen and seen[0]["kv_layer_groups"] == 6:
                break
            assert time.time() < end, st["nodes"]
            time.sleep(0.2)
        assert seen[0]["pool"]["kv_blocks"] == node.kv_blocks_total, seen[0]
        assert seen[0]["pool"]["layer_groups"] == 6, seen[0]
        # its blocks hold one group's 3 layers: 3 * 2 * 256 * 16 * 2 = 49,152 B (2.9)
        assert seen[0]["kv_block_bytes"] == p8["block_bytes"] == 49152, seen[0]
        for ctx, plan in ((8192, p8), (32768, p32)):
            url = f"{base}/api/capacity?node=decode-0&context={ctx}"
            with urllib.request.urlopen(url, timeout=30) as resp:
                cap = json.loads(resp.read())
            assert cap["layer_groups"] == 6, cap
            assert cap["pool_blocks"] == node.kv_blocks_total, cap
            assert cap["block_bytes"] == plan["block_bytes"], (cap, plan)
            assert cap["blocks_per_sequence"] == plan["blocks_per_sequence"], (cap, plan)
            # the node's own pool at that context
            assert cap["max_sequences"] == node.kv_blocks_total // plan["blocks_per_sequence"], \
                (cap, plan)
        # without node=: the served model, per layer group as kvcalc -m (all_layers: every
        # layer in every block, as kvcalc --all-layers)
        for q, plan, groups in (("", p8, 6), ("&all_layers=1", full, 1)):
            url = f"{base}/api/capacity?context=8192&memory=768MiB{q}"
            with urllib.request.urlopen(url, timeout=30) as resp:
                cap = json.loads(resp.read())
            assert cap["source"] == "model" and cap["layer_groups"] == groups, cap
            assert cap["block_bytes"] == plan["block_bytes"], (cap, plan)
            assert cap["blocks_per_sequence"] == plan["blocks_per_sequence"], (cap, plan)
        try:
            urllib.request.urlopen(f"{base}/api/capacity?all_layers=maybe", timeout=30)
            raise AssertionError("all_layers=maybe accepted")
        except urllib.error.HTTPError as e:
            assert e.code == 400, e.code
            assert "all_layers must be 1, true, 0 or false" in e.read().decode(), e
        # about 700 tokens: past the 512-token window
        prompt = " ".join(f"item {i} is {'red' if i % 3 else 'blue'};" for i in range(120))
        cl = c.client()
        try:
            for sp in ({"temperature": 0.0}, {"temperature": 0.8, "seed": 7}):
                res = cl.generate(prompt_request(prompt=prompt, max_tokens=12, **sp),
                                  timeout_s=600)
                assert res.status == "OK", (res.status, res.message)
                assert res.final.usage.prompt_tokens > 512, res.final.usage
                ref = reference(prompt=prompt, max_tokens=12, model=GEMMA,
                                temperature=sp["temperature"], seed=sp.get("seed"))
                assert res.text == ref, (sp, res.text, ref)
        finally:
            cl.close()
    finally:
        codes = c.stop()
    assert all(rc == 0 for rc in codes.values()), codes


def test_node_allocating_per_layer_group_is_refused_by_a_router_expecting_every_layer(tmp_path):
    """A CPU decode node of a config whose Gemma nodes are all on the CPU allocates per layer
    group; a router whose config puts the prefill node on a GPU (so that every node of the model
    allocates every layer: their KV could not travel to a grouped pool) refuses its
    registration and says why in tandem status."""
    if not os.path.exists(GEMMA):
        pytest.skip(f"{GEMMA} is not in the model cache (scripts/setup)")
    c = Cluster(str(tmp_path), n_prefill=1, n_decode=1, memory_budget="768MiB", threads=1,
                model=GEMMA, default_keys=False)
    gpu = os.path.join(str(tmp_path), "gpu-prefill.yaml")
    with open(c.config) as f:
        cfg = f.read()
    prefill = ("  - id: prefill-0\n    role: prefill\n    threads: 1\n"
               "    memory_budget: 768MiB\n")
    assert prefill in cfg
    with open(gpu, "w") as f:
        f.write(cfg.replace(prefill, prefill + "    device: cuda:0\n"))
    try:
        c._spawn("router", [BINARIES["router"], "--config", gpu])
        c._spawn("decode-0", [BINARIES["decode"], "--config", c.config, "--node-id", "decode-0"])
        end = time.time() + 300
        node = None
        while time.time() < end:
            try:
                node = c.nodes().get("decode-0")
            except Exception:  # the router not listening yet
                node = None
            if node is not None and node.refused_reason:
                break
            time.sleep(0.5)
        assert node is not None and node.refused_reason, "no refusal in 300 s"
        assert not node.up
        assert "allocates KV in 6 layer groups" in node.refused_reason, node.refused_reason
        assert "the router expects every layer in every block" in node.refused_reason
        assert "no CUDA node in the config" in node.refused_reason, node.refused_reason
    finally:
        c.stop()


def test_gemma_disaggregated_per_layer_group_equals_single_process(tmp_path):
    """A CPU prefill node and two CPU decode nodes of Gemma 3 270M all allocate per layer group
    (protocol 2.9: the KV transfer ships each group's live blocks); a prompt past the 512-token
    window gives `tandem generate`'s tokens, greedy and seeded, and so do two streams of which
    one is migrated when its decode node is killed (its prompt and the output so far prefilled
    again and shipped, per group, to the other decode node)."""
    if not os.path.exists(GEMMA):
        pytest.skip(f"{GEMMA} is not in the model cache (scripts/setup)")
    c = Cluster(str(tmp_path), n_prefill=1, n_decode=2, memory_budget="768MiB", threads=1,
                model=GEMMA).start(timeout_s=300)
    try:
        nodes = c.nodes()
        assert [nodes[n].kv_layer_groups for n in ("prefill-0", "decode-0", "decode-1")] == \
            [6, 6, 6], nodes
        prompt = " ".join(f"item {i} is {'red' if i % 3 else 'blue'};" for i in range(120))
        cl = c.client()
        try:
            for sp in ({"temperature": 0.0}, {"temperature": 0.8, "seed": 7}):
                res = cl.generate(prompt_request(prompt=prompt, max_tokens=12, **sp),
                                  timeout_s=600)
                assert res.status == "OK", (res.status, res.message)
                assert res.final.usage.prompt_tokens > 512, res.final.usage
                ref = reference(prompt=prompt, max_tokens=12, model=GEMMA,
                                temperature=sp["temperature"], seed=sp.get("seed"))
                assert res.text == ref, (sp, res.text, ref)
            # migration: one stream on each decode node, then decode-0 dies
            n_out = 200
            calls = {cl.start(prompt_request(prompt=prompt, max_tokens=n_out, temperature=0.0,
                                             ignore_eos=True)): Result() for _ in range(2)}
            end = time.time() + 600
            while time.time() < end:
                nodes = c.nodes()
                if all(nodes[d].load.running > 0 for d in c.decode_ids):
                    break
                time.sleep(0.05)
            assert all(nodes[d].load.running > 0 for d in c.decode_ids), \
                {d: nodes[d].load.running for d in c.decode_ids}
            c.kill("decode-0")
            cl.collect(calls, timeout_s=600)
            ref = reference(prompt=prompt, max_tokens=n_out, model=GEMMA,
                            extra=("--ignore-eos",))
            for r in calls.values():
                assert r.status == "OK", (r.status, r.message)
                assert len(r.token_ids) == n_out, len(r.token_ids)
                assert r.text == ref, (r.text, ref)
        finally:
            cl.close()
    finally:
        c.stop()
