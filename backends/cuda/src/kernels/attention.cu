// Attention, one block (256 threads) per selected query head j (head idx[j], or j) and batch
// row r = blockIdx.y, keys and values of positions p0..=pos (pos = step[0] + r, below n_ctx;
// p0 = 0, or pos + 1 - window when window > 0: sliding-window attention):
// 1. scores: thread p (and p + 256, ...) the dot of q with key p, 8 dims per 128-bit load, times
//    `scale`, then (softcap > 0) softcap * tanh(s / softcap);
// 2. softmax over the block;
// 3. out: thread t owns 8 dims (t % (hd/8)) of one position group (t / (hd/8)); groups take
//    positions in turn and meet in shared memory.
// q and out are compact (head j of row r at (r * gridDim.x + j) * hd); hd a multiple of 8, at
// most 256. Dynamic shared memory: hd + n_ctx floats.
// One head's attention (the block's) over a span of positions: query `q` (hd values) of query
// head h over the keys and values of positions p0..p1 - 1 (kc and vc start at position 0).
// With `mz` null, the softmax-weighted sum into `out` (hd values); else the sum of the values
// weighted by exp(score - m) into `out` and m, z (the span's largest score and its sum of
// exp(score - m)) into mz[0], mz[1], for `merge_spans` (an empty span: m = -3e38,
// z = 0, zeros). Dynamic shared memory: hd + p1 - p0 floats.
__device__ __forceinline__ void attend_span(const float* q, const u16* kc, const u16* vc, int h,
                                            int n_heads, int n_kv_heads, int hd, int p0, int p1,
                                            float scale, float softcap, float* out, float* mz) {
    extern __shared__ float sm[];
    __shared__ float red[32];
    __shared__ float part[2048];
    float* qs = sm;
    float* sc = sm + hd;
    int kvh = h / (n_heads / n_kv_heads), width = n_kv_heads * hd;
    // Scores of positions p0 + p for p < n, kept at sc[p].
    int n = max(p1 - p0, 0);
    kc += (size_t)p0 * width;
    vc += (size_t)p0 * width;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = q[d];
    __syncthreads();
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
        const u16* k = kc + (size_t)p * width + (size_t)kvh * hd;
        float s = 0.f;
        for (int d = 0; d < hd; d += 8) {
            float v[8];
            unpack_half8(*(const uint4*)(k + d), v, false);
            for (int i = 0; i < 8; i++) s += qs[d + i] * v[i];
        }
        s *= scale;
        sc[p] = softcap > 0.f ? softcap * tanhf(s / softcap) : s;
    }
    __syncthreads();
    float m = -3.0e38f;
    for (int p = threadIdx.x; p < n; p += blockDim.x) m = fmaxf(m, sc[p]);
    m = block_max(m, red);
    float z = 0.f;
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
        float e = expf(sc[p] - m);
        sc[p] = e;
        z += e;
    }
    z = block_sum(z, red);  // its barriers also order the sc writes before the reads below
    int chunks = hd / 8, groups = blockDim.x / chunks;
    int c = threadIdx.x % chunks, g = threadIdx.x / chunks;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (g < groups) {
        const u16* v0 = vc + (size_t)kvh * hd + c * 8;
        for (int p = g; p < n; p += groups) {
            float v[8], w = sc[p];
            unpack_half8(*(const uint4*)(v0 + (size_t)p * width), v, false);
            for (int i = 0; i < 8; i++) acc[i] += w * v[i];
        }
        for (int i = 0; i < 8; i++) part[g * hd + c * 8 + i] = acc[i];
    }
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float s = 0.f;
        for (int q2 = 0; q2 < groups; q2++) s += part[q2 * hd + d];
        out[d] = mz ? s : s / z;
    }
    if (mz && threadIdx.x == 0) {
        mz[0] = m;
        mz[1] = z;
    }
}
// One head's attention over positions p0..end - 1, p0 = 0, or end - window when window > 0.
__device__ __forceinline__ void attend_head(const float* q, const u16* kc, const u16* vc, int h,
                                            int n_heads, int n_kv_heads, int hd, int end,
                                            float scale, float softcap, int window, float* out) {
    int p0 = window > 0 ? max(end - window, 0) : 0;
    attend_span(q, kc, vc, h, n_heads, n_kv_heads, hd, p0, end, scale, softcap, out, nullptr);
}
extern "C" __global__ void attention_f16(const float* q, const u16* kc, const u16* vc,
                                         const u32* idx, int n_heads, int n_kv_heads, int hd,
                                         int n_ctx, float scale, float softcap, int window,
                                         const int* step, float* out) {
    int j = blockIdx.x, h = idx ? (int)idx[j] : j;
    if (h >= n_heads || hd % 8 != 0 || hd > 256) return;
    int end = min(step[0] + (int)blockIdx.y + 1, n_ctx);
    size_t at = ((size_t)blockIdx.y * gridDim.x + j) * hd;
    attend_head(q + at, kc, vc, h, n_heads, n_kv_heads, hd, end, scale, softcap, window,
                out + at);
}
// Row r = blockIdx.y's entry of `tab` and its j-th head (j = blockIdx.x): the entry, with `h`
// the head and `end` past the row's last position (its position + 1, within its context);
// null where the row has no j-th head.
__device__ __forceinline__ const u64* row_head(const u64* tab, int n_heads, int* h, int* end) {
    const u64* t = tab + (size_t)blockIdx.y * SEQ_TAB;
    int j = blockIdx.x;
    if (j >= (int)t[5]) return nullptr;
    const u32* idx = (const u32*)t[2];
    *h = idx ? (int)idx[j] : j;
    if (*h >= n_heads) return nullptr;
    *end = min((int)t[3] + 1, (int)t[4]);
    return t;
}
// A step of several sequences (`Device::attend_rows`): batch row r = blockIdx.y is its own
// sequence's, described by row r of `tab` (SEQ_TAB values, common.cuh: its key and value
// caches, its heads' index list or 0 for every head, its position, its context, its head
// count). Block j is row r's j-th head h; q and out hold every head of each row (head h of row
// r at (r * n_heads + h) * hd); positions 0..=pos below the row's context.
extern "C" __global__ void attention_rows_f16(const float* q, const u64* tab, int n_heads,
                                              int n_kv_heads, int hd, float scale,
                                              float softcap, int window, float* out) {
    int h, end;
    const u64* t = row_head(tab, n_heads, &h, &end);
    if (!t || hd % 8 != 0 || hd > 256) return;
    size_t at = ((size_t)blockIdx.y * n_heads + h) * hd;
    attend_head(q + at, (const u16*)t[0], (const u16*)t[1], h, n_heads, n_kv_heads, hd, end,
                scale, softcap, window, out + at);
}

