// Up to 3 products of one weight type over a batch of `nt` rows (a prompt's), in one launch:
// job i's Y[t][j] = act(dot(W[j], X[t]) + bias[j]), or Y[t][j] += dot + bias (accumulate), for
// every row j < n of W (n x k, ggml layout) and batch row t < nt (X rows of k, Y rows of n).
//
// A block of 256 threads computes a tile of MM_T (64) weight rows by MM_T batch rows, k in
// steps of 32: each step dequantizes the weight tile (8 elements a thread, load8) and copies the
// input tile into shared memory, both stored k-major, then each thread accumulates 4 weight rows
// by 4 batch rows from float4 reads of them. Tiles past n or nt compute on clamped rows and do
// not write.
#define MM_T 64
#define MM_K 32
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

template <int T>
__device__ __forceinline__ void matmul(const u8* w, const float* bias, const float* x, float* y,
                                       int n, int k, int accumulate, int act, int tiles_n,
                                       int blk, int nt) {
    __shared__ __align__(16) float ws[MM_K][MM_T + 4];
    __shared__ __align__(16) float xs[MM_K][MM_T + 4];
    int j0 = (blk % tiles_n) * MM_T, t0 = (blk / tiles_n) * MM_T;
    int tid = threadIdx.x, lr = tid / 4, lk = (tid % 4) * 8;
    const u8* wrow = w + (size_t)min(j0 + lr, n - 1) * row_bytes<T>(k);
    const float* xrow = x + (size_t)min(t0 + lr, nt - 1) * k;
    bool vec = k % 8 == 0;
    int ty = tid / 16, tx = tid % 16;
    float c[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int t = 0; t < 4; t++) c[i][t] = 0.f;
    for (int k0 = 0; k0 < k; k0 += MM_K) {
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
        for (int kk = 0; kk < MM_K; kk++) {
            float4 a = *(const float4*)&ws[kk][ty * 4];
            float4 b = *(const float4*)&xs[kk][tx * 4];
            float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int t = 0; t < 4; t++) c[i][t] += av[i] * bv[t];
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int j = j0 + ty * 4 + i;
        if (j >= n) continue;
        float bj = bias ? bias[j] : 0.f;
#pragma unroll
        for (int t = 0; t < 4; t++) {
            int r = t0 + tx * 4 + t;
            if (r >= nt) continue;
            float s = c[i][t] + bj;
            float* o = y + (size_t)r * n + j;
            *o = accumulate ? *o + s : (act >= 0 ? act_apply(act, s) : s);
        }
    }
}

// The job of this block, its fields read by constant indices (as matvec.cu).
#define MM_CALL(q) matmul<T>(jobs.job[q].w, jobs.job[q].bias, jobs.job[q].x, jobs.job[q].y,      \
    jobs.job[q].n, jobs.job[q].k, jobs.job[q].accumulate, jobs.job[q].act, jobs.job[q].tiles_n, \
    b - jobs.job[q].first_block, jobs.nt)
template <int T>
__device__ __forceinline__ void matmul_jobs(const MmJobs& jobs) {
    int b = blockIdx.x;
    if (jobs.n_jobs > 2 && b >= jobs.job[2].first_block) MM_CALL(2);
    else if (jobs.n_jobs > 1 && b >= jobs.job[1].first_block) MM_CALL(1);
    else MM_CALL(0);
}
#define MATMUL(name, T)                                                                          \
    extern "C" __global__ void __launch_bounds__(256) matmul_##name(MmJobs jobs) {             \
        matmul_jobs<T>(jobs);                                                                     \
    }
FOR_TYPES(MATMUL)
