/* transport.h - the KV transport the router picks for a (prefill, decode) pair of nodes,
 * from what each registered: its host, the GPUs it sees and the one it computes on, and the
 * transports it can use. */
#ifndef TANDEM_ROUTER_TRANSPORT_H
#define TANDEM_ROUTER_TRANSPORT_H

#include <stdint.h>

#include "tandem/device.h"
#include "tandem/proto.h"
#include "tandem/transfer.h"

/* GPUs of a registration the router keeps (the first ones listed). */
#define RT_MAX_GPUS 16

/* Where a node runs, as it registered (RegisterRequest host_id, gpu_uuid, gpu_uuids,
 * transports). */
typedef struct rt_place {
    char host_id[64];                                 /* boot_id; "" unknown: no host match */
    char gpu_uuid[TDM_DEVICE_UUID_MAX];               /* the GPU it computes on; "" CPU */
    char gpu_uuids[RT_MAX_GPUS][TDM_DEVICE_UUID_MAX]; /* GPUs it sees */
    uint32_t n_gpu_uuids;
    uint32_t transports; /* bit (1u << tdm_kv_backend_t) for each transport it listed */
} rt_place_t;

/* Fills p from registration m (longer strings are cut, unknown transports ignored). Cannot
 * fail. */
void rt_place_from(rt_place_t *p, const Tandem__V1__RegisterRequest *m);

/* The transport from prefill node p to decode node d: tcp when either computes on the CPU
 * (or lists no device transport); cuda_ipc when both are on the same host (equal, non-empty
 * host ids) and d's GPU is one p sees (a CUDA IPC handle opens only there); nccl between
 * GPU pools otherwise. A transport either side did not list falls back to the next one
 * (cuda_ipc -> nccl -> tcp). Cannot fail. */
tdm_kv_backend_t rt_transport_choose(const rt_place_t *p, const rt_place_t *d);

#endif /* TANDEM_ROUTER_TRANSPORT_H */