// ---- Positions in spans (flash-decoding): more blocks where the heads and rows alone leave SMs
// idle, and a long context read by many. Block (j, r, c) runs span c (positions p0 + c span ..,
// p0 as in `attend_head`) of its head into `part` at (slot * gridDim.z + c) * (hd + 2), slot =
// r * gridDim.x + j: the span's weighted sum, then m and z (see `attend_span`); a merge then
// adds the spans of each slot. Dynamic shared memory: hd + span floats.

// The spans of one slot merged in order of span (deterministic): out = sum_c e_c acc_c /
// sum_c e_c z_c, e_c = exp(m_c - max m) (an empty span's e_c is 0).
__device__ __forceinline__ void merge_spans(const float* p, int spans, int hd, float* out) {
    float mx = -3.0e38f;
    for (int c = 0; c < spans; c++) mx = fmaxf(mx, p[c * (hd + 2) + hd]);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float num = 0.f, den = 0.f;
        for (int c = 0; c < spans; c++) {
            const float* pc = p + c * (hd + 2);
            float e = expf(pc[hd] - mx);
            num += e * pc[d];
            den += e * pc[hd + 1];
        }
        out[d] = num / den;
    }
}
__device__ __forceinline__ float* span_part(float* part, int hd) {
    size_t slot = (size_t)blockIdx.y * gridDim.x + blockIdx.x;
    return part + (slot * gridDim.z + blockIdx.z) * (hd + 2);
}
// `attention_f16` in spans of `span` positions.
extern "C" __global__ void attention_split_f16(const float* q, const u16* kc, const u16* vc,
                                               const u32* idx, int n_heads, int n_kv_heads,
                                               int hd, int n_ctx, float scale, float softcap,
                                               int window, const int* step, int span,
                                               float* part) {
    int j = blockIdx.x, h = idx ? (int)idx[j] : j;
    if (h >= n_heads || hd % 8 != 0 || hd > 256) return;
    int end = min(step[0] + (int)blockIdx.y + 1, n_ctx);
    int p0 = (window > 0 ? max(end - window, 0) : 0) + (int)blockIdx.z * span;
    size_t at = ((size_t)blockIdx.y * gridDim.x + j) * hd;
    float* o = span_part(part, hd);
    attend_span(q + at, kc, vc, h, n_heads, n_kv_heads, hd, p0, min(p0 + span, end), scale,
                softcap, o, o + hd);
}
// The spans of `attention_split_f16` merged: block (j, r) the slot's.
extern "C" __global__ void attention_merge(const u32* idx, int n_heads, int hd, int spans,
                                           const float* part, float* out) {
    int j = blockIdx.x, h = idx ? (int)idx[j] : j;
    if (h >= n_heads) return;
    size_t slot = (size_t)blockIdx.y * gridDim.x + j;
    merge_spans(part + slot * spans * (hd + 2), spans, hd, out + slot * hd);
}
// `attention_rows_f16` in spans of `span` positions (the slot of row r's j-th head).
extern "C" __global__ void attention_rows_split_f16(const float* q, const u64* tab, int n_heads,
                                                    int n_kv_heads, int hd, float scale,
                                                    float softcap, int window, int span,
                                                    float* part) {
    int h, end;
    const u64* t = row_head(tab, n_heads, &h, &end);
    if (!t || hd % 8 != 0 || hd > 256) return;
    int p0 = (window > 0 ? max(end - window, 0) : 0) + (int)blockIdx.z * span;
    size_t at = ((size_t)blockIdx.y * n_heads + h) * hd;
    float* o = span_part(part, hd);
    attend_span(q + at, (const u16*)t[0], (const u16*)t[1], h, n_heads, n_kv_heads, hd, p0,
                min(p0 + span, end), scale, softcap, o, o + hd);
}
// The spans of `attention_rows_split_f16` merged: block (j, r) row r's j-th head's.
extern "C" __global__ void attention_rows_merge(const u64* tab, int n_heads, int hd, int spans,
                                                const float* part, float* out) {
    int h, end;
    if (!row_head(tab, n_heads, &h, &end)) return;
    size_t slot = (size_t)blockIdx.y * gridDim.x + blockIdx.x;
    float* o = out + ((size_t)blockIdx.y * n_heads + h) * hd;
    merge_spans(part + slot * spans * (hd + 2), spans, hd, o);
}
