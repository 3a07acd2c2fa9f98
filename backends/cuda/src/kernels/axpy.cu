// Up to 3 products of one weight type and one input a in one launch (Q, K and V of an input under
// input sparsity; gate and up), each: y[c] += sum over outputs j of a[j] * W[row(j)][c]
// (+ bias[c]), W neuron-major (row r: neuron r's output column), or input-major; a[j] taken
// through input sparsity's mask where the call has one (`AxIn`: no `sparsify` launch before). Blocks of x
// `first_tile` on are the job's. A block of 8 warps owns 256 * AX_VEC columns (tile `tile`): lane l loads 8 columns at
// each of base + v * 256 + l * 8 (v < AX_VEC), so a warp reads AX_VEC * 512 contiguous bytes of a
// 16-bit row. Row y of blocks (split-K) owns one contiguous range of the outputs j. It walks its
// range in segments of 256: the block first lists the segment's rows whose a[j] is nonzero (a
// ReLU zero, an input that input sparsity dropped: those rows are not read), in order, in
// shared memory, then its warps take the listed rows in turn, AX_UNROLL in flight per lane, so
// every load in flight is a row that counts and none waits on its coefficient's load. The
// warps' sums meet in shared memory and leave with one atomic add per column; the blocks of
// blockIdx.y == 0 add the bias.
// Tuning (`profile_layer`, `profile_verbs` on the H200): 256 columns a block (AX_VEC 1), 4 rows in
// flight a lane, 4 blocks per SM (the host's AX_FILL). Against 1024 columns, 2 rows, 2 blocks:
// Llama-3-8B's gate and up at half the inputs 42.6 against 113 us, its down 20.7 against 57.7,
// 10% of OPT-30B's fc2 rows 12.7 against 40.0 us. AX_VEC 2 and AX_FILL 8 or 16 were slower, as
// were 2 or 8 rows in flight.
#ifndef AX_UNROLL
#define AX_UNROLL 4
#endif
// A block of 8 warps lists the entries its threads keep, in thread order: returns this
// thread's slot in the list (meaningful where it keeps), and the list's length in `n`.
// Every thread of the block calls it (a barrier inside).
__device__ __forceinline__ int list_slot(bool keep, int* wcount, int& n) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    unsigned m = __ballot_sync(0xffffffff, keep);
    if (lane == 0) wcount[warp] = __popc(m);
    __syncthreads();
    int off = 0;
    n = 0;
    for (int q = 0; q < 8; q++) {
        off += q < warp ? wcount[q] : 0;
        n += wcount[q];
    }
    return off + __popc(m & ((1u << lane) - 1));
}
#ifndef AX_VEC
#define AX_VEC 1
#endif
// The coefficients of `Device::axpys`: a[j], or with `masked` a[j] where |a[j]| * scale[j] > t
// (scale 1 when null) and 0 elsewhere, as `sparsify_f32` writes them (a NaN score is kept).
struct AxIn {
    const float* a;
    const float* scale;
    float t;
    int masked;
};
__device__ __forceinline__ float ax_coef(const AxIn& in, int j) {
    float v = in.a[j];
    if (!in.masked) return v;
    float s = fabsf(v) * (in.scale ? in.scale[j] : 1.0f);
    return s <= in.t ? 0.0f : v;
}
template <int T>
__device__ __forceinline__ void axpy(const u8* w, int rows, int cols, const u32* idx, int n_out,
                                     int group, const AxIn& a, const float* bias, float* y,
                                     int tile) {
    __shared__ float part[8][256 * AX_VEC + 1];
    __shared__ int krow[256];
    __shared__ float kval[256];
    __shared__ int wcount[8];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int base = tile * 256 * AX_VEC;
    size_t rb = row_bytes<T>(cols);
    bool vec = cols % 8 == 0;
    float acc[AX_VEC][8];
#pragma unroll
    for (int c = 0; c < AX_VEC; c++)
        for (int i = 0; i < 8; i++) acc[c][i] = 0.f;
    int per = (n_out + gridDim.y - 1) / gridDim.y;
    int jb = blockIdx.y * per, je = min(n_out, jb + per);
    for (int s0 = jb; s0 < je; s0 += 256) {
        // The segment's kept rows, in order: a warp ballot, then the warps' offsets.
        int j = s0 + threadIdx.x, r = rows;
        float av = 0.f;
        if (j < je) {
            av = ax_coef(a, j);
            r = av != 0.f ? sel_row(idx, j, group) : rows;
        }
        bool keep = r < rows;
        int n, at = list_slot(keep, wcount, n);
        if (keep) {
            krow[at] = r;
            kval[at] = av;
        }
        __syncthreads();
        for (int i0 = warp; i0 < n; i0 += 8 * AX_UNROLL) {
            float v[AX_UNROLL][AX_VEC][8], sv[AX_UNROLL];
#pragma unroll
            for (int u = 0; u < AX_UNROLL; u++) {
                int i = i0 + u * 8;
                sv[u] = i < n ? kval[i] : 0.f;
                if (i < n) {
                    const u8* row = w + (size_t)krow[i] * rb;
#pragma unroll
                    for (int c = 0; c < AX_VEC; c++) {
                        int col = base + c * 256 + lane * 8;
                        if (col < cols) load8<T>(row, col, cols, vec, v[u][c]);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < AX_UNROLL; u++)
                if (i0 + u * 8 < n) {
#pragma unroll
                    for (int c = 0; c < AX_VEC; c++)
                        if (base + c * 256 + lane * 8 < cols)
                            for (int i = 0; i < 8; i++) acc[c][i] += sv[u] * v[u][c][i];
                }
        }
        __syncthreads();  // the list is rewritten by the next segment
    }
#pragma unroll
    for (int c = 0; c < AX_VEC; c++)
        for (int i = 0; i < 8; i++) part[warp][c * 256 + lane * 8 + i] = acc[c][i];
    __syncthreads();
    for (int t = threadIdx.x; t < 256 * AX_VEC; t += blockDim.x) {
        int col = base + t;
        if (col >= cols) break;
        float sum = bias && blockIdx.y == 0 ? bias[col] : 0.f;
        for (int q = 0; q < 8; q++) sum += part[q][t];
        atomicAdd(&y[col], sum);
    }
}
// The block-quantized types' axpy: no list in shared memory and no barrier until the end. Warp w
// of a block takes the block's outputs in chunks of 32 (chunks w, w + 8, ...): each lane holds
// one coefficient and its row, a ballot marks the chunk's kept rows, and the warp takes them
// lowest first, U rows a round (a round's rows may span chunks; the next chunk's coefficients
// are loaded a chunk ahead), every lane loading its 8 columns of each before using any. Built
// to 64 registers (`AX_BOUNDS_Q`), so 4 blocks fit an SM as the host's AX_FILL assumes: the
// listed kernel above takes 66-96 on these types, 3 blocks an SM, and the grid's last quarter
// ran as a second wave. On the H100 (`profile_layer 4096 32 8 14336 q4_k`, half the inputs
// kept at random), the teal:0.5 layer in one graph 195.7 -> 172.6 us on Q4_K, 171.3 -> 162.1
// on Q8_0; on f16 (64 registers either way) the listed kernel stays ahead, 130.2 against 148.1.
// Rows a lane loads a round: AX_UNROLL, 2 for the types whose 8 values take many registers to
// decode (at 64 registers a thread, the 4 blocks per SM that the host's AX_FILL assumes).
template <int T> struct AxRound { enum { U = AX_UNROLL }; };
#define AX_ROUND_2(T) template <> struct AxRound<T> { enum { U = AX_UNROLL < 2 ? AX_UNROLL : 2 }; };
AX_ROUND_2(T_Q5_0) AX_ROUND_2(T_Q5_1) AX_ROUND_2(T_Q2K) AX_ROUND_2(T_Q3K) AX_ROUND_2(T_Q4K)
AX_ROUND_2(T_Q5K) AX_ROUND_2(T_Q6K) AX_ROUND_2(T_IQ4XS)
template <int T>
__device__ __forceinline__ void axpy_warp(const u8* w, int rows, int cols, const u32* idx,
                                          int n_out, int group, const AxIn& a,
                                          const float* bias, float* y, int tile) {
    __shared__ float part[8][256 * AX_VEC + 1];
    constexpr int U = AxRound<T>::U;
    const unsigned all = 0xffffffffu;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int base = tile * 256 * AX_VEC;
    size_t rb = row_bytes<T>(cols);
    bool vec = cols % 8 == 0;
    float acc[AX_VEC][8];
#pragma unroll
    for (int c = 0; c < AX_VEC; c++)
        for (int i = 0; i < 8; i++) acc[c][i] = 0.f;
    int per = (n_out + gridDim.y - 1) / gridDim.y;
    int jb = blockIdx.y * per, je = min(n_out, jb + per);
    // This lane's coefficient and row in the chunk from c on (0 and `rows` past the range).
    auto fetch = [&](int c, float& av, int& r) {
        int j = c + lane;
        av = j < je ? ax_coef(a, j) : 0.f;
        r = j < je ? sel_row(idx, j, group) : rows;
    };
    int c = jb + 32 * warp;
    float av, av_next;
    int r, r_next;
    fetch(c, av, r);
    fetch(c + 256, av_next, r_next);
    unsigned m = __ballot_sync(all, av != 0.f && r < rows);
    for (;;) {
        int kr[U];
        float kv[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            while (m == 0 && c < je) {  // the next chunk (m and c are the warp's, not a lane's)
                c += 256;
                av = av_next;
                r = r_next;
                fetch(c + 256, av_next, r_next);
                m = __ballot_sync(all, av != 0.f && r < rows);
            }
            kr[u] = -1;
            kv[u] = 0.f;
            if (m) {
                int b = __ffs(m) - 1;
                m &= m - 1;
                kr[u] = __shfl_sync(all, r, b);
                kv[u] = __shfl_sync(all, av, b);
            }
        }
        if (kr[0] < 0) break;
        float v[U][AX_VEC][8];
#pragma unroll
        for (int u = 0; u < U; u++)
            if (kr[u] >= 0) {
                const u8* row = w + (size_t)kr[u] * rb;
#pragma unroll
                for (int c2 = 0; c2 < AX_VEC; c2++) {
                    int col = base + c2 * 256 + lane * 8;
                    if (col < cols) load8<T>(row, col, cols, vec, v[u][c2]);
                }
            }
#pragma unroll
        for (int u = 0; u < U; u++)
            if (kr[u] >= 0) {
#pragma unroll
                for (int c2 = 0; c2 < AX_VEC; c2++)
                    if (base + c2 * 256 + lane * 8 < cols)
                        for (int i = 0; i < 8; i++) acc[c2][i] += kv[u] * v[u][c2][i];
            }
    }
#pragma unroll
    for (int c2 = 0; c2 < AX_VEC; c2++)
        for (int i = 0; i < 8; i++) part[warp][c2 * 256 + lane * 8 + i] = acc[c2][i];
    __syncthreads();
    for (int t = threadIdx.x; t < 256 * AX_VEC; t += blockDim.x) {
        int col = base + t;
        if (col >= cols) break;
        float sum = bias && blockIdx.y == 0 ? bias[col] : 0.f;
        for (int q = 0; q < 8; q++) sum += part[q][t];
        atomicAdd(&y[col], sum);
    }
}
struct AxJob {
    const u8* w;
    const u32* idx;
    const float* bias;
    float* y;
    int rows, cols, n_out, group, first_tile, pad;
};
struct AxJobs {
    AxJob job[3];
    AxIn in;
    int n, pad;
};
// One job's tile: the listed kernel for rows of floats, the warp kernel for quantized blocks.
template <int T>
__device__ __forceinline__ void axpy_one(const u8* w, int rows, int cols, const u32* idx,
                                         int n_out, int group, const AxIn& a,
                                         const float* bias, float* y, int tile) {
    if constexpr (Blk<T>::LEN == 1) axpy<T>(w, rows, cols, idx, n_out, group, a, bias, y, tile);
    else axpy_warp<T>(w, rows, cols, idx, n_out, group, a, bias, y, tile);
}
// The job of this block, its fields read by constant indices (as in matvec.cu).
#define AX_CALL(n) axpy_one<T>(jobs.job[n].w, jobs.job[n].rows, jobs.job[n].cols, jobs.job[n].idx,    \
    jobs.job[n].n_out, jobs.job[n].group, jobs.in, jobs.job[n].bias, jobs.job[n].y,              \
    b - jobs.job[n].first_tile)
template <int T>
__device__ __forceinline__ void axpy_jobs(const AxJobs& jobs) {
    int b = blockIdx.x;
    if (jobs.n > 2 && b >= jobs.job[2].first_tile) AX_CALL(2);
    else if (jobs.n > 1 && b >= jobs.job[1].first_tile) AX_CALL(1);
    else AX_CALL(0);
}
// Launch bounds by type: the float rows at the compiler's choice (64 registers on sm_90), the
// quantized ones held to 4 blocks an SM (a new type without a line here does not compile).
#define AX_BOUNDS_F __launch_bounds__(256)
#define AX_BOUNDS_Q __launch_bounds__(256, 4)
#define AX_BOUNDS_T_F32 AX_BOUNDS_F
#define AX_BOUNDS_T_F16 AX_BOUNDS_F
#define AX_BOUNDS_T_BF16 AX_BOUNDS_F
#define AX_BOUNDS_T_Q8_0 AX_BOUNDS_Q
#define AX_BOUNDS_T_Q4_0 AX_BOUNDS_Q
#define AX_BOUNDS_T_Q4_1 AX_BOUNDS_Q
#define AX_BOUNDS_T_Q5_0 AX_BOUNDS_Q
#define AX_BOUNDS_T_Q5_1 AX_BOUNDS_Q
#define AX_BOUNDS_T_Q2K AX_BOUNDS_Q
#define AX_BOUNDS_T_Q3K AX_BOUNDS_Q
#define AX_BOUNDS_T_Q4K AX_BOUNDS_Q
#define AX_BOUNDS_T_Q5K AX_BOUNDS_Q
#define AX_BOUNDS_T_Q6K AX_BOUNDS_Q
#define AX_BOUNDS_T_IQ4NL AX_BOUNDS_Q
#define AX_BOUNDS_T_IQ4XS AX_BOUNDS_Q
#define AXPY(name, T)                                                                            \
    extern "C" __global__ void AX_BOUNDS_##T axpy_##name(AxJobs jobs) {                         \
        axpy_jobs<T>(jobs);                                                                       \
    }
