"""The Grafana dashboards' rules (deploy/grafana/tandem.json and vllm.json), checked by
evaluating their own queries with `promtool test rules` over made-up series (no cluster, no
Prometheus server: promtool's rule unit tests, Debian package `prometheus`):

- a percentile is drawn only where its rate interval holds enough observations (p50 10, p90 20,
  p95 50, p99 100), and every latency panel also draws that observation count: one slow
  request is not a p50 and a p99;
- client cancellations (status CANCELLED) are their own series, never errors;
- KV usage is per node with its role, and the pool figure counts decode nodes only.

Grafana's variables are replaced by what they expand to ($__rate_interval: 1m, $instance: .*,
$model_name: the series' model).
"""
import json
import os
import re
import shutil
import subprocess

import pytest

from tandem_client import SOURCE_DIR

DASHBOARDS = {name: os.path.join(SOURCE_DIR, "deploy", "grafana", name)
              for name in ("tandem.json", "vllm.json")}
# observations a quantile needs in its window before a dashboard draws it
MIN_N = {0.5: 10, 0.9: 20, 0.95: 50, 0.99: 100}
MODEL = "m"
# every made-up series carries the labels either dashboard selects on
LABELS = f'instance="r",model_name="{MODEL}",engine="0"'
GUARD = re.compile(r"^histogram_quantile\(([0-9.]+), sum by ?\(le\) \(rate\(([a-z0-9_:]+)_bucket"
                   r"(\{[^}]*\})\[\$__rate_interval\]\)\)\) and on\(\) \(sum\(increase\(\2_count\3"
                   r"\[\$__rate_interval\]\)\) >= (\d+)\)$")


def promtool():
    path = shutil.which("promtool") or "/usr/bin/promtool"
    if not os.path.exists(path):
        pytest.fail("promtool is not installed (Debian package prometheus; run scripts/setup)")
    return path


def panels(name):
    with open(DASHBOARDS[name]) as f:
        dash = json.load(f)
    out = []

    def walk(ps):
        for p in ps:
            out.append(p)
            walk(p.get("panels", []))

    walk(dash["panels"])
    return out


def promql(expr):
    """A dashboard query as Prometheus gets it from Grafana."""
    return (expr.replace("$__rate_interval", "1m").replace("$instance", ".*")
            .replace("$model_name", MODEL))


def target(name, title, legend):
    """The expression of the target drawn as legend in the panel titled title."""
    for p in panels(name):
        if p.get("title") == title:
            for t in p.get("targets", []):
                if t.get("legendFormat") == legend:
                    return promql(t["expr"])
    raise AssertionError(f"{name}: no target {legend!r} in a panel {title!r}")


def quantile_targets(name):
    """[(panel, target, quantile, family, threshold)] of every histogram_quantile query; fails
    on one that is not guarded by its observation count."""
    out = []
    for p in panels(name):
        for t in p.get("targets", []):
            e = t["expr"]
            if "histogram_quantile" not in e:
                continue
            m = GUARD.match(e)
            assert m, f"{name} '{p['title']}' {t['legendFormat']}: an unguarded percentile: {e}"
            out.append((p, t, float(m.group(1)), m.group(2), int(m.group(4))))
    return out


