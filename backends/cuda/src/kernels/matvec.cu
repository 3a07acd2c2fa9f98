// y[j] (+)= dot(W[row(j)], x) + bias[row(j)] for the outputs j of a selection. A block of 8
// warps computes 8 / split outputs: `split` warps share an output (split-K, for products of few
// rows), each lane dequantizing 8 elements at a time (128-bit loads for the 16-bit types),
// MV_UNROLL such loads in flight per lane, then a warp sum and a sum over the output's warps.
// Rows outside the matrix write 0.
#ifndef MV_UNROLL
#define MV_UNROLL 1
#endif
template <int T>
__device__ void matvec(const u8* w, int rows, int cols, const float* x, const u32* idx, int n_out,
                       int group, const float* bias, float* y, int accumulate, int split) {
    __shared__ float part[8];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int j = blockIdx.x * (8 / split) + warp / split, k = warp % split;
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
        y[j] = accumulate ? y[j] + s : s;
    }
}
#define MATVEC(name, T)                                                                          \
    extern "C" __global__ void matvec_##name(const u8* w, int rows, int cols, const float* x,     \
                                             const u32* idx, int n_out, int group,               \
                                             const float* bias, float* y, int accumulate,        \
                                             int split) {                                        \
        matvec<T>(w, rows, cols, x, idx, n_out, group, bias, y, accumulate, split);               \
    }
FOR_TYPES(MATVEC)
