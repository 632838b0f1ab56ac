// kv_store.cu - writes the rows' K and V into the device copy of the paged KV pool, in the
// host pool's layout ([block][layer][K|V][kv_head] records of [slot][head_dim] values; q8: a
// float scale, then int8 values) and with cpu_attention.c's arithmetic (kv_put), so the bytes match
// the CPU backend's for the same inputs.
//
// One thread block per (run, kv head, K|V), where a run is the rows of one sequence that
// write one KV block, in position order (begin builds them). The rows of a run are stored one
// after the other: q8 keeps one scale per record, the running max|x| / 127 of the slots
// written so far, and requantizes the earlier slots when a new slot needs a larger scale, so
// the order matters.
#include "model/cuda/cuda_internal.cuh"

#define KV_THREADS 128

enum { KV_F32 = TDM_KV_F32, KV_F16 = TDM_KV_F16, KV_Q8 = TDM_KV_Q8 };

template <int DT>
static __global__ void __launch_bounds__(KV_THREADS)
    kv_store_kernel(uint8_t *kv, const float *k, const float *v, const uint32_t *pos,
                    const uint32_t *tab_off, const uint32_t *table, const uint32_t *run_rows,
                    const uint32_t *run_start, uint32_t layer, uint32_t n_kv_heads,
                    uint32_t head_dim, uint32_t block_size, uint64_t block_bytes,
                    uint64_t rec_bytes)
{
    __shared__ float scratch[32];
    const uint32_t run = blockIdx.x, h = blockIdx.y, which = blockIdx.z, D = head_dim;
    const float *src_all = which ? v : k;
    const uint64_t rec_off = (((uint64_t)layer * 2 + which) * n_kv_heads + h) * rec_bytes;
    for (uint32_t r = run_start[run]; r < run_start[run + 1]; r++) {
        const uint32_t t = run_rows[r], p = pos[t], slot = p % block_size;
        uint8_t *rec = kv + (uint64_t)table[tab_off[t] + p / block_size] * block_bytes + rec_off;
        const float *src = src_all + ((size_t)t * n_kv_heads + h) * D;
        if (DT == KV_F32) {
            float *dst = (float *)rec + (size_t)slot * D;
            for (uint32_t i = threadIdx.x; i < D; i += blockDim.x)
                dst[i] = src[i];
        } else if (DT == KV_F16) {
            __half *dst = (__half *)rec + (size_t)slot * D;
            for (uint32_t i = threadIdx.x; i < D; i += blockDim.x)
                dst[i] = __float2half_rn(src[i]);
        } else {
            int8_t *qv = (int8_t *)(rec + sizeof(float));
            float amax = 0.0f;
            for (uint32_t i = threadIdx.x; i < D; i += blockDim.x)
                amax = fmaxf(amax, fabsf(src[i]));
            amax = tdm_block_max(amax, scratch);
            const float need = __fdiv_rn(amax, 127.0f);
            float scale = *(const float *)rec; // written by thread 0 before the last barrier
            if (slot == 0) {
                scale = need;
            } else if (need > scale) {
                for (uint32_t i = threadIdx.x; i < slot * D; i += blockDim.x)
                    qv[i] = (int8_t)rintf(__fdiv_rn(__fmul_rn((float)qv[i], scale), need));
                scale = need;
            }
            const float id = scale != 0.0f ? __fdiv_rn(1.0f, scale) : 0.0f;
            for (uint32_t i = threadIdx.x; i < D; i += blockDim.x) {
                float q = rintf(__fmul_rn(src[i], id));
                qv[(size_t)slot * D + i] = (int8_t)(q > 127.0f    ? 127.0f
                                                    : q < -127.0f ? -127.0f
                                                                  : q);
            }
            __syncthreads(); // every thread has read the old scale
            if (threadIdx.x == 0)
                *(float *)rec = scale;
        }
        __syncthreads(); // the next row of the run sees this one's values and scale
    }
}

int tdm_cuda_op_kv_store(cuda_be_t *be, uint32_t layer, const float *k, const float *v)
{
    const cuda_pass_t *ps = &be->pass;
    if (ps->n_runs == 0)
        return TDM_OK;
    dim3 grid(ps->n_runs, be->kl.n_kv_heads, 2);
#define TDM_KV_LAUNCH(DT)                                                                          \
    kv_store_kernel<DT><<<grid, KV_THREADS, 0, be->stream>>>(                                      \
        be->kv, k, v, ps->pos, ps->tab_off, ps->table, ps->run_rows, ps->run_start, layer,         \
        be->kl.n_kv_heads, be->kl.head_dim, be->kl.block_size, be->block_bytes, be->rec_bytes)
    switch (be->kl.dtype) {
    case TDM_KV_F32: TDM_KV_LAUNCH(KV_F32); break;
    case TDM_KV_F16: TDM_KV_LAUNCH(KV_F16); break;
    case TDM_KV_Q8: TDM_KV_LAUNCH(KV_Q8); break;
    default:
        return tdm_cuda_fail(be, TDM_EINTERNAL, "kv_store: unknown KV dtype %d", (int)be->kl.dtype);
    }
#undef TDM_KV_LAUNCH
    TDM_CUDA_CHECK_LAUNCH(be, "kv_store_kernel");
    return TDM_OK;
}
