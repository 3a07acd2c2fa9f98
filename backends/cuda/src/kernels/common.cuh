// Shared by every kernel: element types, 8-element dequantization of each weight type (the
// ggml block layouts of dejavu_backend_api::quant), and reductions. Compiled by NVRTC with no
// CUDA headers: f16 conversions are PTX.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
// Values per row of a step of several sequences' table (see attention_rows_f16).
#define SEQ_TAB 6

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ u16 ld16(const u8* p) { return (u16)p[0] | ((u16)p[1] << 8); }
__device__ __forceinline__ float ldh(const u8* p) { return f16_to_f32(ld16(p)); }

// Weight types (the kernels of each are named by the host's `type_suffix`).
enum { T_F32 = 0, T_F16 = 1, T_BF16 = 2, T_Q8_0 = 3, T_Q4_0 = 4, T_Q4_1 = 5, T_Q5_0 = 6,
       T_Q4K = 7, T_Q6K = 8, T_Q5_1 = 9, T_Q2K = 10, T_Q3K = 11, T_Q5K = 12, T_IQ4NL = 13,
       T_IQ4XS = 14 };

// Elements per block and bytes per block of each type.
template <int T> struct Blk;
template <> struct Blk<T_F32> { enum { LEN = 1, BYTES = 4 }; };
template <> struct Blk<T_F16> { enum { LEN = 1, BYTES = 2 }; };
template <> struct Blk<T_BF16> { enum { LEN = 1, BYTES = 2 }; };
template <> struct Blk<T_Q8_0> { enum { LEN = 32, BYTES = 34 }; };
template <> struct Blk<T_Q4_0> { enum { LEN = 32, BYTES = 18 }; };
template <> struct Blk<T_Q4_1> { enum { LEN = 32, BYTES = 20 }; };
template <> struct Blk<T_Q5_0> { enum { LEN = 32, BYTES = 22 }; };
template <> struct Blk<T_Q4K> { enum { LEN = 256, BYTES = 144 }; };
template <> struct Blk<T_Q6K> { enum { LEN = 256, BYTES = 210 }; };
template <> struct Blk<T_Q5_1> { enum { LEN = 32, BYTES = 24 }; };
template <> struct Blk<T_Q2K> { enum { LEN = 256, BYTES = 84 }; };
template <> struct Blk<T_Q3K> { enum { LEN = 256, BYTES = 110 }; };
template <> struct Blk<T_Q5K> { enum { LEN = 256, BYTES = 176 }; };
template <> struct Blk<T_IQ4NL> { enum { LEN = 32, BYTES = 18 }; };
template <> struct Blk<T_IQ4XS> { enum { LEN = 256, BYTES = 136 }; };

// The 16 levels of IQ4_NL and IQ4_XS (dejavu_backend_api::quant::KVALUES_IQ4NL).
__constant__ signed char KV_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                          1,    13,   25,  38,  53,  69,  89,  113};


// v[0..8] = elements e..e+8 of a row (e a multiple of 8; for the float types, `vec`: the row is
// 16-byte aligned and e + 8 <= cols, else element loads with bounds).
template <int T>
__device__ __forceinline__ void load8(const u8* row, int e, int cols, bool vec, float* v);