def run_promtool(tmp_path, tests):
    """promtool test rules over tests (a list of YAML test groups, as text)."""
    f = tmp_path / "dashboard_test.yml"
    f.write_text("rule_files: []\nevaluation_interval: 1m\ntests:\n" + "".join(tests))
    out = subprocess.run([promtool(), "test", "rules", str(f)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def group(series, exprs):
    """One test group: series {selector: values} sampled every 15 s from 0 s, and exprs
    [(expr, [(labels, value)])] evaluated at 2 m (so over the window 60..120 s)."""
    lines = ["  - interval: 15s\n    input_series:\n"]
    for s, v in series.items():
        lines.append(f"      - series: {json.dumps(s)}\n        values: {json.dumps(v)}\n")
    lines.append("    promql_expr_test:\n")
    for e, samples in exprs:
        lines.append(f"      - expr: {json.dumps(e)}\n        eval_time: 2m\n")
        if not samples:
            lines.append("        exp_samples: []\n")
            continue
        lines.append("        exp_samples:\n")
        for labels, value in samples:
            lines.append(f"          - labels: {json.dumps(labels)}\n            value: {value}\n")
    return "".join(lines)


def histogram_series(family, values):
    """A histogram whose every observation falls in (1, 30] s: values of the cumulative
    counts (bucket le=30, +Inf and _count alike)."""
    zero = " ".join(["0"] * len(values.split()))
    return {f"{family}_bucket{{{LABELS},le=\"1\"}}": zero,
            f"{family}_bucket{{{LABELS},le=\"30\"}}": values,
            f"{family}_bucket{{{LABELS},le=\"+Inf\"}}": values,
            f"{family}_count{{{LABELS}}}": values,
            f"{family}_sum{{{LABELS}}}": values}


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_percentiles_need_enough_observations_and_show_their_count(name, tmp_path):
    qs = quantile_targets(name)
    assert qs, f"{name} draws no percentile"
    for p, t, q, fam, n in qs:
        assert n >= MIN_N[q], \
            f"{name} '{p['title']}' {t['legendFormat']}: p{q} from {n} observations"
        counts = [x for x in p["targets"]
                  if x["expr"].startswith(f"sum(increase({fam}_count{{")
                  and "histogram_quantile" not in x["expr"]]
        assert counts, f"{name} '{p['title']}': the observation count of {fam} is not drawn"
    # evaluated: one slow request (the 14.5 s TTFT of issue 37) draws no percentile and a count
    # of 1; 200 requests in the window draw every percentile and a count of 200
    fams = sorted({fam for _, _, _, fam, _ in qs})
    one, many = {}, {}
    for fam in fams:
        one.update(histogram_series(fam, "0 0 0 0 0 0 1 1 1"))
        many.update(histogram_series(fam, "0 0 0 0 0 50 100 150 200"))
    exprs_one, exprs_many, seen = [], [], set()
    for p, t, q, fam, n in qs:
        e = promql(t["expr"])
        exprs_one.append((f"count({e})", []))
        exprs_many.append((f"count({e})", [("{}", 1)]))
        for x in p["targets"]:
            c = promql(x["expr"])
            if x["expr"].startswith(f"sum(increase({fam}_count{{") and c not in seen:
                seen.add(c)
                exprs_one.append((c, [("{}", 1)]))
                exprs_many.append((c, [("{}", 200)]))
    run_promtool(tmp_path, [group(one, exprs_one), group(many, exprs_many)])


def test_client_cancellations_are_their_own_series_not_errors(tmp_path):
    # one request a second completes, one a second is cancelled by its client
    series = {f'tandem_requests_total{{{LABELS},status="OK",finish_reason="stop"}}': "0+15x8",
              f'tandem_requests_total{{{LABELS},status="CANCELLED",finish_reason="cancelled"}}':
                  "0+15x8"}
    ratio = target("tandem.json", "Error ratio", "")
    errors = target("tandem.json", "Errors / s by status", "{{status}}")
    cancelled = target("tandem.json", "Client cancellations / s", "cancelled")
    by_status = target("tandem.json", "Requests / s by status", "{{status}} {{finish_reason}}")
    exprs = [(ratio, [("{}", 0)]), (errors, []), (cancelled, [("{}", 1)]),
             (by_status, [('{status="OK",finish_reason="stop"}', 1),
                          ('{status="CANCELLED",finish_reason="cancelled"}', 1)])]
    # and one a second fails: an error, the cancellations unchanged
    failing = dict(series)
    failing[f'tandem_requests_total{{{LABELS},status="UNAVAILABLE",finish_reason="error"}}'] = \
        "0+15x8"
    exprs_failing = [(ratio, [("{}", 1 / 3)]), (errors, [('{status="UNAVAILABLE"}', 1)]),
                     (cancelled, [("{}", 1)])]
    # vLLM's names: abort is a finished_reason of its own, beside error
    vllm = {f'vllm:request_success_total{{{LABELS},finished_reason="{r}"}}': v
            for r, v in (("stop", "0+15x8"), ("abort", "0+15x8"), ("error", "0x8"))}
    reasons = target("vllm.json", "Finish Reason", "{{finished_reason}}")
    exprs_vllm = [(reasons, [('{finished_reason="stop"}', 60), ('{finished_reason="abort"}', 60),
                             ('{finished_reason="error"}', 0)])]
    run_promtool(tmp_path, [group(series, exprs), group(failing, exprs_failing),
                            group(vllm, exprs_vllm)])


def test_kv_usage_per_node_with_its_role_and_a_decode_only_pool(tmp_path):
    nodes = (("prefill-0", "prefill", 90), ("decode-0", "decode", 25), ("decode-1", "decode", 75))
    series = {}
    for node, role, used in nodes:
        sel = f'{LABELS},node="{node}",role="{role}"'
        series[f"tandem_node_kv_blocks_used{{{sel}}}"] = f"{used}x8"
        series[f"tandem_node_kv_blocks_capacity{{{sel}}}"] = "100x8"
        series[f'vllm:kv_cache_usage_perc{{model_name="{MODEL}",engine="{node}",role="{role}",'
               f'instance="r"}}'] = f"{used / 100}x8"
    title = "KV cache usage per node and decode pool"
    per_node = target("tandem.json", title, "{{node}} ({{role}})")
    pool = target("tandem.json", title, "decode pool")
    vpool = target("vllm.json", "Cache Utilization", "decode pool")
    vper_node = target("vllm.json", "Cache Utilization", "{{engine}} ({{role}})")
    exprs = [(per_node, [(f'{{node="{n}",role="{r}"}}', u / 100) for n, r, u in nodes]),
             (pool, [("{}", 0.5)]),  # (25 + 75) / 200: the prefill node's 90 not counted
             (vpool, [("{}", 0.5)]),
             (vper_node, [(f'{{__name__="vllm:kv_cache_usage_perc",model_name="{MODEL}",'
                           f'engine="{n}",role="{r}",instance="r"}}', u / 100)
                          for n, r, u in nodes])]
    run_promtool(tmp_path, [group(series, exprs)])
