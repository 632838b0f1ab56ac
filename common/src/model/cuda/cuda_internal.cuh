// cuda_internal.cuh - state and helpers shared by the CUDA backend's .cu files (C++ only).
//
// The backend state (cuda_be_t) is created by backend_cuda.cu; each op family lives in its own
// .cu file and is reached through the tdm_cuda_op_* launchers declared here. Launchers check
// their arguments and every CUDA call; on failure they record the message in be->err and
// return its tdm status.
#ifndef TANDEM_MODEL_CUDA_INTERNAL_CUH
#define TANDEM_MODEL_CUDA_INTERNAL_CUH

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "model/cuda/cuda_backend.h"

// Widest head the attention and KV kernels take (values per head).
#define TDM_CUDA_MAX_HEAD_DIM 256

// A weight's device copy, found by the address of its host data (tdm_weight_t.data).
typedef struct cuda_wentry {
    const void *host; // key; NULL = empty slot
    void *gemm;       // [n_out][n_in] in the GEMM type (bf16 or f16); NULL for vectors
    float *vec;       // [n_in] f32 for vectors (norms, biases); NULL for matrices
} cuda_wentry_t;

// The rows of the current forward pass as the device sees them: one block of device memory
// filled by one copy in begin (views into be->d_stage).
typedef struct cuda_pass {
    uint32_t n_rows, n_logits, n_runs;
    const int32_t *tokens;      // device [n_rows]
    const uint32_t *pos;        // device [n_rows]
    const uint32_t *tab_off;    // device [n_rows] start of the row's block table in table
    const uint32_t *logit_rows; // device [n_logits]
    const uint32_t *run_rows;   // device [n_rows] rows ordered by (seq, position)
    const uint32_t *run_start;  // device [n_runs + 1] runs: rows writing one KV block
    const uint32_t *table;      // device: the block tables of the pass's sequences
    const int32_t *h_tokens;    // the host arrays begin saw (ops must be given the same)
    const uint32_t *h_pos;
    const uint32_t *h_logit_rows;
    bool active; // begin succeeded
} cuda_pass_t;

typedef struct cuda_be {
    int device;
    const tdm_model_t *model;
    const tdm_llama_hparams_t *hp;
    tdm_kv_layout_t kl;
    uint64_t block_bytes, rec_bytes;
    uint32_t n_blocks;
    uint32_t max_rows, max_logits, n_ctx;
    size_t max_in;            // widest matmul input (elements)
    cudaDataType_t gemm_type; // CUDA_R_16BF or CUDA_R_16F
    char name[160];
    tdm_error_t err; // last failure
    cudaStream_t stream;
    cublasHandle_t blas;
    cudaEvent_t staged; // recorded after the row upload: the staging buffer is free again
    bool staged_recorded;
    void *blas_ws; // cuBLAS workspace (so GEMMs allocate nothing)
    size_t blas_ws_bytes;
    uint8_t *kv;     // device KV pool copy [n_blocks][block_bytes]
    uint8_t *warena; // every weight's device copy
    uint64_t warena_bytes;
    cuda_wentry_t *wmap; // open addressing, wmap_cap a power of two
    size_t wmap_cap;
    void *xh;                    // [max_rows][max_in] activations in the GEMM type
    uint32_t *h_stage, *d_stage; // pinned host / device staging for the rows of a pass
    size_t stage_words;
    uint32_t *h_seq_off, *h_seq_need, *h_seq_count; // host scratch [max_rows + 1]
    void **allocs;                                  // scratch from the alloc op
    size_t n_allocs, cap_allocs;
    float theta_scale; // rope_freq_base^(-2/rope_dim), computed as the CPU does
    cuda_pass_t pass;
} cuda_be_t;

