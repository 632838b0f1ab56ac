/* header.c - the KV transfer's wire framing (docs/protocol.md "KV transfer"): the backend
 * names it carries, the KvTransfer header a sender writes and every check a receiver makes of
 * a header and its framing before it looks at the blocks. The two sides are kept together
 * here so that what is written and what is accepted cannot drift apart.
 */
#include "transfer/transfer_internal.h"

#include <inttypes.h>
#include <string.h>

/* ---- backend names ---- */

static const char *const backend_names[] = {"tcp", "nccl", "cuda_ipc"};

const char *tdm_kv_backend_name(tdm_kv_backend_t b)
{
    if ((unsigned)b < sizeof backend_names / sizeof backend_names[0])
        return backend_names[b];
    return "?";
}

int tdm_kv_backend_parse(const char *name, tdm_kv_backend_t *out, tdm_error_t *err)
{
    for (unsigned i = 0; name && i < sizeof backend_names / sizeof backend_names[0]; i++) {
        if (strcmp(name, backend_names[i]) == 0) {
            *out = (tdm_kv_backend_t)i;
            return 0;
        }
    }
    return tdm_error_set(err, TDM_EINVALID, "KV backend \"%s\" unknown: use tcp, nccl or cuda_ipc",
                         name ? name : "(null)");
}

bool tdm_kv_backend_built(tdm_kv_backend_t b)
{
    switch (b) {
    case TDM_KV_BACKEND_TCP: return true;
    case TDM_KV_BACKEND_NCCL:
    case TDM_KV_BACKEND_CUDA_IPC:
#ifdef TANDEM_HAVE_CUDA
        return true;
#else
        return false;
#endif
    }
    return false;
}

/* ---- the layout on the wire and the blocks of a transfer ---- */

void tdm_kv_wire_layout(const tdm_kv_layout_t *pool_layout, const tdm_kv_groups_t *groups,
                        uint32_t *windows, Tandem__V1__KvLayout *m)
{
    tdm_proto_layout_to(pool_layout, m);
    if (!groups)
        return;
    m->n_layers = groups->n_layers;
    m->layers_per_group = groups->layers_per_group;
    for (uint32_t g = 0; g < groups->n_groups; g++)
        windows[g] = groups->window[g];
    m->n_group_windows = groups->n_groups;
    m->group_windows = windows;
}

uint64_t tdm_kv_transfer_blocks(const tdm_kv_pool_t *pool, uint32_t n_tokens, uint32_t *first)
{
    const tdm_kv_layout_t *l = tdm_kv_pool_layout(pool);
    const tdm_kv_groups_t *g = tdm_kv_pool_groups(pool);
    if (!g)
        return tdm_kv_blocks_for_tokens(l, n_tokens);
    uint64_t n = 0;
    for (uint32_t gi = 0; gi < g->n_groups; gi++) {
        if (first)
            first[gi] = (uint32_t)tdm_kv_group_first_needed(g, gi, l->block_size, n_tokens);
        n += tdm_kv_group_live(g, gi, l->block_size, n_tokens, n_tokens);
    }
    return n;
}

/* ---- sender: the header ---- */

void tdm_kv_header_build(const tdm_kv_sender_t *s, const tdm_kv_xfer_t *x, uint64_t *sums,
                         uint64_t *offsets, Tandem__V1__KvTransfer *h, Tandem__V1__KvLayout *lay,
                         ProtobufCBinaryData *handle)
{
    tandem__v1__kv_transfer__init(h);
    tdm_kv_wire_layout(&s->layout, s->groups, (uint32_t *)s->windows, lay);
    if (s->groups) { /* s->first: filled by tdm_kv_transfer_blocks when x was checked */
        h->n_group_first_block = s->groups->n_groups;
        h->group_first_block = (uint32_t *)s->first;
    }
    h->request_id = (char *)x->request_id;
    h->attempt_id = x->attempt_id;
    h->transfer_id = x->id;
    h->n_tokens = x->n_tokens;
    h->first_token = x->first_token;
    h->layout = lay;
    h->model_fingerprint = s->model_fingerprint;
    h->n_blocks = x->n_blocks;
    h->block_bytes = s->block_bytes;
    h->checksum_kind = TANDEM__V1__CHECKSUM_KIND__CHECKSUM_KIND_XXH3_64;
    h->backend = (char *)tdm_kv_backend_name(s->backend);
    h->sender_node_id = (char *)s->node_id;
    h->prefill_s = x->prefill_s;
    h->n_checksums = x->n_blocks;
    h->checksums = sums;
    *handle = (ProtobufCBinaryData){sizeof s->ipc_handle, (uint8_t *)s->ipc_handle};
    if (s->backend == TDM_KV_BACKEND_CUDA_IPC) {
        h->n_ipc_handles = 1;
        h->ipc_handles = handle;
        h->n_block_offsets = x->n_blocks;
        h->block_offsets = offsets;
    }
    h->header_checksum = tdm_kv_header_checksum(h);
}

/* ---- receiver: the checks of a header ---- */

