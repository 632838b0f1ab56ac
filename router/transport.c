/* transport.c - the router's KV transport choice per (prefill, decode) pair
 * (transport.h; docs/operations.md "GPU nodes"). */
#include "transport.h"

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

void rt_place_from(rt_place_t *p, const Tandem__V1__RegisterRequest *m)
{
    memset(p, 0, sizeof *p);
    snprintf(p->host_id, sizeof p->host_id, "%s", m->host_id ? m->host_id : "");
    snprintf(p->gpu_uuid, sizeof p->gpu_uuid, "%s", m->gpu_uuid ? m->gpu_uuid : "");
    for (size_t i = 0; i < m->n_gpu_uuids && p->n_gpu_uuids < RT_MAX_GPUS; i++)
        snprintf(p->gpu_uuids[p->n_gpu_uuids++], TDM_DEVICE_UUID_MAX, "%s", m->gpu_uuids[i]);
    for (size_t i = 0; i < m->n_transports; i++) {
        tdm_kv_backend_t b;
        if (tdm_kv_backend_parse(m->transports[i], &b, NULL) == TDM_OK)
            p->transports |= 1u << b;
    }
}

static bool both_list(const rt_place_t *p, const rt_place_t *d, tdm_kv_backend_t b)
{
    return (p->transports & d->transports & (1u << b)) != 0;
}

static bool sees_gpu(const rt_place_t *p, const char *uuid)
{
    for (uint32_t i = 0; i < p->n_gpu_uuids; i++)
        if (strcmp(p->gpu_uuids[i], uuid) == 0)
            return true;
    return false;
}

tdm_kv_backend_t rt_transport_choose(const rt_place_t *p, const rt_place_t *d)
{
    if (!p->gpu_uuid[0] || !d->gpu_uuid[0])
        return TDM_KV_BACKEND_TCP;
    bool same_host = p->host_id[0] && strcmp(p->host_id, d->host_id) == 0;
    if (same_host && sees_gpu(p, d->gpu_uuid) && both_list(p, d, TDM_KV_BACKEND_CUDA_IPC))
        return TDM_KV_BACKEND_CUDA_IPC;
    if (both_list(p, d, TDM_KV_BACKEND_NCCL))
        return TDM_KV_BACKEND_NCCL;
    return TDM_KV_BACKEND_TCP;
}
