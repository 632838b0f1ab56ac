/* test_config.c - the cluster config: defaults, a full file, every class of error with its
 * exact "FILE:LINE: key 'a.b': message", dump -> load round trips, byte sizes, the example. */
#include "tdm_test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/chat.h"
#include "tandem/config.h"

/* Loads text as "cluster.yaml" and expects success. */
static void load_ok(const char *text, tdm_config_t *cfg)
{
    tdm_error_t err = {0};
    int rc = tdm_config_load_string(text, strlen(text), "cluster.yaml", cfg, &err);
    if (rc != TDM_OK)
        fail_msg("unexpected error: %s", err.msg);
}

/* Loads text as "cluster.yaml" and expects TDM_EINVALID with exactly this message. */
static void load_fails(const char *text, const char *msg)
{
    tdm_config_t cfg;
    tdm_error_t err = {0};
    int rc = tdm_config_load_string(text, strlen(text), "cluster.yaml", &cfg, &err);
    assert_int_equal(rc, TDM_EINVALID);
    assert_int_equal(err.code, TDM_EINVALID);
    assert_string_equal(err.msg, msg);
    /* the key a message names is the error's field */
    const char *k = strstr(msg, "key '");
    char key[TDM_ERRFIELD_MAX] = "";
    if (k)
        snprintf(key, sizeof key, "%.*s", (int)strcspn(k + 5, "'"), k + 5);
    assert_string_equal(err.field, key);
    /* A failed load leaves nothing to free. */
    assert_null(cfg.nodes);
    assert_null(cfg.model.path);
    assert_null(cfg.router.client_endpoint);
}

/* The dump of cfg as a heap string; caller frees. */
static char *dump_string(const tdm_config_t *cfg)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_non_null(f);
    assert_int_equal(tdm_config_dump(cfg, f), TDM_OK);
    assert_int_equal(fclose(f), 0);
    return buf;
}

static void assert_str_or_null_equal(const char *a, const char *b)
{
    if (!a || !b)
        assert_ptr_equal(a, b);
    else
        assert_string_equal(a, b);
}

/* Field by field equality of two configs. */
static void assert_config_equal(const tdm_config_t *a, const tdm_config_t *b)
{
    assert_string_equal(a->model.path, b->model.path);
    assert_int_equal(a->model.chat_template == NULL, b->model.chat_template == NULL);
    if (a->model.chat_template)
        assert_string_equal(a->model.chat_template, b->model.chat_template);
    assert_string_equal(a->model.name, b->model.name);
    assert_string_equal(a->router.client_endpoint, b->router.client_endpoint);
    assert_string_equal(a->router.node_endpoint, b->router.node_endpoint);
    assert_str_or_null_equal(a->router.node_advertise, b->router.node_advertise);
    assert_string_equal(a->router.http_address, b->router.http_address);
    assert_int_equal(a->router.http_port, b->router.http_port);
    assert_int_equal(a->router.http_threads, b->router.http_threads);
    assert_int_equal(a->router.http_connection_timeout_s, b->router.http_connection_timeout_s);
    assert_int_equal(a->router.http_max_connections, b->router.http_max_connections);
    assert_int_equal(a->router.http_max_connections_per_client,
                     b->router.http_max_connections_per_client);
    assert_int_equal(a->router.prefill_policy, b->router.prefill_policy);
    assert_int_equal(a->router.max_queue, b->router.max_queue);
    assert_int_equal(a->router.admission_control, b->router.admission_control);
    assert_int_equal(a->router.metrics_compat_vllm, b->router.metrics_compat_vllm);
    assert_true(a->router.request_timeout_s == b->router.request_timeout_s);
    assert_int_equal(a->router.n_api_keys, b->router.n_api_keys);
    for (size_t i = 0; i < a->router.n_api_keys; i++)
        assert_string_equal(a->router.api_keys[i], b->router.api_keys[i]);
    assert_int_equal(a->router.public_metrics, b->router.public_metrics);
    assert_int_equal(a->router.n_cors_origins, b->router.n_cors_origins);
    for (size_t i = 0; i < a->router.n_cors_origins; i++)
        assert_string_equal(a->router.cors_origins[i], b->router.cors_origins[i]);
    assert_int_equal(a->kv.block_size, b->kv.block_size);
    assert_int_equal(a->kv.dtype, b->kv.dtype);
    assert_int_equal(a->kv.prefix_caching, b->kv.prefix_caching);
    assert_true(a->kv.transfer_timeout_s == b->kv.transfer_timeout_s);
    assert_int_equal(a->log.level, b->log.level);
    assert_str_or_null_equal(a->router.curve_public_key, b->router.curve_public_key);
    assert_str_or_null_equal(a->router.curve_secret_key_file, b->router.curve_secret_key_file);
    assert_int_equal(a->security.insecure, b->security.insecure);
    assert_int_equal(a->n_models, b->n_models);
    for (size_t i = 0; i < a->n_models; i++) {
        const tdm_model_config_t *x = &a->models[i], *y = &b->models[i];
        assert_string_equal(x->path, y->path);
        assert_string_equal(x->name, y->name);
        assert_str_or_null_equal(x->chat_template, y->chat_template);
        assert_int_equal(x->reasoning_parser, y->reasoning_parser);
        assert_int_equal(x->tool_call_parser, y->tool_call_parser);
        assert_int_equal(x->n_aliases, y->n_aliases);
        assert_memory_equal(&x->defaults, &y->defaults, sizeof x->defaults);
        for (size_t j = 0; j < x->n_aliases; j++)
            assert_string_equal(x->aliases[j], y->aliases[j]);
    }
    assert_int_equal(a->n_nodes, b->n_nodes);
    for (size_t i = 0; i < a->n_nodes; i++) {
        const tdm_node_config_t *x = &a->nodes[i], *y = &b->nodes[i];
        assert_string_equal(x->id, y->id);
        assert_str_or_null_equal(x->model, y->model);
        assert_int_equal(x->role, y->role);
        assert_str_or_null_equal(x->endpoint, y->endpoint);
        assert_str_or_null_equal(x->kv_endpoint, y->kv_endpoint);
        assert_str_or_null_equal(x->kv_advertise, y->kv_advertise);
        assert_int_equal(x->device.kind, y->device.kind);
        assert_int_equal(x->device.index, y->device.index);
        assert_int_equal(x->threads, y->threads);
        assert_int_equal(x->memory_budget, y->memory_budget);
        assert_true(x->gpu_memory_utilization == y->gpu_memory_utilization);
        assert_str_or_null_equal(x->curve_public_key, y->curve_public_key);
        assert_str_or_null_equal(x->curve_secret_key_file, y->curve_secret_key_file);
        assert_int_equal(x->max_batch_tokens, y->max_batch_tokens);
        assert_int_equal(x->max_running, y->max_running);
        assert_int_equal(x->grammar_cache_bytes, y->grammar_cache_bytes);
        assert_int_equal(x->spec_max_draft, y->spec_max_draft);
        assert_true(x->spec_row_cost == y->spec_row_cost);
    }
}

/* dump(cfg) loads back into a config equal to cfg whose dump is the same text. */
static void assert_round_trip(const tdm_config_t *cfg)
{
    char *text = dump_string(cfg);
    tdm_config_t back;
    load_ok(text, &back);
    assert_config_equal(cfg, &back);
    char *again = dump_string(&back);
    assert_string_equal(text, again);
    free(again);
    free(text);
    tdm_config_free(&back);
}

