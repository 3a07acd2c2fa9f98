// A batch of 2 to 8 * NT rows (a step of several sequences, a chunk of a prompt) through
// 16-bit weights on the tensor cores: up to 3 products of one weight type in one launch (the
// `MvJobs` of matvec.cu, `split` holding the batch's rows), each weight row read once for every
// batch row. Job i's output j of batch row t: y[t * n_out + j] = act(dot(W[row(j)], x_t) +
// bias[row(j)]), or += (accumulate), row(j) = sel_row(idx, j, group). Needs cols % 32 == 0 and
// compute capability 8.0 (the host checks both).
//
// Precision: mma.m16n8k8 on tf32 with f32 accumulation. f16 and bf16 weights are exact in
// tf32; each input is split x = hi + lo, both tf32 (hi rounded from x, lo from x - hi), and both
// halves go through the tensor cores, so a product keeps about 22 bits of each input: within
// f32 rounding of matvec_rows' sums (a different order of the same sums).
//
// Layout: a block of 8 warps computes one tile of 16 outputs for every batch row (NT tiles of
// 8). k goes in chunks of 32, dealt round robin to the warps (warp w: chunks w, w + 8, ...),
// MMA_U chunks loaded ahead. Lane (g = lane / 4, q = lane % 4) loads 8 contiguous elements at
// chunk + 8q of weight rows g and g + 8 and of batch row g's input (of each tile); its pair
// (2m, 2m + 1) is its k-columns (q, q + 4) of mma m (0..3): a permutation of k that the weights
// and inputs share, so each mma sums whole products. The warps' partial tiles are summed through
// shared memory in warp order (the same order in every launch: deterministic).
#ifndef MMA_U
#define MMA_U 4
#endif

__device__ __forceinline__ u32 tf32_bits(float f) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(f));
    return r;
}

