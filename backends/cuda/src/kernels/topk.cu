// The indices of the k largest of s[0..n) into out[0..k), any order: one block finds the k-th
// largest key by a 4-pass radix select (8 bits a pass) over order-preserving u32 keys, then
// writes every index above it and as many equal to it as fill k. Scores cluster in a few
// exponents, so the histogram and the output counters take one atomic per distinct bin per
// warp (lanes of one bin are counted together), not one per element.
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
extern "C" __global__ void top_k(const float* s, int n, int k, u32* out) {
    extern __shared__ u32 keys[];
    __shared__ u32 hist[256];
    __shared__ u32 prefix, want, n_above, n_tied;
    for (int i = threadIdx.x; i < n; i += blockDim.x) keys[i] = key_of(s[i]);
    if (threadIdx.x == 0) { prefix = 0; want = (u32)k; n_above = 0; n_tied = 0; }
    __syncthreads();
    if (n <= (int)blockDim.x) {
        // Few scores (heads): each thread ranks its own by counting the larger ones (ties by
        // index), one pass.
        int i = threadIdx.x;
        if (i < n) {
            u32 key = keys[i], rank = 0;
            for (int j = 0; j < n; j++) rank += keys[j] > key || (keys[j] == key && j < i);
            if (rank < (u32)k) out[rank] = (u32)i;
        }
        return;
    }
    for (int pass = 0; pass < 4; pass++) {
        int shift = 24 - 8 * pass;
        u32 mask = pass == 0 ? 0u : (0xffffffffu << (32 - 8 * pass));
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int base = 0; base < n; base += blockDim.x) {
            int i = base + threadIdx.x;
            u32 key = i < n ? keys[i] : 0;
            bool on = i < n && (key & mask) == prefix;
            u32 bin = on ? (key >> shift) & 255 : 256;  // 256: not counted
            u32 same = __match_any_sync(0xffffffffu, bin);
            if (on && (threadIdx.x % 32) == (u32)(__ffs(same) - 1)) atomicAdd(&hist[bin], (u32)__popc(same));
        }
        __syncthreads();
        // The bin holding the k-th largest: warp 0, 8 bins a lane, a suffix sum over lanes.
        if (threadIdx.x < 32) {
            int lane = threadIdx.x;
            u32 loc[8], sum = 0;
            for (int i = 0; i < 8; i++) { loc[i] = hist[lane * 8 + i]; sum += loc[i]; }
            u32 suf = sum;
            for (int o = 1; o < 32; o <<= 1) {
                u32 t = __shfl_down_sync(0xffffffffu, suf, o);
                if (lane + o < 32) suf += t;
            }
            u32 acc = suf - sum, w = want;  // acc: candidates in the bins above this lane's
            if (acc < w && w <= suf) {
                int b = lane * 8;
                for (int i = 7; i >= 0; i--) {
                    if (acc + loc[i] >= w) { b = lane * 8 + i; break; }
                    acc += loc[i];
                }
                want = w - acc;
                prefix |= (u32)b << shift;
            }
        }
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