/* The request id and the backend (known, built in, and one this node's pool can take). */
static int check_header_backend(const tdm_kv_receiver_t *r, const Tandem__V1__KvTransfer *h,
                                tdm_kv_backend_t *backend, tdm_error_t *err)
{
    if (!h->request_id[0])
        return tdm_error_set(err, TDM_EINVALID, "request_id is empty");
    if (strlen(h->request_id) > TDM_REQUEST_ID_MAX)
        return tdm_error_set(err, TDM_EINVALID, "request_id is %zu bytes; at most %u",
                             strlen(h->request_id), TDM_REQUEST_ID_MAX);
    if (tdm_kv_backend_parse(h->backend, backend, NULL) != 0)
        return tdm_error_set(err, TDM_EINVALID, "backend \"%.64s\" unknown (tcp, nccl, cuda_ipc)",
                             h->backend);
    if (!tdm_kv_backend_built(*backend))
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "backend %s is not built into this node (no CUDA)", h->backend);
    if (*backend != TDM_KV_BACKEND_TCP && !r->memory.device_base)
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "backend %s needs a device pool; this node's pool is in host "
                             "memory",
                             h->backend);
    return 0;
}

/* The layer groups of the transfer against this node's (2.9): blocks of every layer go only
 * into a plain pool, blocks of a group's layers only into a pool with the same groups (the
 * same layers per group and windows), and group_first_block has one value per group. */
static int check_header_groups(const tdm_kv_receiver_t *r, const Tandem__V1__KvTransfer *h,
                               tdm_error_t *err)
{
    const Tandem__V1__KvLayout *l = h->layout;
    const tdm_kv_groups_t *g = r->groups;
    bool grouped = l->n_group_windows > 0 || l->layers_per_group > 0;
    if (!grouped && !g) {
        if (h->n_group_first_block)
            return tdm_error_set(err, TDM_EINVALID,
                                 "group_first_block has %zu values without layer groups",
                                 h->n_group_first_block);
        return 0;
    }
    if (!grouped || !g)
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "KV layout mismatch: the transfer's blocks hold %s; this node's "
                             "hold %s (docs/capacity.md: a model's nodes allocate alike)",
                             grouped ? "one layer group's layers" : "every layer",
                             g ? "one layer group's layers" : "every layer");
    if (l->layers_per_group != g->layers_per_group || l->n_group_windows != g->n_groups)
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "KV layout mismatch: %zu layer groups of %u layers in the transfer, "
                             "%u of %u on this node",
                             l->n_group_windows, l->layers_per_group, g->n_groups,
                             g->layers_per_group);
    for (uint32_t i = 0; i < g->n_groups; i++)
        if (l->group_windows[i] != g->window[i])
            return tdm_error_set(err, TDM_EPRECONDITION,
                                 "KV layout mismatch: group %u's window is %u tokens in the "
                                 "transfer, %u on this node",
                                 i, l->group_windows[i], g->window[i]);
    if (h->n_group_first_block != g->n_groups)
        return tdm_error_set(err, TDM_EINVALID, "group_first_block has %zu values for %u groups",
                             h->n_group_first_block, g->n_groups);
    return 0;
}

/* What must agree with this node: layout (layer groups included), model, block size, the block
 * count for n_tokens (and against the pool), the checksum kind. */
static int check_header_layout(const tdm_kv_receiver_t *r, const Tandem__V1__KvTransfer *h,
                               tdm_error_t *err)
{
    if (!h->layout)
        return tdm_error_set(err, TDM_EINVALID, "layout is missing");
    tdm_kv_layout_t l;
    int rc = tdm_proto_layout_from(h->layout, &l, err); /* TDM_EINVALID naming the field */
    if (rc != 0)
        return rc;
    const tdm_kv_layout_t *mine = &r->layout;
    tdm_kv_layout_t wire = *mine; /* the model's layers, as the header gives them */
    if (r->groups)
        wire.n_layers = r->groups->n_layers;
    uint32_t theirs = 0, ours = 0;
    const char *field = tdm_kv_layout_mismatch(&l, &wire, &theirs, &ours);
    if (field && strcmp(field, "dtype") == 0)
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "KV layout mismatch: dtype is %s in the transfer, %s on this node",
                             tdm_kv_dtype_name((tdm_kv_dtype_t)theirs),
                             tdm_kv_dtype_name((tdm_kv_dtype_t)ours));
    if (field)
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "KV layout mismatch: %s is %u in the transfer, %u on this node", field,
                             theirs, ours);
    if ((rc = check_header_groups(r, h, err)) != 0)
        return rc;
    if (h->model_fingerprint != r->model_fingerprint)
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "model fingerprint mismatch: transfer 0x%016" PRIx64
                             ", this node serves 0x%016" PRIx64,
                             h->model_fingerprint, r->model_fingerprint);
    if (h->block_bytes != r->block_bytes)
        return tdm_error_set(err, TDM_EINVALID,
                             "block_bytes is %" PRIu64 "; the layout gives %" PRIu64,
                             h->block_bytes, r->block_bytes);
    if (h->n_tokens == 0)
        return tdm_error_set(err, TDM_EINVALID, "n_tokens is 0");
    uint32_t first[TDM_KV_MAX_LAYERS];
    uint64_t want = tdm_kv_transfer_blocks(r->pool, h->n_tokens, first);
    if (h->n_blocks != want)
        return tdm_error_set(err, TDM_EINVALID,
                             "n_blocks is %u but %u tokens need %" PRIu64 " blocks of %u%s",
                             h->n_blocks, h->n_tokens, want, mine->block_size,
                             r->groups ? " (the live blocks of every layer group)" : "");
    for (uint32_t g = 0; r->groups && g < r->groups->n_groups; g++)
        if (h->group_first_block[g] != first[g])
            return tdm_error_set(err, TDM_EINVALID,
                                 "group_first_block[%u] is %u but %u tokens need group %u's "
                                 "blocks from entry %u on",
                                 g, h->group_first_block[g], h->n_tokens, g, first[g]);
    if (h->n_blocks > r->pool_blocks)
        return tdm_error_set(err, TDM_ERESOURCE,
                             "transfer of %u blocks exceeds this node's pool of %u blocks",
                             h->n_blocks, r->pool_blocks);
    if (h->checksum_kind != TANDEM__V1__CHECKSUM_KIND__CHECKSUM_KIND_XXH3_64)
        return tdm_error_set(err, TDM_EINVALID, "checksum_kind %d unknown", (int)h->checksum_kind);
    return 0;
}