// c += A (16 x 8, rows g and g + 8) * B (8 x 8, column g), tf32 in, f32 accumulators.
__device__ __forceinline__ void mma_tf32(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One warp's m16n8 tile c (rows r and r + 8, batch columns t and t + 1 of lane (g, q): r = g,
// t = 2q within the tile) into its partial sums pw[row * W + batch].
__device__ __forceinline__ void mma_keep(float* pw, const float* c, int r, int t, int W) {
    pw[r * W + t] = c[0];
    pw[r * W + t + 1] = c[1];
    pw[(r + 8) * W + t] = c[2];
    pw[(r + 8) * W + t + 1] = c[3];
}

// Output j of batch row t from its sum s: times 2^-ex[t] where ex is given, then bias, act or
// accumulate, into y[t * n_out + j].
__device__ __forceinline__ void mma_out(float s, int t, int j, const int* ex, const u32* idx,
                                        const float* bias, float* y, int n_out, int group,
                                        int accumulate, int act) {
    if (ex) s = ldexpf(s, -ex[t]);
    if (bias) s += bias[sel_row(idx, j, group)];
    float* out = y + (size_t)t * n_out + j;
    if (accumulate) *out += s;
    else *out = act >= 0 ? act_apply(act, s) : s;
}

// The 8 warps' partial sums (part[v * n + o], o = r * W + t: output j0 + r, batch row t)
// summed in warp order (deterministic), through `mma_out`.
__device__ __forceinline__ void mma_store(const float* part, int n, int W, const int* ex,
                                          const u32* idx, const float* bias, float* y,
                                          int n_out, int group, int accumulate, int act, int j0,
                                          int nt) {
    for (int o = threadIdx.x; o < n; o += blockDim.x) {
        int r = o / W, t = o % W, j = j0 + r;
        if (j >= n_out || t >= nt) continue;
        float s = 0.f;
#pragma unroll
        for (int v = 0; v < 8; v++) s += part[v * n + o];
        mma_out(s, t, j, ex, idx, bias, y, n_out, group, accumulate, act);
    }
}

template <int T, int NT>
__device__ __forceinline__ void matvec_mma(const u8* w, const u32* idx, const float* bias,
                                           float* y, const float* x, int n_out, int group,
                                           int cols, int accumulate, int act, int blk, int nt) {
#if __CUDA_ARCH__ >= 800
    __shared__ float part[8][16 * 8 * NT];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    int j0 = blk * 16;
    // Rows past n_out compute on the last output's row and are not written.
    const u8* ra = w + (size_t)sel_row(idx, min(j0 + g, n_out - 1), group) * cols * 2;
    const u8* rb = w + (size_t)sel_row(idx, min(j0 + g + 8, n_out - 1), group) * cols * 2;
    float c[NT][4];
#pragma unroll
    for (int i = 0; i < NT; i++) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
    int chunks = cols / 32;
    for (int c0 = warp; c0 < chunks; c0 += 8 * MMA_U) {
        uint4 wa[MMA_U], wb[MMA_U];
#pragma unroll
        for (int u = 0; u < MMA_U; u++) {
            int ch = c0 + 8 * u;
            if (ch < chunks) {
                wa[u] = *(const uint4*)(ra + (size_t)(ch * 32 + 8 * q) * 2);
                wb[u] = *(const uint4*)(rb + (size_t)(ch * 32 + 8 * q) * 2);
            }
        }
#pragma unroll
        for (int u = 0; u < MMA_U; u++) {
            int ch = c0 + 8 * u;
            if (ch >= chunks) break;  // the same for every lane of the warp
            float fa[8], fb[8];
            unpack_half8(wa[u], fa, T == T_BF16);
            unpack_half8(wb[u], fb, T == T_BF16);
            int e = ch * 32 + 8 * q;
#pragma unroll
            for (int i = 0; i < NT; i++) {
                if (8 * i >= nt) break;
                int t = 8 * i + g;
                float xv[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                if (t < nt) {
                    const float* xp = x + (size_t)t * cols + e;
                    float4 a = *(const float4*)xp, b = *(const float4*)(xp + 4);
                    xv[0] = a.x; xv[1] = a.y; xv[2] = a.z; xv[3] = a.w;
                    xv[4] = b.x; xv[5] = b.y; xv[6] = b.z; xv[7] = b.w;
                }
#pragma unroll
                for (int m = 0; m < 4; m++) {
                    u32 h0 = tf32_bits(xv[2 * m]), h1 = tf32_bits(xv[2 * m + 1]);
                    u32 l0 = tf32_bits(xv[2 * m] - __uint_as_float(h0));
                    u32 l1 = tf32_bits(xv[2 * m + 1] - __uint_as_float(h1));
                    u32 a0 = __float_as_uint(fa[2 * m]), a1 = __float_as_uint(fb[2 * m]);
                    u32 a2 = __float_as_uint(fa[2 * m + 1]), a3 = __float_as_uint(fb[2 * m + 1]);
                    mma_tf32(c[i], a0, a1, a2, a3, l0, l1);
                    mma_tf32(c[i], a0, a1, a2, a3, h0, h1);
                }
            }
        }
    }
    constexpr int W = 8 * NT;
#pragma unroll
    for (int i = 0; i < NT; i++) mma_keep(part[warp], c[i], g, 8 * i + 2 * q, W);
    __syncthreads();
    mma_store(&part[0][0], 16 * W, W, nullptr, idx, bias, y, n_out, group, accumulate, act, j0,
              nt);
#endif
}


// ---- 16-bit inputs (`MMA_H=1`): mma.m16n8k16 of the weights' own type ----
//
// The inputs are split first (`mma_split_T`, one launch per product's input): row t of x in P
// planes of the weights' 16-bit type whose sum is x, so the tensor cores take the weights as
// loaded (no conversion) and each input in P parts. f16: x * 2^e[t] = hi + lo (P = 2), e[t]
// the power of two that puts the row's largest |x| in [2^14, 2^15): every element keeps 22
// bits or more relative to that largest, and no part overflows; the sums are scaled back by
// 2^-e[t] (exact). bf16: x = b0 + b1 + b2 (P = 3, 24 bits: f32's). Infinities and NaNs stay
// what they are (e = 0 when the largest is not finite or is 0).
//
// Layout of a split input (a slot of the host's `MmaScratch::x`): planes [P][nt][cols] of u16,
// then nt ints e[t] (4-byte aligned: cols is a multiple of 32).

template <int T> struct Parts { enum { P = T == T_F16 ? 2 : 3 }; };

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 h = 0;
#if __CUDA_ARCH__ >= 800
    asm("{ .reg .b16 t; cvt.rn.bf16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(f));
#endif
    return h;
}

// A product input: `x` rows of `cols` floats, split into `xs`.
struct SplitJob {
    const float* x;
    u16* xs;
    int cols, pad;
};
struct SplitJobs {
    SplitJob job[3];
    int nt, chunk;  // chunk: columns per block of mma_split
};

// Block (c, t) of input s (blockIdx.x, .y, .z) writes columns [c C, (c + 1) C) of row t (C the
// jobs' `chunk`: the host's `SPLIT_COLS`, or the widest row for a block a row), each f16 block
// first finding the row's largest |x| itself (the whole row in float4s: rows are 128-byte
// aligned, cols a multiple of 32), block 0 writing e[t].
template <int T>
__device__ __forceinline__ void mma_split(const SplitJob& j, int nt, int C) {
    __shared__ float red[32];
    constexpr int P = Parts<T>::P;
    int t = blockIdx.y, cols = j.cols, c0 = blockIdx.x * C;
    if (c0 >= cols) return;  // the same for the whole block
    const float* r = j.x + (size_t)t * cols;
    int e = 0;
    if (T == T_F16) {
        const float4* r4 = (const float4*)r;
        float m = 0.f;
#pragma unroll 4
        for (int i = threadIdx.x; i < cols / 4; i += blockDim.x) {
            float4 v = r4[i];
            m = fmaxf(fmaxf(m, fmaxf(fabsf(v.x), fabsf(v.y))), fmaxf(fabsf(v.z), fabsf(v.w)));
        }
        m = block_max(m, red);
        if (m > 0.f && m <= 3.4e38f) {
            frexpf(m, &e);
            e = 15 - e;
        }
        if (blockIdx.x == 0 && threadIdx.x == 0) ((int*)(j.xs + (size_t)P * nt * cols))[t] = e;
    }
    for (int i = c0 + threadIdx.x; i < min(c0 + C, cols); i += blockDim.x) {
        float v = T == T_F16 ? ldexpf(r[i], e) : r[i];
#pragma unroll
        for (int p = 0; p < P; p++) {
            u16 h = T == T_F16 ? f32_to_f16(v) : f32_to_bf16(v);
            j.xs[((size_t)p * nt + t) * cols + i] = h;
            v -= T == T_F16 ? f16_to_f32(h) : bf16_to_f32(h);
        }
    }
}
#define MMA_SPLIT(name, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(256) mma_split_##name(SplitJobs jobs) {  \
        if (blockIdx.z == 0) mma_split<T>(jobs.job[0], jobs.nt, jobs.chunk);               \
        else if (blockIdx.z == 1) mma_split<T>(jobs.job[1], jobs.nt, jobs.chunk);          \
        else mma_split<T>(jobs.job[2], jobs.nt, jobs.chunk);                               \
    }
MMA_SPLIT(f16, T_F16)
MMA_SPLIT(bf16, T_BF16)

// c += A (16 x 16, rows g and g + 8) * B (16 x 8, column g), 16-bit in, f32 accumulators.
template <int T>
__device__ __forceinline__ void mma_16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    if (T == T_F16)
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// matvec_mma's tiles of 16 outputs, chunks, warps and sums, over a split input `xs`, and the
// chunks of a row split between `ks` blocks (the host's choice where the tiles alone would
// leave SMs idle): block `s` of tile `tile` (`tg` counting every job's tiles) takes chunks
// [s c, (s + 1) c), c = ceil(chunks / ks), and writes its warps' sum to `gpart`; the last of
// the ks blocks to finish (a counter per tile, `gcount`, zero between launches) adds the ks
// sums in order of s (deterministic) and stores. Lane (g, q) holds elements 8q..8q + 8 of a
// chunk (of weight rows g and g + 8, of batch row g's parts) as four pairs; the first mma takes
// pairs 0 and 1 as its k (2q, 2q + 1) and (2q + 8, 2q + 9), the second pairs 2 and 3: the same
// permutation of k for weights and inputs. HMMA_U chunks are loaded ahead (fewer for more batch
// rows: registers).
#ifndef HMMA_U
#define HMMA_U 2
#endif
template <int T, int NT>
__device__ __forceinline__ void matvec_hmma(const u8* w, const u32* idx, const float* bias,
                                            float* y, const u16* xs, int n_out, int group,
                                            int cols, int accumulate, int act, int tile, int nt,
                                            int ks, int s, int tg, float* gpart, u32* gcount) {
#if __CUDA_ARCH__ >= 800
    constexpr int P = Parts<T>::P, W = 8 * NT, N = 16 * W;
    constexpr int U = HMMA_U / NT > 0 ? HMMA_U / NT : 1;
    __shared__ float part[8][N];
    __shared__ int last;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    int j0 = tile * 16;
    const u8* ra = w + (size_t)sel_row(idx, min(j0 + g, n_out - 1), group) * cols * 2;
    const u8* rb = w + (size_t)sel_row(idx, min(j0 + g + 8, n_out - 1), group) * cols * 2;
    float c[NT][4];
#pragma unroll
    for (int i = 0; i < NT; i++) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
    int per = (cols / 32 + ks - 1) / ks, lo = s * per, hi = min(lo + per, cols / 32);
    // A chunk past the range loads the range's last one again and goes unused.
    for (int c0 = lo + warp; c0 < hi; c0 += 8 * U) {
        uint4 wa[U], wb[U], xv[U][NT][P];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int e = min(c0 + 8 * u, hi - 1) * 32 + 8 * q;
            wa[u] = *(const uint4*)(ra + (size_t)e * 2);
            wb[u] = *(const uint4*)(rb + (size_t)e * 2);
#pragma unroll
            for (int i = 0; i < NT; i++) {
                int t = 8 * i + g;
#pragma unroll
                for (int p = 0; p < P; p++) {
                    xv[u][i][p] = make_uint4(0, 0, 0, 0);
                    if (t < nt) xv[u][i][p] = *(const uint4*)(xs + ((size_t)p * nt + t) * cols + e);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (c0 + 8 * u >= hi) break;  // the same for every lane of the warp
#pragma unroll
            for (int i = 0; i < NT; i++) {
                if (8 * i >= nt) break;
#pragma unroll
                for (int p = P - 1; p >= 0; p--) {  // the smallest part first
                    uint4 a = wa[u], b = wb[u], x = xv[u][i][p];
                    mma_16<T>(c[i], a.x, b.x, a.y, b.y, x.x, x.y);
                    mma_16<T>(c[i], a.z, b.z, a.w, b.w, x.z, x.w);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < NT; i++) mma_keep(part[warp], c[i], g, 8 * i + 2 * q, W);
    __syncthreads();
    const int* ex = T == T_F16 ? (const int*)(xs + (size_t)P * nt * cols) : nullptr;
    if (ks == 1) {
        mma_store(&part[0][0], N, W, ex, idx, bias, y, n_out, group, accumulate, act, j0, nt);
        return;
    }
    float* mine = gpart + ((size_t)tg * ks + s) * N;
    for (int o = threadIdx.x; o < N; o += blockDim.x) {
        float v = 0.f;
#pragma unroll
        for (int k = 0; k < 8; k++) v += part[k][o];
        mine[o] = v;
    }
    __threadfence();  // this block's sums are visible before its count
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(gcount + tg, 1u) == (u32)ks - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();  // the other blocks' sums, counted, are read after
    const volatile float* all = gpart + (size_t)tg * ks * N;
    for (int o = threadIdx.x; o < N; o += blockDim.x) {
        int r = o / W, t = o % W, j = j0 + r;
        if (j >= n_out || t >= nt) continue;
        float v = 0.f;
        for (int k = 0; k < ks; k++) v += all[(size_t)k * N + o];
        mma_out(v, t, j, ex, idx, bias, y, n_out, group, accumulate, act);
    }
    if (threadIdx.x == 0) gcount[tg] = 0;
#endif
}

// Job `j`'s block `blk` (of its `ks` blocks a tile; `b` counting every job's blocks) on the
// split input (H, with `gpart`, `gcount`) or in tf32.
template <int T, int NT, bool H>
__device__ __forceinline__ void mma_job(const MvJob& j, int blk, int b, const MvJobs& jobs,
                                        float* gpart, u32* gcount) {
    if (H)
        matvec_hmma<T, NT>(j.w, j.idx, j.bias, j.y, (const u16*)j.x, j.n_out, j.group, j.cols,
                           j.accumulate, j.act, blk / jobs.ks, jobs.split, jobs.ks, blk % jobs.ks,
                           b / jobs.ks, gpart, gcount);
    else
        matvec_mma<T, NT>(j.w, j.idx, j.bias, j.y, j.x, j.n_out, j.group, j.cols, j.accumulate,
                          j.act, blk, jobs.split);
}
// Each job's blocks from its first_block on, fields read by constant indices as `matvec_jobs`.
template <int T, int NT, bool H>
__device__ __forceinline__ void matvec_mma_jobs(const MvJobs& jobs, float* gpart, u32* gcount) {
    int b = blockIdx.x;
    if (jobs.n > 2 && b >= jobs.job[2].first_block)
        mma_job<T, NT, H>(jobs.job[2], b - jobs.job[2].first_block, b, jobs, gpart, gcount);
    else if (jobs.n > 1 && b >= jobs.job[1].first_block)
        mma_job<T, NT, H>(jobs.job[1], b - jobs.job[1].first_block, b, jobs, gpart, gcount);
    else
        mma_job<T, NT, H>(jobs.job[0], b - jobs.job[0].first_block, b, jobs, gpart, gcount);
}
// matvec_mma{1,2,4}_{f16,bf16} (tf32) and matvec_hmma{1,2,4}_{f16,bf16} (split inputs, each
// job's `x` the split of its input; `jobs.ks` blocks a tile, each job's first_block a multiple
// of it; at least HMMA_OCC blocks an SM for 8 rows, HMMA_OCC_WIDE for more, their registers
// the limit): up to 8, 16 or 32 batch rows.
#ifndef HMMA_OCC
#define HMMA_OCC 4
#endif
#ifndef HMMA_OCC_WIDE
#define HMMA_OCC_WIDE 3
#endif
#define MATVEC_MMA(name, T, NT)                                                                  \
    extern "C" __global__ void __launch_bounds__(256) matvec_mma##NT##_##name(MvJobs jobs) {   \
        matvec_mma_jobs<T, NT, false>(jobs, nullptr, nullptr);                                   \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(256, NT == 1 ? HMMA_OCC : HMMA_OCC_WIDE)        \
        matvec_hmma##NT##_##name(                                                                \
            MvJobs jobs, float* gpart, u32* gcount) {                                            \
        matvec_mma_jobs<T, NT, true>(jobs, gpart, gcount);                                       \
    }
MATVEC_MMA(f16, T_F16, 1)
MATVEC_MMA(f16, T_F16, 2)
MATVEC_MMA(f16, T_F16, 4)
MATVEC_MMA(bf16, T_BF16, 1)
MATVEC_MMA(bf16, T_BF16, 2)
MATVEC_MMA(bf16, T_BF16, 4)
