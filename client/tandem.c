/* tandem.c - entry point of the `tandem` command-line tool: dispatches to a subcommand. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "commands.h"

typedef struct subcommand {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} subcommand_t;

static const subcommand_t subcommands[] = {
    {"generate", tdm_cmd_generate, "generate text through the router, or in this process (-m)"},
    {"chat", tdm_cmd_chat, "chat with the served model through the router"},
    {"status", tdm_cmd_status, "show the cluster: nodes, KV blocks, queues, heartbeats"},
    {"bench", tdm_cmd_bench, "load-test the router: latency percentiles, throughput, goodput"},
    {"cluster", tdm_cmd_cluster, "start (up) or stop (down) a router and its nodes on this host"},
    {"inspect", tdm_cmd_inspect, "show a GGUF model: architecture, hyperparameters, tensors"},
    {"embed", tdm_cmd_embed,
     "print the embeddings of texts through the router, or in this process (-m)"},
    {"tokenize", tdm_cmd_tokenize, "print the token ids of a text with a model's tokenizer"},
    {"tokenizer", tdm_cmd_tokenizer,
     "export a Hugging Face tokenizer folder for a model's vocabulary"},
    {"model", tdm_cmd_model, "write a random-weight model of a real architecture's shape (synth)"},
    {"grammar", tdm_cmd_grammar, "check a GBNF grammar, and an instance against it"},
    {"config", tdm_cmd_config, "check a cluster config file, print it resolved or list its keys"},
    {"keys", tdm_cmd_keys,
     "generate the CURVE key pairs of a cluster, or show its keys by default"},
    {"kvcalc", tdm_cmd_kvcalc, "size the KV cache: bytes per token, per sequence, per budget"},
    {"version", tdm_cmd_version, "print the version and the build's features"},
};

static void usage(FILE *out)
{
    fprintf(out, "usage: tandem <command> [options]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof subcommands / sizeof subcommands[0]; i++)
        fprintf(out, "  %-10s %s\n", subcommands[i].name, subcommands[i].summary);
    fprintf(out, "\n`tandem <command> --help` describes a command's options.\n");
}

/* libgomp reads its wait policy once, when it is loaded. Its default spins at every barrier;
 * when another process holds one of the cores a spinning thread waits out whole scheduler
 * slices, and a forward pass (about 150 parallel regions) slows down 10-100x. Unless the user
 * chose a policy, set OMP_WAIT_POLICY=passive and re-execute once, before any thread starts.
 * Measured on the 2-core CI machine with one core busy: decode 26 -> 51 tokens/s. On dedicated
 * cores OMP_WAIT_POLICY=active may be a little faster (docs/performance.md). */
static void set_omp_wait_policy(char **argv)
{
    if (getenv("OMP_WAIT_POLICY") || getenv("GOMP_SPINCOUNT"))
        return;
    if (setenv("OMP_WAIT_POLICY", "passive", 1) != 0)
        return;
    execv("/proc/self/exe", argv); /* returns only on failure: then carry on as we are */
}

int main(int argc, char **argv)
{
    set_omp_wait_policy(argv);
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
        strcmp(argv[1], "help") == 0) {
        usage(stdout);
        return 0;
    }
    if (strcmp(argv[1], "--version") == 0)
        return tdm_cmd_version(argc - 1, argv + 1);
    for (size_t i = 0; i < sizeof subcommands / sizeof subcommands[0]; i++)
        if (strcmp(argv[1], subcommands[i].name) == 0) {
            /* getopt names the program by argv[0] in its messages: "tandem generate: …" */
            char name[64];
            snprintf(name, sizeof name, "tandem %s", subcommands[i].name);
            argv[1] = name;
            return subcommands[i].run(argc - 1, argv + 1);
        }
    fprintf(stderr, "tandem: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
