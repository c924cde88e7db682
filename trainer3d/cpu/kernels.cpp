// Fused CPU kernels for the model's RMSNorm, rotary embedding and SwiGLU, forward and backward
// (trainer3d/cpu/kernels.py builds this file and loads it; trainer3d/cpu/ops.py registers it as the CPU
// implementation of the model's operators, model/functional.py).
//
// Each kernel makes one pass over its rows where the operator composition makes one per
// operator: an fp32 Llama block of the DeepSpeed pair (tools/bench/deepspeed_pair.py) runs 29
// elementwise multiplications, two silu and a silu_backward, each reading and writing the whole
// activation, around matmuls that cost about as much as all of them together.
//
// Plain C++ with no torch headers (it builds in a second): contiguous fp32 buffers in, buffers
// the caller allocated out. Every operation is an IEEE single-precision add, multiply, divide or
// square root (-ffp-contract=off: no multiply-add the source does not spell out), in an order
// the source fixes, so the AVX-512, AVX2 and baseline clones (target_clones, chosen when the
// library loads) give the same bits, and so does any number of threads: rows are split over
// threads, never a row, and the weight gradient of RMSNorm is summed per block of 64 rows, then
// the blocks in order.
//
// What rounds as torch's composition: the rotation (the same products and sums, bit for bit);
// RMSNorm's normalised value and product with the weight (the mean square is summed in 16
// lanes, ATen's reduction in its own order: ~1 ulp); silu and its derivative (the formulas of
// aten/src/ATen/native/cpu/Activation.cpp with an exp of ~1 ulp, Cephes' expf polynomial,
// where ATen calls SLEEF's).

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define T3D_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define T3D_CLONES
#endif

namespace {

constexpr int64_t kLanes = 16;        // accumulators of a row's sums: one AVX-512 register of floats
constexpr int64_t kNormBlock = 64;    // rows per partial sum of RMSNorm's weight gradient
constexpr int64_t kChunk = 16384;     // elements per task of the elementwise kernels

// exp(x) in fp32 (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r,
// times 2^n), branch-free so that the loops that call it vectorise. Below -87.3 (where 2^n
// would leave the normal range) it returns 0, above 88.7 infinity: silu and sigmoid then
// take their limits, as with the exact exp.
inline float exp_f32(float x) {
  const float hi = 88.72283935546875f, lo = -87.33654022216797f;
  const float xc = x > hi ? hi : (x < lo ? lo : x);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // 2^n for n in [-126, 128]: n = 128 (x near the top) as 2 * 2^127
  const int32_t ni = static_cast<int32_t>(n);
  const int32_t half = ni > 127 ? 1 : 0;
  int32_t bits = (ni - half + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const float out = p * scale * (half ? 2.0f : 1.0f);
  return x > hi ? INFINITY : (x < lo ? 0.0f : out);
}

// ----------------------------------------------------------------------------------- RMSNorm

T3D_CLONES
void rms_rows_forward(const float* x, const float* w, float* y, float* rstd, int64_t r0, int64_t r1, int64_t dim,
                      float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    float acc[kLanes] = {0};
    int64_t i = 0;
    for (; i + kLanes <= dim; i += kLanes)
      for (int64_t k = 0; k < kLanes; ++k) acc[k] += xr[i + k] * xr[i + k];
    for (int64_t k = 0; i + k < dim; ++k) acc[k] += xr[i + k] * xr[i + k];
    float ss = 0.f;
    for (int64_t k = 0; k < kLanes; ++k) ss += acc[k];
    const float s = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
    rstd[r] = s;
    for (int64_t j = 0; j < dim; ++j) {
      const float xhat = xr[j] * s;
      yr[j] = xhat * w[j];
    }
  }
}

// Rows [r0, r1): grad_x (where asked) and the block's sum of grad_y * xhat (where asked).
T3D_CLONES
void rms_rows_backward(const float* gy, const float* x, const float* w, const float* rstd, float* gx, float* gw_block,
                       int64_t r0, int64_t r1, int64_t dim) {
  if (gw_block)
    for (int64_t j = 0; j < dim; ++j) gw_block[j] = 0.f;
  for (int64_t r = r0; r < r1; ++r) {
    const float* gr = gy + r * dim;
    const float* xr = x + r * dim;
    const float s = rstd[r];
    if (gw_block)
      for (int64_t j = 0; j < dim; ++j) gw_block[j] += gr[j] * (xr[j] * s);
    if (!gx) continue;
    float acc[kLanes] = {0};
    int64_t i = 0;
    for (; i + kLanes <= dim; i += kLanes)
      for (int64_t k = 0; k < kLanes; ++k) acc[k] += (gr[i + k] * w[i + k]) * (xr[i + k] * s);
    for (int64_t k = 0; i + k < dim; ++k) acc[k] += (gr[i + k] * w[i + k]) * (xr[i + k] * s);
    float dot = 0.f;
    for (int64_t k = 0; k < kLanes; ++k) dot += acc[k];
    dot = dot / static_cast<float>(dim);
    float* out = gx + r * dim;
    for (int64_t j = 0; j < dim; ++j) out[j] = (gr[j] * w[j] - (xr[j] * s) * dot) * s;
  }
}

// ------------------------------------------------------------------------------------ rotary

// Rows [r0, r1) of x (seq, batch, heads, head_dim), read through its strides (in elements; the
// last dimension dense), written to out contiguous: x cos + R(x) sin at the row's position, R
// turning pairs (i, i + d/2) a quarter (sign 1) or back (sign -1), rounded as
// model/functional.py's ``_rotate`` rounds: the product by cos, then the other product added.
T3D_CLONES
void rotary_rows(const float* __restrict__ x, const float* __restrict__ cos, const float* __restrict__ sin,
                 float* __restrict__ out, int64_t r0, int64_t r1, int64_t batch, int64_t heads, int64_t hd,
                 int64_t s_seq, int64_t s_batch, int64_t s_head, int sign) {
  const int64_t h = hd / 2;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t pos = r / (batch * heads), bi = (r / heads) % batch, hi = r % heads;
    const float* c = cos + pos * hd;
    const float* sn = sin + pos * hd;
    const float* xr = x + pos * s_seq + bi * s_batch + hi * s_head;
    float* o = out + r * hd;
    if (sign > 0) {
      for (int64_t i = 0; i < h; ++i) {
        const float x1 = xr[i], x2 = xr[i + h];
        o[i] = x1 * c[i] - x2 * sn[i];
        o[i + h] = x2 * c[i + h] + x1 * sn[i + h];
      }
    } else {
      for (int64_t i = 0; i < h; ++i) {
        const float x1 = xr[i], x2 = xr[i + h];
        o[i] = x1 * c[i] + x2 * sn[i];
        o[i + h] = x2 * c[i + h] - x1 * sn[i + h];
      }
    }
  }
}

