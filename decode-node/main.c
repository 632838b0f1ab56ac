/* main.c - tandem-decode: runs one decode node of a Tandem cluster (see decode.h and
 * tandem/daemon.h). */
#include "decode.h"
#include "tandem/daemon.h"

static void *create(const tdm_config_t *cfg, const char *node_id, tdm_net_t *net,
                    const tdm_logger_t *log, tdm_error_t *err)
{
    return tdm_decode_new(cfg, node_id, net, log, err);
}

static int run(void *node, volatile sig_atomic_t *stop, tdm_error_t *err)
{
    return tdm_decode_run(node, stop, err);
}

static void destroy(void *node)
{
    tdm_decode_t *n = node;
    tdm_decode_destroy(&n);
}

static tdm_node_link_t *link_of(void *node, size_t i)
{
    return tdm_decode_link(node, i);
}

int main(int argc, char **argv)
{
    const tdm_daemon_ops_t ops = {TDM_NODE_ROLE_DECODE, create, run, destroy, link_of};
    return tdm_daemon_main(argc, argv, &ops);
}
