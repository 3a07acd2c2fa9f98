// x[b] (+)= table[row] for batch row b = blockIdx.y, the row its step names: its token
// (which = 0) or its position (which = 1), plus `offset` (a vocabulary shard's first row, negated).
// step = {pos, token of each batch row, ...}; pos = each batch row's position. A row outside the
// table writes zeros (accumulate: nothing).
template <int T>
__device__ void embed(const u8* w, int rows, int cols, const int* step, const int* pos,
                      int which, int offset, int accumulate, float* x) {
    int r = (which == 0 ? step[1 + blockIdx.y] : pos[blockIdx.y]) + offset;
    x += (size_t)blockIdx.y * cols;
    if (r < 0 || r >= rows) {
        if (accumulate) return;
        for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < cols; e += gridDim.x * blockDim.x)
            x[e] = 0.0f;
        return;
    }
    const u8* row = w + (size_t)r * row_bytes<T>(cols);
    bool vec = cols % 8 == 0;
    for (int e = (blockIdx.x * blockDim.x + threadIdx.x) * 8; e < cols; e += gridDim.x * blockDim.x * 8) {
        float v[8];
        load8<T>(row, e, cols, vec, v);
        for (int i = 0; i < 8 && e + i < cols; i++) x[e + i] = accumulate ? x[e + i] + v[i] : v[i];
    }
}
#define EMBED(name, T)                                                                           \
    extern "C" __global__ void embed_##name(const u8* w, int rows, int cols, const int* step,     \
                                            const int* pos, int which, int offset,               \
                                            int accumulate, float* x) {                          \
        embed<T>(w, rows, cols, step, pos, which, offset, accumulate, x);                         \
    }
FOR_TYPES(EMBED)
