extern "C" __global__ void glu(int act, float* gate, const float* up, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) gate[i] = act_apply(act, gate[i]) * up[i];
}
extern "C" __global__ void activate(int act, float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = act_apply(act, x[i]);
}
extern "C" __global__ void copy_f32(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i];
}
// dst[idx[j]] = src[j] for j < n; an index at or past len writes nothing.
extern "C" __global__ void scatter_f32(const float* src, const u32* idx, int n, float* dst,
                                       int len) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j < n && idx[j] < (u32)len) dst[idx[j]] = src[j];
}
extern "C" __global__ void add_f32(float* x, const float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}
// kc[pos][..width] = k[r] and vc[pos][..width] = v[r], in f16, for batch row r = blockIdx.y
// (pos = step[0] + r, below n_ctx).
extern "C" __global__ void store_f16(const float* k, const float* v, u16* kc, u16* vc, int width,
                                     int n_ctx, const int* step) {
    int i = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y, p = step[0] + r;
    size_t at = (size_t)r * width + i;
    if (i < width && p >= 0 && p < n_ctx) {
        kc[(size_t)p * width + i] = f32_to_f16(k[at]);
        vc[(size_t)p * width + i] = f32_to_f16(v[at]);
    }
}
