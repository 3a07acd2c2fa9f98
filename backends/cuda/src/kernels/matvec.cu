// Up to 3 products of one weight type in one launch (Q, K and V; gate and up; the predictors'
// layers), each of its own input x (often the same one). Job i's outputs j:
// y[j] = act(dot(W[row(j)], x) + bias[row(j)]), or y[j] += dot + bias (accumulate), for the
// outputs of a selection. A block of 8 warps computes 8 * MV_ROWS outputs of one job (each
// warp MV_ROWS rows, sharing its loads of x), or with split-K (products of few rows) 8 / split
// outputs, `split` warps sharing one. Each lane dequantizes 8 elements at a time (128-bit loads
// for the 16-bit types); a warp sum and a sum over an output's warps finish. Rows outside the
// matrix write 0.
#ifndef MV_ROWS
#define MV_ROWS 1
#endif
// 16-bit rows: chunks loaded ahead per lane (measured on the H200, a Llama-3-8B bf16 layer in one
// graph: 1 chunk 150 us, 2 chunks 136, 3 or 4 chunks 139-140; loads that skip L1 were slower).
#ifndef MV_UNROLL
#define MV_UNROLL 2
#endif
struct MvJob {
    const u8* w;
    const u32* idx;
    const float* bias;
    float* y;
    const float* x;
    int rows, cols, n_out, group, accumulate, act, first_block, pad;
};
struct MvJobs {
    MvJob job[3];
    int n, split, ks, pad;  // ks: warps per output of matvec_rows
};

template <int T, int U>
__device__ __forceinline__ void matvec(const u8* w, const u32* idx, const float* bias, float* y,
                                       int rows, int cols, int n_out, int group, int accumulate,
                                       int act, int blk, const float* x, int split) {
    __shared__ float part[8 * MV_ROWS];
    // split == 1: each warp computes MV_ROWS outputs (sharing the loads of x); else `split`
    // warps compute one output.
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int rpw = split == 1 ? MV_ROWS : 1;
    int j0 = split == 1 ? (blk * 8 + warp) * MV_ROWS : blk * (8 / split) + warp / split;
    int k = split == 1 ? 0 : warp % split;
    int r[MV_ROWS];
    const u8* row[MV_ROWS];
    float s[MV_ROWS];
#pragma unroll
    for (int q = 0; q < MV_ROWS; q++) {
        int j = j0 + q;
        r[q] = (q < rpw && j < n_out) ? sel_row(idx, j, group) : rows;
        row[q] = w + (size_t)min(r[q], rows - 1) * row_bytes<T>(cols);
        s[q] = 0.f;
    }
    bool vec = cols % 8 == 0;
    int stride = 256 * split;
    int e = (k * 32 + lane) * 8;
    // 16-bit rows, U > 1: U chunks of every row loaded before any is used (the same sums in
    // the same order as the loop below, which does the rest and the other types one chunk of 8
    // a lane per iteration).
    if (U > 1 && vec && (T == T_F16 || T == T_BF16)) {
        for (; e + (U - 1) * stride < cols; e += U * stride) {
            uint4 raw[U > 1 ? U : 1][MV_ROWS];
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int q = 0; q < MV_ROWS; q++)
                    raw[u][q] = *(const uint4*)(row[q] + (size_t)(e + u * stride) * 2);
#pragma unroll
            for (int u = 0; u < U; u++) {
                const float* xp = x + e + u * stride;
                float4 a = *(const float4*)xp, b = *(const float4*)(xp + 4);
                float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                for (int q = 0; q < MV_ROWS; q++) {
                    float v[8];
                    unpack_half8(raw[u][q], v, T == T_BF16);
                    for (int i = 0; i < 8; i++) s[q] += v[i] * xv[i];
                }
            }
        }
    }
    for (; e < cols; e += stride) {
        float xv[8];
        if (vec) {
            float4 a = *(const float4*)(x + e), b = *(const float4*)(x + e + 4);
            xv[0] = a.x; xv[1] = a.y; xv[2] = a.z; xv[3] = a.w;
            xv[4] = b.x; xv[5] = b.y; xv[6] = b.z; xv[7] = b.w;
        } else {
            for (int i = 0; i < 8; i++) xv[i] = e + i < cols ? x[e + i] : 0.f;
        }
#pragma unroll
        for (int q = 0; q < MV_ROWS; q++) {
            if (r[q] >= rows) continue;
            float v[8];
            load8<T>(row[q], e, cols, vec, v);
            for (int i = 0; i < 8; i++) s[q] += v[i] * xv[i];
        }
    }
