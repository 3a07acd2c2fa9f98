// Rotate nx heads of x, then ny heads of y (queries and keys in one launch), of head_dim hd,
// of batch row r = blockIdx.y (rows of nx and ny heads) at its position step[0] + r. neox = 0: pairs (2i, 2i+1); neox = 1: pairs (i, i + hd/2).
// Angle of pair i: pos * theta^(-2i/hd) / factors[i] (factors: Llama 3's divisors, or null: 1).
// With `tab` (a step of several sequences, see attention_rows_f16), row r's position is its
// sequence's, tab[r * SEQ_TAB + 3].
extern "C" __global__ void rope(float* x, int nx, float* y, int ny, int hd, const int* step,
                                float theta, const float* factors, int neox,
                                const u64* tab) {
    int t = blockIdx.x * blockDim.x + threadIdx.x, half = hd / 2;
    if (t >= (nx + ny) * half) return;
    int h = t / half, i = t % half, r = blockIdx.y;
    x += (size_t)r * nx * hd;
    y += (size_t)r * ny * hd;
    int pos = tab ? (int)tab[(size_t)r * SEQ_TAB + 3] : step[0] + r;
    double ang = (double)pos * pow((double)theta, -2.0 * (double)i / (double)hd), sd, cd;
    if (factors) ang /= (double)factors[i];
    sincos(ang, &sd, &cd);  // in f64, as the CPU reference
    float c = (float)cd, s = (float)sd;
    float* p = h < nx ? x + (size_t)h * hd : y + (size_t)(h - nx) * hd;
    int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    float x0 = p[a], x1 = p[b];
    p[a] = x0 * c - x1 * s;
    p[b] = x0 * s + x1 * c;
}
