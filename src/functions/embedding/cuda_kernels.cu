// Kernels of flumen's BERT forward on CUDA, compiled at run time by NVRTC.
// Matrix products go to cuBLAS; these do the rest. Sequences are packed back to back
// (no padding): token t belongs to sequence token_seq[t], which starts at seq_start[s]
// and is seq_len[s] tokens long. Block sizes are multiples of 32.

__device__ float block_sum(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    __syncthreads();
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < (blockDim.x + 31) / 32; ++w) total += red[w];
    return total;
}

__device__ float block_max(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    __syncthreads();
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    float best = -__int_as_float(0x7f800000);
    for (int w = 0; w < (blockDim.x + 31) / 32; ++w) best = fmaxf(best, red[w]);
    return best;
}

// ---------------------------------------------------------------------------------------
// The bf16 path (`flumen.embed_precision = 'bf16'`): embeddings, matrices and every stored
// activation in bfloat16, held as their 16 bits (no cuda_bf16.h: NVRTC need not find it);
// products run on tensor cores through cuBLAS with fp32 sums and fp32 outputs, which these
// kernels finish in fp32 (bias, GELU, layer norm, softmax) and store rounded to bf16.
// Rounding is to nearest, ties to even, as the CPU's emulation of this path rounds.

typedef unsigned short bf16;

__device__ __forceinline__ float bf16_load(bf16 v) { return __uint_as_float(((unsigned int)v) << 16); }

__device__ __forceinline__ bf16 bf16_store(float v) {
    unsigned int bits = __float_as_uint(v);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (bf16)((bits >> 16) | 0x40u);  // NaN stays NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (bf16)(bits >> 16);
}

// Reading and writing a stored value of either path in fp32: `load` widens, `store<T>`
// narrows (identity for fp32).
__device__ __forceinline__ float load(float v) { return v; }
__device__ __forceinline__ float load(bf16 v) { return bf16_load(v); }
template <typename T> __device__ __forceinline__ T store(float v);
template <> __device__ __forceinline__ float store<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16 store<bf16>(float v) { return bf16_store(v); }

// ---------------------------------------------------------------------------------------
// Kernels of both paths: T is the stored type (float, or bf16 for the bf16 path).

// out[t] = word[ids[t]] + position[positions[t]] + type0, summed in fp32. One block per token.
template <typename T>
__device__ void embed_tokens_of(const unsigned int* ids, const unsigned int* positions,
                                const T* word, const T* position, const T* type0, float* out,
                                int width) {
    int t = blockIdx.x;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        out[(long long)t * width + i] = load(word[(long long)ids[t] * width + i]) +
                                        load(position[(long long)positions[t] * width + i]) +
                                        load(type0[i]);
    }
}

extern "C" __global__ void embed_tokens(const unsigned int* ids, const unsigned int* positions,
                                        const float* word, const float* position,
                                        const float* type0, float* out, int width) {
    embed_tokens_of(ids, positions, word, position, type0, out, width);
}

extern "C" __global__ void embed_tokens_bf16(const unsigned int* ids, const unsigned int* positions,
                                             const bf16* word, const bf16* position,
                                             const bf16* type0, float* out, int width) {
    embed_tokens_of(ids, positions, word, position, type0, out, width);
}

// x[r, c] += bias[c] for a row-major [rows, width] matrix.
extern "C" __global__ void add_bias(float* x, const float* bias, int width, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        x[i] += bias[i % width];
    }
}

// x = gelu(x + bias), erf form. Row-major [rows, width].
extern "C" __global__ void bias_gelu(float* x, const float* bias, int width, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float v = x[i] + bias[i % width];
        x[i] = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    }
}

// out[row] = LayerNorm(x[row] + bias + residual[row]) · gamma + beta, in fp32 over the fp32
// x (a product) and the stored residual, stored as T. One block per row; shared memory:
// width + 32 floats. residual may be null.
template <typename T>
__device__ void add_layer_norm_of(const float* x, const float* bias, const T* residual,
                                  const float* gamma, const float* beta, T* out, int width,
                                  float eps) {
    extern __shared__ float shared[];
    float* v = shared;
    float* red = shared + width;
    long long row = blockIdx.x;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float a = x[row * width + i] + bias[i];
        if (residual) a += load(residual[row * width + i]);
        v[i] = a;
        sum += a;
    }
    float mean = block_sum(sum, red) / width;
    float sq = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float d = v[i] - mean;
        sq += d * d;
    }
    float inv = rsqrtf(block_sum(sq, red) / width + eps);
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        out[row * width + i] = store<T>((v[i] - mean) * inv * gamma[i] + beta[i]);
    }
}