#pragma unroll
    for (int q = 0; q < MV_ROWS; q++) s[q] = warp_sum(s[q]);
    if (split > 1) {
        if (lane == 0) part[warp] = s[0];
        __syncthreads();
        if (k != 0) return;
        for (int i = 1; i < split; i++) s[0] += part[warp + i];
    }
    if (lane != 0) return;
#pragma unroll
    for (int q = 0; q < MV_ROWS; q++) {
        int j = j0 + q;
        if (q >= rpw || j >= n_out) continue;
        float v = r[q] < rows ? s[q] + (bias ? bias[r[q]] : 0.f) : 0.f;
        if (accumulate) y[j] += v;
        else y[j] = act >= 0 ? act_apply(act, v) : v;
    }
}

// One kernel per weight type (one type per launch): a kernel holding every type's code would
// run at the occupancy of the most register-hungry one.
// The job of this block, its fields read by constant indices (a dynamic index would copy the
// whole struct to local memory and cost registers).
#define MV_CALL(n) matvec<T, U>(jobs.job[n].w, jobs.job[n].idx, jobs.job[n].bias, jobs.job[n].y,    \
    jobs.job[n].rows, jobs.job[n].cols, jobs.job[n].n_out, jobs.job[n].group,                  \
    jobs.job[n].accumulate, jobs.job[n].act, b - jobs.job[n].first_block, jobs.job[n].x,       \
    jobs.split)
template <int T, int U>
__device__ __forceinline__ void matvec_jobs(const MvJobs& jobs) {
    int b = blockIdx.x;
    if (jobs.n > 2 && b >= jobs.job[2].first_block) MV_CALL(2);
    else if (jobs.n > 1 && b >= jobs.job[1].first_block) MV_CALL(1);
    else MV_CALL(0);
}
#define MATVEC(name, T)                                                                          \
    extern "C" __global__ void __launch_bounds__(256) matvec_##name(MvJobs jobs) {             \
        matvec_jobs<T, 1>(jobs);                                                                  \
    }
FOR_TYPES(MATVEC)
// The 16-bit types' products of every row without split-K (the dense step's), MV_UNROLL chunks
// ahead: a kernel of their own, so that gathers and split rows keep the registers, and the
// occupancy, of the plain loop (on OPT-13B f16, `paper` ran 2.02x dense with one kernel for
// both, 1.93x with the unrolled loop in every product).
extern "C" __global__ void __launch_bounds__(256) matvec_f16_ahead(MvJobs jobs) {
    matvec_jobs<T_F16, MV_UNROLL>(jobs);
}
extern "C" __global__ void __launch_bounds__(256) matvec_bf16_ahead(MvJobs jobs) {
    matvec_jobs<T_BF16, MV_UNROLL>(jobs);
}

