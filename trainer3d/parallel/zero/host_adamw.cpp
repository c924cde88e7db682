// The host AdamW step of ZeRO-Offload (trainer3d/parallel/zero/host_kernel.py builds and loads it).
//
// Bit for bit the arithmetic of torch's fused CPU AdamW (aten/src/ATen/native/cpu/FusedAdamKernel.cpp,
// fp32, ADAMW mode, as the torch 2.13 wheel compiles it), element by element:
//   g  = g / grad_scale                        (stored back, where a scale is given)
//   p  = p * float(1 - lr * weight_decay)      (where weight_decay != 0)
//   m  = fma(1 - beta1, g - m, m)              (torch's lerp for 1 - beta1 < 0.5;
//        fma(-beta1, g - m, g) otherwise)
//   v  = fma((1 - beta2) * g, g, v * beta2)    (torch's vector code; the last size % 8 elements
//        fma(v, beta2, (1 - beta2) * g * g)     of each tensor take its scalar code, this one)
//   p  = p + (-step_size * m) / (sqrt(v) / sqrt(bias_correction2) + eps)
// with the coefficients computed in double and rounded to float as torch does. Every operation
// is correctly rounded (IEEE add/mul/div/sqrt/fma), so the AVX-512, AVX2 and scalar paths give
// the same bits, and so does any split of the elements over threads.
//
// What differs from torch's kernel is the work around the arithmetic: one call runs every
// contiguous run of the owned state (torch: one at::parallel_for per tensor of the list), the
// threads split the runs' total length, the loop body is unrolled twice so that two independent
// sqrt/div chains are in flight, and it prefetches its four streams ahead of the hardware.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define T3D_X86 1
#endif

