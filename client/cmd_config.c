/* cmd_config.c - `tandem config check [FILE]`, `tandem config defaults` and `tandem config keys
 * [SECTION]`: validate a cluster config and print it resolved (every key, defaults filled in)
 * as YAML, or print the key table as the Markdown tables of docs/operations.md. */
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "commands.h"
#include "tandem/config.h"
#include "tandem/node_runtime.h"
#include "tandem/serve.h"

static void usage(FILE *out)
{
    fprintf(out,
            "usage: tandem config check [FILE]\n"
            "       tandem config defaults\n"
            "       tandem config keys [SECTION]\n"
            "\n"
            "check     loads FILE (a cluster config, see docs/operations.md) and prints the\n"
            "          resolved config as YAML: every key, defaults filled in. Errors go to\n"
            "          stderr as FILE:LINE: key 'a.b': message, and the exit status is 1.\n"
            "          A bind the daemons would refuse (a non-loopback node or KV endpoint\n"
            "          without CURVE, a client endpoint or HTTP address without API keys,\n"
            "          unless security.insecure) is an error too, and so is what the\n"
            "          daemons would refuse in a model file that exists (opened, not\n"
            "          run): a max_context past its trained context, a GGUF or tokenizer\n"
            "          Tandem cannot load, a KV layout kv.block_size and kv.dtype cannot\n"
            "          hold. Without FILE it checks the defaults.\n"
            "defaults  prints the default config (one prefill and one decode node on the CPU).\n"
            "keys      prints every key of SECTION (model, router, kv, log, security or nodes)\n"
            "          as a Markdown table: type, default, range and meaning. Without SECTION,\n"
            "          every section's table under its marker line, as docs/operations.md\n"
            "          holds them.\n"
            "\n"
            "The model path defaults to $TANDEM_MODEL, else\n"
            "${XDG_CACHE_HOME:-$HOME/.cache}/tandem/models/" TDM_DEFAULT_MODEL_FILE ".\n"
            "\n"
            "options:\n"
            "  -h, --help   this help\n");
}

static bool is_help(const char *arg)
{
    return strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0;
}

/* Prints cfg to stdout and notes on stderr a model file that is not there yet. */
static int print_config(const tdm_config_t *cfg)
{
    if (tdm_config_dump(cfg, stdout) != TDM_OK) {
        fprintf(stderr, "tandem config: writing to stdout failed\n");
        return 1;
    }
    struct stat st;
    for (size_t i = 0; i < cfg->n_models; i++) {
        const char *path = cfg->models[i].path;
        if (stat(path, &st) == 0)
            continue;
        size_t n = strlen(path), m = strlen(TDM_DEFAULT_MODEL_FILE);
        bool is_default = n >= m && strcmp(path + n - m, TDM_DEFAULT_MODEL_FILE) == 0;
        fprintf(stderr, "tandem config: note: model file %s does not exist%s\n", path,
                is_default ? " yet (scripts/setup installs it)" : "");
    }
    return 0;
}

/* `tandem config keys [SECTION]`: the key table as Markdown on stdout. */
static int print_keys(const char *section)
{
    int rc = tdm_config_keys_markdown(section, stdout);
    if (rc == TDM_ENOTFOUND) {
        fprintf(stderr,
                "tandem config keys: unknown section '%s' (model, router, kv, log, security or "
                "nodes)\n",
                section);
        return 2;
    }
    if (rc != TDM_OK) {
        fprintf(stderr, "tandem config: writing to stdout failed\n");
        return 1;
    }
    return 0;
}

/* Sizes the KV pool of each CPU node whose model opened (ok[model index]) as the node does at
 * start (tdm_node_runtime_check: memory_budget against the weights, engine scratch and one
 * full-context sequence) and prints each refusal after "where: ". Returns their number. */
