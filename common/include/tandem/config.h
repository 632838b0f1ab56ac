/* config.h - the cluster configuration: one YAML file (libyaml) that describes the model, the
 * router's endpoints, the KV cache settings, logging, CURVE keys and the list of nodes.
 *
 * Every key has a default, so a single-host cluster (one prefill and one decode node on the
 * CPU, the default model from the cache) runs with no file at all. Loading is strict: unknown
 * keys, duplicate keys, wrong types, out-of-range values, duplicate node ids and endpoints and
 * missing required fields are errors whose message starts with "FILE:LINE: key 'a.b': ".
 * A tdm_config_t is a plain value that owns its strings and arrays; nothing is global, so a
 * process may hold several. Every key is one row of the key table (common/src/config/
 * config_keys.c: name, type, bounds, default, doc line) that the loader, the defaults, the
 * dumper and docs/operations.md's tables (tdm_config_keys_markdown) all follow.
 */
#ifndef TANDEM_CONFIG_H
#define TANDEM_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "tandem/base.h"
#include "tandem/chat.h"
#include "tandem/kv.h"
#include "tandem/log.h"

#ifdef __cplusplus
extern "C" {
#endif

/* File name of the default model inside the model cache folder. */
#define TDM_DEFAULT_MODEL_FILE "SmolLM2-135M-Instruct.Q4_1.gguf"

/* Largest config file accepted, in bytes. */
#define TDM_CONFIG_MAX_FILE_BYTES (1u << 20)

/* Most models one config may list (models:). */
#define TDM_CONFIG_MAX_MODELS 64

/* Most nodes one config may list. */
#define TDM_CONFIG_MAX_NODES 1024

/* Longest node id, in bytes (ids are [A-Za-z0-9._-]+; they name the node in logs). */
#define TDM_NODE_ID_MAX 63

typedef enum tdm_node_role {
    TDM_NODE_ROLE_PREFILL = 0, /* runs prompts, ships KV pages to a decode node */
    TDM_NODE_ROLE_DECODE = 1,  /* receives KV pages, runs the continuous-batching loop */
} tdm_node_role_t;

typedef enum tdm_prefill_policy {
    TDM_PREFILL_POLICY_ROUND_ROBIN = 0,  /* each healthy prefill node in turn */
    TDM_PREFILL_POLICY_LEAST_LOADED = 1, /* fewest queued prompt tokens */
    TDM_PREFILL_POLICY_PREFIX_AWARE = 2, /* most cached prompt blocks, within a load bound */
} tdm_prefill_policy_t;

typedef enum tdm_node_device_kind {
    TDM_NODE_DEVICE_CPU = 0,
    TDM_NODE_DEVICE_CUDA = 1,
} tdm_node_device_kind_t;

/* Where a node computes: "cpu" or "cuda:N". */
typedef struct tdm_node_device {
    tdm_node_device_kind_t kind;
    int index; /* CUDA device ordinal 0..63; 0 for the CPU */
} tdm_node_device_t;

/* model.reasoning_parser: how the gateway finds reasoning in chat output (docs/models.md). */
typedef enum tdm_reasoning_parser {
    TDM_REASONING_PARSER_AUTO = 0,        /* from the chat template */
    TDM_REASONING_PARSER_NONE = 1,        /* no reasoning: all output is content */
    TDM_REASONING_PARSER_DEEPSEEK_R1 = 2, /* output begins inside <think>…</think> */
    TDM_REASONING_PARSER_QWEN3 = 3,       /* a leading <think> opens the reasoning */
} tdm_reasoning_parser_t;

/* model.tool_call_parser: the format of generated tool calls (docs/models.md). */
typedef enum tdm_tool_call_parser {
    TDM_TOOL_CALL_PARSER_AUTO = 0,        /* from the chat template */
    TDM_TOOL_CALL_PARSER_HERMES = 1,      /* <tool_call>{…}</tool_call> */
    TDM_TOOL_CALL_PARSER_LLAMA3_JSON = 2, /* {"name": …, "parameters": …} */
    TDM_TOOL_CALL_PARSER_MISTRAL = 3,     /* [TOOL_CALLS]… */
} tdm_tool_call_parser_t;

/* model.defaults: the sampling a request of this model gets for what it leaves unset (vLLM's
 * per-model generation defaults). The defaults of these defaults are Tandem's own
 * (tdm_sampling_params_default, TDM_ROUTER_MAX_TOKENS_DEFAULT), so a config without them
 * changes nothing. */
typedef struct tdm_model_defaults {
    double temperature;        /* [0, 5]; 1 */
    double top_p;              /* (0, 1]; 1 */
    int top_k;                 /* 0..1048576 (at most the vocabulary, checked per request); 0 */
    double repetition_penalty; /* (0, 10]; 1 */
    int max_tokens; /* 0..1048576: output tokens of a request that sets none (native max_tokens
                       0, /v1/chat/completions without it), at most what the context leaves;
                       0 = what the context leaves, at most 1024 */
} tdm_model_defaults_t;

/* model: which weights to serve and how to present them. */
typedef struct tdm_model_config {
    char *path;          /* GGUF file; default tdm_model_default_path(); a leading "~/" is
                            expanded with $HOME; relative paths are taken from the cwd */
    char *chat_template; /* NULL: the model's tokenizer.chat_template; else a built-in name
                            ("chatml", "llama3", "llama2", "gemma") or a Jinja template file's
                            path ("~/" expanded), checked at load (tdm_chat_template_check) */
    char *name;          /* model name clients use (/v1/models); default: path's file name
                            without the .gguf suffix */
    char **aliases;      /* n_aliases more names clients may use for this model (vLLM's
                            several --served-model-name); none: NULL, 0 */
    size_t n_aliases;
    tdm_reasoning_parser_t reasoning_parser; /* auto (default) */
    tdm_tool_call_parser_t tool_call_parser; /* auto (default) */
    tdm_model_defaults_t defaults;           /* its requests' sampling defaults */
    int max_context; /* tokens a sequence (prompt + output) may hold: 0 (default) =
                        min(TDM_MODEL_MAX_SERVE_CTX, trained context); else 1..the trained
                        context (checked when the model is opened: tdm_served_model_open) */
} tdm_model_config_t;

/* Routers a node registers with at most (router.node_endpoints). */
#define TDM_CONFIG_MAX_ROUTERS 16

/* router: the client-facing endpoints and the scheduler's knobs. */
typedef struct tdm_router_config {
    char *client_endpoint; /* ZMQ ROUTER for clients; "tcp://127.0.0.1:7600" */
    char *node_endpoint;   /* ZMQ ROUTER the nodes connect to; ":7601" */
    char *node_advertise;  /* what the nodes connect to when it is not node_endpoint (which the
                              router binds): e.g. bind tcp://0.0.0.0:7601, advertise
                              tcp://router:7601 (ZeroMQ binds no host names). NULL: node_endpoint;
                              see tdm_config_router_advertise */
    char **node_endpoints; /* n_node_endpoints router node endpoints every node registers with,
                              one per router process (several routers sharing the node pools);
                              none (NULL, 0): the one of tdm_config_router_advertise. See
                              tdm_config_router_endpoints */
    size_t n_node_endpoints;
    char *http_address;            /* HTTP gateway bind address; "127.0.0.1" */
    int http_port;                 /* 1..65535; 8000 */
    int http_threads;              /* the HTTP gateway's thread pool, 1..256; default 4 */
    int http_connection_timeout_s; /* an HTTP connection idle this long (headers or body not
                                      arriving, keep-alive) is closed, 1..3600 s; default 30 */
    int http_max_connections;      /* open HTTP connections at most, 1..100000; default 1000 */
    int http_max_connections_per_client; /* from one client address at most, 0 (no limit)..
                                            100000; default 64 */
    int http_header_timeout_s;           /* a request's headers must be complete this long after the
                                            connection opened, 1..3600 s; default 10 */
    int responses_store_max;             /* /v1/responses answers kept for previous_response_id and
                                            GET /v1/responses/{id}, 0 (none)..1000000; default 1000 */
    uint64_t responses_store_bytes;      /* their bytes in all, 1 MiB..64 GiB; default 64 MiB */
    int http_min_body_rate;              /* bytes/s a request body must average after the first
                                            http_header_timeout_s, 0 (none)..1e9; default 1024 */
    tdm_prefill_policy_t prefill_policy; /* round_robin (default) */
    int max_queue;                       /* requests waiting for a node before RESOURCE_EXHAUSTED;
                                            1..1000000, default 1024 */
    bool admission_control;   /* refuse (RESOURCE_EXHAUSTED) a new request no decode node up can
                                 finish before its deadline by the router's estimate; default
                                 true */
    bool metrics_compat_vllm; /* metrics_compat: vllm (default) also serves vLLM's `vllm:`
                                 series beside the tandem_ ones; none: tandem_ only */
    double request_timeout_s; /* deadline of a request that sets none, seconds; (0, 86400],
                                 default 600 */
    char **api_keys;          /* n_api_keys accepted keys; none (NULL, 0) = no authentication */
    size_t n_api_keys;
    bool public_metrics;    /* with api_keys set: true leaves /metrics, /api/status, the dashboard
                               and the native STATUS and METRICS calls open; default false (they
                               need a key too) */
    char *curve_public_key; /* the router's CURVE public key (Z85, 40 characters); set =
                               CURVE on for the node and KV channels; NULL: off */
    char *curve_secret_key_file; /* file holding the router's secret key (read by the router
                                    only, tdm_net_curve_secret_read); required with the key */
    char **cors_origins;         /* n_cors_origins origins ("https://host:port", or "*": any) whose
                                    browser pages may call the HTTP API; none (NULL, 0): no CORS */
    size_t n_cors_origins;
} tdm_router_config_t;

/* kv: the paged KV cache, identical on every node. */
typedef struct tdm_kv_config {
    int block_size;                /* tokens per block: a power of two in 1..256; default 16 */
    tdm_kv_dtype_t dtype;          /* f16 (default) */
    bool prefix_caching;           /* share blocks of identical prompt prefixes; default true */
    double transfer_timeout_s;     /* a KV transfer not acknowledged within this many seconds
                                      fails (the prefill node reports it, the router retries);
                                      (0, 3600], default 10 */
    uint64_t early_transfer_bytes; /* decode: KV transfers that arrive before their
                                      reservation is decided are held up to this many bytes
                                      in all (0: none held); default 256 MiB */
    double early_transfer_s;       /* decode: and each at most this long; (0, 3600],
                                      default 5 */
} tdm_kv_config_t;

typedef struct tdm_log_config {
    tdm_log_level_t level; /* info (default) */
} tdm_log_config_t;

/* security: what the daemons may do without protection. CURVE itself is configured by keys:
 * router.curve_public_key turns it on, and then every node has its own pair
 * (nodes[].curve_public_key, nodes[].curve_secret_key_file). */
typedef struct tdm_security_config {
    bool insecure;     /* allow non-loopback binds without CURVE (node and KV endpoints) or without
                          API keys (client endpoint, HTTP); every daemon logs a warning at start.
                          Default false */
    bool default_keys; /* a config without CURVE keys whose node and KV endpoints are all on
                          this host takes per-node keys from the user's key directory
                          (tdm_keydir_apply, tandem/node_keys.h). Default true */
} tdm_security_config_t;

/* One entry of nodes:. */
#define TDM_CONFIG_DEFAULT_SPEC_MAX_DRAFT 8
#define TDM_CONFIG_MAX_SPEC_MAX_DRAFT 16 /* = TDM_WORKER_MAX_DRAFT (tandem/worker.h) */

typedef struct tdm_node_config {
    char *id;                      /* unique, 1..63 bytes of [A-Za-z0-9._-]; required */
    tdm_node_role_t role;          /* required */
    char *endpoint;                /* optional ZMQ endpoint the node binds for direct control
                                      connections; NULL: reachable only through router.node_endpoint */
    char *kv_endpoint;             /* decode nodes: ZMQ endpoint receiving KV pages; default
                                      "tcp://127.0.0.1:(7610 + n)" for the n-th decode node (from 0);
                                      always NULL for prefill nodes */
    char *kv_advertise;            /* decode nodes: the KV endpoint the node registers with the
                                      router, which prefill nodes connect to, when it is not
                                      kv_endpoint (which the node binds): e.g. bind
                                      tcp://0.0.0.0:7610, advertise tcp://decode-0:7610. NULL:
                                      kv_endpoint; see tdm_config_kv_advertise */
    tdm_node_device_t device;      /* default cpu */
    int threads;                   /* CPU compute threads, 0..1024; 0 = one per core (default) */
    uint64_t memory_budget;        /* bytes for weights + KV on this node (>= 1 MiB); 0 when
                                      gpu_memory_utilization is used. Default 2 GiB on cpu */
    double gpu_memory_utilization; /* cuda only: fraction (0, 1] of the GPU's memory; 0 when
                                      memory_budget is used. Default 0.9 on cuda */
    int max_batch_tokens;          /* tokens in one forward pass, 1..1048576; default 2048 */
    int max_running;               /* sequences in the running batch, 1..65536; default 64 */
    uint64_t grammar_cache_bytes;  /* compiled grammars (structured output) kept for reuse,
                                      bytes, 0..16 GiB; 0 = none kept; default 64 MiB
                                      (TDM_GRAMMAR_CACHE_DEFAULT_BYTES) */
    int spec_max_draft;            /* speculative.max_draft: decode nodes, draft tokens per
                                      sequence and step of prompt-lookup speculative decoding,
                                      0..16 (TDM_WORKER_MAX_DRAFT); 0 = off; default 8
                                      (TDM_CONFIG_DEFAULT_SPEC_MAX_DRAFT) */
    double spec_row_cost;          /* speculative.row_cost: a draft row's cost relative to a
                                      decode step, [0, 10]; 0 (default) = fitted from the
                                      node's own step times (tdm_worker_opts_t.spec_row_cost) */
    char *model;                   /* the served name (name or alias) of the model this node
                                      serves, one of the config's models; NULL: the first
                                      (tdm_config_node_model) */
    char *curve_public_key;        /* this node's CURVE public key (Z85, 40 characters); required
                                      and distinct per node when CURVE is on, NULL otherwise */
    char *curve_secret_key_file;   /* file with this node's secret key, read only by this node's
                                      daemon (tdm_net_curve_secret_read); required with the key */
} tdm_node_config_t;

/* The whole cluster. Owns every string and array in it; release with tdm_config_free. */
typedef struct tdm_config {
    tdm_model_config_t model;   /* the first served model (models[0], copied): what code that
                                   serves one model reads */
    tdm_model_config_t *models; /* n_models >= 1 served models, in file order: the models: list,
                                   or the one model: section; their names and aliases are
                                   distinct across the list */
    size_t n_models;
    tdm_router_config_t router;
    tdm_kv_config_t kv;
    tdm_log_config_t log;
    tdm_security_config_t security;
    tdm_node_config_t *nodes; /* n_nodes entries, in file order; at least one decode node */
    size_t n_nodes;
} tdm_config_t;

/* Fills *cfg (whose previous contents are ignored, not freed) with the defaults: the values
 * above, one node "prefill-0" (prefill, cpu) and one "decode-0" (decode, cpu, KV on
 * tcp://127.0.0.1:7610), the default model path. Returns 0; TDM_ERESOURCE on out of memory,
 * TDM_ENOTFOUND when the default model path cannot be formed (no $HOME); on error *cfg holds
 * nothing to free. Caller releases a successful result with tdm_config_free. */
int tdm_config_defaults(tdm_config_t *cfg);

/* Loads the YAML file at path over the defaults into *cfg (previous contents ignored).
 * Returns 0, or with *err set (message "PATH:LINE: key 'a.b': what is wrong"):
 * TDM_ENOTFOUND (no such file), TDM_EUNAVAILABLE (read error), TDM_EINVALID (YAML syntax,
 * unknown or duplicate key, wrong type, value out of range, duplicate node id or endpoint,
 * missing required field), TDM_ERESOURCE (out of memory, file over
 * TDM_CONFIG_MAX_FILE_BYTES). On error *cfg holds nothing to free; on success the caller
 * releases it with tdm_config_free. An empty file gives the defaults. */
int tdm_config_load_file(const char *path, tdm_config_t *cfg, tdm_error_t *err);

/* Like tdm_config_load_file for len bytes of YAML text; name stands for the file in messages
 * (NULL: "<string>"). */
int tdm_config_load_string(const char *text, size_t len, const char *name, tdm_config_t *cfg,
                           tdm_error_t *err);

/* The node with the given id, or NULL. The pointer is into cfg->nodes (valid until
 * tdm_config_free). Cannot fail. */
const tdm_node_config_t *tdm_config_find_node(const tdm_config_t *cfg, const char *id);

/* The index in cfg->models of the model whose name or one of whose aliases is served, or -1
 * (none; served NULL or ""). Cannot fail. */
int tdm_config_model_index(const tdm_config_t *cfg, const char *served);

/* The index in cfg->models of the model node serves (nodes[].model; 0 when it names none).
 * A loaded config's nodes always name a listed model. Cannot fail. */
size_t tdm_config_node_model_index(const tdm_config_t *cfg, const tdm_node_config_t *node);

/* The model node serves: &cfg->models[tdm_config_node_model_index]. Borrowed from cfg. */
const tdm_model_config_t *tdm_config_node_model(const tdm_config_t *cfg,
                                                const tdm_node_config_t *node);

/* The endpoint nodes connect to: router.node_advertise when set, else router.node_endpoint.
 * Borrowed from cfg. Cannot fail. */
const char *tdm_config_router_advertise(const tdm_config_t *cfg);

/* The router endpoints a node registers with, one link each: router.node_endpoints when set
 * (1..TDM_CONFIG_MAX_ROUTERS distinct endpoints), else the single tdm_config_router_advertise.
 * *n gets the count (>= 1). Borrowed from cfg. Cannot fail. */
const char *const *tdm_config_router_endpoints(const tdm_config_t *cfg, size_t *n);

/* The KV endpoint prefill nodes connect to for decode node `node`: its kv_advertise when set,
 * else its kv_endpoint; NULL for a prefill node. Borrowed from node. Cannot fail. */
const char *tdm_config_kv_advertise(const tdm_node_config_t *node);

/* Whether id is a node id: 1..TDM_NODE_ID_MAX characters of A-Z a-z 0-9 . _ - (what a config
 * may name, so what the router may be asked to register). Cannot fail. */
bool tdm_config_node_id_ok(const char *id);

/* Whether key (NUL-terminated; NULL or "" for none) is one of router->api_keys, compared in
 * constant time per configured key; true when no API keys are configured. The one check the
 * router's client endpoint and the HTTP gateway both use. Cannot fail. */
bool tdm_config_api_key_ok(const tdm_router_config_t *router, const char *key);

/* True when CURVE secures the node and KV channels (router.curve_public_key is set; the
 * loader then guarantees every node a distinct key pair). Cannot fail. */
bool tdm_config_curve_on(const tdm_config_t *cfg);

/* True when address can only be reached from this host: a ZeroMQ endpoint inproc://… or
 * ipc://…, or tcp://HOST:PORT, or a bare HOST (router.http_address), where HOST is an IPv4
 * address in 127.0.0.0/8, ::1 (with or without brackets) or "localhost". Anything else (a
 * wildcard, an interface name, another address or host name) is false. Cannot fail. */
bool tdm_config_address_is_loopback(const char *address);

/* What every daemon logs at start (a warning) while security.insecure is true. */
#define TDM_CONFIG_INSECURE_WARNING                                                                \
    "security.insecure is true: non-loopback binds without CURVE or API keys are allowed; "        \
    "anyone who can reach this cluster's endpoints may pose as a node or a client"

/* What protects a bound endpoint when its address is not loopback. */
typedef enum tdm_bind_guard {
    TDM_BIND_GUARD_CURVE = 0,    /* node and KV endpoints: needs tdm_config_curve_on */
    TDM_BIND_GUARD_API_KEYS = 1, /* client endpoint and HTTP: needs router.api_keys */
} tdm_bind_guard_t;

/* Whether a daemon may bind address, which the config key `key` gave ("router.node_endpoint",
 * "nodes[2].kv_endpoint"): yes when it is loopback (tdm_config_address_is_loopback), when its
 * guard is configured, or when security.insecure is true. Returns 0, or TDM_EPRECONDITION with
 * a message naming the key, the address and the ways to fix it. Cannot fail otherwise. */
int tdm_config_bind_check(const tdm_config_t *cfg, const char *key, const char *address,
                          tdm_bind_guard_t guard, tdm_error_t *err);

/* The binds of cfg that their daemons would refuse (tdm_config_bind_check of the router's
 * client endpoint, node endpoint and HTTP address, and of every decode node's kv_endpoint),
 * one message each in errs[0..cap). Returns how many were written. Cannot fail. */
size_t tdm_config_bind_problems(const tdm_config_t *cfg, tdm_error_t *errs, size_t cap);

/* Writes the resolved configuration (every key, defaults included) as YAML that
 * tdm_config_load_string reads back into an identical config. Returns 0, or TDM_EUNAVAILABLE
 * when writing to out failed. */
int tdm_config_dump(const tdm_config_t *cfg, FILE *out);

/* Writes the Markdown table of the keys of one section ("model", "router", "kv", "log",
 * "security" or "nodes": key, type, default, range and meaning, from the key table), the
 * tables docs/operations.md holds. section NULL: every section's table, each after a line
 * "<!-- tandem config keys SECTION -->" and the tables apart by a blank line. Returns 0,
 * TDM_ENOTFOUND for another section name (nothing written), or TDM_EUNAVAILABLE when writing
 * to out failed. */
int tdm_config_keys_markdown(const char *section, FILE *out);

/* Frees everything *cfg owns and zeroes it; accepts NULL and a zeroed config. */
void tdm_config_free(tdm_config_t *cfg);

/* Writes the default model path to buf (cap bytes): $TANDEM_MODEL when set and not empty,
 * else "${XDG_CACHE_HOME:-$HOME/.cache}/tandem/models/" TDM_DEFAULT_MODEL_FILE. The file need
 * not exist. Returns 0; TDM_ENOTFOUND when neither XDG_CACHE_HOME nor HOME is set,
 * TDM_ERESOURCE when the path does not fit in cap bytes (buf then holds ""). */
int tdm_model_default_path(char *buf, size_t cap);

/* Writes the path of file (a model file name) in the model cache to buf (cap bytes):
 * "${XDG_CACHE_HOME:-$HOME/.cache}/tandem/models/FILE", the folder scripts/setup installs
 * models into. The file need not exist. Returns 0; TDM_ENOTFOUND when neither XDG_CACHE_HOME
 * nor HOME is set, TDM_ERESOURCE when the path does not fit in cap bytes (buf then holds ""). */
int tdm_model_cache_path(const char *file, char *buf, size_t cap);

/* Parses a byte size: a decimal number (fraction allowed) with an optional unit, with or
 * without a space between: B, kB/KB/K, MB/M, GB/G, TB/T (powers of 1000) or KiB/Ki, MiB/Mi,
 * GiB/Gi, TiB/Ti (powers of 1024); units are case-insensitive ("2GiB", "512 MiB", "1.5GB",
 * "4096"). A fraction of a byte is dropped. Returns 0 with *bytes set, or TDM_EINVALID for
 * anything else (empty, negative, unknown unit, over 2^63 - 1 bytes). */
int tdm_config_parse_bytes(const char *text, uint64_t *bytes);

/* Formats bytes exactly, in the largest binary unit that divides it ("2GiB", "1536KiB",
 * "1000"), so that tdm_config_parse_bytes gives the same number back. Writes at most cap bytes
 * (NUL included; 24 always suffice) and returns the length snprintf would have. */
int tdm_config_format_bytes(uint64_t bytes, char *buf, size_t cap);

/* Names of the enum values as the config file spells them ("prefill", "least_loaded",
 * "f16"); "?" for a value outside the enum. (KV dtypes: tdm_kv_dtype_name in kv.h; chat
 * templates: tdm_chat_template_name.) */
const char *tdm_config_node_role_name(tdm_node_role_t role);
const char *tdm_config_prefill_policy_name(tdm_prefill_policy_t policy);

/* Writes "cpu" or "cuda:N" to buf (cap bytes); returns the length snprintf would have. */
int tdm_config_device_format(tdm_node_device_t device, char *buf, size_t cap);

/* Parses "cpu", "cuda" (= cuda:0) or "cuda:N" (N in 0..63). Returns 0 or TDM_EINVALID. */
int tdm_config_device_parse(const char *text, tdm_node_device_t *device);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_CONFIG_H */