namespace {

// The float coefficients of one step.
struct Coeffs {
  float decay;         // 1 - lr * weight_decay
  bool decays;         // weight_decay != 0
  float lerp;          // 1 - beta1 (|lerp| < 0.5) or -beta1 (lerp - 1, otherwise)
  bool lerp_small;     // |1 - beta1| < 0.5: m + lerp * (g - m); otherwise g + (lerp - 1) * (g - m)
  float lerp_weight;   // 1 - beta1
  float beta2;
  float sq_weight;     // 1 - beta2
  float bc2_sqrt;      // sqrt(1 - beta2^step)
  float eps;
  float neg_step;      // -lr / (1 - beta1^step)
  float step;          // lr / (1 - beta1^step)
  const float* grad_scale;
};

Coeffs coeffs(double lr, double beta1, double beta2, double weight_decay, double eps, double step,
              const float* grad_scale) {
  const double bc1 = 1 - std::pow(beta1, step);
  const double bc2 = 1 - std::pow(beta2, step);
  const double step_size = lr / bc1;
  Coeffs c;
  c.decay = static_cast<float>(1 - lr * weight_decay);
  c.decays = weight_decay != 0.f;
  c.lerp_weight = static_cast<float>(1 - beta1);
  c.lerp_small = std::abs(c.lerp_weight) < 0.5f;
  c.lerp = c.lerp_small ? c.lerp_weight : c.lerp_weight - 1.f;
  c.beta2 = static_cast<float>(beta2);
  c.sq_weight = static_cast<float>(1 - beta2);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.eps = static_cast<float>(eps);
  c.neg_step = static_cast<float>(-step_size);
  c.step = static_cast<float>(step_size);
  c.grad_scale = grad_scale;
  return c;
}

// One element as torch's vectorised body computes it (the scalar stand-in for a vector lane).
inline void body_element(float* p, float* g, float* m, float* v, const Coeffs& c) {
  float gv = *g;
  if (c.grad_scale) {
    gv = gv / *c.grad_scale;
    *g = gv;
  }
  float pv = *p;
  if (c.decays) pv = pv * c.decay;
  const float diff = gv - *m;
  const float mv = std::fma(c.lerp, diff, c.lerp_small ? *m : gv);
  const float vv = std::fma(c.sq_weight * gv, gv, *v * c.beta2);
  const float denom = std::sqrt(vv) / c.bc2_sqrt + c.eps;
  *p = pv + (c.neg_step * mv) / denom;
  *m = mv;
  *v = vv;
}

// One element as torch's scalar loop computes the last size % 16 elements of a tensor.
inline void tail_element(float* p, float* g, float* m, float* v, const Coeffs& c) {
  float gv = *g;
  if (c.grad_scale) {
    gv = gv / *c.grad_scale;
    *g = gv;
  }
  float pv = *p;
  if (c.decays) pv = pv * c.decay;
  const float mv = c.lerp_small ? std::fma(c.lerp_weight, gv - *m, *m)
                                : std::fma(-(gv - *m), 1.f - c.lerp_weight, gv);
  const float vv = std::fma(*v, c.beta2, c.sq_weight * gv * gv);
  const float denom = std::sqrt(vv) / c.bc2_sqrt + c.eps;
  *p = pv - (c.step * mv) / denom;
  *m = mv;
  *v = vv;
}

void body_scalar(float* p, float* g, float* m, float* v, int64_t n, const Coeffs& c) {
  for (int64_t i = 0; i < n; ++i) body_element(p + i, g + i, m + i, v + i, c);
}

#ifdef T3D_X86

// How far ahead the loop asks for its four streams (elements: 2 KiB per stream). The hardware
// prefetcher alone left the loop waiting on memory on the shared 2-core development VM: with
// these hints the step ran 1.3x as fast there (tools/bench/offload.py, docs/offload.md).
constexpr int64_t kPrefetch = 512;

// The vectorised body on W lanes (an at::vec-free copy per width: each function carries its own
// target attribute, so the file builds without -march and runs on any x86-64 CPU).
#define T3D_BODY(NAME, TARGET, VEC, W, SET1, LOAD, STORE, ADD, SUB, MUL, DIV, SQRT, FMADD)                      \
  __attribute__((target(TARGET), always_inline)) inline void NAME##_lanes(                                 \
      float* p, float* g, float* m, float* v, const Coeffs& c, VEC decay, VEC lerp, VEC beta2, VEC sq_weight, \
      VEC bc2_sqrt, VEC eps, VEC neg_step, VEC scale) {                                                      \
    VEC G = LOAD(g);                                                                                         \
    if (c.grad_scale) {                                                                                      \
      G = DIV(G, scale);                                                                                     \
      STORE(g, G);                                                                                           \
    }                                                                                                        \
    VEC P = LOAD(p);                                                                                         \
    if (c.decays) P = MUL(P, decay);                                                                         \
    const VEC M0 = LOAD(m);                                                                                  \
    const VEC M = FMADD(lerp, SUB(G, M0), c.lerp_small ? M0 : G);                                            \
    const VEC V = FMADD(MUL(sq_weight, G), G, MUL(LOAD(v), beta2));                                          \
    const VEC D = ADD(DIV(SQRT(V), bc2_sqrt), eps);                                                          \
    STORE(p, ADD(P, DIV(MUL(neg_step, M), D)));                                                              \
    STORE(m, M);                                                                                             \
    STORE(v, V);                                                                                             \
  }                                                                                                          \
  /* n: a multiple of W; two independent chains per turn */                                                     \
  __attribute__((target(TARGET))) void NAME(float* p, float* g, float* m, float* v, int64_t n,               \
                                            const Coeffs& c) {                                               \
    const VEC decay = SET1(c.decay), lerp = SET1(c.lerp), beta2 = SET1(c.beta2),                             \
              sq_weight = SET1(c.sq_weight), bc2_sqrt = SET1(c.bc2_sqrt), eps = SET1(c.eps),                 \
              neg_step = SET1(c.neg_step), scale = SET1(c.grad_scale ? *c.grad_scale : 1.f);                 \
    int64_t i = 0;                                                                                           \
    for (; i + 2 * W <= n; i += 2 * W) {                                                                     \
      for (int64_t line = 0; line < 2 * W; line += 16) { /* the cache lines kPrefetch elements ahead */        \
        _mm_prefetch(reinterpret_cast<const char*>(p + i + kPrefetch + line), _MM_HINT_T0);                    \
        _mm_prefetch(reinterpret_cast<const char*>(g + i + kPrefetch + line), _MM_HINT_T0);                    \
        _mm_prefetch(reinterpret_cast<const char*>(m + i + kPrefetch + line), _MM_HINT_T0);                    \
        _mm_prefetch(reinterpret_cast<const char*>(v + i + kPrefetch + line), _MM_HINT_T0);                    \
      }                                                                                                        \
      NAME##_lanes(p + i, g + i, m + i, v + i, c, decay, lerp, beta2, sq_weight, bc2_sqrt, eps, neg_step,    \
                   scale);                                                                                   \
      NAME##_lanes(p + i + W, g + i + W, m + i + W, v + i + W, c, decay, lerp, beta2, sq_weight, bc2_sqrt,   \
                   eps, neg_step, scale);                                                                    \
    }                                                                                                        \
    for (; i < n; i += W)                                                                                    \
      NAME##_lanes(p + i, g + i, m + i, v + i, c, decay, lerp, beta2, sq_weight, bc2_sqrt, eps, neg_step,    \
                   scale);                                                                                   \
  }