static void test_defaults(void **state)
{
    (void)state;
    setenv("XDG_CACHE_HOME", "/tmp/xdg-cache", 1);
    unsetenv("TANDEM_MODEL");
    tdm_config_t cfg;
    assert_int_equal(tdm_config_defaults(&cfg), TDM_OK);
    assert_string_equal(cfg.model.path,
                        "/tmp/xdg-cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert_string_equal(cfg.model.name, "SmolLM2-135M-Instruct.Q4_1");
    assert_null(cfg.model.chat_template);
    assert_string_equal(cfg.router.client_endpoint, "tcp://127.0.0.1:7600");
    assert_string_equal(cfg.router.node_endpoint, "tcp://127.0.0.1:7601");
    assert_string_equal(cfg.router.http_address, "127.0.0.1");
    assert_int_equal(cfg.router.http_port, 8000);
    assert_int_equal(cfg.router.http_threads, 4);
    assert_int_equal(cfg.router.http_connection_timeout_s, 30);
    assert_int_equal(cfg.router.http_max_connections, 1000);
    assert_int_equal(cfg.router.http_max_connections_per_client, 64);
    assert_int_equal(cfg.router.prefill_policy, TDM_PREFILL_POLICY_ROUND_ROBIN);
    assert_int_equal(cfg.router.max_queue, 1024);
    assert_true(cfg.router.admission_control);
    assert_true(cfg.router.metrics_compat_vllm);
    assert_true(cfg.router.request_timeout_s == 600.0);
    assert_int_equal(cfg.router.n_api_keys, 0);
    assert_false(cfg.router.public_metrics);
    assert_int_equal(cfg.router.n_cors_origins, 0);
    assert_int_equal(cfg.kv.block_size, 16);
    assert_int_equal(cfg.kv.dtype, TDM_KV_F16);
    assert_true(cfg.kv.prefix_caching);
    assert_true(cfg.kv.transfer_timeout_s == 10.0); /* docs/protocol.md's default */
    assert_int_equal(cfg.log.level, TDM_LOG_INFO);
    assert_null(cfg.router.curve_public_key);
    assert_null(cfg.router.curve_secret_key_file);
    assert_false(cfg.security.insecure);
    assert_false(tdm_config_curve_on(&cfg));
    assert_int_equal(cfg.n_nodes, 2);
    const tdm_node_config_t *p = tdm_config_find_node(&cfg, "prefill-0");
    const tdm_node_config_t *d = tdm_config_find_node(&cfg, "decode-0");
    assert_ptr_equal(p, &cfg.nodes[0]);
    assert_ptr_equal(d, &cfg.nodes[1]);
    assert_null(tdm_config_find_node(&cfg, "decode-1"));
    assert_null(tdm_config_find_node(&cfg, NULL));
    assert_int_equal(p->role, TDM_NODE_ROLE_PREFILL);
    assert_null(p->kv_endpoint);
    assert_null(p->endpoint);
    assert_int_equal(d->role, TDM_NODE_ROLE_DECODE);
    assert_string_equal(d->kv_endpoint, "tcp://127.0.0.1:7610");
    for (size_t i = 0; i < 2; i++) {
        assert_int_equal(cfg.nodes[i].device.kind, TDM_NODE_DEVICE_CPU);
        assert_int_equal(cfg.nodes[i].threads, 0);
        assert_int_equal(cfg.nodes[i].memory_budget, 2ull << 30);
        assert_true(cfg.nodes[i].gpu_memory_utilization == 0.0);
        assert_int_equal(cfg.nodes[i].max_batch_tokens, 2048);
        assert_int_equal(cfg.nodes[i].max_running, 64);
        assert_int_equal(cfg.nodes[i].grammar_cache_bytes, 64ull << 20);
        assert_int_equal(cfg.nodes[i].spec_max_draft, TDM_CONFIG_DEFAULT_SPEC_MAX_DRAFT);
    }

    /* An empty file, a comment-only file and empty sections give the same defaults. */
    const char *same[] = {"", "# nothing here\n", "model:\nrouter:\nkv: {}\nlog:\nsecurity:\n"};
    for (size_t i = 0; i < sizeof same / sizeof same[0]; i++) {
        tdm_config_t other;
        load_ok(same[i], &other);
        assert_config_equal(&cfg, &other);
        tdm_config_free(&other);
    }
    assert_round_trip(&cfg);
    tdm_config_free(&cfg);
    assert_null(cfg.nodes);
    tdm_config_free(&cfg); /* a freed config may be freed again */
    tdm_config_free(NULL);
    unsetenv("XDG_CACHE_HOME");
}

static void test_model_default_path(void **state)
{
    (void)state;
    char buf[512], home[1024];
    snprintf(home, sizeof home, "%s", getenv("HOME") ? getenv("HOME") : "/root");
    unsetenv("TANDEM_MODEL");
    setenv("XDG_CACHE_HOME", "/x/cache", 1);
    assert_int_equal(tdm_model_default_path(buf, sizeof buf), TDM_OK);
    assert_string_equal(buf, "/x/cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    unsetenv("XDG_CACHE_HOME");
    setenv("HOME", "/home/u", 1);
    assert_int_equal(tdm_model_default_path(buf, sizeof buf), TDM_OK);
    assert_string_equal(buf, "/home/u/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert_int_equal(tdm_model_default_path(buf, 10), TDM_ERESOURCE);
    assert_string_equal(buf, "");
    setenv("TANDEM_MODEL", "/models/other.gguf", 1);
    assert_int_equal(tdm_model_default_path(buf, sizeof buf), TDM_OK);
    assert_string_equal(buf, "/models/other.gguf");

    /* The model name follows the path; "~/" expands with $HOME. */
    tdm_config_t cfg;
    assert_int_equal(tdm_config_defaults(&cfg), TDM_OK);
    assert_string_equal(cfg.model.path, "/models/other.gguf");
    assert_string_equal(cfg.model.name, "other");
    tdm_config_free(&cfg);
    load_ok("model:\n  path: ~/m/llama.gguf\n", &cfg);
    assert_string_equal(cfg.model.path, "/home/u/m/llama.gguf");
    assert_string_equal(cfg.model.name, "llama");
    tdm_config_free(&cfg);
    unsetenv("TANDEM_MODEL");

    unsetenv("HOME");
    assert_int_equal(tdm_model_default_path(buf, sizeof buf), TDM_ENOTFOUND);
    assert_int_equal(tdm_config_defaults(&cfg), TDM_ENOTFOUND);
    assert_null(cfg.nodes);
    /* With model.path set the file does not need $HOME. */
    load_ok("model: {path: /m.gguf}\n", &cfg);
    assert_string_equal(cfg.model.name, "m");
    tdm_config_free(&cfg);
    setenv("HOME", home, 1);
}

static const char full_yaml[] =
    "# a cluster of two prefill and two decode nodes\n"
    "model:\n"
    "  path: /models/llama.gguf\n"
    "  chat_template: llama3\n"
    "  name: llama-3-8b\n"
    "router:\n"
    "  client_endpoint: tcp://10.0.0.1:9600\n"
    "  node_endpoint: \"tcp://10.0.0.1:9601\"\n"
    "  http_address: 0.0.0.0\n"
    "  http_port: 8080\n"
    "  http_threads: 2\n"
    "  http_connection_timeout_s: 10\n"
    "  http_max_connections: 500\n"
    "  http_max_connections_per_client: 0\n"
    "  prefill_policy: prefix_aware\n"
    "  max_queue: 50\n"
    "  admission_control: false\n"
    "  metrics_compat: none\n"
    "  request_timeout_s: 2.5\n"
    "  api_keys: [key-one, 'key-two']\n"
    "  public_metrics: true\n"
    "  cors_origins: ['http://localhost:3000', '*']\n"
    "  curve_public_key: \"rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7\"\n"
    "  curve_secret_key_file: /etc/tandem/keys/router.key\n"
    "kv:\n"
    "  block_size: 32\n"
    "  dtype: q8\n"
    "  prefix_caching: false\n"
    "  transfer_timeout_s: 2.5\n"
    "log: {level: warning}\n"
    "security:\n"
    "  insecure: true\n"
    "nodes:\n"
    "  - id: p0\n"
    "    role: prefill\n"
    "    device: cuda:0\n"
    "    max_batch_tokens: 8192\n"
    "    curve_public_key: \"Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID\"\n"
    "    curve_secret_key_file: /etc/tandem/keys/p0.key\n"
    "  - id: p1\n"
    "    role: prefill\n"
    "    endpoint: ipc:///tmp/p1.sock\n"
    "    device: cpu\n"
    "    threads: 8\n"
    "    memory_budget: 1.5GB\n"
    "    curve_public_key: \"D:)Q[IlAW!ahhC2ac:9*A}h:p?([4%wOTJ%JR%cs\"\n"
    "    curve_secret_key_file: /etc/tandem/keys/p1.key\n"
    "  - id: d0\n"
    "    role: decode\n"
    "    device: cuda:1\n"
    "    gpu_memory_utilization: 0.5\n"
    "    max_running: 256\n"
    "    grammar_cache_bytes: 1MiB\n"
    "    speculative:\n"
    "      max_draft: 5\n"
    "      row_cost: 0.25\n"
    "    curve_public_key: \"Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hIE\"\n"
    "    curve_secret_key_file: /etc/tandem/keys/d0.key\n"
    "  - id: d1\n"
    "    role: decode\n"
    "    kv_endpoint: tcp://10.0.0.3:9700\n"
    "    device: cuda\n"
    "    memory_budget: 40GiB\n"
    "    curve_public_key: \"D:)Q[IlAW!ahhC2ac:9*A}h:p?([4%wOTJ%JR%ct\"\n"
    "    curve_secret_key_file: ~/keys/d1.key\n";

static void test_full_file(void **state)
{
    (void)state;
    tdm_config_t cfg;
    load_ok(full_yaml, &cfg);
    assert_string_equal(cfg.model.path, "/models/llama.gguf");
    assert_string_equal(cfg.model.chat_template, "llama3");
    assert_string_equal(cfg.model.name, "llama-3-8b");
    assert_string_equal(cfg.router.client_endpoint, "tcp://10.0.0.1:9600");
    assert_string_equal(cfg.router.node_endpoint, "tcp://10.0.0.1:9601");
    assert_string_equal(cfg.router.http_address, "0.0.0.0");
    assert_int_equal(cfg.router.http_port, 8080);
    assert_int_equal(cfg.router.http_threads, 2);
    assert_int_equal(cfg.router.http_connection_timeout_s, 10);
    assert_int_equal(cfg.router.http_max_connections, 500);
    assert_int_equal(cfg.router.http_max_connections_per_client, 0);
    assert_int_equal(cfg.router.prefill_policy, TDM_PREFILL_POLICY_PREFIX_AWARE);
    assert_int_equal(cfg.router.max_queue, 50);
    assert_false(cfg.router.admission_control);
    assert_false(cfg.router.metrics_compat_vllm);
    assert_true(cfg.router.request_timeout_s == 2.5);
    assert_int_equal(cfg.router.n_api_keys, 2);
    assert_string_equal(cfg.router.api_keys[0], "key-one");
    assert_string_equal(cfg.router.api_keys[1], "key-two");
    assert_true(cfg.router.public_metrics);
    assert_int_equal(cfg.router.n_cors_origins, 2);
    assert_string_equal(cfg.router.cors_origins[0], "http://localhost:3000");
    assert_string_equal(cfg.router.cors_origins[1], "*");
    assert_int_equal(cfg.kv.block_size, 32);
    assert_int_equal(cfg.kv.dtype, TDM_KV_Q8);
    assert_false(cfg.kv.prefix_caching);
    assert_true(cfg.kv.transfer_timeout_s == 2.5);
    assert_int_equal(cfg.log.level, TDM_LOG_WARN);
    assert_string_equal(cfg.router.curve_public_key, "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7");
    assert_string_equal(cfg.router.curve_secret_key_file, "/etc/tandem/keys/router.key");
    assert_true(tdm_config_curve_on(&cfg));
    assert_true(cfg.security.insecure);
    assert_string_equal(cfg.nodes[0].curve_public_key, "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID");
    assert_string_equal(cfg.nodes[3].curve_public_key, "D:)Q[IlAW!ahhC2ac:9*A}h:p?([4%wOTJ%JR%ct");
    assert_string_equal(cfg.nodes[2].curve_secret_key_file, "/etc/tandem/keys/d0.key");
    if (getenv("HOME") && getenv("HOME")[0]) /* "~/" is expanded like model.path */
        assert_ptr_equal(strstr(cfg.nodes[3].curve_secret_key_file, getenv("HOME")),
                         cfg.nodes[3].curve_secret_key_file);
    assert_int_equal(cfg.n_nodes, 4);

    const tdm_node_config_t *n = tdm_config_find_node(&cfg, "p0");
    assert_non_null(n);
    assert_int_equal(n->role, TDM_NODE_ROLE_PREFILL);
    assert_int_equal(n->device.kind, TDM_NODE_DEVICE_CUDA);
    assert_int_equal(n->device.index, 0);
    assert_true(n->gpu_memory_utilization == 0.9); /* default on cuda */
    assert_int_equal(n->memory_budget, 0);
    assert_int_equal(n->max_batch_tokens, 8192);
    assert_int_equal(n->max_running, 64);
    assert_null(n->kv_endpoint);

    n = tdm_config_find_node(&cfg, "p1");
    assert_string_equal(n->endpoint, "ipc:///tmp/p1.sock");
    assert_int_equal(n->device.kind, TDM_NODE_DEVICE_CPU);
    assert_int_equal(n->threads, 8);
    assert_int_equal(n->memory_budget, 1500000000ull);
    assert_true(n->gpu_memory_utilization == 0.0);

    n = tdm_config_find_node(&cfg, "d0");
    assert_int_equal(n->role, TDM_NODE_ROLE_DECODE);
    assert_string_equal(n->kv_endpoint, "tcp://127.0.0.1:7610"); /* first decode node */
    assert_int_equal(n->device.index, 1);
    assert_true(n->gpu_memory_utilization == 0.5);
    assert_int_equal(n->max_running, 256);
    assert_int_equal(n->grammar_cache_bytes, 1ull << 20);
    assert_int_equal(n->spec_max_draft, 5);
    assert_true(n->spec_row_cost == 0.25);

    n = tdm_config_find_node(&cfg, "d1");
    assert_string_equal(n->kv_endpoint, "tcp://10.0.0.3:9700");
    assert_int_equal(n->device.kind, TDM_NODE_DEVICE_CUDA);
    assert_int_equal(n->device.index, 0);
    assert_int_equal(n->memory_budget, 40ull << 30);
    assert_true(n->gpu_memory_utilization == 0.0);

    assert_round_trip(&cfg);
    tdm_config_free(&cfg);
}

/* Writes len bytes of text to a fresh temporary file whose path goes into path (cap bytes). */
static void temp_file(const char *text, size_t len, char *path, size_t cap)
{
    snprintf(path, cap, "/tmp/tdm-test-config-XXXXXX");
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    assert_non_null(f);
    assert_int_equal(fwrite(text, 1, len, f), len);
    fclose(f);
}

/* model.chat_template naming a file: loaded when it compiles; refused, naming the path and the
 * limit or the line:column, when it is too big or does not compile. */
static void test_chat_template_file(void **state)
{
    (void)state;
    char path[64], yaml[160];
    tdm_config_t cfg;
    tdm_error_t err = {0};
    temp_file("{% for m in messages %}{{ m.content }}{% endfor %}\n", 51, path, sizeof path);
    snprintf(yaml, sizeof yaml, "model:\n  chat_template: %s\n", path);
    load_ok(yaml, &cfg);
    assert_string_equal(cfg.model.chat_template, path);
    assert_round_trip(&cfg);
    tdm_config_free(&cfg);
    unlink(path);

    size_t big = TDM_CHAT_TEMPLATE_MAX_BYTES + 1;
    char *text = malloc(big);
    assert_non_null(text);
    memset(text, 'x', big);
    temp_file(text, big, path, sizeof path);
    free(text);
    snprintf(yaml, sizeof yaml, "model:\n  chat_template: %s\n", path);
    assert_int_equal(tdm_config_load_string(yaml, strlen(yaml), "c.yaml", &cfg, &err),
                     TDM_EINVALID);
    assert_string_equal(err.field, "model.chat_template");
    assert_non_null(strstr(err.msg, path));
    assert_non_null(strstr(err.msg, "262144"));
    unlink(path);

    temp_file("ok\n{{ x + }}", 12, path, sizeof path);
    snprintf(yaml, sizeof yaml, "model:\n  chat_template: %s\n", path);
    assert_int_equal(tdm_config_load_string(yaml, strlen(yaml), "c.yaml", &cfg, &err),
                     TDM_EINVALID);
    char where[80];
    snprintf(where, sizeof where, "%s: 2:", path);
    if (!strstr(err.msg, where))
        fail_msg("%s", err.msg);
    unlink(path);
}

static void test_chat_template_gemma(void **state)
{
    (void)state;
    tdm_config_t cfg;
    load_ok("model:\n  chat_template: gemma\n", &cfg);
    assert_string_equal(cfg.model.chat_template, "gemma");
    assert_round_trip(&cfg);
    tdm_config_free(&cfg);
}

static void test_default_kv_endpoints(void **state)
{
    (void)state;
    tdm_config_t cfg;
    load_ok("nodes:\n"
            "  - {id: d0, role: decode}\n"
            "  - {id: p0, role: prefill}\n"
            "  - {id: d1, role: decode}\n"
            "  - {id: d2, role: decode, kv_endpoint: 'tcp://127.0.0.1:7700'}\n"
            "  - {id: d3, role: decode}\n",
            &cfg);
    assert_string_equal(cfg.nodes[0].kv_endpoint, "tcp://127.0.0.1:7610");
    assert_null(cfg.nodes[1].kv_endpoint);
    assert_string_equal(cfg.nodes[2].kv_endpoint, "tcp://127.0.0.1:7611");
    assert_string_equal(cfg.nodes[3].kv_endpoint, "tcp://127.0.0.1:7700");
    assert_string_equal(cfg.nodes[4].kv_endpoint, "tcp://127.0.0.1:7613");
    assert_round_trip(&cfg);
    tdm_config_free(&cfg);

    /* A decode-only cluster is valid (decode nodes can prefill locally). */
    load_ok("nodes:\n  - id: solo\n    role: decode\n", &cfg);
    assert_int_equal(cfg.n_nodes, 1);
    tdm_config_free(&cfg);
}

/* Bind here, advertise there (containers: ZeroMQ binds no host names, so a node binds
 * tcp://0.0.0.0:P and the others reach it by its service name). */
static void test_advertise(void **state)
{
    (void)state;
    tdm_config_t cfg;
    /* Unset: the advertised endpoints are the bound ones. */
    load_ok("nodes:\n  - {id: p0, role: prefill}\n  - {id: d0, role: decode}\n", &cfg);
    assert_null(cfg.router.node_advertise);
    assert_string_equal(tdm_config_router_advertise(&cfg), "tcp://127.0.0.1:7601");
    assert_null(tdm_config_kv_advertise(&cfg.nodes[0]));
    assert_null(cfg.nodes[1].kv_advertise);
    assert_string_equal(tdm_config_kv_advertise(&cfg.nodes[1]), "tcp://127.0.0.1:7610");
    assert_round_trip(&cfg);
    tdm_config_free(&cfg);

    /* The compose file's shape: every decode node binds the same wildcard endpoint on its own
     * host, which is no duplicate since each advertises its own name. */
    load_ok("router:\n"
            "  client_endpoint: tcp://0.0.0.0:7600\n"
            "  node_endpoint: tcp://0.0.0.0:7601\n"
            "  node_advertise: \"tcp://router:7601\"\n"
            "nodes:\n"
            "  - {id: prefill-0, role: prefill}\n"
            "  - id: decode-0\n"
            "    role: decode\n"
            "    kv_endpoint: tcp://0.0.0.0:7610\n"
            "    kv_advertise: tcp://decode-0:7610\n"
            "  - id: decode-1\n"
            "    role: decode\n"
            "    kv_endpoint: tcp://0.0.0.0:7610\n"
            "    kv_advertise: \"tcp://decode-1:7610\"\n",
            &cfg);
    assert_string_equal(cfg.router.node_endpoint, "tcp://0.0.0.0:7601");
    assert_string_equal(cfg.router.node_advertise, "tcp://router:7601");
    assert_string_equal(tdm_config_router_advertise(&cfg), "tcp://router:7601");
    assert_string_equal(cfg.nodes[1].kv_endpoint, "tcp://0.0.0.0:7610");
    assert_string_equal(cfg.nodes[1].kv_advertise, "tcp://decode-0:7610");
    assert_string_equal(tdm_config_kv_advertise(&cfg.nodes[1]), "tcp://decode-0:7610");
    assert_string_equal(tdm_config_kv_advertise(&cfg.nodes[2]), "tcp://decode-1:7610");
    assert_round_trip(&cfg);
    char *text = dump_string(&cfg);
    assert_non_null(strstr(text, "  node_advertise: \"tcp://router:7601\"\n"));
    assert_non_null(strstr(text, "    kv_advertise: \"tcp://decode-1:7610\"\n"));
    free(text);
    tdm_config_free(&cfg);

    /* Advertising what is bound is allowed (and changes nothing). */
    load_ok("router:\n  node_advertise: tcp://127.0.0.1:7601\n"
            "nodes:\n  - {id: d, role: decode, kv_endpoint: 'tcp://10.0.0.2:7610',"
            " kv_advertise: 'tcp://10.0.0.2:7610'}\n",
            &cfg);
    assert_string_equal(tdm_config_kv_advertise(&cfg.nodes[0]), "tcp://10.0.0.2:7610");
    tdm_config_free(&cfg);

    load_fails("router:\n  node_advertise: tcp://0.0.0.0:7601\n",
               "cluster.yaml:2: key 'router.node_advertise': must name a host the other nodes "
               "can reach, not the wildcard address '0.0.0.0' (a wildcard belongs in the "
               "endpoint that is bound)");
    load_fails("nodes:\n  - id: d\n    role: decode\n    kv_advertise: tcp://*:7610\n",
               "cluster.yaml:4: key 'nodes[0].kv_advertise': must name a host the other nodes "
               "can reach, not the wildcard address '*' (a wildcard belongs in the endpoint "
               "that is bound)");
    load_fails("nodes:\n  - id: d\n    role: decode\n    kv_advertise: decode-0:7610\n",
               "cluster.yaml:4: key 'nodes[0].kv_advertise': must be a ZeroMQ endpoint "
               "tcp://HOST:PORT, ipc://PATH or inproc://NAME, got 'decode-0:7610'");
    load_fails("nodes:\n  - {id: d, role: decode}\n"
               "  - {id: p, role: prefill, kv_advertise: 'tcp://p:1'}\n",
               "cluster.yaml:3: key 'nodes[1].kv_advertise': only decode nodes receive KV pages");
    /* Two nodes advertising the same endpoint collide; so does an advertised endpoint that
     * is another node's bound one. */
    load_fails("nodes:\n"
               "  - {id: d0, role: decode, kv_endpoint: 'tcp://0.0.0.0:7610',"
               " kv_advertise: 'tcp://kv:7610'}\n"
               "  - {id: d1, role: decode, kv_endpoint: 'tcp://0.0.0.0:7610',"
               " kv_advertise: 'tcp://kv:7610'}\n",
               "cluster.yaml:3: key 'nodes[1].kv_advertise': endpoint tcp://kv:7610 is also "
               "used by nodes[0].kv_advertise");
    load_fails("router:\n  node_advertise: tcp://127.0.0.1:7610\n"
               "nodes:\n  - {id: d, role: decode}\n",
               "cluster.yaml:2: key 'router.node_advertise': endpoint tcp://127.0.0.1:7610 is "
               "also used by nodes[0].kv_endpoint (its default)");
    /* Without kv_advertise two equal binds are still an error (one host, one port). */
    load_fails("nodes:\n"
               "  - {id: d0, role: decode, kv_endpoint: 'tcp://0.0.0.0:7610'}\n"
               "  - {id: d1, role: decode, kv_endpoint: 'tcp://0.0.0.0:7610'}\n",
               "cluster.yaml:3: key 'nodes[1].kv_endpoint': endpoint tcp://0.0.0.0:7610 is "
               "also used by nodes[0].kv_endpoint");
}

/* deploy/config/compose.yaml (docker compose) and the cluster configs of deploy/k8s (base,
 * cuda) load, and bind wildcards while advertising service names (every router's). */
static void test_deploy_configs(void **state)
{
    (void)state;
    tdm_config_t cfg;
    tdm_error_t err = {0};
    const char *path = TDM_SOURCE_DIR "/deploy/config/compose.yaml";
    if (tdm_config_load_file(path, &cfg, &err) != TDM_OK)
        fail_msg("%s", err.msg);
    assert_string_equal(cfg.router.node_endpoint, "tcp://0.0.0.0:7601");
    size_t n_eps;
    const char *const *eps = tdm_config_router_endpoints(&cfg, &n_eps);
    assert_int_equal(n_eps, 2); /* two routers: the services router and router-1 */
    assert_string_equal(eps[0], "tcp://router:7601");
    assert_string_equal(eps[1], "tcp://router-1:7601");
    assert_string_equal(cfg.router.http_address, "0.0.0.0");
    const tdm_node_config_t *d = tdm_config_find_node(&cfg, "decode-0");
    assert_non_null(d);
    assert_string_equal(d->kv_endpoint, "tcp://0.0.0.0:7610");
    assert_string_equal(tdm_config_kv_advertise(d), "tcp://decode-0:7610");
    assert_non_null(tdm_config_find_node(&cfg, "prefill-0"));
    assert_round_trip(&cfg);
    tdm_config_free(&cfg);

    path = TDM_SOURCE_DIR "/deploy/k8s/base/cluster.yaml";
    if (tdm_config_load_file(path, &cfg, &err) != TDM_OK)
        fail_msg("%s", err.msg);
    eps = tdm_config_router_endpoints(&cfg, &n_eps);
    assert_int_equal(n_eps, 2); /* the router StatefulSet's pods, through its headless Service */
    assert_string_equal(eps[0], "tcp://tandem-router-0.tandem-router-nodes:7601");
    assert_string_equal(eps[1], "tcp://tandem-router-1.tandem-router-nodes:7601");
    d = tdm_config_find_node(&cfg, "tandem-decode-0");
    assert_non_null(d);
    assert_string_equal(tdm_config_kv_advertise(d), "tcp://tandem-decode-0.tandem-decode-kv:7610");
    assert_non_null(tdm_config_find_node(&cfg, "tandem-prefill-0"));
    assert_round_trip(&cfg);
    tdm_config_free(&cfg);

    path = TDM_SOURCE_DIR "/deploy/k8s/cuda/cluster.yaml";
    if (tdm_config_load_file(path, &cfg, &err) != TDM_OK)
        fail_msg("%s", err.msg);
    d = tdm_config_find_node(&cfg, "tandem-decode-0");
    assert_non_null(d);
    assert_int_equal(d->device.kind, TDM_NODE_DEVICE_CUDA);
    assert_string_equal(tdm_config_kv_advertise(d), "tcp://tandem-decode-0.tandem-decode-kv:7610");
    assert_round_trip(&cfg);
    tdm_config_free(&cfg);
}

/* The example from the issue: the message names file, line and key. */
static void test_error_block_size(void **state)
{
    (void)state;
    load_fails("# line 1\n"
               "model:\n"
               "  name: smol\n"
               "router:\n"
               "  http_port: 8000\n"
               "\n"
               "  max_queue: 10\n"
               "log:\n"
               "  level: debug\n"
               "kv:\n"
               "  dtype: f16\n"
               "  block_size: 24\n",
               "cluster.yaml:12: key 'kv.block_size': must be a power of two between 1 and 256 "
               "tokens, got 24");
    load_fails("kv:\n  block_size: 0\n",
               "cluster.yaml:2: key 'kv.block_size': must be a power of two between 1 and 256 "
               "tokens, got 0");
    load_fails("kv:\n  block_size: 512\n",
               "cluster.yaml:2: key 'kv.block_size': must be a power of two between 1 and 256 "
               "tokens, got 512");
    tdm_config_t cfg;
    load_ok("kv:\n  block_size: 1\n", &cfg);
    assert_int_equal(cfg.kv.block_size, 1);
    tdm_config_free(&cfg);
    load_ok("kv:\n  block_size: 256\n", &cfg);
    assert_int_equal(cfg.kv.block_size, 256);
    tdm_config_free(&cfg);
}

static void test_error_unknown_keys(void **state)
{
    (void)state;
    load_fails(
        "modle:\n  path: x\n",
        "cluster.yaml:1: key 'modle': unknown key (expected one of: model, models, router, kv, "
        "log, security, nodes)");
    load_fails("router:\n  http_port: 1\n  htp_port: 2\n",
               "cluster.yaml:3: key 'router.htp_port': unknown key (expected one of: "
               "client_endpoint, node_endpoint, node_advertise, node_endpoints, http_address, "
               "http_port, http_threads, http_connection_timeout_s, http_max_connections, "
               "http_max_connections_per_client, http_header_timeout_s, http_min_body_rate, "
               "prefill_policy, max_queue, request_timeout_s, "
               "api_keys, public_metrics, curve_public_key, curve_secret_key_file, "
               "admission_control, and 4 more: `tandem config defaults` lists them)");
    /* a file name so long that the whole list does not fit: the key first, whole names
     * only, the rest counted */
    char name[200], want[TDM_ERRMSG_MAX];
    snprintf(name, sizeof name, "/etc/%0150d/cluster.yaml", 0);
    tdm_config_t cfg;
    tdm_error_t err = {0};
    const char *yaml = "router:\n  htp_port: 2\n";
    assert_int_equal(tdm_config_load_string(yaml, strlen(yaml), name, &cfg, &err), TDM_EINVALID);
    snprintf(want, sizeof want,
             "%s:2: key 'router.htp_port': unknown key (expected one of: client_endpoint, "
             "node_endpoint, node_advertise, node_endpoints, http_address, http_port, "
             "http_threads, http_connection_timeout_s, http_max_connections, "
             "http_max_connections_per_client, and 14 more: `tandem config defaults` lists "
             "them)",
             name);
    assert_string_equal(err.msg, want);
    load_fails("kv:\n  blocksize: 16\n",
               "cluster.yaml:2: key 'kv.blocksize': unknown key (expected one of: block_size, "
               "dtype, prefix_caching, transfer_timeout_s, early_transfer_bytes, "
               "early_transfer_s)");
    load_fails("kv:\n  transfer_timeout_s: 0\n",
               "cluster.yaml:2: key 'kv.transfer_timeout_s': must be more than 0 and at most 3600 "
               "seconds, got 0");
    load_fails("kv:\n  transfer_timeout_s: 4000\n",
               "cluster.yaml:2: key 'kv.transfer_timeout_s': must be more than 0 and at most 3600 "
               "seconds, got "
               "4000");
    load_fails("nodes:\n  - id: d\n    role: decode\n    gpu: 0\n",
               "cluster.yaml:4: key 'nodes[0].gpu': unknown key (expected one of: id, role, "
               "endpoint, kv_endpoint, kv_advertise, device, threads, memory_budget, "
               "gpu_memory_utilization, max_batch_tokens, max_running, grammar_cache_bytes, "
               "speculative, model, curve_public_key, curve_secret_key_file)");
    load_fails("log:\n  level: info\n  format: json\n",
               "cluster.yaml:3: key 'log.format': unknown key (expected one of: level)");
}

static void test_error_wrong_types(void **state)
{
    (void)state;
    load_fails("router:\n  http_port: eight-thousand\n",
               "cluster.yaml:2: key 'router.http_port': must be an integer, got "
               "'eight-thousand'");
    load_fails("router:\n  http_port: \"8000\"\n",
               "cluster.yaml:2: key 'router.http_port': must be an integer, got the quoted "
               "string '8000'");
    load_fails("router:\n  http_port: 80.5\n",
               "cluster.yaml:2: key 'router.http_port': must be an integer, got '80.5'");
    load_fails("router:\n  http_port:\n",
               "cluster.yaml:2: key 'router.http_port': must be an integer, got nothing (null)");
    load_fails("router:\n  - http_port: 1\n",
               "cluster.yaml:2: key 'router': must be a mapping, got a list");
    load_fails("nodes:\n  id: d0\n  role: decode\n",
               "cluster.yaml:2: key 'nodes': must be a list of nodes, got a mapping");
    load_fails("nodes:\n  - d0\n",
               "cluster.yaml:2: key 'nodes[0]': must be a mapping with at least id and role, got "
               "'d0'");
    load_fails("model:\n  path: [a, b]\n",
               "cluster.yaml:2: key 'model.path': must be a string, got a list");
    load_fails("kv:\n  prefix_caching: maybe\n",
               "cluster.yaml:2: key 'kv.prefix_caching': must be true or false, got 'maybe'");
    load_fails("kv:\n  prefix_caching: 'true'\n",
               "cluster.yaml:2: key 'kv.prefix_caching': must be true or false, got the quoted "
               "string 'true'");
    load_fails("router:\n  request_timeout_s: soon\n",
               "cluster.yaml:2: key 'router.request_timeout_s': must be a number, got 'soon'");
    load_fails("router:\n  public_metrics: sometimes\n",
               "cluster.yaml:2: key 'router.public_metrics': must be true or false, got "
               "'sometimes'");
    load_fails("router:\n  api_keys: secret\n",
               "cluster.yaml:2: key 'router.api_keys': must be a list of strings, got 'secret'");
    load_fails("router:\n  api_keys:\n    - {k: v}\n",
               "cluster.yaml:3: key 'router.api_keys[0]': must be a string, got a mapping");
    load_fails("router:\n  cors_origins: '*'\n", "cluster.yaml:2: key 'router.cors_origins': must "
                                                 "be a list of strings, got the quoted string '*'");
    load_fails("router:\n  cors_origins: [localhost]\n",
               "cluster.yaml:2: key 'router.cors_origins[0]': must be \"*\" or an origin such as "
               "\"https://app.example.com:8443\"");
    load_fails("router:\n  cors_origins: ['http://a.example/']\n",
               "cluster.yaml:2: key 'router.cors_origins[0]': an origin has no path (no '/' after "
               "the host)");
    load_fails("router:\n  cors_origins: ['http://a:1', 'http://a:1']\n",
               "cluster.yaml:2: key 'router.cors_origins[1]': duplicate origin (same as "
               "router.cors_origins[0])");
    load_fails("- a\n- b\n", "cluster.yaml:1: the top level must be a mapping, got a list");
    load_fails("{[a]: 1}\n", "cluster.yaml:1: keys must be names, got a list");
}

static void test_error_enums(void **state)
{
    (void)state;
    load_fails("router:\n  prefill_policy: random\n",
               "cluster.yaml:2: key 'router.prefill_policy': must be one of round_robin, "
               "least_loaded, prefix_aware; got 'random'");
    load_fails("router:\n  metrics_compat: prometheus\n",
               "cluster.yaml:2: key 'router.metrics_compat': must be one of none, vllm; got "
               "'prometheus'");
    load_fails("kv:\n  dtype: bf16\n",
               "cluster.yaml:2: key 'kv.dtype': must be one of f32, f16, q8; got 'bf16'");
    load_fails("log:\n  level: loud\n",
               "cluster.yaml:2: key 'log.level': must be one of debug, info, warn, error, off; "
               "got 'loud'");
    load_fails("model:\n  chat_template: vicuna\n",
               "cluster.yaml:2: key 'model.chat_template': chat template 'vicuna' is not a "
               "built-in name (chatml, llama3, llama2 or gemma) nor a readable template file of "
               "at most 262144 bytes: vicuna: No such file or directory");
    load_fails("nodes:\n  - id: a\n    role: both\n",
               "cluster.yaml:3: key 'nodes[0].role': must be one of prefill, decode; got 'both'");
    load_fails("nodes:\n  - id: a\n    role: decode\n    device: gpu\n",
               "cluster.yaml:4: key 'nodes[0].device': must be cpu or cuda:N (N from 0 to 63), "
               "got 'gpu'");
    load_fails("nodes:\n  - id: a\n    role: decode\n    device: cuda:64\n",
               "cluster.yaml:4: key 'nodes[0].device': must be cpu or cuda:N (N from 0 to 63), "
               "got 'cuda:64'");
}

static void test_error_ranges(void **state)
{
    (void)state;
    load_fails("router:\n  http_port: 70000\n",
               "cluster.yaml:2: key 'router.http_port': must be between 1 and 65535, got 70000");
    load_fails("router:\n  http_port: 99999999999999999999999\n",
               "cluster.yaml:2: key 'router.http_port': must be between 1 and 65535, got "
               "99999999999999999999999");
    load_fails(
        "router:\n  max_queue: 0\n",
        "cluster.yaml:2: key 'router.max_queue': must be between 1 and 1000000 requests, got 0");
    load_fails("router:\n  request_timeout_s: 0\n",
               "cluster.yaml:2: key 'router.request_timeout_s': must be more than 0 and at most "
               "86400 seconds, got 0");
    load_fails(
        "nodes:\n  - id: a\n    role: decode\n    threads: -1\n",
        "cluster.yaml:4: key 'nodes[0].threads': must be between 0 and 1024 threads, got -1");
    load_fails("nodes:\n  - id: a\n    role: decode\n    max_batch_tokens: 0\n",
               "cluster.yaml:4: key 'nodes[0].max_batch_tokens': must be between 1 and "
               "1048576 tokens, got 0");
    load_fails(
        "nodes:\n  - id: a\n    role: decode\n    max_running: 100000\n",
        "cluster.yaml:4: key 'nodes[0].max_running': must be between 1 and 65536 sequences, got "
        "100000");
    load_fails("nodes:\n  - id: a\n    role: decode\n    grammar_cache_bytes: 17GiB\n",
               "cluster.yaml:4: key 'nodes[0].grammar_cache_bytes': must be from 0 to 16GiB, got "
               "17GiB (18253611008 bytes)");
    load_fails("nodes:\n  - id: a\n    role: decode\n    speculative:\n      max_draft: 17\n",
               "cluster.yaml:5: key 'nodes[0].speculative.max_draft': must be between 0 and 16 "
               "tokens, got 17");
    load_fails("nodes:\n  - id: a\n    role: decode\n    speculative:\n      k: 2\n",
               "cluster.yaml:5: key 'nodes[0].speculative.k': unknown key (expected one of: "
               "max_draft, row_cost)");
    load_fails("nodes:\n  - id: a\n    role: decode\n    speculative:\n      row_cost: 11\n",
               "cluster.yaml:5: key 'nodes[0].speculative.row_cost': must be from 0 to 10, got "
               "11");
    load_fails("nodes:\n  - id: a\n    role: decode\n    memory_budget: 512KiB\n",
               "cluster.yaml:4: key 'nodes[0].memory_budget': must be at least 1MiB, got "
               "512KiB (524288 bytes)");
    load_fails("nodes:\n  - id: a\n    role: decode\n    memory_budget: lots\n",
               "cluster.yaml:4: key 'nodes[0].memory_budget': must be a byte size such as "
               "512MiB, 2GiB or 1.5GB, below 8EiB (2^63 bytes), got 'lots'");
    load_fails("nodes:\n  - id: a\n    role: decode\n    memory_budget: 99999999TiB\n",
               "cluster.yaml:4: key 'nodes[0].memory_budget': must be a byte size such as "
               "512MiB, 2GiB or 1.5GB, below 8EiB (2^63 bytes), got '99999999TiB'");
    /* an integer past 64 bits is out of range, not "not an integer" */
    load_fails("router:\n  max_queue: 99999999999999999999999\n",
               "cluster.yaml:2: key 'router.max_queue': must be between 1 and 1000000 requests, "
               "got 99999999999999999999999");
    load_fails("nodes:\n  - id: a\n    role: decode\n    device: cuda:0\n"
               "    gpu_memory_utilization: 1.5\n",
               "cluster.yaml:5: key 'nodes[0].gpu_memory_utilization': must be more than 0 and "
               "at most 1, got 1.5");
    load_fails("nodes:\n  - id: 'a b'\n    role: decode\n",
               "cluster.yaml:2: key 'nodes[0].id': must be 1 to 63 characters of A-Z a-z 0-9 . "
               "_ -, got the quoted string 'a b'");
    load_fails("router:\n  client_endpoint: localhost:7600\n",
               "cluster.yaml:2: key 'router.client_endpoint': must be a ZeroMQ endpoint "
               "tcp://HOST:PORT, ipc://PATH or inproc://NAME, got 'localhost:7600'");
    load_fails("router:\n  node_endpoint: tcp://127.0.0.1:0\n",
               "cluster.yaml:2: key 'router.node_endpoint': must be a ZeroMQ endpoint "
               "tcp://HOST:PORT, ipc://PATH or inproc://NAME, got 'tcp://127.0.0.1:0'");
    load_fails("router:\n  curve_public_key: short\n",
               "cluster.yaml:2: key 'router.curve_public_key': must be a 40-character Z85 CURVE "
               "public key (tandem keys generate writes one), got 5 characters");
    load_fails("nodes:\n  - {id: d, role: decode, curve_public_key: 'x'}\n",
               "cluster.yaml:2: key 'nodes[0].curve_public_key': must be a 40-character Z85 "
               "CURVE public key (tandem keys generate writes one), got 1 characters");
    load_fails("security:\n  insecure: maybe\n",
               "cluster.yaml:2: key 'security.insecure': must be true or false, got 'maybe'");
    load_fails("model:\n  name: ''\n", "cluster.yaml:2: key 'model.name': must not be empty");
}

/* The routers a node registers with: router.node_endpoints in order, else the one router. */
static void test_router_endpoints(void **state)
{
    (void)state;
    tdm_config_t cfg;
    size_t n = 0;
    load_ok("router:\n  node_endpoint: 'tcp://0.0.0.0:7601'\n"
            "  node_endpoints: [tcp://r0:7601, tcp://r1:7601]\n"
            "security: {insecure: true}\n",
            &cfg);
    const char *const *eps = tdm_config_router_endpoints(&cfg, &n);
    assert_int_equal(n, 2);
    assert_string_equal(eps[0], "tcp://r0:7601");
    assert_string_equal(eps[1], "tcp://r1:7601");
    tdm_config_free(&cfg);
    load_ok("router:\n  node_advertise: tcp://r0:7601\n", &cfg);
    eps = tdm_config_router_endpoints(&cfg, &n);
    assert_int_equal(n, 1);
    assert_string_equal(eps[0], "tcp://r0:7601");
    tdm_config_free(&cfg);
    load_ok("", &cfg);
    eps = tdm_config_router_endpoints(&cfg, &n);
    assert_int_equal(n, 1);
    assert_string_equal(eps[0], "tcp://127.0.0.1:7601");
    tdm_config_free(&cfg);
}

static void test_error_duplicates(void **state)
{
    (void)state;
    load_fails("kv:\n  block_size: 16\n  dtype: f16\n  block_size: 32\n",
               "cluster.yaml:4: key 'kv.block_size': duplicate key (first at line 2)");
    load_fails("kv: {}\nlog: {}\nkv: {}\n",
               "cluster.yaml:3: key 'kv': duplicate key (first at line 1)");
    load_fails("nodes:\n"
               "  - id: n1\n"
               "    role: prefill\n"
               "  - id: n2\n"
               "    role: decode\n"
               "  - id: n1\n"
               "    role: decode\n",
               "cluster.yaml:6: key 'nodes[2].id': duplicate node id 'n1' (first at line 2, "
               "nodes[0])");
    load_fails("router:\n  api_keys: [a, b, a]\n",
               "cluster.yaml:2: key 'router.api_keys[2]': duplicate API key (same as "
               "router.api_keys[0])");
    /* several routers: router.node_endpoints, each a distinct endpoint of its own */
    load_fails("router:\n  node_endpoints: [tcp://r0:7601, tcp://r1:7601, tcp://r0:7601]\n",
               "cluster.yaml:2: key 'router.node_endpoints[2]': duplicate router endpoint (same "
               "as router.node_endpoints[0])");
    load_fails("router:\n  node_endpoints:\n    - tcp://r0:7601\n    - r1:7601\n",
               "cluster.yaml:4: key 'router.node_endpoints[1]': must be a ZeroMQ endpoint "
               "tcp://HOST:PORT, ipc://PATH or inproc://NAME, got 'r1:7601'");
    load_fails("router:\n  node_endpoints: ['tcp://0.0.0.0:7601']\n",
               "cluster.yaml:2: key 'router.node_endpoints[0]': must name a host the other nodes "
               "can reach, not the wildcard address '0.0.0.0' (a wildcard belongs in the "
               "endpoint that is bound)");
    load_fails("router:\n  node_advertise: tcp://r0:7601\n"
               "  node_endpoints: [tcp://r0:7601, tcp://r1:7601]\n",
               "cluster.yaml:3: key 'router.node_endpoints': set router.node_endpoints (every "
               "router the nodes register with) or router.node_advertise (the one router), not "
               "both");
    load_fails("router:\n  node_endpoints: [tcp://r0:7601, 'tcp://127.0.0.1:7600']\n",
               "cluster.yaml:2: key 'router.node_endpoints[1]': tcp://127.0.0.1:7600 is also "
               "the endpoint of router.client_endpoint; a router node endpoint must be one of "
               "its own");
    load_fails("router:\n  node_endpoint: tcp://127.0.0.1:7610\n"
               "nodes:\n  - {id: d, role: decode}\n",
               "cluster.yaml:2: key 'router.node_endpoint': endpoint tcp://127.0.0.1:7610 is "
               "also used by nodes[0].kv_endpoint (its default)");
    load_fails("nodes:\n"
               "  - id: d0\n"
               "    role: decode\n"
               "    kv_endpoint: tcp://h:1\n"
               "  - id: d1\n"
               "    role: decode\n"
               "    kv_endpoint: tcp://h:1\n",
               "cluster.yaml:7: key 'nodes[1].kv_endpoint': endpoint tcp://h:1 is also used by "
               "nodes[0].kv_endpoint");
    /* the HTTP API's port against the ZMQ binds of the router's host */
    load_fails("router:\n  http_port: 7600\n",
               "cluster.yaml:2: key 'router.http_port': port 7600 on 127.0.0.1 is also "
               "router.client_endpoint (tcp://127.0.0.1:7600), its default");
    load_fails("nodes:\n  - {id: d, role: decode, kv_endpoint: 'tcp://127.0.0.1:8000'}\n",
               "cluster.yaml:2: key 'nodes[0].kv_endpoint': endpoint tcp://127.0.0.1:8000 takes "
               "the HTTP API's port (router.http_port 8000 on 127.0.0.1, its default)");
    load_fails("security: {insecure: true}\n"
               "router: {http_address: 0.0.0.0, node_endpoint: 'tcp://127.0.0.1:9000', "
               "http_port: 9000}\n",
               "cluster.yaml:2: key 'router.http_port': port 9000 on 0.0.0.0 is also "
               "router.node_endpoint (tcp://127.0.0.1:9000)");
    /* another host's endpoint, or another address, is no clash */
    tdm_config_t cfg;
    load_ok("router: {http_port: 7610, http_address: 127.0.0.2}\n", &cfg);
    tdm_config_free(&cfg);
    load_ok("nodes:\n  - {id: d, role: decode, kv_endpoint: 'tcp://10.0.0.5:8000'}\n"
            "security: {insecure: true}\n",
            &cfg);
    tdm_config_free(&cfg);
}

static void test_error_missing_and_conflicts(void **state)
{
    (void)state;
    load_fails("nodes:\n  - id: d0\n  - id: d1\n    role: decode\n",
               "cluster.yaml:2: key 'nodes[0].role': is required (prefill or decode)");
    load_fails("nodes:\n  - role: decode\n", "cluster.yaml:2: key 'nodes[0].id': is required");
    load_fails("nodes: []\n", "cluster.yaml:1: key 'nodes': must list at least one decode node");
    load_fails("nodes:\n  - id: p\n    role: prefill\n",
               "cluster.yaml:2: key 'nodes': must list at least one decode node (role: decode)");
    load_fails("nodes:\n  - id: p\n    kv_endpoint: tcp://h:1\n    role: prefill\n",
               "cluster.yaml:3: key 'nodes[0].kv_endpoint': only decode nodes receive KV pages");
    load_fails("nodes:\n  - id: d\n    role: decode\n    device: cuda:0\n"
               "    memory_budget: 8GiB\n    gpu_memory_utilization: 0.8\n",
               "cluster.yaml:6: key 'nodes[0].gpu_memory_utilization': set memory_budget or "
               "gpu_memory_utilization, not both");
    load_fails("nodes:\n  - id: d\n    role: decode\n    gpu_memory_utilization: 0.8\n",
               "cluster.yaml:4: key 'nodes[0].gpu_memory_utilization': only for cuda devices "
               "(this node's device is cpu); use memory_budget");
}

/* Per-node CURVE keys: all or nothing, one distinct pair per node, the old shared keys gone. */
static void test_curve_keys(void **state)
{
    (void)state;
#define KR "{wJ#^3Xv#6keLYvM/d<v1rQznNk9h{{Ugg00qrll"
#define KA "BEp/}qnpNC2KRlix8GC[(0)H8DJDZEnZYm7w2JP2"
#define KB "*RKM>1V5n{pfvXI+J^wXd(LB4TbqH+]KiHz/bDED"
    static const char removed[] =
        "was removed: give the router its own pair in router.curve_public_key / "
        "router.curve_secret_key_file and each node its own in nodes[].curve_public_key / "
        "nodes[].curve_secret_key_file (tandem keys generate writes them)";
    const char *old[] = {"curve_server_public_key", "curve_server_secret_key",
                         "curve_client_public_key", "curve_client_secret_key"};
    for (size_t i = 0; i < 4; i++) {
        char text[256], msg[512];
        snprintf(text, sizeof text, "security:\n  %s: \"%s\"\n", old[i], KR);
        snprintf(msg, sizeof msg, "cluster.yaml:2: key 'security.%s': %s", old[i], removed);
        load_fails(text, msg);
    }
    const char *router = "router:\n  curve_public_key: '" KR "'\n"
                         "  curve_secret_key_file: /k/router.key\n";
    char text[1024];
    /* CURVE on: every node needs its own key */
    snprintf(text, sizeof text,
             "%snodes:\n"
             "  - {id: p, role: prefill, curve_public_key: '" KA "', curve_secret_key_file: /k/p}\n"
             "  - {id: d, role: decode}\n",
             router);
    load_fails(text, "cluster.yaml:6: key 'nodes[1].curve_public_key': node 'd' has no CURVE "
                     "public key, but CURVE is on (router.curve_public_key is set): every node "
                     "needs its own pair (tandem keys generate writes them)");
    snprintf(text, sizeof text,
             "%snodes:\n"
             "  - {id: p, role: prefill, curve_public_key: '" KA "', curve_secret_key_file: /k/p}\n"
             "  - {id: d, role: decode, curve_public_key: '" KA "', curve_secret_key_file: /k/d}\n",
             router);
    load_fails(text, "cluster.yaml:6: key 'nodes[1].curve_public_key': duplicate CURVE public "
                     "key: node 'd' has the same key as nodes[0] ('p'); every node needs its own "
                     "pair");
    snprintf(text, sizeof text,
             "%snodes:\n"
             "  - {id: d, role: decode, curve_public_key: '" KR "', curve_secret_key_file: /k/d}\n",
             router);
    load_fails(text, "cluster.yaml:5: key 'nodes[0].curve_public_key': node 'd' has the router's "
                     "public key; every node needs its own pair");
    snprintf(text, sizeof text, "%snodes:\n  - {id: d, role: decode, curve_public_key: '" KB "'}\n",
             router);
    load_fails(text, "cluster.yaml:5: key 'nodes[0].curve_secret_key_file': is required with "
                     "nodes[0].curve_public_key: the file holding node 'd''s secret key");
    /* the default nodes have no keys */
    load_fails(router, "cluster.yaml:2: key 'nodes[0].curve_public_key': node 'prefill-0' has no "
                       "CURVE public key, but CURVE is on (router.curve_public_key is set): every "
                       "node needs its own pair (tandem keys generate writes them)");
    load_fails("router:\n  curve_public_key: '" KR "'\n",
               "cluster.yaml:2: key 'router.curve_secret_key_file': is required with "
               "router.curve_public_key: the file holding the router's secret key");
    /* CURVE off: no node keys */
    load_fails("router:\n  curve_secret_key_file: /k/r\n",
               "cluster.yaml:2: key 'router.curve_secret_key_file': is set but "
               "router.curve_public_key is not; set both or neither");
    load_fails("nodes:\n  - {id: d, role: decode, curve_public_key: '" KA "'}\n",
               "cluster.yaml:2: key 'nodes[0].curve_public_key': CURVE is off because "
               "router.curve_public_key is not set; give the router its pair too (tandem keys "
               "generate writes all of them)");
    /* a whole set loads, and dumps and reloads unchanged */
    snprintf(text, sizeof text,
             "%snodes:\n"
             "  - {id: p, role: prefill, curve_public_key: '" KA "', curve_secret_key_file: /k/p}\n"
             "  - {id: d, role: decode, curve_public_key: '" KB "', curve_secret_key_file: /k/d}\n",
             router);
    tdm_config_t cfg;
    load_ok(text, &cfg);
    assert_true(tdm_config_curve_on(&cfg));
    assert_string_equal(cfg.router.curve_secret_key_file, "/k/router.key");
    assert_string_equal(cfg.nodes[1].curve_public_key, KB);
    assert_round_trip(&cfg);
    tdm_config_free(&cfg);
#undef KR
#undef KA
#undef KB
}

/* What counts as loopback, and which binds are refused without CURVE or API keys. */
static void test_bind_check(void **state)
{
    (void)state;
    const char *loopback[] = {"tcp://127.0.0.1:7601",
                              "tcp://127.1.2.3:1",
                              "tcp://localhost:80",
                              "tcp://[::1]:7600",
                              "inproc://x",
                              "ipc:///tmp/s",
                              "127.0.0.1",
                              "::1",
                              "[::1]",
                              "localhost",
                              "tcp://127.0.0.1:*"};
    const char *remote[] = {"tcp://0.0.0.0:7601",
                            "tcp://*:7601",
                            "tcp://10.0.0.1:7601",
                            "tcp://[::]:7600",
                            "tcp://eth0:7600",
                            "tcp://router:7601",
                            "0.0.0.0",
                            "::",
                            "192.168.1.2",
                            "tcp://128.0.0.1:1",
                            "tcp://localhost.evil.com:1",
                            "tcp://127.0.0.1;10.0.0.1:5",
                            "",
                            "tcp://:5"};
    for (size_t i = 0; i < sizeof loopback / sizeof *loopback; i++)
        if (!tdm_config_address_is_loopback(loopback[i]))
            fail_msg("%s should be loopback", loopback[i]);
    for (size_t i = 0; i < sizeof remote / sizeof *remote; i++)
        if (tdm_config_address_is_loopback(remote[i]))
            fail_msg("%s should not be loopback", remote[i]);
    assert_false(tdm_config_address_is_loopback(NULL));

    tdm_config_t cfg;
    load_ok("", &cfg);
    tdm_error_t err = {0};
    assert_int_equal(tdm_config_bind_check(&cfg, "router.node_endpoint", "tcp://127.0.0.1:7601",
                                           TDM_BIND_GUARD_CURVE, &err),
                     0);
    assert_int_equal(tdm_config_bind_check(&cfg, "nodes[1].kv_endpoint", "tcp://0.0.0.0:7610",
                                           TDM_BIND_GUARD_CURVE, &err),
                     TDM_EPRECONDITION);
    assert_non_null(strstr(err.msg, "nodes[1].kv_endpoint tcp://0.0.0.0:7610 is not a loopback "
                                    "address and CURVE is off"));
    assert_non_null(strstr(err.msg, "tandem keys generate"));
    assert_non_null(strstr(err.msg, "security.insecure: true"));
    assert_int_equal(tdm_config_bind_check(&cfg, "router.http_address", "0.0.0.0",
                                           TDM_BIND_GUARD_API_KEYS, &err),
                     TDM_EPRECONDITION);
    assert_non_null(strstr(err.msg, "router.http_address 0.0.0.0 is not a loopback address and "
                                    "router.api_keys is empty"));
    /* API keys guard the client side; CURVE does not */
    char *key = tdm_strdup("k");
    cfg.router.api_keys = &key;
    cfg.router.n_api_keys = 1;
    assert_int_equal(tdm_config_bind_check(&cfg, "router.client_endpoint", "tcp://0.0.0.0:7600",
                                           TDM_BIND_GUARD_API_KEYS, &err),
                     0);
    assert_int_equal(tdm_config_bind_check(&cfg, "router.node_endpoint", "tcp://0.0.0.0:7601",
                                           TDM_BIND_GUARD_CURVE, &err),
                     TDM_EPRECONDITION);
    cfg.router.api_keys = NULL;
    cfg.router.n_api_keys = 0;
    free(key);
    /* security.insecure lets everything through */
    cfg.security.insecure = true;
    assert_int_equal(tdm_config_bind_check(&cfg, "router.node_endpoint", "tcp://0.0.0.0:7601",
                                           TDM_BIND_GUARD_CURVE, &err),
                     0);
    assert_int_equal(tdm_config_bind_check(&cfg, "router.http_address", "0.0.0.0",
                                           TDM_BIND_GUARD_API_KEYS, &err),
                     0);
    tdm_config_free(&cfg);
}

static void test_error_syntax(void **state)
{
    (void)state;
    load_fails("kv:\n  block_size: 16\n dtype: f16\n",
               "cluster.yaml:3: YAML syntax error: did not find expected key while parsing a "
               "block mapping");
    load_fails("kv: {}\n---\nkv: {}\n",
               "cluster.yaml:3: a second YAML document; a config file holds one");
    load_fails("kv: *undefined\n", "cluster.yaml:1: YAML syntax error: found undefined alias");
    /* Messages for text loaded without a name. */
    tdm_config_t cfg;
    tdm_error_t err = {0};
    const char *bad = "kv: [";
    assert_int_equal(tdm_config_load_string(bad, strlen(bad), NULL, &cfg, &err), TDM_EINVALID);
    assert_string_equal(err.msg, "<string>:1: YAML syntax error: did not find expected node "
                                 "content while parsing a flow node");
    load_fails("a: 1\nb: \"\x01\"\n",
               "cluster.yaml:2: YAML syntax error: control characters are not allowed");
    load_fails("a: 1\nb: 2\n\xff\n",
               "cluster.yaml:3: YAML syntax error: invalid leading UTF-8 octet");
}

static void test_load_file(void **state)
{
    (void)state;
    tdm_config_t cfg;
    tdm_error_t err = {0};
    assert_int_equal(tdm_config_load_file("/nonexistent/cluster.yaml", &cfg, &err), TDM_ENOTFOUND);
    assert_string_equal(err.msg, "/nonexistent/cluster.yaml: No such file or directory");
    assert_null(cfg.nodes);

    char path[] = "/tmp/tdm_config_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fputs("kv:\n  dtype: f64\n", f);
    fclose(f);
    assert_int_equal(tdm_config_load_file(path, &cfg, &err), TDM_EINVALID);
    char want[256];
    snprintf(want, sizeof want, "%s:2: key 'kv.dtype': must be one of f32, f16, q8; got 'f64'",
             path);
    assert_string_equal(err.msg, want);

    f = fopen(path, "w");
    fputs(full_yaml, f);
    fclose(f);
    assert_int_equal(tdm_config_load_file(path, &cfg, &err), TDM_OK);
    assert_int_equal(err.code, TDM_OK);
    assert_int_equal(cfg.n_nodes, 4);
    tdm_config_free(&cfg);
    unlink(path);
}

static void test_round_trip_special_strings(void **state)
{
    (void)state;
    tdm_config_t cfg;
    load_ok("model:\n"
            "  path: \"/odd dir/a \\\"quoted\\\" \\\\ name:\\t#x.gguf\"\n"
            "  name: 'yes'\n"
            "router:\n"
            "  http_address: '::1'\n"
            "  request_timeout_s: 0.1\n"
            "  api_keys: ['null', '123', 'k#1', \"é\"]\n"
            "nodes:\n"
            "  - {id: '007', role: decode, memory_budget: 1234567, device: cuda:3}\n",
            &cfg);
    assert_string_equal(cfg.model.path, "/odd dir/a \"quoted\" \\ name:\t#x.gguf");
    assert_string_equal(cfg.model.name, "yes");
    assert_string_equal(cfg.router.api_keys[0], "null");
    assert_string_equal(cfg.nodes[0].id, "007");
    assert_int_equal(cfg.nodes[0].memory_budget, 1234567);
    assert_round_trip(&cfg);
    tdm_config_free(&cfg);
}

static void test_parse_bytes(void **state)
{
    (void)state;
    static const struct {
        const char *text;
        uint64_t bytes;
    } good[] = {
        {"0", 0},
        {"4096", 4096},
        {"1B", 1},
        {"512MiB", 512ull << 20},
        {"512 MiB", 512ull << 20},
        {"2GiB", 2ull << 30},
        {"2gib", 2ull << 30},
        {"2Gi", 2ull << 30},
        {"1.5GB", 1500000000ull},
        {"1.5GiB", 3ull << 29},
        {"2G", 2000000000ull},
        {"10k", 10000},
        {"10KB", 10000},
        {"1KiB", 1024},
        {"1.5KiB", 1536},
        {"1.3KiB", 1331}, /* 1331.2: the fraction of a byte is dropped */
        {".5MiB", 512ull << 10},
        {"3TB", 3000000000000ull},
        {"1TiB", 1ull << 40},
        {"8388607TiB", 8388607ull << 40},
        {"9223372036854775807", 9223372036854775807ull},
        {"0.000000000000000000001TiB", 0},
    };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        uint64_t b = 12345;
        if (tdm_config_parse_bytes(good[i].text, &b) != TDM_OK)
            fail_msg("'%s' was rejected", good[i].text);
        if (b != good[i].bytes)
            fail_msg("'%s' gave %llu, want %llu", good[i].text, (unsigned long long)b,
                     (unsigned long long)good[i].bytes);
    }
    static const char *const bad[] = {
        "",
        "GiB",
        "-1",
        "1.",
        "1.5.5GB",
        "2 GiB ",
        " 2GiB",
        "2XB",
        "2GiBs",
        "1e9",
        "0x10",
        "2 gi b",
        "8388608TiB",
        "9223372036854775808",
        "99999999999999999999999",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        uint64_t b = 12345;
        if (tdm_config_parse_bytes(bad[i], &b) != TDM_EINVALID)
            fail_msg("'%s' was accepted", bad[i]);
        assert_int_equal(b, 12345);
    }
    assert_int_equal(tdm_config_parse_bytes(NULL, NULL), TDM_EINVALID);

    /* tdm_config_format_bytes is exact and parses back. */
    static const uint64_t values[] = {0,
                                      1,
                                      1000,
                                      1024,
                                      1536,
                                      512 << 20,
                                      2ull << 30,
                                      1500000000u,
                                      1ull << 40,
                                      3ull << 41,
                                      (uint64_t)INT64_MAX};
    static const char *const texts[] = {"0",
                                        "1",
                                        "1000",
                                        "1KiB",
                                        "1536",
                                        "512MiB",
                                        "2GiB",
                                        "1500000000",
                                        "1TiB",
                                        "6TiB",
                                        "9223372036854775807"};
    for (size_t i = 0; i < sizeof values / sizeof values[0]; i++) {
        char buf[24];
        tdm_config_format_bytes(values[i], buf, sizeof buf);
        assert_string_equal(buf, texts[i]);
        uint64_t back;
        assert_int_equal(tdm_config_parse_bytes(buf, &back), TDM_OK);
        assert_int_equal(back, values[i]);
    }
}

static void test_device_parse(void **state)
{
    (void)state;
    tdm_node_device_t d;
    char buf[16];
    assert_int_equal(tdm_config_device_parse("cpu", &d), TDM_OK);
    assert_int_equal(d.kind, TDM_NODE_DEVICE_CPU);
    tdm_config_device_format(d, buf, sizeof buf);
    assert_string_equal(buf, "cpu");
    assert_int_equal(tdm_config_device_parse("cuda:7", &d), TDM_OK);
    assert_int_equal(d.kind, TDM_NODE_DEVICE_CUDA);
    assert_int_equal(d.index, 7);
    tdm_config_device_format(d, buf, sizeof buf);
    assert_string_equal(buf, "cuda:7");
    static const char *const bad[] = {"",        "gpu",     "cuda:", "cuda:-1", "cuda:01",
                                      "cuda:1x", "cuda:64", "CPU",   "cuda0"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        if (tdm_config_device_parse(bad[i], &d) != TDM_EINVALID)
            fail_msg("device '%s' was accepted", bad[i]);
    assert_string_equal(tdm_config_node_role_name(TDM_NODE_ROLE_DECODE), "decode");
    assert_string_equal(tdm_config_prefill_policy_name(TDM_PREFILL_POLICY_LEAST_LOADED),
                        "least_loaded");
}

/* deploy/config/cluster.example.yaml, the documented example, loads and round-trips. */
static void test_example_file(void **state)
{
    (void)state;
    tdm_config_t cfg;
    tdm_error_t err = {0};
    const char *path = TDM_SOURCE_DIR "/deploy/config/cluster.example.yaml";
    if (tdm_config_load_file(path, &cfg, &err) != TDM_OK)
        fail_msg("%s", err.msg);
    assert_true(cfg.n_nodes >= 2);
    assert_non_null(tdm_config_find_node(&cfg, "prefill-0"));
    assert_non_null(tdm_config_find_node(&cfg, "decode-0"));
    assert_round_trip(&cfg);
    tdm_config_free(&cfg);
}

/* Several models: the models: list, names and aliases, nodes[].model, and the single model:
 * form as a list of one. */
static void test_models(void **state)
{
    (void)state;
    tdm_config_t cfg;
    /* the single form: a list of one, model == models[0] */
    load_ok("model:\n  path: /m/smol.gguf\n  aliases: [small, tiny]\n", &cfg);
    assert_int_equal(cfg.n_models, 1);
    assert_string_equal(cfg.models[0].path, "/m/smol.gguf");
    assert_string_equal(cfg.models[0].name, "smol");
    assert_string_equal(cfg.model.name, "smol");
    assert_int_equal(cfg.models[0].n_aliases, 2);
    assert_int_equal(tdm_config_model_index(&cfg, "tiny"), 0);
    assert_int_equal(tdm_config_model_index(&cfg, "other"), -1);
    assert_int_equal(tdm_config_model_index(&cfg, ""), -1);
    assert_int_equal(tdm_config_node_model_index(&cfg, &cfg.nodes[0]), 0);
    assert_round_trip(&cfg);
    tdm_config_free(&cfg);

    /* two models, nodes naming theirs by name or alias; an unset one serves the first */
    load_ok("models:\n"
            "  - path: /m/SmolLM2.gguf\n"
            "    name: smol\n"
            "  - path: /m/gemma-3-270m.gguf\n"
            "    aliases: [gemma, g3]\n"
            "    chat_template: gemma\n"
            "nodes:\n"
            "  - {id: p0, role: prefill}\n"
            "  - {id: d0, role: decode, model: smol}\n"
            "  - {id: p1, role: prefill, model: g3}\n"
            "  - {id: d1, role: decode, model: gemma-3-270m}\n",
            &cfg);
    assert_int_equal(cfg.n_models, 2);
    assert_string_equal(cfg.model.name, "smol");
    assert_string_equal(cfg.model.path, "/m/SmolLM2.gguf");
    assert_string_equal(cfg.models[1].name, "gemma-3-270m"); /* from the path */
    assert_string_equal(cfg.models[1].chat_template, "gemma");
    assert_int_equal(tdm_config_model_index(&cfg, "gemma"), 1);
    assert_int_equal(tdm_config_model_index(&cfg, "smol"), 0);
    assert_int_equal(tdm_config_node_model_index(&cfg, &cfg.nodes[0]), 0);
    assert_int_equal(tdm_config_node_model_index(&cfg, &cfg.nodes[1]), 0);
    assert_int_equal(tdm_config_node_model_index(&cfg, &cfg.nodes[2]), 1);
    assert_ptr_equal(tdm_config_node_model(&cfg, &cfg.nodes[3]), &cfg.models[1]);
    assert_round_trip(&cfg);
    tdm_config_free(&cfg);

    /* duplicate served names across models, naming both */
    load_fails("models:\n"
               "  - path: /m/a.gguf\n"
               "    name: chat\n"
               "  - path: /m/b.gguf\n"
               "    aliases: [bee, chat]\n",
               "cluster.yaml:5: key 'models[1].aliases': duplicate served model name 'chat': "
               "models[1].aliases (path /m/b.gguf) and models[0].name (path /m/a.gguf) both "
               "serve it; each name and alias must name one model");
    load_fails("models:\n"
               "  - path: /m/a.gguf\n"
               "  - path: /x/a.gguf\n",
               "cluster.yaml:3: key 'models[1].name': duplicate served model name 'a': "
               "models[1].name (path /x/a.gguf) and models[0].name (path /m/a.gguf) both serve "
               "it; each name and alias must name one model");
    load_fails("model:\n  path: /m/a.gguf\n  aliases: [a]\n",
               "cluster.yaml:3: key 'model.aliases': duplicate served model name 'a': "
               "model.aliases (path /m/a.gguf) and model.name (path /m/a.gguf) both serve it; "
               "each name and alias must name one model");
    /* a node's model must be listed */
    load_fails("models:\n  - path: /m/a.gguf\n  - path: /m/b.gguf\n"
               "nodes:\n  - {id: d0, role: decode, model: c}\n",
               "cluster.yaml:5: key 'nodes[0].model': 'c' is not a served name of any model "
               "(models: 'a', 'b')");
    /* the list's own shape */
    load_fails("model:\n  path: /m/a.gguf\nmodels:\n  - path: /m/b.gguf\n",
               "cluster.yaml:4: key 'models': give model (one model) or models (a list), not "
               "both");
    load_fails("models: []\n", "cluster.yaml:1: key 'models': must list at least one model");
    load_fails("models:\n  - name: x\n",
               "cluster.yaml:2: key 'models[0].path': is required (the GGUF file this model "
               "serves)");
    load_fails(
        "models:\n  - path: /m/a.gguf\n    nmae: x\n",
        "cluster.yaml:3: key 'models[0].nmae': unknown key (expected one of: path, "
        "chat_template, name, aliases, reasoning_parser, tool_call_parser, max_context, defaults)");
    /* per-model sampling defaults, Tandem's own when unset */
    load_ok("models:\n"
            "  - path: /m/a.gguf\n"
            "    defaults: {temperature: 0, max_tokens: 8}\n"
            "  - path: /m/b.gguf\n",
            &cfg);
    assert_true(cfg.models[0].defaults.temperature == 0.0);
    assert_int_equal(cfg.models[0].defaults.max_tokens, 8);
    assert_true(cfg.models[0].defaults.top_p == 1.0);
    assert_true(cfg.models[1].defaults.temperature == 1.0);
    assert_true(cfg.models[1].defaults.repetition_penalty == 1.0);
    assert_int_equal(cfg.models[1].defaults.max_tokens, 0);
    assert_true(cfg.model.defaults.temperature == 0.0); /* model is models[0] */
    assert_round_trip(&cfg);
    tdm_config_free(&cfg);
    load_fails("models:\n  - path: /m/a.gguf\n    defaults: {top_p: 0}\n",
               "cluster.yaml:3: key 'models[0].defaults.top_p': must be more than 0 and at most "
               "1, got 0");
    load_fails("models: x\n", "cluster.yaml:1: key 'models': must be a list of models, got 'x'");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_model_default_path),
        cmocka_unit_test(test_full_file),
        cmocka_unit_test(test_chat_template_gemma),
        cmocka_unit_test(test_default_kv_endpoints),
        cmocka_unit_test(test_error_block_size),
        cmocka_unit_test(test_error_unknown_keys),
        cmocka_unit_test(test_error_wrong_types),
        cmocka_unit_test(test_error_enums),
        cmocka_unit_test(test_chat_template_file),
        cmocka_unit_test(test_error_ranges),
        cmocka_unit_test(test_error_duplicates),
        cmocka_unit_test(test_router_endpoints),
        cmocka_unit_test(test_error_missing_and_conflicts),
        cmocka_unit_test(test_error_syntax),
        cmocka_unit_test(test_load_file),
        cmocka_unit_test(test_round_trip_special_strings),
        cmocka_unit_test(test_parse_bytes),
        cmocka_unit_test(test_device_parse),
        cmocka_unit_test(test_example_file),
        cmocka_unit_test(test_advertise),
        cmocka_unit_test(test_deploy_configs),
        cmocka_unit_test(test_curve_keys),
        cmocka_unit_test(test_bind_check),
        cmocka_unit_test(test_models),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
