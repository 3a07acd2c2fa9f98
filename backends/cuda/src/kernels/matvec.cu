// Up to 3 products of one input x, of one weight type, in one launch (Q, K and V; gate and up). Job i's outputs j:
// y[j] = act(dot(W[row(j)], x) + bias[row(j)]), or y[j] += dot + bias (accumulate), for the
// outputs of a selection. A block of 8 warps computes 8 / split outputs of one job: `split`
// warps share an output (split-K, for products of few rows), each lane dequantizing 8 elements
// at a time (128-bit loads for the 16-bit types), MV_UNROLL such loads in flight per lane,
// then a warp sum and a sum over the output's warps. Rows outside the matrix write 0.
#ifndef MV_UNROLL
#define MV_UNROLL 1
#endif
struct MvJob {
    const u8* w;
    const u32* idx;
    const float* bias;
    float* y;
    int rows, cols, n_out, group, accumulate, act, first_block, pad;
};
struct MvJobs {
    MvJob job[3];
    int n, split;
};

template <int T>
__device__ void matvec(const u8* w, const u32* idx, const float* bias, float* y, int rows,
                       int cols, int n_out, int group, int accumulate, int act, int blk,
                       const float* x, int split) {
    __shared__ float part[8];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int j = blk * (8 / split) + warp / split, k = warp % split;
    int r = j < n_out ? sel_row(idx, j, group) : rows;
    float s = 0.f;
    if (r < rows) {
        const u8* row = w + (size_t)r * row_bytes<T>(cols);
        bool vec = cols % 8 == 0;
        int stride = 256 * split;
        for (int e0 = (k * 32 + lane) * 8; e0 < cols; e0 += stride * MV_UNROLL) {
            float v[MV_UNROLL][8];
#pragma unroll
            for (int u = 0; u < MV_UNROLL; u++)
                if (e0 + stride * u < cols) load8<T>(row, e0 + stride * u, cols, vec, v[u]);
#pragma unroll
            for (int u = 0; u < MV_UNROLL; u++) {
                int e = e0 + stride * u;
                if (e >= cols) break;
                if (vec) {
                    float4 a = *(const float4*)(x + e), b = *(const float4*)(x + e + 4);
                    s += v[u][0] * a.x + v[u][1] * a.y + v[u][2] * a.z + v[u][3] * a.w +
                         v[u][4] * b.x + v[u][5] * b.y + v[u][6] * b.z + v[u][7] * b.w;
                } else {
                    for (int i = 0; i < 8 && e + i < cols; i++) s += v[u][i] * x[e + i];
                }
            }
        }
    }
    s = warp_sum(s);
    if (split > 1) {
        if (lane == 0) part[warp] = s;
        __syncthreads();
        if (k != 0) return;
        for (int i = 1; i < split; i++) s += part[warp + i];
    }
    if (lane == 0 && j < n_out) {
        if (r < rows && bias) s += bias[r];
        if (r >= rows) s = 0.f;
        if (accumulate) y[j] += s;
        else y[j] = act >= 0 ? act_apply(act, s) : s;
    }
}

// One kernel per weight type (one type per launch): a kernel holding every type's code would
// run at the occupancy of the most register-hungry one.
// The job of this block, copied out of the parameters by constant indices (a dynamic index
// would copy the whole struct to local memory).
template <int T>
__device__ void matvec_jobs(const MvJobs& jobs, const float* x) {
    int b = blockIdx.x;
    int i = (jobs.n > 2 && b >= jobs.job[2].first_block) ? 2 : (jobs.n > 1 && b >= jobs.job[1].first_block) ? 1 : 0;
    MvJob jb = i == 0 ? jobs.job[0] : i == 1 ? jobs.job[1] : jobs.job[2];
    matvec<T>(jb.w, jb.idx, jb.bias, jb.y, jb.rows, jb.cols, jb.n_out, jb.group, jb.accumulate,
              jb.act, b - jb.first_block, x, jobs.split);
}
#define MATVEC(name, T)                                                                          \
    extern "C" __global__ void matvec_##name(MvJobs jobs, const float* x) {                      \
        matvec_jobs<T>(jobs, x);                                                                  \
    }
FOR_TYPES(MATVEC)