T3D_BODY(body_avx512, "avx512f", __m512, 16, _mm512_set1_ps, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_add_ps,
         _mm512_sub_ps, _mm512_mul_ps, _mm512_div_ps, _mm512_sqrt_ps, _mm512_fmadd_ps)
T3D_BODY(body_avx2, "avx2,fma", __m256, 8, _mm256_set1_ps, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_add_ps,
         _mm256_sub_ps, _mm256_mul_ps, _mm256_div_ps, _mm256_sqrt_ps, _mm256_fmadd_ps)
#undef T3D_BODY

#endif

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

Isa best_isa() {
#ifdef T3D_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kScalar;
}

// The vector-code elements [0, n): the widest path on whole vectors, the rest element-wise (the
// same bits either way).
void body(Isa isa, float* p, float* g, float* m, float* v, int64_t n, const Coeffs& c) {
  int64_t done = 0;
#ifdef T3D_X86
  if (isa == Isa::kAvx512) body_avx512(p, g, m, v, done = n / 16 * 16, c);
  if (isa == Isa::kAvx2) body_avx2(p, g, m, v, done = n / 8 * 8, c);
#endif
  body_scalar(p + done, g + done, m + done, v + done, n - done, c);
}

// torch's kernel runs each tensor from its start through at::vec in steps of 16 (AVX-512) and the
// rest through a scalar loop that the compiler vectorised 8 lanes at a time, with the same
// roundings as the at::vec code, and left size % 8 to scalar code that rounds v differently
// (measured on the torch 2.13 wheel: tests/unit/test_offload_adamw.py holds every tail length).
constexpr int64_t kTorchVector = 8;
// Threads split a run at multiples of kUnit elements from its start (whole cache lines).
constexpr int64_t kUnit = 16;
// Units (of kUnit elements) per thread at least: a small state is not worth waking the pool.
constexpr int64_t kGrain = 4096;

// at::parallel_for's split (ATen/ParallelOpenMP.h) without torch's headers: [0, total) in at most
// ``threads`` contiguous chunks of ``grain`` or more, one per thread of an OpenMP region (serial
// without -fopenmp). The threads are torch's count, passed in: the OpenMP runtime's own default
// is every core, which ranks sharing a node's cores must not each take.
template <typename F>
void parallel_for(int64_t total, int64_t grain, int threads, const F& f) {
  if (total <= 0) return;
  const int64_t parts = std::min<int64_t>(std::max(threads, 1), (total + grain - 1) / grain);
#ifdef _OPENMP
  if (parts > 1 && !omp_in_parallel()) {
#pragma omp parallel num_threads(static_cast<int>(parts))
    {
      const int64_t granted = omp_get_num_threads();  // the runtime may give fewer than asked
      const int64_t chunk = (total + granted - 1) / granted;
      const int64_t begin = omp_get_thread_num() * chunk;
      if (begin < total) f(begin, std::min(total, begin + chunk));
    }
    return;
  }
#endif
  f(0, total);
}

}  // namespace