extern "C" __global__ void add_layer_norm(const float* x, const float* bias, const float* residual,
                                          const float* gamma, const float* beta, float* out,
                                          int width, float eps) {
    add_layer_norm_of(x, bias, residual, gamma, beta, out, width, eps);
}

extern "C" __global__ void add_layer_norm_bf16(const float* x, const float* bias,
                                               const bf16* residual, const float* gamma,
                                               const float* beta, bf16* out, int width,
                                               float eps) {
    add_layer_norm_of(x, bias, residual, gamma, beta, out, width, eps);
}

// Self-attention of one query token over its own sequence, for one head: for head widths
// attention_tiled has no instance of. Grid (tokens, heads); qkv rows are [q | k | v], 3 * heads * head_dim wide.
// Shared memory: head_dim + max_len + blockDim floats. Needs head_dim <= blockDim.
extern "C" __global__ void attention(const float* qkv, float* context,
                                     const unsigned int* token_seq, const unsigned int* seq_start,
                                     const unsigned int* seq_len, int heads, int head_dim,
                                     int max_len, float scale) {
    extern __shared__ float shared[];
    float* q = shared;
    float* p = shared + head_dim;
    float* red = p + max_len;
    int t = blockIdx.x, h = blockIdx.y;
    int s = token_seq[t];
    int start = seq_start[s], len = seq_len[s];
    int hidden = heads * head_dim, stride = 3 * hidden;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        q[i] = qkv[(long long)t * stride + h * head_dim + i];
    }
    __syncthreads();
    float best = -__int_as_float(0x7f800000);
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        const float* k = qkv + (long long)(start + j) * stride + hidden + h * head_dim;
        float acc = 0.0f;
        for (int d = 0; d < head_dim; ++d) acc += q[d] * k[d];
        acc *= scale;
        p[j] = acc;
        best = fmaxf(best, acc);
    }
    best = block_max(best, red);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        float e = expf(p[j] - best);
        p[j] = e;
        sum += e;
    }
    sum = block_sum(sum, red);
    __syncthreads();
    int groups = blockDim.x / head_dim;
    int d = threadIdx.x % head_dim, g = threadIdx.x / head_dim;
    float acc = 0.0f;
    if (g < groups) {
        for (int j = g; j < len; j += groups) {
            acc += p[j] * qkv[(long long)(start + j) * stride + 2 * hidden + h * head_dim + d];
        }
    }
    red[threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.x < head_dim) {
        float total = 0.0f;
        for (int g2 = 0; g2 < groups; ++g2) total += red[g2 * head_dim + threadIdx.x];
        context[(long long)t * hidden + h * head_dim + threadIdx.x] = total / sum;
    }
}

// Keys (and queries) a block of attention_tiled holds at a time; its block size.
#define ATTENTION_TILE 64