// ------------------------------------------------------------------------------------ SwiGLU

T3D_CLONES
void swiglu_range_forward(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ prod,
                          int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    const float silu = a[i] / (1.0f + exp_f32(-a[i]));
    prod[i] = silu * b[i];
  }
}

// With g the gradient of silu(a) * b: the product itself (w2's weight gradient reads it),
// g * silu(a) (b's gradient) and silu's derivative applied to g * b (a's gradient, as
// aten::silu_backward: dy * s * (1 + a (1 - s)), s = sigmoid(a)). One loop per choice of
// outputs, each without branches (so that it vectorises).
template <bool kProd, bool kInputs>
T3D_CLONES void swiglu_range_backward(const float* __restrict__ g, const float* __restrict__ a,
                                      const float* __restrict__ b, float* __restrict__ prod, float* __restrict__ ga,
                                      float* __restrict__ gb, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    const float d = 1.0f + exp_f32(-a[i]);
    const float silu = a[i] / d;
    if constexpr (kProd) prod[i] = silu * b[i];
    if constexpr (kInputs) {
      gb[i] = g[i] * silu;
      const float s = 1.0f / d;
      ga[i] = (g[i] * b[i]) * s * (1.0f + a[i] * (1.0f - s));
    }
  }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

extern "C" {

int t3d_kernels_abi() { return 2; }

void t3d_rms_norm_forward(const float* x, const float* w, float* y, float* rstd, int64_t rows, int64_t dim, float eps,
                          int threads) {
  const int64_t tasks = ceil_div(rows, kNormBlock);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tasks > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t r0 = t * kNormBlock, r1 = r0 + kNormBlock < rows ? r0 + kNormBlock : rows;
    rms_rows_forward(x, w, y, rstd, r0, r1, dim, eps);
  }
}

// gx and gw may be null (not asked for); scratch holds ceil(rows / 64) x dim floats when gw is asked.
void t3d_rms_norm_backward(const float* gy, const float* x, const float* w, const float* rstd, float* gx, float* gw,
                           float* scratch, int64_t rows, int64_t dim, int threads) {
  const int64_t tasks = ceil_div(rows, kNormBlock);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tasks > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t r0 = t * kNormBlock, r1 = r0 + kNormBlock < rows ? r0 + kNormBlock : rows;
    rms_rows_backward(gy, x, w, rstd, gx, gw ? scratch + t * dim : nullptr, r0, r1, dim);
  }
  if (!gw) return;
  for (int64_t j = 0; j < dim; ++j) gw[j] = 0.f;
  for (int64_t t = 0; t < tasks; ++t)
    for (int64_t j = 0; j < dim; ++j) gw[j] += scratch[t * dim + j];
}

// x (seq, batch, heads, hd) with strides s_seq, s_batch, s_head (elements) and a dense last dimension.
void t3d_rotary(const float* x, const float* cos, const float* sin, float* out, int64_t seq, int64_t batch,
                int64_t heads, int64_t hd, int64_t s_seq, int64_t s_batch, int64_t s_head, int sign, int threads) {
  const int64_t rows = seq * batch * heads;
  const int64_t per = kChunk / hd > 0 ? kChunk / hd : 1;
  const int64_t tasks = ceil_div(rows, per);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tasks > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t r0 = t * per, r1 = r0 + per < rows ? r0 + per : rows;
    rotary_rows(x, cos, sin, out, r0, r1, batch, heads, hd, s_seq, s_batch, s_head, sign);
  }
}

void t3d_swiglu_forward(const float* a, const float* b, float* prod, int64_t n, int threads) {
  const int64_t tasks = ceil_div(n, kChunk);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tasks > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t i0 = t * kChunk, i1 = i0 + kChunk < n ? i0 + kChunk : n;
    swiglu_range_forward(a, b, prod, i0, i1);
  }
}

void t3d_swiglu_backward(const float* g, const float* a, const float* b, float* prod, float* ga, float* gb, int64_t n,
                         int threads) {
  const int64_t tasks = ceil_div(n, kChunk);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tasks > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t i0 = t * kChunk, i1 = i0 + kChunk < n ? i0 + kChunk : n;
    if (prod && ga)
      swiglu_range_backward<true, true>(g, a, b, prod, ga, gb, i0, i1);
    else if (prod)
      swiglu_range_backward<true, false>(g, a, b, prod, ga, gb, i0, i1);
    else if (ga)
      swiglu_range_backward<false, true>(g, a, b, prod, ga, gb, i0, i1);
  }
}

}  // extern "C"