template <>
__device__ __forceinline__ void load8<T_F32>(const u8* row, int e, int cols, bool vec, float* v) {
    const float* r = (const float*)row;
    if (vec) {
        float4 a = *(const float4*)(r + e), b = *(const float4*)(r + e + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
        for (int i = 0; i < 8; i++) v[i] = e + i < cols ? r[e + i] : 0.f;
    }
}
__device__ __forceinline__ void unpack_half8(uint4 u, float* v, bool bf) {
    u32 w[4] = {u.x, u.y, u.z, u.w};
    for (int i = 0; i < 4; i++) {
        u16 lo = (u16)(w[i] & 0xffff), hi = (u16)(w[i] >> 16);
        v[2 * i] = bf ? bf16_to_f32(lo) : f16_to_f32(lo);
        v[2 * i + 1] = bf ? bf16_to_f32(hi) : f16_to_f32(hi);
    }
}
template <>
__device__ __forceinline__ void load8<T_F16>(const u8* row, int e, int cols, bool vec, float* v) {
    const u16* r = (const u16*)row;
    if (vec) unpack_half8(*(const uint4*)(r + e), v, false);
    else for (int i = 0; i < 8; i++) v[i] = e + i < cols ? f16_to_f32(r[e + i]) : 0.f;
}
template <>
__device__ __forceinline__ void load8<T_BF16>(const u8* row, int e, int cols, bool vec, float* v) {
    const u16* r = (const u16*)row;
    if (vec) unpack_half8(*(const uint4*)(r + e), v, true);
    else for (int i = 0; i < 8; i++) v[i] = e + i < cols ? bf16_to_f32(r[e + i]) : 0.f;
}
template <>
__device__ __forceinline__ void load8<T_Q8_0>(const u8* row, int e, int, bool, float* v) {
    const u8* b = row + (e / 32) * 34;
    float d = ldh(b);
    const signed char* q = (const signed char*)(b + 2 + e % 32);
    for (int i = 0; i < 8; i++) v[i] = d * (float)q[i];
}
template <>
__device__ __forceinline__ void load8<T_Q4_0>(const u8* row, int e, int, bool, float* v) {
    const u8* b = row + (e / 32) * 18;
    float d = ldh(b);
    int j = e % 32, sh = j < 16 ? 0 : 4;
    const u8* q = b + 2 + (j & 15);
    for (int i = 0; i < 8; i++) v[i] = d * (float)(((q[i] >> sh) & 0xF) - 8);
}
template <>
__device__ __forceinline__ void load8<T_Q4_1>(const u8* row, int e, int, bool, float* v) {
    const u8* b = row + (e / 32) * 20;
    float d = ldh(b), m = ldh(b + 2);
    int j = e % 32, sh = j < 16 ? 0 : 4;
    const u8* q = b + 4 + (j & 15);
    for (int i = 0; i < 8; i++) v[i] = d * (float)((q[i] >> sh) & 0xF) + m;
}
template <>
__device__ __forceinline__ void load8<T_Q5_0>(const u8* row, int e, int, bool, float* v) {
    const u8* b = row + (e / 32) * 22;
    float d = ldh(b);
    u32 qh = (u32)b[2] | ((u32)b[3] << 8) | ((u32)b[4] << 16) | ((u32)b[5] << 24);
    int j = e % 32, sh = j < 16 ? 0 : 4;
    const u8* q = b + 6 + (j & 15);
    for (int i = 0; i < 8; i++) {
        int h = (qh >> (j + i)) & 1;  // element j+i's fifth bit is bit j+i of qh
        v[i] = d * (float)((((q[i] >> sh) & 0xF) | (h << 4)) - 16);
    }
}
__device__ __forceinline__ void q4k_scale_min(int j, const u8* s, int* sc, int* m) {
    if (j < 4) { *sc = s[j] & 63; *m = s[j + 4] & 63; }
    else { *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4); *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}
template <>
__device__ __forceinline__ void load8<T_Q4K>(const u8* row, int e, int, bool, float* v) {
    const u8* b = row + (e / 256) * 144;
    int k = e % 256, sub = k / 32, l = k % 32;
    int sc, m;
    q4k_scale_min(sub, b + 4, &sc, &m);
    float d = ldh(b) * (float)sc, o = ldh(b + 2) * (float)m;
    const u8* q = b + 16 + 32 * (sub / 2) + l;
    int sh = (sub & 1) * 4;
    for (int i = 0; i < 8; i++) v[i] = d * (float)((q[i] >> sh) & 0xF) - o;
}
template <>
__device__ __forceinline__ void load8<T_Q6K>(const u8* row, int e, int, bool, float* v) {
    const u8* b = row + (e / 256) * 210;
    int k = e % 256, n = k / 128, qt = (k % 128) / 32, l = k % 32;
    const u8* ql = b + 64 * n + (qt & 1) * 32 + l;
    const u8* qh = b + 128 + 32 * n + l;
    const signed char* sc = (const signed char*)(b + 192 + 8 * n + 2 * qt + l / 16);
    float d = ldh(b + 208) * (float)sc[0];
    int sl = (qt >> 1) * 4, sh = 2 * qt;
    for (int i = 0; i < 8; i++) {
        int q = (((ql[i] >> sl) & 0xF) | (((qh[i] >> sh) & 3) << 4)) - 32;
        v[i] = d * (float)q;
    }
}

template <>
__device__ __forceinline__ void load8<T_Q5_1>(const u8* row, int e, int, bool, float* v) {
    const u8* b = row + (e / 32) * 24;
    float d = ldh(b), m = ldh(b + 2);
    u32 qh = (u32)b[4] | ((u32)b[5] << 8) | ((u32)b[6] << 16) | ((u32)b[7] << 24);
    int j = e % 32, sh = j < 16 ? 0 : 4;
    const u8* q = b + 8 + (j & 15);
    for (int i = 0; i < 8; i++) {
        int h = (qh >> (j + i)) & 1;
        v[i] = d * (float)(((q[i] >> sh) & 0xF) | (h << 4)) + m;
    }
}
// Q2_K and Q3_K: element l of 32-element group g = 4n + s is bits 2s..2s+2 of qs[32n + l], in
// sub-block 2g + l / 16 (dejavu_backend_api::quant::BlockQ2K, BlockQ3K).
template <>
__device__ __forceinline__ void load8<T_Q2K>(const u8* row, int e, int, bool, float* v) {
    const u8* b = row + (e / 256) * 84;
    int k = e % 256, g = k / 32, l = k % 32;
    int sc = b[2 * g + l / 16];
    float d = ldh(b + 80) * (float)(sc & 0xF), o = ldh(b + 82) * (float)(sc >> 4);
    const u8* q = b + 16 + 32 * (g / 4) + l;
    int sh = 2 * (g % 4);
    for (int i = 0; i < 8; i++) v[i] = d * (float)((q[i] >> sh) & 3) - o;
}
template <>
__device__ __forceinline__ void load8<T_Q3K>(const u8* row, int e, int, bool, float* v) {
    const u8* b = row + (e / 256) * 110;
    int k = e % 256, g = k / 32, l = k % 32, j = 2 * g + l / 16;
    const u8* s = b + 96;
    int low = j < 8 ? (s[j] & 0xF) : (s[j - 8] >> 4);
    int high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    float d = ldh(b + 108) * (float)((low | (high << 4)) - 32);
    const u8* q = b + 32 + 32 * (g / 4) + l;
    const u8* hm = b + l;
    int sh = 2 * (g % 4);
    for (int i = 0; i < 8; i++)
        v[i] = d * (float)(((q[i] >> sh) & 3) - (((hm[i] >> g) & 1) ? 0 : 4));
}
template <>
__device__ __forceinline__ void load8<T_Q5K>(const u8* row, int e, int, bool, float* v) {
    const u8* b = row + (e / 256) * 176;
    int k = e % 256, sub = k / 32, l = k % 32;
    int sc, m;
    q4k_scale_min(sub, b + 4, &sc, &m);
    float d = ldh(b) * (float)sc, o = ldh(b + 2) * (float)m;
    const u8* qh = b + 16 + l;
    const u8* q = b + 48 + 32 * (sub / 2) + l;
    int sh = (sub & 1) * 4;
    for (int i = 0; i < 8; i++)
        v[i] = d * (float)(((q[i] >> sh) & 0xF) | (((qh[i] >> sub) & 1) << 4)) - o;
}
template <>
__device__ __forceinline__ void load8<T_IQ4NL>(const u8* row, int e, int, bool, float* v) {
    const u8* b = row + (e / 32) * 18;
    float d = ldh(b);
    int j = e % 32, sh = j < 16 ? 0 : 4;
    const u8* q = b + 2 + (j & 15);
    for (int i = 0; i < 8; i++) v[i] = d * (float)KV_IQ4NL[(q[i] >> sh) & 0xF];
}
template <>
__device__ __forceinline__ void load8<T_IQ4XS>(const u8* row, int e, int, bool, float* v) {
    const u8* b = row + (e / 256) * 136;
    int k = e % 256, sub = k / 32, j = k % 32, sh = j < 16 ? 0 : 4;
    int ls = ((b[4 + sub / 2] >> (4 * (sub % 2))) & 0xF) | (((ld16(b + 2) >> (2 * sub)) & 3) << 4);
    float d = ldh(b) * (float)(ls - 32);
    const u8* q = b + 8 + 16 * sub + (j & 15);
    for (int i = 0; i < 8; i++) v[i] = d * (float)KV_IQ4NL[(q[i] >> sh) & 0xF];
}

template <int T>
__device__ __forceinline__ size_t row_bytes(int cols) {
    return (size_t)(cols / Blk<T>::LEN) * Blk<T>::BYTES;
}

__device__ __forceinline__ float warp_sum(float s) {
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
    return s;
}
__device__ __forceinline__ float warp_max(float s) {
    for (int o = 16; o > 0; o >>= 1) s = fmaxf(s, __shfl_xor_sync(0xffffffff, s, o));
    return s;
}
// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ float block_sum(float s, float* red) {
    int lane = threadIdx.x % 32, w = threadIdx.x / 32, nw = blockDim.x / 32;
    s = warp_sum(s);
    __syncthreads();
    if (lane == 0) red[w] = s;
    __syncthreads();
    s = lane < nw ? red[lane] : 0.f;
    return warp_sum(s);
}
__device__ float block_max(float s, float* red) {
    int lane = threadIdx.x % 32, w = threadIdx.x / 32, nw = blockDim.x / 32;
    s = warp_max(s);
    __syncthreads();
    if (lane == 0) red[w] = s;
    __syncthreads();
    s = lane < nw ? red[lane] : -3.0e38f;
    return warp_max(s);
}

// Row of output j of a selection (see dejavu_backend_api::Rows): idx null is every row.
__device__ __forceinline__ int sel_row(const u32* idx, int j, int group) {
    return idx ? (int)idx[j / group] * group + j % group : j;
}

// act: 0 = SiLU, 1 = ReLU, 2 = GELU's tanh approximation (dejavu_backend_api::Activation).
__device__ __forceinline__ float act_apply(int act, float x) {
    if (act == 2) return 0.5f * x * (1.f + tanhf(0.7978846f * (x + 0.044715f * x * x * x)));
    return act == 0 ? x / (1.f + expf(-x)) : fmaxf(x, 0.f);
}

#define FOR_TYPES(X) X(f32, T_F32) X(f16, T_F16) X(bf16, T_BF16) X(q8_0, T_Q8_0) X(q4_0, T_Q4_0) \
    X(q4_1, T_Q4_1) X(q5_0, T_Q5_0) X(q4_k, T_Q4K) X(q6_k, T_Q6K) X(q5_1, T_Q5_1) X(q2_k, T_Q2K) \
    X(q3_k, T_Q3K) X(q5_k, T_Q5K) X(iq4_nl, T_IQ4NL) X(iq4_xs, T_IQ4XS)