// Self-attention for a tile of up to ATTENTION_TILE consecutive query tokens of one sequence
// (from tile_first[blockIdx.x] to the tile's or the sequence's end), for head blockIdx.y,
// D wide, over stored q, k and v of type T, in fp32. One thread per query, q and its output
// in registers; the sequence's keys and values go through shared memory a tile at a time,
// read once per block instead of once per query, with an online softmax (a running max,
// rescaling what was summed when it grows).
template <int D, typename T>
__device__ void attention_tiled(const T* qkv, T* context, const unsigned int* token_seq,
                                const unsigned int* seq_start, const unsigned int* seq_len,
                                const unsigned int* tile_first, int heads, float scale) {
    __shared__ float keys[ATTENTION_TILE][D];
    __shared__ float values[ATTENTION_TILE][D];
    int h = blockIdx.y;
    unsigned int first = tile_first[blockIdx.x];
    int s = token_seq[first];
    int start = seq_start[s], len = seq_len[s];
    int hidden = heads * D, stride = 3 * hidden;
    long long t = (long long)first + threadIdx.x;
    bool active = t < (long long)start + len;
    float q[D], acc[D];
    for (int d = 0; d < D; ++d) {
        q[d] = active ? load(qkv[t * stride + h * D + d]) * scale : 0.0f;
        acc[d] = 0.0f;
    }
    float best = -__int_as_float(0x7f800000), sum = 0.0f;
    for (int k0 = 0; k0 < len; k0 += ATTENTION_TILE) {
        int n = min(ATTENTION_TILE, len - k0);
        for (int i = threadIdx.x; i < n * D; i += blockDim.x) {
            int r = i / D, c = i % D;
            long long at = (long long)(start + k0 + r) * stride + h * D + c;
            keys[r][c] = load(qkv[at + hidden]);
            values[r][c] = load(qkv[at + 2 * hidden]);
        }
        __syncthreads();
        if (active) {
            for (int j = 0; j < n; ++j) {
                float score = 0.0f;
                for (int d = 0; d < D; ++d) score += q[d] * keys[j][d];
                float next = fmaxf(best, score);
                float rescale = expf(best - next);
                float p = expf(score - next);
                sum = sum * rescale + p;
                for (int d = 0; d < D; ++d) acc[d] = acc[d] * rescale + p * values[j][d];
                best = next;
            }
        }
        __syncthreads();
    }
    if (active) {
        for (int d = 0; d < D; ++d) context[t * hidden + h * D + d] = store<T>(acc[d] / sum);
    }
}

// attention_tiled_{32,64} (fp32) and attention_tiled_bf16_{32,64}: the instances the
// encoder loads.
#define ATTENTION_TILED(NAME, D, T)                                                         \
    extern "C" __global__ void NAME(const T* qkv, T* context, const unsigned int* token_seq, \
                                    const unsigned int* seq_start,                          \
                                    const unsigned int* seq_len,                            \
                                    const unsigned int* tile_first, int heads,              \
                                    float scale) {                                          \
        attention_tiled<D, T>(qkv, context, token_seq, seq_start, seq_len, tile_first,      \
                              heads, scale);                                                \
    }
ATTENTION_TILED(attention_tiled_32, 32, float)
ATTENTION_TILED(attention_tiled_64, 64, float)
ATTENTION_TILED(attention_tiled_bf16_32, 32, bf16)
ATTENTION_TILED(attention_tiled_bf16_64, 64, bf16)

// out[s] = normalize(mean of the sequence's stored token rows), in fp32. One block per
// sequence; shared memory: width + 32 floats.
template <typename T>
__device__ void mean_pool_normalize_of(const T* x, const unsigned int* seq_start,
                                       const unsigned int* seq_len, float* out, int width) {
    extern __shared__ float shared[];
    float* v = shared;
    float* red = shared + width;
    int s = blockIdx.x;
    int start = seq_start[s], len = seq_len[s];
    float sq = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float acc = 0.0f;
        for (int t = 0; t < len; ++t) acc += load(x[(long long)(start + t) * width + i]);
        acc /= (float)(len > 0 ? len : 1);
        v[i] = acc;
        sq += acc * acc;
    }
    float norm = fmaxf(sqrtf(block_sum(sq, red)), 1e-12f);
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        out[(long long)s * width + i] = v[i] / norm;
    }
}

extern "C" __global__ void mean_pool_normalize(const float* x, const unsigned int* seq_start,
                                               const unsigned int* seq_len, float* out, int width) {
    mean_pool_normalize_of(x, seq_start, seq_len, out, width);
}

extern "C" __global__ void mean_pool_normalize_bf16(const bf16* x, const unsigned int* seq_start,
                                                    const unsigned int* seq_len, float* out,
                                                    int width) {
    mean_pool_normalize_of(x, seq_start, seq_len, out, width);
}

// The bf16 path's epilogues: an fp32 product finished and stored in bf16 (out of place).

// out = bf16(x + bias), x the fp32 product of a matrix. Row-major [rows, width].
extern "C" __global__ void add_bias_bf16(const float* x, const float* bias, bf16* out, int width,
                                         long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = bf16_store(x[i] + bias[i % width]);
    }
}

// out = bf16(gelu(x + bias)), erf form. Row-major [rows, width].
extern "C" __global__ void bias_gelu_bf16(const float* x, const float* bias, bf16* out, int width,
                                          long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float v = x[i] + bias[i % width];
        out[i] = bf16_store(0.5f * v * (1.0f + erff(v * 0.70710678118654752f)));
    }
}
