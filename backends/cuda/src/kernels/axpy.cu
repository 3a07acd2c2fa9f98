// y[c] += sum over outputs j of a[j] * W[row(j)][c], W neuron-major (row r: neuron r's output
// column). A block of 8 warps owns 256 columns (8 per lane: one 128-bit load of a 16-bit row)
// and the outputs j = by*8 + warp, + gridDim.y*8, ... (split-K; AX_UNROLL rows in flight per
// lane); its warps' sums meet in shared memory and leave with one atomic add per column.
#ifndef AX_UNROLL
#define AX_UNROLL 4
#endif
template <int T>
__device__ void axpy(const u8* w, int rows, int cols, const u32* idx, int n_out, int group,
                     const float* a, float* y) {
    __shared__ float part[8][257];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int c = blockIdx.x * 256 + lane * 8;
    size_t rb = row_bytes<T>(cols);
    bool vec = cols % 8 == 0;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int step = gridDim.y * 8;
    if (c < cols) {
        for (int j0 = blockIdx.y * 8 + warp; j0 < n_out; j0 += step * AX_UNROLL) {
            float v[AX_UNROLL][8], s[AX_UNROLL];
#pragma unroll
            for (int u = 0; u < AX_UNROLL; u++) {
                int j = j0 + u * step, r = j < n_out ? sel_row(idx, j, group) : rows;
                s[u] = 0.f;
                if (r < rows) {
                    s[u] = a[j];
                    load8<T>(w + (size_t)r * rb, c, cols, vec, v[u]);
                }
            }
#pragma unroll
            for (int u = 0; u < AX_UNROLL; u++)
                if (s[u] != 0.f)
                    for (int i = 0; i < 8; i++) acc[i] += s[u] * v[u][i];
        }
    }
    for (int i = 0; i < 8; i++) part[warp][lane * 8 + i] = acc[i];
    __syncthreads();
    int t = threadIdx.x, col = blockIdx.x * 256 + t;
    if (col < cols) {
        float sum = 0.f;
        for (int q = 0; q < 8; q++) sum += part[q][t];
        atomicAdd(&y[col], sum);
    }
}
#define AXPY(name, T)                                                                            \
    extern "C" __global__ void axpy_##name(const u8* w, int rows, int cols, const u32* idx,       \
                                           int n_out, int group, const float* a, float* y) {     \
        axpy<T>(w, rows, cols, idx, n_out, group, a, y);                                          \
    }
FOR_TYPES(AXPY)