static size_t node_problems(const tdm_config_t *cfg, const bool *ok, const char *where)
{
    size_t n = 0;
    for (size_t j = 0; j < cfg->n_nodes; j++) {
        const tdm_node_config_t *node = &cfg->nodes[j];
        if (node->device.kind != TDM_NODE_DEVICE_CPU || !ok[tdm_config_node_model_index(cfg, node)])
            continue;
        tdm_worker_mode_t mode =
            node->role == TDM_NODE_ROLE_PREFILL ? TDM_WORKER_MODE_PREFILL : TDM_WORKER_MODE_DECODE;
        uint64_t kv_bytes = 0;
        tdm_error_t err = {0};
        if (tdm_node_runtime_check(cfg, node, mode, &kv_bytes, &err) != TDM_OK) {
            fprintf(stderr, "%s: %s\n", where, err.msg);
            n++;
        }
    }
    return n;
}

/* Opens each model of cfg whose file exists as the router and the nodes do at start
 * (tdm_served_model_open_at: GGUF, tokenizer, max_context against the trained context, KV
 * layout), then sizes the CPU nodes' KV pools (node_problems), and prints each refusal to
 * stderr after "where: ". A file that is not there is left to print_config's note. Returns the
 * number of refusals. */
static size_t model_problems(const tdm_config_t *cfg, const char *where)
{
    size_t n = 0;
    struct stat st;
    bool ok[TDM_CONFIG_MAX_MODELS] = {false};
    for (size_t i = 0; i < cfg->n_models && i < TDM_CONFIG_MAX_MODELS; i++) {
        if (stat(cfg->models[i].path, &st) != 0)
            continue;
        tdm_served_model_t sm;
        tdm_error_t err = {0};
        if (tdm_served_model_open_at(&sm, cfg, i, &err) != TDM_OK) {
            fprintf(stderr, "%s: %s\n", where, err.msg);
            n++;
            continue;
        }
        tdm_served_model_close(&sm);
        ok[i] = true;
    }
    return n + node_problems(cfg, ok, where);
}

/* `tandem config check [FILE]` and `tandem config defaults` (file NULL): loads FILE or the
 * defaults and prints the resolved config; a load error, a bind the daemons would refuse or
 * (check only) a model file they would refuse goes to stderr. Returns the exit status. */
static int check_config(const char *file, bool open_models)
{
    tdm_config_t cfg;
    tdm_error_t err = {0};
    int rc = file ? tdm_config_load_file(file, &cfg, &err) : tdm_config_defaults(&cfg);
    if (rc != TDM_OK && file) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    if (rc != TDM_OK) {
        fprintf(stderr, "tandem config: cannot build the defaults: %s%s\n", tdm_strerror(rc),
                rc == TDM_ENOTFOUND ? " (neither XDG_CACHE_HOME nor HOME is set)" : "");
        return 1;
    }
    /* what the daemons would refuse at start is an error here too */
    tdm_error_t problems[16];
    size_t n_problems = tdm_config_bind_problems(&cfg, problems, 16);
    for (size_t i = 0; i < n_problems; i++)
        fprintf(stderr, "%s: %s\n", file ? file : "(defaults)", problems[i].msg);
    if (open_models)
        n_problems += model_problems(&cfg, file ? file : "(defaults)");
    int status = n_problems ? 1 : print_config(&cfg);
    tdm_config_free(&cfg);
    return status;
}

int tdm_cmd_config(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (is_help(argv[1])) {
        usage(stdout);
        return 0;
    }
    const char *action = argv[1];
    const char *file = NULL; /* check: FILE; keys: SECTION */
    for (int i = 2; i < argc; i++) {
        if (is_help(argv[i])) {
            usage(stdout);
            return 0;
        }
        if (argv[i][0] == '-' && argv[i][1] != '\0') {
            fprintf(stderr, "tandem config: unknown option '%s'\n", argv[i]);
            return 2;
        }
        if (file || (strcmp(action, "check") != 0 && strcmp(action, "keys") != 0)) {
            fprintf(stderr, "tandem config %s: unexpected argument '%s'\n", action, argv[i]);
            return 2;
        }
        file = argv[i];
    }

    if (strcmp(action, "keys") == 0)
        return print_keys(file);
    if (strcmp(action, "check") == 0 || strcmp(action, "defaults") == 0)
        return check_config(file, strcmp(action, "check") == 0);
    fprintf(stderr, "tandem config: unknown action '%s' (check, defaults or keys)\n\n", action);
    usage(stderr);
    return 2;
}
