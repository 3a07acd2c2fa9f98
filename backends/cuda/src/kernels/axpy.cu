// y[c] += sum over outputs j of a[j] * W[row(j)][c] (+ bias[c]), W neuron-major (row r: neuron
// r's output column). A block of 8 warps owns 256 * AX_VEC columns: lane l loads 8 columns at
// each of base + v * 256 + l * 8 (v < AX_VEC), so a warp reads AX_VEC * 512 contiguous bytes of a
// 16-bit row. Its warps take the outputs j = by*8 + warp, + gridDim.y*8, ... (split-K), AX_UNROLL
// rows in flight per lane; a row whose a[j] is 0 (a ReLU zero) is not read. The warps' sums meet
// in shared memory and leave with one atomic add per column; the blocks of by == 0 add the bias.
#ifndef AX_UNROLL
#define AX_UNROLL 2
#endif
#ifndef AX_VEC
#define AX_VEC 4
#endif
template <int T>
__device__ void axpy(const u8* w, int rows, int cols, const u32* idx, int n_out, int group,
                     const float* a, const float* bias, float* y) {
    __shared__ float part[8][256 * AX_VEC + 1];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int base = blockIdx.x * 256 * AX_VEC;
    size_t rb = row_bytes<T>(cols);
    bool vec = cols % 8 == 0;
    float acc[AX_VEC][8];
#pragma unroll
    for (int c = 0; c < AX_VEC; c++)
        for (int i = 0; i < 8; i++) acc[c][i] = 0.f;
    int step = gridDim.y * 8;
    for (int j0 = blockIdx.y * 8 + warp; j0 < n_out; j0 += step * AX_UNROLL) {
        float v[AX_UNROLL][AX_VEC][8], s[AX_UNROLL];
#pragma unroll
        for (int u = 0; u < AX_UNROLL; u++) {
            int j = j0 + u * step, r = j < n_out ? sel_row(idx, j, group) : rows;
            s[u] = r < rows ? a[j] : 0.f;
            if (s[u] != 0.f) {
#pragma unroll
                for (int c = 0; c < AX_VEC; c++) {
                    int col = base + c * 256 + lane * 8;
                    if (col < cols) load8<T>(w + (size_t)r * rb, col, cols, vec, v[u][c]);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < AX_UNROLL; u++)
            if (s[u] != 0.f) {
#pragma unroll
                for (int c = 0; c < AX_VEC; c++)
                    if (base + c * 256 + lane * 8 < cols)
                        for (int i = 0; i < 8; i++) acc[c][i] += s[u] * v[u][c][i];
            }
    }
#pragma unroll
    for (int c = 0; c < AX_VEC; c++)
        for (int i = 0; i < 8; i++) part[warp][c * 256 + lane * 8 + i] = acc[c][i];
    __syncthreads();
    for (int t = threadIdx.x; t < 256 * AX_VEC; t += blockDim.x) {
        int col = base + t;
        if (col >= cols) break;
        float sum = bias && blockIdx.y == 0 ? bias[col] : 0.f;
        for (int q = 0; q < 8; q++) sum += part[q][t];
        atomicAdd(&y[col], sum);
    }
}
#define AXPY(name, T)                                                                            \
    extern "C" __global__ void axpy_##name(const u8* w, int rows, int cols, const u32* idx,       \
                                           int n_out, int group, const float* a,                 \
                                           const float* bias, float* y) {                       \
        axpy<T>(w, rows, cols, idx, n_out, group, a, bias, y);                                    \
    }
FOR_TYPES(AXPY)
