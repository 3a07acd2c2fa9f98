// One block per row (blockIdx.x) of n elements (x and out: rows of n, one after another). out may be x: every thread reads its own
// elements before writing them, after the reductions. Up to NORM_REGS * blockDim elements are
// kept in registers between the passes (one read of x), with their weights and biases, loaded
// before the first reduction so that their latency overlaps it; past that they are read again.
#ifndef NORM_REGS
#define NORM_REGS 8
#endif
// Runs `body` for each of this thread's elements i, its value, weight and bias as `e`, `we`,
// `be`: the ones in registers (a loop unrolled at compile time, so the arrays stay registers),
// then any past them, read from memory.
#define NORM_EACH(body)                                                                          \
    _Pragma("unroll") for (int r = 0; r < NORM_REGS; r++) {                                      \
        int i = threadIdx.x + r * blockDim.x;                                                    \
        if (i < n) { float e = v[r], we = wv[r], be = bv[r]; body; }                             \
    }                                                                                            \
    for (int i = threadIdx.x + NORM_REGS * blockDim.x; i < n; i += blockDim.x) {                 \
        float e = x[i], we = w[i], be = b ? b[i] : 0.f; body;                                    \
    }

// v[r], wv[r], bv[r] = x, w, b (0 if null) at threadIdx.x + r * blockDim.x (0 past n).
__device__ __forceinline__ void norm_load(const float* x, const float* w, const float* b, int n,
                                          float* v, float* wv, float* bv) {
#pragma unroll
    for (int r = 0; r < NORM_REGS; r++) {
        int i = threadIdx.x + r * blockDim.x;
        v[r] = i < n ? x[i] : 0.f;
        wv[r] = i < n ? w[i] : 0.f;
        bv[r] = i < n && b ? b[i] : 0.f;
    }
}

extern "C" __global__ void __launch_bounds__(1024)
rmsnorm(const float* x, const float* w, int n, float eps, float* out) {
    __shared__ float red[32];
    x += (size_t)blockIdx.x * n;
    out += (size_t)blockIdx.x * n;
    const float* b = nullptr;
    float v[NORM_REGS], wv[NORM_REGS], bv[NORM_REGS], s = 0.f;
    norm_load(x, w, b, n, v, wv, bv);
    NORM_EACH(s += e * e)
    float k = rsqrtf(block_sum(s, red) / n + eps);
    NORM_EACH(out[i] = e * k * we)
}
extern "C" __global__ void __launch_bounds__(1024)
layernorm(const float* x, const float* w, const float* b, int n, float eps, float* out) {
    __shared__ float red[32];
    x += (size_t)blockIdx.x * n;
    out += (size_t)blockIdx.x * n;
    float v[NORM_REGS], wv[NORM_REGS], bv[NORM_REGS], s = 0.f, q = 0.f;
    norm_load(x, w, b, n, v, wv, bv);
    NORM_EACH(s += e)
    float mean = block_sum(s, red) / n;
    NORM_EACH(q += (e - mean) * (e - mean))
    float k = rsqrtf(block_sum(q, red) / n + eps);
    NORM_EACH(out[i] = (e - mean) * k * we + be)
}