// A plain C interface, loaded with ctypes (trainer3d/parallel/zero/host_kernel.py checks the
// arguments): no torch headers, so the build takes a second or two, not the minute
// <torch/extension.h> costs.
extern "C" {

int t3d_host_adamw_abi() { return 1; }

// The widest vector path this CPU runs: 0 scalar, 1 AVX2, 2 AVX-512.
int t3d_host_adamw_isa() { return static_cast<int>(best_isa()); }

// How many chunks one parallel_for of this library runs on ``threads`` (tests hold it to torch's count).
int64_t t3d_host_adamw_parallel_threads(int threads) {
  std::atomic<int64_t> tasks{0};
  parallel_for(int64_t{1} << 20, 1, threads, [&](int64_t, int64_t) { tasks.fetch_add(1); });
  return tasks.load();
}

// AdamW on the runs of the flat fp32 buffers p, g, m, v (``numel`` elements each), in place.
// ``runs``: k rows of (start, end, decays); ``step``: the step counter torch's kernel reads
// (already advanced); ``grad_scale`` (or null): divides the gradients (stored back);
// ``found_inf`` (or null): 1 skips the step, as torch's kernel does. ``isa``: -1 the best this
// CPU has, else 0 scalar, 1 AVX2, 2 AVX-512. Returns 0, or -1 where a run lies outside the buffers.
int t3d_host_adamw_step(float* p, float* g, float* m, float* v, int64_t numel, const int64_t* r, int64_t k,
                        double step, double lr, double beta1, double beta2, double weight_decay, double eps,
                        const float* grad_scale, const float* found_inf, int isa, int threads) {
  std::vector<int64_t> first_unit(k + 1, 0);  // run i covers units [first_unit[i], first_unit[i + 1])
  for (int64_t i = 0; i < k; ++i) {
    if (!(0 <= r[3 * i] && r[3 * i] <= r[3 * i + 1] && r[3 * i + 1] <= numel)) return -1;
    first_unit[i + 1] = first_unit[i] + (r[3 * i + 1] - r[3 * i] + kUnit - 1) / kUnit;
  }
  if (found_inf != nullptr && found_inf[0] == 1.0f) return 0;
  const Isa best = best_isa();
  const Isa use = isa < 0 ? best : static_cast<Isa>(std::min(isa, static_cast<int>(best)));
  const Coeffs decayed = coeffs(lr, beta1, beta2, weight_decay, eps, step, grad_scale);
  const Coeffs plain = coeffs(lr, beta1, beta2, 0.0, eps, step, grad_scale);
  parallel_for(first_unit[k], kGrain, threads, [&](int64_t begin, int64_t end) {
    int64_t i = std::upper_bound(first_unit.begin(), first_unit.end(), begin) - first_unit.begin() - 1;
    for (; i < k && first_unit[i] < end; ++i) {
      const int64_t start = r[3 * i], stop = r[3 * i + 1];
      const Coeffs& c = r[3 * i + 2] ? decayed : plain;
      const int64_t lo = start + (std::max(begin, first_unit[i]) - first_unit[i]) * kUnit;
      const int64_t hi = std::min(stop, start + (std::min(end, first_unit[i + 1]) - first_unit[i]) * kUnit);
      const int64_t vector_end = start + (stop - start) / kTorchVector * kTorchVector;  // scalar from here
      const int64_t body_hi = std::min(hi, vector_end);
      if (body_hi > lo) body(use, p + lo, g + lo, m + lo, v + lo, body_hi - lo, c);
      for (int64_t j = std::max(lo, vector_end); j < hi; ++j) tail_element(p + j, g + j, m + j, v + j, c);
    }
  });
  return 0;
}

}  // extern "C"
