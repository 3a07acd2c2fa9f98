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
    // c[i]: (row g, batch 8i + 2q), (g, 8i + 2q + 1), (g + 8, 8i + 2q), (g + 8, 8i + 2q + 1).
    constexpr int W = 8 * NT;
#pragma unroll
    for (int i = 0; i < NT; i++) {
        int t = 8 * i + 2 * q;
        part[warp][g * W + t] = c[i][0];
        part[warp][g * W + t + 1] = c[i][1];
        part[warp][(g + 8) * W + t] = c[i][2];
        part[warp][(g + 8) * W + t + 1] = c[i][3];
    }
    __syncthreads();
    for (int o = threadIdx.x; o < 16 * W; o += 256) {
        int r = o / W, t = o % W, j = j0 + r;
        if (j >= n_out || t >= nt) continue;
        float s = 0.f;
#pragma unroll
        for (int v = 0; v < 8; v++) s += part[v][o];
        if (bias) s += bias[sel_row(idx, j, group)];
        float* out = y + (size_t)t * n_out + j;
        if (accumulate) *out += s;
        else *out = act >= 0 ? act_apply(act, s) : s;
    }
#endif
}

// Each job's blocks (one a tile of 16 outputs) from its first_block on, fields read by constant
// indices as `matvec_jobs`.
#define MMA_CALL(n) matvec_mma<T, NT>(jobs.job[n].w, jobs.job[n].idx, jobs.job[n].bias,          \
    jobs.job[n].y, jobs.job[n].x, jobs.job[n].n_out, jobs.job[n].group, jobs.job[n].cols,       \
    jobs.job[n].accumulate, jobs.job[n].act, b - jobs.job[n].first_block, jobs.split)
template <int T, int NT>
__device__ __forceinline__ void matvec_mma_jobs(const MvJobs& jobs) {
    int b = blockIdx.x;
    if (jobs.n > 2 && b >= jobs.job[2].first_block) MMA_CALL(2);
    else if (jobs.n > 1 && b >= jobs.job[1].first_block) MMA_CALL(1);
    else MMA_CALL(0);
}
// matvec_mma{1,2,4}_{f16,bf16}: up to 8, 16 or 32 batch rows.
#define MATVEC_MMA(name, T, NT)                                                                  \
    extern "C" __global__ void __launch_bounds__(256) matvec_mma##NT##_##name(MvJobs jobs) {   \
        matvec_mma_jobs<T, NT>(jobs);                                                             \
    }
MATVEC_MMA(f16, T_F16, 1)
MATVEC_MMA(f16, T_F16, 2)
MATVEC_MMA(f16, T_F16, 4)
MATVEC_MMA(bf16, T_BF16, 1)
MATVEC_MMA(bf16, T_BF16, 2)
MATVEC_MMA(bf16, T_BF16, 4)
