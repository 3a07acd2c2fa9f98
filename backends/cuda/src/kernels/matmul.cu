// Up to 3 products of one weight type over a batch of `nt` rows (a prompt's), in one launch:
// job i's Y[t][j] = act(dot(W[j], X[t]) + bias[j]), or Y[t][j] += dot + bias (accumulate), for
// every row j < n of W (n x k, ggml layout) and batch row t < nt (X rows of k, Y rows of n).
//
// A block of 256 threads computes a tile of TS weight rows by TS batch rows (TS 64, or 32 for
// products of few tiles: 4 times the blocks, each with a quarter of the work per step), k in
// steps of 2048 / TS: each step dequantizes the weight tile (8 elements a thread, load8) and
// copies the input tile into shared memory, both stored k-major, then each thread accumulates
// TS/16 weight rows by TS/16 batch rows from vector reads of them. Tiles past n or nt compute on
// clamped rows and do not write.
struct MmJob {
    const u8* w;
    const float* bias;
    const float* x;
    float* y;
    int n, k, accumulate, act, tiles_n, first_block, pad0, pad1;
};
struct MmJobs {
    MmJob job[3];
    int n_jobs, nt;
};

// v[0..M) = p[0..M) from shared memory in one vector read (p aligned to M floats).
template <int M> __device__ __forceinline__ void lds(const float* p, float* v);
template <> __device__ __forceinline__ void lds<4>(const float* p, float* v) {
    float4 a = *(const float4*)p;
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
}
template <> __device__ __forceinline__ void lds<2>(const float* p, float* v) {
    float2 a = *(const float2*)p;
    v[0] = a.x; v[1] = a.y;
}

template <int T, int TS>
__device__ __forceinline__ void matmul(const u8* w, const float* bias, const float* x, float* y,
                                       int n, int k, int accumulate, int act, int tiles_n,
                                       int blk, int nt) {
    constexpr int KS = 2048 / TS, M = TS / 16, LPR = KS / 8;  // k-step, micro-tile, loaders/row
    __shared__ __align__(16) float ws[KS][TS + 4];
    __shared__ __align__(16) float xs[KS][TS + 4];
    int j0 = (blk % tiles_n) * TS, t0 = (blk / tiles_n) * TS;
    int tid = threadIdx.x, lr = tid / LPR, lk = (tid % LPR) * 8;
    const u8* wrow = w + (size_t)min(j0 + lr, n - 1) * row_bytes<T>(k);
    const float* xrow = x + (size_t)min(t0 + lr, nt - 1) * k;
    bool vec = k % 8 == 0;
    int ty = tid / 16, tx = tid % 16;
    float c[M][M];
#pragma unroll
    for (int i = 0; i < M; i++)
#pragma unroll
        for (int t = 0; t < M; t++) c[i][t] = 0.f;
    for (int k0 = 0; k0 < k; k0 += KS) {
        int e = k0 + lk;
        float v[8], xv[8];
        if (e < k) {
            load8<T>(wrow, e, k, vec, v);
        } else {
            for (int i = 0; i < 8; i++) v[i] = 0.f;
        }
        for (int i = 0; i < 8; i++) xv[i] = e + i < k ? xrow[e + i] : 0.f;
        __syncthreads();  // the last step's reads of the tiles are done
#pragma unroll
        for (int i = 0; i < 8; i++) {
            ws[lk + i][lr] = v[i];
            xs[lk + i][lr] = xv[i];
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < KS; kk++) {
            float av[M], bv[M];
            lds<M>(&ws[kk][ty * M], av);
            lds<M>(&xs[kk][tx * M], bv);
#pragma unroll
            for (int i = 0; i < M; i++)
#pragma unroll
                for (int t = 0; t < M; t++) c[i][t] += av[i] * bv[t];
        }
    }
#pragma unroll
    for (int i = 0; i < M; i++) {
        int j = j0 + ty * M + i;
        if (j >= n) continue;
        float bj = bias ? bias[j] : 0.f;
#pragma unroll
        for (int t = 0; t < M; t++) {
            int r = t0 + tx * M + t;
            if (r >= nt) continue;
            float s = c[i][t] + bj;
            float* o = y + (size_t)r * n + j;
            *o = accumulate ? *o + s : (act >= 0 ? act_apply(act, s) : s);
        }
    }
}

// The job of this block, its fields read by constant indices (as matvec.cu).
#define MM_CALL(q) matmul<T, TS>(jobs.job[q].w, jobs.job[q].bias, jobs.job[q].x, jobs.job[q].y,  \
    jobs.job[q].n, jobs.job[q].k, jobs.job[q].accumulate, jobs.job[q].act, jobs.job[q].tiles_n, \
    b - jobs.job[q].first_block, jobs.nt)
template <int T, int TS>
__device__ __forceinline__ void matmul_jobs(const MmJobs& jobs) {
    int b = blockIdx.x;
    if (jobs.n_jobs > 2 && b >= jobs.job[2].first_block) MM_CALL(2);
    else if (jobs.n_jobs > 1 && b >= jobs.job[1].first_block) MM_CALL(1);
    else MM_CALL(0);
}
// matmul_T: 64-row tiles; matmul_small_T: 32-row tiles.
#define MATMUL(name, T)                                                                          \
    extern "C" __global__ void __launch_bounds__(256) matmul_##name(MmJobs jobs) {             \
        matmul_jobs<T, 64>(jobs);                                                                 \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(256) matmul_small_##name(MmJobs jobs) {       \
        matmul_jobs<T, 32>(jobs);                                                                 \
    }
FOR_TYPES(MATMUL)