// A batch of a few rows (1 to MVR_MAX: the steps of continuous batching, a speculative
// draft's verification) through one read of the weights: `ks` warps (1, 2, 4 or 8) one weight
// row of one job, dotted with every batch row's input (row t at x + t * cols), into
// y[t * n_out + j] for output j (weight row sel_row(idx, j, group): every row, or a selection,
// compact): act(dot + bias), or += (accumulate). Warp q of an output's ks takes the row's
// chunks of 256 columns q, q + ks, ...; their sums meet in shared memory (a small matrix, such
// as a predictor's, then fills the GPU: 8 / ks outputs a block).
#define MVR_MAX 8
template <int T>
__device__ __forceinline__ void matvec_rows(const u8* w, const u32* idx, const float* bias,
                                            float* y, const float* x, int n_out, int group,
                                            int cols, int accumulate, int act, int blk, int nt,
                                            int ks) {
    __shared__ float red[8][MVR_MAX];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int j = blk * (8 / ks) + warp / ks, part = warp % ks;
    bool live = j < n_out;
    int r = live ? sel_row(idx, j, group) : 0;
    const u8* row = w + (size_t)r * row_bytes<T>(cols);
    float s[MVR_MAX];
#pragma unroll
    for (int t = 0; t < MVR_MAX; t++) s[t] = 0.f;
    bool vec = cols % 8 == 0;
    for (int e = (part * 32 + lane) * 8; live && e < cols; e += 256 * ks) {
        float v[8];
        load8<T>(row, e, cols, vec, v);
#pragma unroll
        for (int t = 0; t < MVR_MAX; t++) {
            if (t < nt) {
                const float* xp = x + (size_t)t * cols + e;
                float xv[8];
                if (vec) {
                    float4 a = *(const float4*)xp, b = *(const float4*)(xp + 4);
                    xv[0] = a.x; xv[1] = a.y; xv[2] = a.z; xv[3] = a.w;
                    xv[4] = b.x; xv[5] = b.y; xv[6] = b.z; xv[7] = b.w;
                } else {
                    for (int i = 0; i < 8; i++) xv[i] = e + i < cols ? xp[i] : 0.f;
                }
                for (int i = 0; i < 8; i++) s[t] += v[i] * xv[i];
            }
        }
    }
#pragma unroll
    for (int t = 0; t < MVR_MAX; t++) s[t] = warp_sum(s[t]);
    if (ks > 1) {  // the same for the whole block: every thread reaches the barrier
        if (lane == 0)
            for (int t = 0; t < MVR_MAX; t++) red[warp][t] = s[t];
        __syncthreads();
        if (part == 0 && lane == 0)
            for (int t = 0; t < MVR_MAX; t++) {
                s[t] = 0.f;
                for (int q = 0; q < ks; q++) s[t] += red[warp + q][t];
            }
    }
    if (lane != 0 || part != 0 || !live) return;
    for (int t = 0; t < nt; t++) {
        float v = s[t] + (bias ? bias[r] : 0.f);
        float* o = y + (size_t)t * n_out + j;
        if (accumulate) *o += v;
        else *o = act >= 0 ? act_apply(act, v) : v;
    }
}
// Each job's blocks from its first_block on; `split` holds the batch's rows. Fields read by
// constant indices, as `matvec_jobs`.
#define MVR_CALL(n) matvec_rows<T>(jobs.job[n].w, jobs.job[n].idx, jobs.job[n].bias, jobs.job[n].y, \
    jobs.job[n].x, jobs.job[n].n_out, jobs.job[n].group, jobs.job[n].cols, jobs.job[n].accumulate, \
    jobs.job[n].act, b - jobs.job[n].first_block, jobs.split, jobs.ks)
template <int T>
__device__ __forceinline__ void matvec_rows_jobs(const MvJobs& jobs) {
    int b = blockIdx.x;
    if (jobs.n > 2 && b >= jobs.job[2].first_block) MVR_CALL(2);
    else if (jobs.n > 1 && b >= jobs.job[1].first_block) MVR_CALL(1);
    else MVR_CALL(0);
}
#define MATVEC_ROWS(name, T)                                                                     \
    extern "C" __global__ void __launch_bounds__(256) matvec_rows_##name(MvJobs jobs) {        \
        matvec_rows_jobs<T>(jobs);                                                                \
    }
FOR_TYPES(MATVEC_ROWS)
