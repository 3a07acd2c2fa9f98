extern "C" __global__ void glu(int act, float* gate, const float* up, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) gate[i] = act_apply(act, gate[i]) * up[i];
}
// x[i] = s * x[i], then (cap > 0) cap * tanh(x[i] / cap).
extern "C" __global__ void scale_cap(float* x, int n, float s, float cap) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = s * x[i];
        x[i] = cap > 0.f ? cap * tanhf(v / cap) : v;
    }
}
extern "C" __global__ void activate(int act, float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = act_apply(act, x[i]);
}
extern "C" __global__ void copy_f32(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i];
}
// dst[idx[j / group] * group + j % group] = src[j] for j < n (count * group); a place at or past
// len is not written.
extern "C" __global__ void scatter_f32(const float* src, const u32* idx, int n, int group,
                                       float* dst, int len) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    size_t at = (size_t)idx[j / group] * group + j % group;
    if (at < (size_t)len) dst[at] = src[j];
}
// dst[j] = src[idx[j / group] * group + j % group] for j < count * group; an index at or past
// len reads 0.
extern "C" __global__ void gather_f32(const float* src, const u32* idx, int count, int group,
                                      float* dst, int len) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j < count * group) {
        u32 r = idx[j / group] * (u32)group + (u32)(j % group);
        dst[j] = r < (u32)len ? src[r] : 0.f;
    }
}
// x[i] = 0 for i < nx, y[i] = 0 for i < ny, z[i] = 0 for i < nz (Device::clear, one launch).
extern "C" __global__ void clear_f32(float* x, int nx, float* y, int ny, float* z, int nz) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < nx) x[i] = 0.f;
    if (i < ny) y[i] = 0.f;
    if (i < nz) z[i] = 0.f;
}
extern "C" __global__ void abs_f32(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = fabsf(x[i]);
}
// Input sparsity (Device::sparsify): out[i] = x[i] where |x[i]| * scale[i] > t (scale 1 when
// null), else 0; a NaN score is kept, as in the host's reference.
extern "C" __global__ void sparsify_f32(const float* x, int n, float t, const float* scale,
                                        float* out) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i], s = fabsf(v) * (scale ? scale[i] : 1.0f);
    out[i] = s <= t ? 0.0f : v;
}
// out[slot] = the number of groups of `group` consecutive x[i], i < n (the last one short), that
// hold a nonzero value (group 1: the nonzero x[i]): one block of 1024 threads.
extern "C" __global__ void count_nonzero_f32(const float* x, int n, int group, float* out,
                                             int slot) {
    __shared__ int part[1024];
    int c = 0;
    int groups = (n + group - 1) / group;
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
        int any = 0, end = min(n, (g + 1) * group);
        for (int i = g * group; i < end; i++) any |= x[i] != 0.0f;
        c += any;
    }
    part[threadIdx.x] = c;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[slot] = (float)part[0];
}
// out[g] = the norm of x[g * width ..][..width], one warp (blockIdx.x = g) per group.
extern "C" __global__ void group_norms(const float* x, int width, float* out) {
    const float* row = x + (size_t)blockIdx.x * width;
    float acc = 0.f;
    for (int t = threadIdx.x; t < width; t += 32) acc += row[t] * row[t];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    if (threadIdx.x == 0) out[blockIdx.x] = sqrtf(acc);
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
// A step of several sequences (see attention_rows_f16): row r = blockIdx.y of k and v into its
// own sequence's caches (tab[r * SEQ_TAB] and + 1) at its position (+ 3), below its context
// (+ 4).
extern "C" __global__ void store_rows_f16(const float* k, const float* v, int width,
                                          const u64* tab) {
    int i = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
    const u64* t = tab + (size_t)r * SEQ_TAB;
    int p = (int)t[3];
    if (i >= width || p < 0 || p >= (int)t[4]) return;
    size_t at = (size_t)r * width + i;
    ((u16*)t[0])[(size_t)p * width + i] = f32_to_f16(k[at]);
    ((u16*)t[1])[(size_t)p * width + i] = f32_to_f16(v[at]);
}