/* tcp: one data frame of block_bytes per block, one checksum each. */
static int check_header_tcp(const tdm_kv_receiver_t *r, const tdm_frame_t *f,
                            const Tandem__V1__KvTransfer *h, tdm_error_t *err)
{
    if (f->n_data < h->n_blocks)
        return tdm_error_set(err, TDM_EINVALID, "truncated transfer: %u data frames for %u blocks",
                             f->n_data, h->n_blocks);
    if (f->n_data > h->n_blocks)
        return tdm_error_set(err, TDM_EINVALID, "%u data frames for %u blocks", f->n_data,
                             h->n_blocks);
    if (h->n_checksums != h->n_blocks)
        return tdm_error_set(err, TDM_EINVALID, "%zu checksums for %u blocks", h->n_checksums,
                             h->n_blocks);
    for (uint32_t i = 0; i < f->n_data; i++) {
        size_t len = 0;
        tdm_frame_data(f, i, &len);
        if (len != r->block_bytes)
            return tdm_error_set(err, TDM_EINVALID, "block %u is %zu bytes; expected %" PRIu64, i,
                                 len, r->block_bytes);
    }
    return 0;
}

/* nccl, cuda_ipc: no data frames; one checksum per block (computed on the sender's GPU, verified
 * on this node's after the blocks land); cuda_ipc's handle and block offsets. */
static int check_header_device(const tdm_kv_receiver_t *r, const tdm_frame_t *f,
                               const Tandem__V1__KvTransfer *h, tdm_kv_backend_t backend,
                               tdm_error_t *err)
{
    if (f->n_data != 0)
        return tdm_error_set(err, TDM_EINVALID,
                             "%u data frames with backend %s (the blocks travel over the "
                             "device channel)",
                             f->n_data, h->backend);
    if (h->n_checksums != h->n_blocks)
        return tdm_error_set(err, TDM_EINVALID,
                             "%zu checksums for %u blocks with backend %s (one per block, "
                             "computed on the sender's device)",
                             h->n_checksums, h->n_blocks, h->backend);
    if (backend == TDM_KV_BACKEND_CUDA_IPC) {
        if (h->n_ipc_handles != 1 || h->ipc_handles[0].len != 64)
            return tdm_error_set(err, TDM_EINVALID,
                                 "cuda_ipc needs one 64-byte ipc handle; got %zu",
                                 h->n_ipc_handles);
        if (h->n_block_offsets != h->n_blocks)
            return tdm_error_set(err, TDM_EINVALID, "%zu block offsets for %u blocks",
                                 h->n_block_offsets, h->n_blocks);
        for (uint32_t i = 0; i < h->n_blocks; i++)
            if (h->block_offsets[i] % r->block_bytes != 0 ||
                h->block_offsets[i] > UINT64_MAX - r->block_bytes)
                return tdm_error_set(err, TDM_EINVALID,
                                     "block %u offset %" PRIu64 " is not a block boundary", i,
                                     h->block_offsets[i]);
    }
    return 0;
}

int tdm_kv_header_check(const tdm_kv_receiver_t *r, const tdm_frame_t *f,
                        const Tandem__V1__KvTransfer *h, tdm_kv_backend_t *backend,
                        tdm_error_t *err)
{
    int rc;
    if ((rc = check_header_backend(r, h, backend, err)) != 0 ||
        (rc = check_header_layout(r, h, err)) != 0)
        return rc;
    if (*backend == TDM_KV_BACKEND_TCP)
        return check_header_tcp(r, f, h, err);
    return check_header_device(r, f, h, *backend, err);
}
