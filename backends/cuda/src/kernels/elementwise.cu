// act: 0 = SiLU, 1 = ReLU (dejavu_backend_api::Activation).
__device__ __forceinline__ float act_apply(int act, float x) {
    return act == 0 ? x / (1.f + expf(-x)) : fmaxf(x, 0.f);
}
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
extern "C" __global__ void add_f32(float* x, const float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}
// cache[pos][..width] = x, in f16 (pos = step[1], below n_ctx).
extern "C" __global__ void store_f16(const float* x, u16* cache, int width, int n_ctx, const int* step) {
    int i = blockIdx.x * blockDim.x + threadIdx.x, p = step[1];
    if (i < width && p >= 0 && p < n_ctx) cache[(size_t)p * width + i] = f32_to_f16(x[i]);
}