// Records a failure in be->err and returns code.
int tdm_cuda_fail(cuda_be_t *be, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
// The tdm status of a CUDA / cuBLAS error.
int tdm_cuda_status(cudaError_t e);
int tdm_cublas_status(cublasStatus_t s);

// Checks a CUDA runtime call; on failure records "statement: error (file:line)" and returns.
#define TDM_CUDA_TRY(be, stmt)                                                                     \
    do {                                                                                           \
        cudaError_t tdm_ce = (stmt);                                                               \
        if (tdm_ce != cudaSuccess)                                                                 \
            return tdm_cuda_fail((be), tdm_cuda_status(tdm_ce), "%s: %s (%s:%d)", #stmt,           \
                                 cudaGetErrorString(tdm_ce), __FILE__, __LINE__);                  \
    } while (0)

// The same for cuBLAS.
#define TDM_CUBLAS_TRY(be, stmt)                                                                   \
    do {                                                                                           \
        cublasStatus_t tdm_bs = (stmt);                                                            \
        if (tdm_bs != CUBLAS_STATUS_SUCCESS)                                                       \
            return tdm_cuda_fail((be), tdm_cublas_status(tdm_bs), "%s: %s (%s:%d)", #stmt,         \
                                 cublasGetStatusString(tdm_bs), __FILE__, __LINE__);               \
    } while (0)

// After a kernel launch: the launch error, if any, naming the kernel.
#define TDM_CUDA_CHECK_LAUNCH(be, kernel)                                                          \
    do {                                                                                           \
        cudaError_t tdm_ce = cudaGetLastError();                                                   \
        if (tdm_ce != cudaSuccess)                                                                 \
            return tdm_cuda_fail((be), tdm_cuda_status(tdm_ce), "launch %s: %s (%s:%d)", kernel,   \
                                 cudaGetErrorString(tdm_ce), __FILE__, __LINE__);                  \
    } while (0)

// Checks that an op of a pass got the host arrays begin staged.
int tdm_cuda_check_pass(cuda_be_t *be, const char *op, const uint32_t *pos, uint32_t n);

// Device pointer of a weight's copy (gemm for matrices, vec for vectors); NULL (with be->err
// set) when the weight was not uploaded at create.
const void *tdm_cuda_weight_gemm(cuda_be_t *be, const tdm_weight_t *w);
const float *tdm_cuda_weight_vec(cuda_be_t *be, const tdm_weight_t *w);

// Launch configuration: enough blocks of `threads` for count elements, capped for grid-stride
// loops.
static inline unsigned tdm_cuda_blocks(size_t count, unsigned threads)
{
    size_t b = (count + threads - 1) / threads;
    return (unsigned)(b > 65535u * 16u ? 65535u * 16u : b ? b : 1);
}

// ---- device helpers ----

static __device__ __forceinline__ float tdm_warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ double tdm_warp_sum_d(double v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float tdm_warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide max of non-negative v over all threads (blockDim.x a multiple of 32, <= 1024); every
// thread gets the result. scratch: 32 floats of shared memory.
static __device__ __forceinline__ float tdm_block_max(float v, float *scratch)
{
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    v = tdm_warp_max(v);
    __syncthreads(); // scratch may still be read by a previous call
    if (lane == 0)
        scratch[warp] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : 0.0f;
    return tdm_warp_max(v);
}

// ---- launchers, one family per .cu file (device pointers; n rows) ----

// embed.cu: x[t] = table row tokens[t] (GEMM type to f32); dst[k] = src[logit_rows[k]];
// dst[i] = src[i] converted to the GEMM type (count values).
int tdm_cuda_op_embed(cuda_be_t *be, const void *table, uint32_t n, uint32_t dim, float *x);
int tdm_cuda_op_gather(cuda_be_t *be, const float *src, uint32_t n, uint32_t dim, float *dst);
int tdm_cuda_op_to_gemm(cuda_be_t *be, const float *src, size_t count, void *dst);
// rmsnorm.cu
int tdm_cuda_op_rmsnorm(cuda_be_t *be, const float *x, const float *g, uint32_t n, uint32_t dim,
                        float eps, float *out);
// rope.cu: q [n][n_heads * head_dim], k [n][n_kv_heads * head_dim] in place
int tdm_cuda_op_rope(cuda_be_t *be, float *q, float *k);
// kv_store.cu: k, v [n][n_kv_heads * head_dim] into the device pool at layer
int tdm_cuda_op_kv_store(cuda_be_t *be, uint32_t layer, const float *k, const float *v);
// attention.cu: out [n][n_heads * head_dim]
int tdm_cuda_op_attention(cuda_be_t *be, uint32_t layer, const float *q, float *out);
// swiglu.cu: out = silu(gate) * up; x += y; x[t] += b
int tdm_cuda_op_swiglu(cuda_be_t *be, const float *gate, const float *up, size_t count, float *out);
int tdm_cuda_op_add(cuda_be_t *be, float *x, const float *y, size_t count);
int tdm_cuda_op_add_bias(cuda_be_t *be, float *x, const float *b, uint32_t n, uint32_t dim);

#endif // TANDEM_MODEL_CUDA_INTERNAL_CUH
