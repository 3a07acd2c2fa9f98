// The indices of the k largest of s[0..n) into out[0..k), any order, by one block over
// order-preserving u32 keys of the scores held in shared memory (see `top_k` below for the two
// ways it finds the k-th largest). Output counters take one atomic per warp.
__device__ __forceinline__ u32 key_of(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
// Every lane calls this (whole warps); lanes with `on` reserve one slot each of `*counter`;
// returns the lane's slot.
__device__ __forceinline__ u32 warp_reserve(u32* counter, bool on) {
    u32 lane = threadIdx.x % 32, b = __ballot_sync(0xffffffffu, on);
    u32 base = 0;
    if (lane == 0 && b) base = atomicAdd(counter, (u32)__popc(b));
    base = __shfl_sync(0xffffffffu, base, 0);
    return base + __popc(b & ((1u << lane) - 1));
}
// Dynamic shared memory: n keys (4 n bytes).
//
// Fast path: 4096 buckets spanning the scores' range linearly; the bucket holding the k-th
// largest is found by a suffix sum, the keys above it written out, and the (few) keys in it
// ranked against each other by counting. If that bucket holds more than TK_CAND keys (scores
// piled on a few values), a radix select over all keys (3 passes of 11, 11 and 10 bits) does
// it instead.
#define TK_BUCKETS 4096
#define TK_CAND 2048
__device__ void top_k_radix(const u32* keys, int n, int k, u32* out, u32* hist) {
    __shared__ u32 prefix, want, n_above, n_tied;
    if (threadIdx.x == 0) { prefix = 0; want = (u32)k; n_above = 0; n_tied = 0; }
    __syncthreads();
    int done = 0;  // high bits of the key already fixed in `prefix`
    for (int pass = 0; pass < 3; pass++) {
        int bits = pass < 2 ? 11 : 10, nb = 1 << bits, shift = 32 - done - bits;
        u32 mask = done == 0 ? 0u : (0xffffffffu << (32 - done));
        for (int i = threadIdx.x; i < nb; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int base = 0; base < n; base += blockDim.x) {
            int i = base + threadIdx.x;
            u32 key = i < n ? keys[i] : 0;
            bool on = i < n && (key & mask) == prefix;
            // Keys here pile on few bins: lanes of one bin add once.
            u32 bin = on ? (key >> shift) & (nb - 1) : 0xffffffffu;  // not counted
            u32 same = __match_any_sync(0xffffffffu, bin);
            if (on && (threadIdx.x % 32) == (u32)(__ffs(same) - 1)) atomicAdd(&hist[bin], (u32)__popc(same));
        }
        __syncthreads();
        // The bin holding the k-th largest: warp 0, nb/32 bins a lane, a suffix sum over lanes.
        if (threadIdx.x < 32) {
            int lane = threadIdx.x, per = nb / 32, b0 = lane * per;
            u32 sum = 0;
            for (int i = 0; i < per; i++) sum += hist[b0 + i];
            u32 suf = sum;
            for (int o = 1; o < 32; o <<= 1) {
                u32 t = __shfl_down_sync(0xffffffffu, suf, o);
                if (lane + o < 32) suf += t;
            }
            u32 acc = suf - sum, w = want;  // acc: candidates in the bins above this lane's
            if (acc < w && w <= suf) {
                int b = b0;
                for (int i = per - 1; i >= 0; i--) {
                    if (acc + hist[b0 + i] >= w) { b = b0 + i; break; }
                    acc += hist[b0 + i];
                }
                want = w - acc;
                prefix |= (u32)b << shift;
            }
        }
        done += bits;
        __syncthreads();
    }
    // prefix: the k-th largest key; want: how many keys equal to it belong to the top k.
    u32 above = (u32)k - want;
    for (int base = 0; base < n; base += blockDim.x) {
        int i = base + threadIdx.x;
        u32 key = i < n ? keys[i] : 0;
        bool hi = i < n && key > prefix, tie = i < n && key == prefix;
        u32 a = warp_reserve(&n_above, hi);
        u32 t = warp_reserve(&n_tied, tie);
        if (hi) out[a] = (u32)i;
        if (tie && t < want) out[above + t] = (u32)i;
    }
}

// The score of a key (key_of's inverse).
__device__ __forceinline__ float val_of(u32 key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}
__device__ __forceinline__ u32 tk_bucket(float v, float lo, float scale) {
    float b = (v - lo) * scale;
    return b == b ? (u32)fminf(fmaxf(b, 0.f), (float)(TK_BUCKETS - 1)) : TK_BUCKETS - 1;
}

extern "C" __global__ void top_k(const float* s, int n, int k, u32* out) {
    extern __shared__ u32 keys[];
    __shared__ u32 hist[TK_BUCKETS];
    __shared__ u32 cand[TK_CAND];
    __shared__ float red_lo[32], red_hi[32];
    __shared__ float lo, scale;
    __shared__ u32 bucket, above, n_out, n_cand;
    float mn = 3.0e38f, mx = -3.0e38f;
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = s[i];
        keys[i] = key_of(v);
        mn = fminf(mn, v);  // fminf/fmaxf skip NaN; NaN keys sort above every number
        mx = fmaxf(mx, v);
    }
    if (n <= (int)blockDim.x) {
        // Few scores (heads): each thread ranks its own by counting the larger ones (ties by
        // index), one pass.
        __syncthreads();
        int i = threadIdx.x;
        if (i < n) {
            u32 key = keys[i], rank = 0;
            for (int j = 0; j < n; j++) rank += keys[j] > key || (keys[j] == key && j < i);
            if (rank < (u32)k) out[rank] = (u32)i;
        }
        return;
    }
    for (int o = 16; o > 0; o >>= 1) {
        mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, o));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    }
    int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    if (lane == 0) { red_lo[w] = mn; red_hi[w] = mx; }
    for (int i = threadIdx.x; i < TK_BUCKETS; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    if (threadIdx.x == 0) {
        float a = 3.0e38f, b = -3.0e38f;
        for (int i = 0; i < (int)blockDim.x / 32; i++) { a = fminf(a, red_lo[i]); b = fmaxf(b, red_hi[i]); }
        lo = a;
        scale = b > a ? (float)TK_BUCKETS / (b - a) : 0.f;
        n_out = 0; n_cand = 0;
    }
    __syncthreads();
    // Bucket of score i: linear in the score between its minimum and maximum (non-decreasing
    // in the score, so every bucket's scores exceed the lower buckets'); NaN in the top one.
#define TK_BUCKET(i) tk_bucket(val_of(keys[i]), lo, scale)
    for (int i = threadIdx.x; i < n; i += blockDim.x) atomicAdd(&hist[TK_BUCKET(i)], 1u);
    __syncthreads();
    if (threadIdx.x < 32) {
        const int per = TK_BUCKETS / 32;
        int b0 = lane * per;
        u32 sum = 0;
        for (int i = 0; i < per; i++) sum += hist[b0 + i];
        u32 suf = sum;
        for (int o = 1; o < 32; o <<= 1) {
            u32 t = __shfl_down_sync(0xffffffffu, suf, o);
            if (lane + o < 32) suf += t;
        }
        u32 acc = suf - sum;
        if (acc < (u32)k && (u32)k <= suf) {
            int b = b0;
            for (int i = per - 1; i >= 0; i--) {
                if (acc + hist[b0 + i] >= (u32)k) { b = b0 + i; break; }
                acc += hist[b0 + i];
            }
            bucket = b;
            above = acc;
        }
    }
    __syncthreads();
    if (hist[bucket] > TK_CAND) {
        top_k_radix(keys, n, k, out, hist);
        return;
    }
    for (int base = 0; base < n; base += blockDim.x) {
        int i = base + threadIdx.x;
        u32 b = i < n ? TK_BUCKET(i) : 0;
        bool up = i < n && b > bucket, in = i < n && b == bucket;
        u32 a = warp_reserve(&n_out, up);
        u32 c = warp_reserve(&n_cand, in);
        if (up) out[a] = (u32)i;
        if (in) cand[c] = (u32)i;
    }
    __syncthreads();
    // The bucket's keys: the top (k - above) of them by key, ties by index.
    u32 nc = n_cand, want = (u32)k - above;
    for (u32 t = threadIdx.x; t < nc; t += blockDim.x) {
        u32 i = cand[t], key = keys[i], rank = 0;
        for (u32 q = 0; q < nc; q++) {
            u32 jq = cand[q], kq = keys[jq];
            rank += kq > key || (kq == key && jq < i);
        }
        if (rank < want) out[above + rank] = i;
    }
#undef TK_BUCKET
}
