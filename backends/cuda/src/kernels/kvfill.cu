// Lazy K/V (dejavu_backend_api::Device::kv_fill): the keys and values a selected head missed,
// recomputed from the layer's kept attention inputs (f16 rows [n_ctx][d]).
//
// One warp per (K or V, selected head j, row pair i): the rows a and b of head h = idx[j] that
// RoPE rotates together ((2i, 2i+1) interleaved, (i, i + hd/2) neox; the same pairs without
// RoPE). For the missing positions p = valid[h] ..= last (the batch's last position,
// step[0] + rows - 1), KV_POS at a time (past the last, the
// last one again, unused; the chunks shared among gridDim.y warps), each lane dots 8 columns of
// both rows with those inputs (the rows read once per KV_POS positions), a warp sum,
// then lane 0 adds the biases, rotates keys at position p (angles in f64, as rope.cu) and
// stores f16 into the caches (`width` values a position; a head index past them, or a
// position past n_ctx, writes nothing). rope: -1 none, 0 interleaved, 1
// neox. d a multiple of 8.
#ifndef KV_POS
#define KV_POS 2
#endif
template <int T>
__device__ void kv_fill(const u8* wk, const u8* wv, const float* bk, const float* bv,
                        const u16* inputs, int d, const u32* idx, int n_sel, int hd,
                        const u32* valid, const int* step, int rows, int n_ctx, float theta,
                        const float* factors, int rope, u16* kc, u16* vc, int width) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, half = hd / 2;
    int g = blockIdx.x * 8 + warp, per = n_sel * half;
    if (g >= 2 * per) return;
    int is_v = g >= per, rem = g % per, j = rem / half, i = rem % half;
    int h = idx ? (int)idx[j] : j, neox = rope == 1;
    if (h * hd >= width) return;  // an index past the heads: nothing read or written
    int a = h * hd + (neox ? i : 2 * i), b = h * hd + (neox ? i + half : 2 * i + 1);
    const u8* w = is_v ? wv : wk;
    const float* bias = is_v ? bv : bk;
    u16* c = is_v ? vc : kc;
    size_t rb = row_bytes<T>(d);
    const u8 *row_a = w + (size_t)a * rb, *row_b = w + (size_t)b * rb;
    int last = step[0] + rows - 1;
    if (last >= n_ctx) return;  // a position past the caches: nothing written
    // Block row y takes the position chunks y, y + gridDim.y, ... (a head that missed many
    // positions, after a long gap, is spread over several warps, not left to one).
    for (int p0 = (int)valid[h] + blockIdx.y * KV_POS; p0 <= last; p0 += gridDim.y * KV_POS) {
        int np = min(KV_POS, last - p0 + 1);
        float sa[KV_POS], sb[KV_POS];
#pragma unroll
        for (int t = 0; t < KV_POS; t++) sa[t] = sb[t] = 0.f;
        for (int e = lane * 8; e < d; e += 256) {
            // Every load of the iteration first (the inputs' under predicates, no branches).
            float va[8], vb[8], x[KV_POS][8];
            load8<T>(row_a, e, d, true, va);
            load8<T>(row_b, e, d, true, vb);
#pragma unroll
            for (int t = 0; t < KV_POS; t++) {
                const u16* in = inputs + (size_t)(p0 + min(t, np - 1)) * d + e;
                unpack_half8(*(const uint4*)in, x[t], false);
            }
#pragma unroll
            for (int t = 0; t < KV_POS; t++)
                for (int q = 0; q < 8; q++) {
                    sa[t] += va[q] * x[t][q];
                    sb[t] += vb[q] * x[t][q];
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
                if (factors) ang /= (double)factors[i];
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
#define KV_FILL(name, T)                                                                         \
    extern "C" __global__ void kv_fill_##name(                                                   \
        const u8* wk, const u8* wv, const float* bk, const float* bv, const u16* inputs, int d,  \
        const u32* idx, int n_sel, int hd, const u32* valid, const int* step, int rows,          \
        int n_ctx, float theta, const float* factors, int rope, u16* kc, u16* vc, int width) {   \
        kv_fill<T>(wk, wv, bk, bv, inputs, d, idx, n_sel, hd, valid, step, rows, n_ctx, theta,    \
                   factors, rope, kc, vc, width);                                                \
    }
FOR_TYPES(KV_FILL)

// valid[h] = last + 1 (= step[0] + rows) for the selected heads (after kv_fill: a launch of its own, so that no
// warp of kv_fill still reads the old value).
extern "C" __global__ void kv_mark(const u32* idx, int n_sel, int n_heads, u32* valid,
                                   const int* step, int rows) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    int h = j < n_sel ? (idx ? (int)idx[j] : j) : n_heads;
    if (h < n_heads) valid[h] = (u32)(step[0] + rows);
}

// c[pos][0..width) = x[r] in f16 for batch row r = blockIdx.y at pos = step[0] + r (a layer's
// attention inputs, kept for lazy K/V).
extern "C" __global__ void store_row_f16(const float* x, u16* c, int width, int n_ctx,
                                         const int* step) {
    int i = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y, p = step[0] + r;
    if (i < width && p < n_ctx) c[(size_t)p * width + i] = f32_to_f16(x[(size_t)r * width + i]);
}