FOR_TYPES(AXPY)

// `Device::axpy_steps`: the down projection of a step of several sequences over the union of
// their neurons, each listed weight row read once for up to AXB_ROWS batch rows: for row b of
// the pass, y[b * cols + c] += sum over outputs j of a[b * n_out + j] * W[row(j)][c]
// (+ bias[c]). Block x = tile * passes + pass (the passes over one tile of 256 columns run side
// by side, so a pass after the first finds the tile's rows in L2); pass p owns batch rows
// p * AXB_ROWS on. Block y owns a contiguous range of the outputs j, as in `axpy` above; a row
// is listed (and read) when any of the pass's rows has a nonzero coefficient for it. The
// coefficients of a listed row sit side by side in shared memory: every lane of a warp reads
// the same one (a broadcast). The partial sums leave one batch row at a time, through the
// same shared array.
#ifndef AXB_ROWS
#define AXB_ROWS 8
#endif
struct AxbJob {
    const u8* w;
    const u32* idx;
    const float* bias;
    const float* a;
    float* y;
    int rows, cols, n_out, group, nb, passes;
};
template <int T>
__device__ __forceinline__ void axpy_rows(const AxbJob& jb) {
    __shared__ float part[8][257];
    __shared__ int krow[256];
    __shared__ float kval[256 * AXB_ROWS];
    __shared__ int wcount[8];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int tile = blockIdx.x / jb.passes, b0 = (blockIdx.x % jb.passes) * AXB_ROWS;
    int nb = min(AXB_ROWS, jb.nb - b0), rows = jb.rows, cols = jb.cols;
    int col = tile * 256 + lane * 8;
    size_t rb = row_bytes<T>(cols);
    bool vec = cols % 8 == 0;
    float acc[AXB_ROWS][8];
#pragma unroll
    for (int b = 0; b < AXB_ROWS; b++)
        for (int i = 0; i < 8; i++) acc[b][i] = 0.f;
    int per = (jb.n_out + gridDim.y - 1) / gridDim.y;
    int j0 = blockIdx.y * per, je = min(jb.n_out, j0 + per);
    for (int s0 = j0; s0 < je; s0 += 256) {
        int j = s0 + threadIdx.x, r = rows;
        float av[AXB_ROWS];
        bool any = false;
#pragma unroll
        for (int b = 0; b < AXB_ROWS; b++) {
            av[b] = j < je && b < nb ? jb.a[(size_t)(b0 + b) * jb.n_out + j] : 0.f;
            any |= av[b] != 0.f;
        }
        if (any) r = sel_row(jb.idx, j, jb.group);
        bool keep = r < rows;
        int n, at = list_slot(keep, wcount, n);
        if (keep) {
            krow[at] = r;
#pragma unroll
            for (int b = 0; b < AXB_ROWS; b++) kval[at * AXB_ROWS + b] = av[b];
        }
        __syncthreads();
        for (int i0 = warp; i0 < n; i0 += 8 * AX_UNROLL) {
            float v[AX_UNROLL][8];
#pragma unroll
            for (int u = 0; u < AX_UNROLL; u++) {
                int i = i0 + u * 8;
                if (i < n && col < cols)
                    load8<T>(jb.w + (size_t)krow[i] * rb, col, cols, vec, v[u]);
            }
            if (col >= cols) continue;
#pragma unroll
            for (int u = 0; u < AX_UNROLL; u++) {
                int i = i0 + u * 8;
                if (i >= n) break;
#pragma unroll
                for (int b = 0; b < AXB_ROWS; b++) {
                    float s = kval[i * AXB_ROWS + b];
                    for (int k = 0; k < 8; k++) acc[b][k] += s * v[u][k];
                }
            }
        }
        __syncthreads();  // the list is rewritten by the next segment
    }
#pragma unroll
    for (int b = 0; b < AXB_ROWS; b++) {
        if (b >= nb) break;
        for (int i = 0; i < 8; i++) part[warp][lane * 8 + i] = acc[b][i];
        __syncthreads();
        int c = tile * 256 + threadIdx.x;
        if (c < cols) {
            float sum = jb.bias && blockIdx.y == 0 ? jb.bias[c] : 0.f;
            for (int q = 0; q < 8; q++) sum += part[q][threadIdx.x];
            atomicAdd(&jb.y[(size_t)(b0 + b) * cols + c], sum);
        }
        __syncthreads();  // part is rewritten for the next row
    }
}
#define AXPY_ROWS(name, T)                                                                       \
    extern "C" __global__ void __launch_bounds__(256) axpy_rows_##name(AxbJob job) {           \
        axpy_rows<T>(job);                                                                        \
    }
FOR_TYPES(AXPY_ROWS)
