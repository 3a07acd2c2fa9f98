// The indices of the k largest of s[0..n) into out[0..k), any order, over order-preserving u32
// keys of the scores; up to 3 such jobs per launch (a layer's predictors), blockIdx.y the job.
// Output counters take one atomic per warp.
//
// A job of more than 1024 scores runs over the whole GPU, in two kernels (`top_k_hist`, then
// `top_k_select`), 1024 scores a block: a histogram of the keys' top 12 bits, summed in global
// memory; every block finds the bin holding the k-th largest and writes out its scores above
// it, and its scores in it as candidates; the last block to finish picks the top of the
// candidates with the one-block `top_k_block` (or, past TK_GCAND candidates, runs it over every
// score), then clears the histogram and counters for the next launch. A job of at most 1024
// scores is one block's `top_k_block`.
struct TkJob {
    const float* s;
    u32* out;
    int n, k;
};
struct TkJobs {
    TkJob job[3];
    int n, pad;
};
// A NaN ranks as -inf (ties by any rule), as in the host's top-k and its reference.
__device__ __forceinline__ u32 key_of(float f) {
    u32 u = f == f ? __float_as_uint(f) : 0xff800000u;
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
// The bin of hist[0..nb) holding the want-th largest key counting from the top bin (1 <= want
// <= the total), into *bin, and the count in the bins above it into *above. Every thread of the
// block calls it; thread t owns nb / blockDim consecutive bins, and a suffix sum over the
// threads (in each warp, then over the warps' totals in `red`) finds the one thread whose bins
// hold it. Ends with a barrier.
__device__ void find_bin(const u32* hist, int nb, u32 want, u32* bin, u32* above, u32* red) {
    int per = (nb + blockDim.x - 1) / blockDim.x, b0 = threadIdx.x * per;
    int lane = threadIdx.x % 32, w = threadIdx.x / 32, nw = blockDim.x / 32;
    u32 sum = 0;
    for (int i = 0; i < per; i++)
        if (b0 + i < nb) sum += hist[b0 + i];
    u32 suf = sum;
    for (int o = 1; o < 32; o <<= 1) {
        u32 t = __shfl_down_sync(0xffffffffu, suf, o);
        if (lane + o < 32) suf += t;
    }
    if (lane == 0) red[w] = suf;
    __syncthreads();
    for (int q = w + 1; q < nw; q++) suf += red[q];
    u32 acc = suf - sum;  // keys in the bins above this thread's
    if (acc < want && want <= suf) {
        for (int i = per - 1; i >= 0; i--) {
            if (b0 + i >= nb) continue;
            u32 h = hist[b0 + i];
            if (acc + h >= want) {
                *bin = b0 + i;
                *above = acc;
                break;
            }
            acc += h;
        }
    }
    __syncthreads();
}

// Dynamic shared memory: n keys (4 n bytes).
//
// Fast path: 4096 buckets spanning the scores' range linearly; the bucket holding the k-th
// largest is found by a suffix sum (`find_bin`), the keys above it written out, and the (few) keys in it
// ranked against each other by counting. If that bucket holds more than TK_CAND keys (scores
// piled on a few values), a radix select over all keys (3 passes of 11, 11 and 10 bits) does
// it instead.
#define TK_BUCKETS 4096
#define TK_CAND 2048
#define TK_COUNT 128
// Element i's index: list[i] (a candidate list in global memory, written by other blocks), or i.
#define TK_ID(i) (list ? __ldcg(list + (i)) : (u32)(i))
__device__ void top_k_radix(const u32* keys, const u32* list, int n, int k, u32* out, u32* hist,
                            u32* red) {
    __shared__ u32 prefix, want, n_above, n_tied, pass_bin, pass_above;
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
        find_bin(hist, nb, want, &pass_bin, &pass_above, red);
        if (threadIdx.x == 0) {
            want -= pass_above;
            prefix |= pass_bin << shift;
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
        if (hi) out[a] = TK_ID(i);
        if (tie && t < want) out[above + t] = TK_ID(i);
    }
}

// The score of a key (key_of's inverse).
__device__ __forceinline__ float val_of(u32 key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}
// Non-decreasing in v: -inf (and a NaN's key) in the bottom bucket; where the span is not finite
// (scale 0 or an infinite minimum), the scores the product leaves NaN in the top one.
__device__ __forceinline__ u32 tk_bucket(float v, float lo, float scale) {
    float b = (v - lo) * scale;
    if (__float_as_uint(v) == 0xff800000u) return 0;  // -inf
    return b == b ? (u32)fminf(fmaxf(b, 0.f), (float)(TK_BUCKETS - 1)) : TK_BUCKETS - 1;
}

// One block: element i of the job is s[TK_ID(i)], i < n (n at most the dynamic shared memory's
// keys); writes the k largest elements' indices TK_ID(i).
__device__ void top_k_block(const float* s, const u32* list, int n, int k, u32* out) {
    extern __shared__ u32 keys[];
    __shared__ u32 hist[TK_BUCKETS];
    __shared__ u32 cand[TK_CAND];
    __shared__ u32 red[32];
    __shared__ float red_lo[32], red_hi[32];
    __shared__ float lo, scale;
    __shared__ u32 bucket, above, n_out, n_cand;
    float mn = 3.0e38f, mx = -3.0e38f;
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = s[TK_ID(i)];
        keys[i] = key_of(v);
        mn = fminf(mn, v);  // fminf/fmaxf skip NaN (its key is -inf's)
        mx = fmaxf(mx, v);
    }
    if (n <= TK_COUNT) {
        // Few scores (heads): each thread ranks its own by counting the larger ones (ties by
        // index), one pass; its cost grows as n^2 (measured: 20 us at n = 900).
        __syncthreads();
        int i = threadIdx.x;
        if (i < n) {
            u32 key = keys[i], rank = 0;
            for (int j = 0; j < n; j++) rank += keys[j] > key || (keys[j] == key && j < i);
            if (rank < (u32)k) out[rank] = TK_ID(i);
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
    // in the score, so every bucket's scores exceed the lower buckets'; `tk_bucket`).
#define TK_BUCKET(i) tk_bucket(val_of(keys[i]), lo, scale)
    for (int i = threadIdx.x; i < n; i += blockDim.x) atomicAdd(&hist[TK_BUCKET(i)], 1u);
    __syncthreads();
    find_bin(hist, TK_BUCKETS, (u32)k, &bucket, &above, red);
    if (hist[bucket] > TK_CAND) {
        top_k_radix(keys, list, n, k, out, hist, red);
        return;
    }
    for (int base = 0; base < n; base += blockDim.x) {
        int i = base + threadIdx.x;
        u32 b = i < n ? TK_BUCKET(i) : 0;
        bool up = i < n && b > bucket, in = i < n && b == bucket;
        u32 a = warp_reserve(&n_out, up);
        u32 c = warp_reserve(&n_cand, in);
        if (up) out[a] = TK_ID(i);
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
        if (rank < want) out[above + rank] = TK_ID(i);
    }
#undef TK_BUCKET
}
// Global state of one job across the two kernels (zero between launches).
#define TK_GBINS 4096
#define TK_GCAND 8192
struct TkScratch {
    u32 hist[TK_GBINS];
    u32 n_out, n_cand, done, pad;
    u32 cand[TK_GCAND];
};
__device__ __forceinline__ u32 tk_gbin(float v) { return key_of(v) >> 20; }

// The job of this block (constant indices, see matvec_jobs).
__device__ __forceinline__ TkJob tk_job(const TkJobs& jobs) {
    int j = blockIdx.y;
    return j == 2 ? jobs.job[2] : j == 1 ? jobs.job[1] : jobs.job[0];
}

extern "C" __global__ void __launch_bounds__(1024) top_k_hist(TkJobs jobs, TkScratch* scr) {
    __shared__ u32 h[TK_GBINS];
    TkJob job = tk_job(jobs);
    int base = blockIdx.x * blockDim.x;
    if (blockIdx.y >= jobs.n || job.n <= (int)blockDim.x || base >= job.n) return;
    for (int b = threadIdx.x; b < TK_GBINS; b += blockDim.x) h[b] = 0;
    __syncthreads();
    int i = base + threadIdx.x;
    if (i < job.n) atomicAdd(&h[tk_gbin(job.s[i])], 1u);
    __syncthreads();
    u32* g = scr[blockIdx.y].hist;
    for (int b = threadIdx.x; b < TK_GBINS; b += blockDim.x)
        if (h[b]) atomicAdd(&g[b], h[b]);
}

// Dynamic shared memory: 4 n bytes (the largest job's keys, for the last block).
extern "C" __global__ void __launch_bounds__(1024) top_k_select(TkJobs jobs, TkScratch* scr) {
    __shared__ u32 red[32];
    __shared__ u32 bin, above;
    __shared__ bool last;
    TkJob job = tk_job(jobs);
    if (blockIdx.y >= jobs.n) return;
    if (job.n <= (int)blockDim.x) {
        if (blockIdx.x == 0) top_k_block(job.s, nullptr, job.n, job.k, job.out);
        return;
    }
    int chunks = (job.n + blockDim.x - 1) / blockDim.x;
    if ((int)blockIdx.x >= chunks) return;
    TkScratch* t = scr + blockIdx.y;
    find_bin(t->hist, TK_GBINS, (u32)job.k, &bin, &above, red);
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    u32 b = i < job.n ? tk_gbin(job.s[i]) : 0;
    bool up = i < job.n && b > bin, in = i < job.n && b == bin;
    u32 a = warp_reserve(&t->n_out, up);
    u32 c = warp_reserve(&t->n_cand, in);
    if (up) job.out[a] = (u32)i;
    if (in && c < TK_GCAND) t->cand[c] = (u32)i;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&t->done, 1u) == (u32)chunks - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    u32 nc = *(volatile u32*)&t->n_cand, want = (u32)job.k - above;
    if (nc <= TK_GCAND) top_k_block(job.s, t->cand, (int)nc, (int)want, job.out + above);
    else top_k_block(job.s, nullptr, job.n, job.k, job.out);  // scores piled on one bin
    __syncthreads();
    for (int q = threadIdx.x; q < TK_GBINS; q += blockDim.x) t->hist[q] = 0;
    if (threadIdx.x == 0) { t->n_out = 0; t->n_cand = 0; t->done = 0; }
}
