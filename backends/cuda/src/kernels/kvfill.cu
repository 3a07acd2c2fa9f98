// Lazy K/V (dejavu_backend_api::Device::kv_fill): the keys and values a selected head missed,
// recomputed from the layer's kept attention inputs (f16 rows [n_ctx][d]), the step's own
// input x read from f32 (rounded to f16 as kept) and kept by block 0.
//
// One warp per (K or V, selected head j, row pair i): the rows a and b of head h = idx[j] that
// RoPE rotates together ((2i, 2i+1) interleaved, (i, i + hd/2) neox; the same pairs without
// RoPE). For the missing positions p = valid[h] ..= pos, KV_POS at a time (past the last, the
// last one again, unused; the chunks shared among gridDim.y warps), each lane dots 8 columns of
// both rows with those inputs (the rows read once per KV_POS positions), a warp sum, then lane
// 0 adds the biases, rotates keys at position p (angles in f64, as rope.cu) and stores f16
// into the caches (`width` values a position). The last block to finish (counted in *done,
// left 0) sets valid[h] = pos + 1. rope: -1 none, 0 interleaved, 1 neox. d a multiple of 8.
#ifndef KV_POS
#define KV_POS 2
#endif
// 8 inputs of position p at column e: from x at the step's position (rounded to f16, as
// kept), else from the kept rows.
__device__ __forceinline__ void kv_input(const float* x, const u16* inputs, int d, int p,
                                         int last, int e, float* v) {
    if (p == last) {
        for (int q = 0; q < 8; q++) v[q] = f16_to_f32(f32_to_f16(x[e + q]));
    } else {
        unpack_half8(*(const uint4*)(inputs + (size_t)p * d + e), v, false);
    }
}
template <int T>
__device__ void kv_fill_warp(const u8* wk, const u8* wv, const float* bk, const float* bv,
                             const float* x, const u16* inputs, int d, const u32* idx, int n_sel,
                             int hd, const u32* valid, int last, float theta, int rope, u16* kc,
                             u16* vc, int width) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, half = hd / 2;
    int g = blockIdx.x * 8 + warp, per = n_sel * half;
    if (g >= 2 * per) return;
    int is_v = g >= per, rem = g % per, j = rem / half, i = rem % half;
    int h = idx ? (int)idx[j] : j, neox = rope == 1;
    int a = h * hd + (neox ? i : 2 * i), b = h * hd + (neox ? i + half : 2 * i + 1);
    const u8* w = is_v ? wv : wk;
    const float* bias = is_v ? bv : bk;
    u16* c = is_v ? vc : kc;
    size_t rb = row_bytes<T>(d);
    const u8 *row_a = w + (size_t)a * rb, *row_b = w + (size_t)b * rb;
    // Block row y takes the position chunks y, y + gridDim.y, ... (a head that missed many
    // positions, after a long gap, is spread over several warps, not left to one).
    for (int p0 = (int)valid[h] + blockIdx.y * KV_POS; p0 <= last; p0 += gridDim.y * KV_POS) {
        int np = min(KV_POS, last - p0 + 1);
        float sa[KV_POS], sb[KV_POS];
#pragma unroll
        for (int t = 0; t < KV_POS; t++) sa[t] = sb[t] = 0.f;
        for (int e = lane * 8; e < d; e += 256) {
            // Every load of the iteration first (the inputs' under predicates, no branches).
            float va[8], vb[8], xs[KV_POS][8];
            load8<T>(row_a, e, d, true, va);
            load8<T>(row_b, e, d, true, vb);
#pragma unroll
            for (int t = 0; t < KV_POS; t++) kv_input(x, inputs, d, p0 + min(t, np - 1), last, e, xs[t]);
#pragma unroll
            for (int t = 0; t < KV_POS; t++)
                for (int q = 0; q < 8; q++) {
                    sa[t] += va[q] * xs[t][q];
                    sb[t] += vb[q] * xs[t][q];
                }
        }
#pragma unroll
        for (int t = 0; t < KV_POS; t++) {
            sa[t] = warp_sum(sa[t]);
            sb[t] = warp_sum(sb[t]);
        }
        if (lane != 0) continue;
        for (int t = 0; t < np; t++) {
            int p = p0 + t;
            float x0 = sa[t] + (bias ? bias[a] : 0.f), x1 = sb[t] + (bias ? bias[b] : 0.f);
            if (!is_v && rope >= 0) {
                double ang = (double)p * pow((double)theta, -2.0 * (double)i / (double)hd);
                double sd, cd;
                sincos(ang, &sd, &cd);
                float cs = (float)cd, sn = (float)sd, r0 = x0 * cs - x1 * sn;
                x1 = x0 * sn + x1 * cs;
                x0 = r0;
            }
            c[(size_t)p * width + a] = f32_to_f16(x0);
            c[(size_t)p * width + b] = f32_to_f16(x1);
        }
    }
}
template <int T>
__device__ void kv_fill(const u8* wk, const u8* wv, const float* bk, const float* bv,
                        const float* x, u16* inputs, int d, const u32* idx, int n_sel, int hd,
                        u32* valid, const int* step, int n_ctx, float theta, int rope, u16* kc,
                        u16* vc, int width, u32* done) {
    __shared__ bool last_block;
    int last = step[1];
    if (last >= n_ctx) return;  // every block alike: nothing filled, nothing counted
    kv_fill_warp<T>(wk, wv, bk, bv, x, inputs, d, idx, n_sel, hd, valid, last, theta, rope, kc,
                    vc, width);
    if (blockIdx.x == 0 && blockIdx.y == 0)
        for (int e = threadIdx.x; e < d; e += blockDim.x)
            inputs[(size_t)last * d + e] = f32_to_f16(x[e]);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 blocks = gridDim.x * gridDim.y;
        last_block = atomicAdd(done, 1u) == blocks - 1;
    }
    __syncthreads();
    if (!last_block) return;
    for (int j = threadIdx.x; j < n_sel; j += blockDim.x) valid[idx ? idx[j] : j] = (u32)last + 1;
    if (threadIdx.x == 0) *done = 0;
}
#define KV_FILL(name, T)                                                                         \
    extern "C" __global__ void kv_fill_##name(                                                   \
        const u8* wk, const u8* wv, const float* bk, const float* bv, const float* x,            \
        u16* inputs, int d, const u32* idx, int n_sel, int hd, u32* valid, const int* step,      \
        int n_ctx, float theta, int rope, u16* kc, u16* vc, int width, u32* done) {              \
        kv_fill<T>(wk, wv, bk, bv, x, inputs, d, idx, n_sel, hd, valid, step, n_ctx, theta,      \
                   rope, kc, vc, width, done);                                                   \
    }
FOR_TYPES(KV_FILL)

// c[pos][0..width) = x in f16 (a layer's attention input, kept for lazy K/V).
extern "C" __global__ void store_row_f16(const float* x, u16* c, int width, int n_ctx,
                                         const int* step) {
    int i = blockIdx.x * blockDim.x + threadIdx.x, p = step[1];
    if (i < width && p < n_ctx) c[(size_t)p * width + i] = f32_to_f16(x[i]);
}
