// One block over the whole vector (n elements). out may be x (every thread reads its own
// elements before writing them, after the reductions).
extern "C" __global__ void rmsnorm(const float* x, const float* w, int n, float eps, float* out) {
    __shared__ float red[32];
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += x[i] * x[i];
    s = block_sum(s, red);
    float k = rsqrtf(s / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = x[i] * k * w[i];
}
extern "C" __global__ void layernorm(const float* x, const float* w, const float* b, int n,
                                     float eps, float* out) {
    __shared__ float red[32];
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
    float mean = block_sum(s, red) / n;
    float v = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) v += (x[i] - mean) * (x[i] - mean);
    float k = rsqrtf(block_sum(v, red) / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        out[i] = (x[i] - mean) * k * w[i] + (b ? b[i] : 0.f);
}
