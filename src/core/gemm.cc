// f32 matrix product with AVX2 and FMA (see gemm.h).
//
// The library is built for baseline x86-64, so these functions carry their own target
// attribute and run only after a CPU check; nothing of the standard library is instantiated
// under that attribute, so no AVX2 code can stand in for a baseline function elsewhere.
//
// Layout: b is copied, 16 columns at a time, into a contiguous panel [k][16] (zero-padded past
// the last column); a micro-kernel keeps a block of up to 6 rows x 16 columns of c in 12
// registers and runs down the panel with one fused multiply-add per row and 8 columns.
#include "gemm.h"

#include <atomic>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define FUNCOL_GEMM_AVX2 1
#endif

namespace funcol::detail {

std::atomic<bool> gemm_f32_disabled{false};

#ifdef FUNCOL_GEMM_AVX2
namespace {

constexpr int64_t kPanel = 16;  // columns per panel: two registers of 8 floats
constexpr int kMaxRows = 6;     // rows per micro-kernel call: 12 accumulators

// r[i][j] becomes r[j][i].
__attribute__((target("avx2,fma"))) inline void transpose8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// panel[p * 16 + q] = b(p, j0 + q) for q < cols, 0 beyond.
__attribute__((target("avx2,fma"))) void pack_panel(int64_t k, const float* b, int64_t b_row,
                                                     int64_t b_col, int64_t j0, int64_t cols,
                                                     float* panel) {
  if (b_col == 1 && cols == kPanel) {
    for (int64_t p = 0; p < k; ++p) {
      const float* src = b + p * b_row + j0;
      _mm256_storeu_ps(panel + p * kPanel, _mm256_loadu_ps(src));
      _mm256_storeu_ps(panel + p * kPanel + 8, _mm256_loadu_ps(src + 8));
    }
    return;
  }
  if (cols < kPanel) {
    for (int64_t p = 0; p < k; ++p) {
      _mm256_storeu_ps(panel + p * kPanel, _mm256_setzero_ps());
      _mm256_storeu_ps(panel + p * kPanel + 8, _mm256_setzero_ps());
    }
  }
  int64_t p0 = 0;
  if (b_row == 1 && cols == kPanel) {
    // A transposed b: 8 x 8 blocks of it, 8 of its rows read along p, transposed in registers.
    for (; p0 + 8 <= k; p0 += 8) {
      for (int64_t q0 = 0; q0 < kPanel; q0 += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(b + (j0 + q0 + i) * b_col + p0);
        transpose8(r);
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(panel + (p0 + i) * kPanel + q0, r[i]);
      }
    }
  }
  for (int64_t p = p0; p < k; ++p) {
    const float* src = b + p * b_row + j0 * b_col;
    for (int64_t q = 0; q < cols; ++q) panel[p * kPanel + q] = src[q * b_col];
  }
}

// Stores one row's two accumulators into c[0 .. cols).
__attribute__((target("avx2,fma"))) inline void store_row(float* row, __m256 lo, __m256 hi,
                                                          int64_t cols) {
  if (cols == kPanel) {
    _mm256_storeu_ps(row, lo);
    _mm256_storeu_ps(row + 8, hi);
    return;
  }
  alignas(32) float tmp[kPanel];
  _mm256_store_ps(tmp, lo);
  _mm256_store_ps(tmp + 8, hi);
  for (int64_t q = 0; q < cols; ++q) row[q] = tmp[q];
}

// One row's step down the panel: l, h += x * (lo, hi).
__attribute__((target("avx2,fma"))) inline void fma_row(const float* x, __m256 lo, __m256 hi,
                                                        __m256& l, __m256& h) {
  const __m256 v = _mm256_broadcast_ss(x);
  l = _mm256_fmadd_ps(v, lo, l);
  h = _mm256_fmadd_ps(v, hi, h);
}

// c[r][0 .. cols) for the R rows starting at a, against one packed panel. The accumulators
// are named variables, not an array: GCC keeps an array's elements in registers but also
// stores them back on every iteration.
template <int R>
__attribute__((target("avx2,fma"))) void micro(int64_t k, const float* a, int64_t a_row,
                                               int64_t a_col, const float* panel, float* c,
                                               int64_t ldc, int64_t cols) {
  static_assert(R >= 1 && R <= kMaxRows);
  __m256 c0l = _mm256_setzero_ps(), c0h = c0l, c1l = c0l, c1h = c0l, c2l = c0l, c2h = c0l;
  __m256 c3l = c0l, c3h = c0l, c4l = c0l, c4h = c0l, c5l = c0l, c5h = c0l;
  for (int64_t p = 0; p < k; ++p) {
    const __m256 lo = _mm256_loadu_ps(panel + p * kPanel);
    const __m256 hi = _mm256_loadu_ps(panel + p * kPanel + 8);
    const float* ap = a + p * a_col;
    fma_row(ap, lo, hi, c0l, c0h);
    if constexpr (R > 1) fma_row(ap + a_row, lo, hi, c1l, c1h);
    if constexpr (R > 2) fma_row(ap + 2 * a_row, lo, hi, c2l, c2h);
    if constexpr (R > 3) fma_row(ap + 3 * a_row, lo, hi, c3l, c3h);
    if constexpr (R > 4) fma_row(ap + 4 * a_row, lo, hi, c4l, c4h);
    if constexpr (R > 5) fma_row(ap + 5 * a_row, lo, hi, c5l, c5h);
  }
  store_row(c, c0l, c0h, cols);
  if constexpr (R > 1) store_row(c + ldc, c1l, c1h, cols);
  if constexpr (R > 2) store_row(c + 2 * ldc, c2l, c2h, cols);
  if constexpr (R > 3) store_row(c + 3 * ldc, c3l, c3h, cols);
  if constexpr (R > 4) store_row(c + 4 * ldc, c4l, c4h, cols);
  if constexpr (R > 5) store_row(c + 5 * ldc, c5l, c5h, cols);
}

__attribute__((target("avx2,fma"))) void gemm_avx2(int64_t m, int64_t n, int64_t k,
                                                    const float* a, int64_t a_row, int64_t a_col,
                                                    const float* b, int64_t b_row, int64_t b_col,
                                                    float* c, float* panel) {
  for (int64_t j0 = 0; j0 < n; j0 += kPanel) {
    const int64_t cols = n - j0 < kPanel ? n - j0 : kPanel;
    pack_panel(k, b, b_row, b_col, j0, cols, panel);
    int64_t i = 0;
    for (; i + kMaxRows <= m; i += kMaxRows) {
      micro<kMaxRows>(k, a + i * a_row, a_row, a_col, panel, c + i * n + j0, n, cols);
    }
    const float* ai = a + i * a_row;
    float* ci = c + i * n + j0;
    switch (m - i) {
      case 5: micro<5>(k, ai, a_row, a_col, panel, ci, n, cols); break;
      case 4: micro<4>(k, ai, a_row, a_col, panel, ci, n, cols); break;
      case 3: micro<3>(k, ai, a_row, a_col, panel, ci, n, cols); break;
      case 2: micro<2>(k, ai, a_row, a_col, panel, ci, n, cols); break;
      case 1: micro<1>(k, ai, a_row, a_col, panel, ci, n, cols); break;
      default: break;
    }
  }
}

}  // namespace

bool have_gemm_f32() {
  static const bool have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return have && !gemm_f32_disabled.load(std::memory_order_relaxed);
}

void gemm_f32(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_row, int64_t a_col,
              const float* b, int64_t b_row, int64_t b_col, float* c) {
  // One panel per thread, kept between calls (a training step makes hundreds of products) up to
  // k = 16384 (1 MiB); a longer one is allocated for the call alone.
  constexpr size_t kKeptFloats = size_t{1} << 18;
  thread_local std::vector<float> kept;
  const auto need = static_cast<size_t>(k * kPanel);
  if (need > kKeptFloats) {
    std::vector<float> panel(need);
    gemm_avx2(m, n, k, a, a_row, a_col, b, b_row, b_col, c, panel.data());
    return;
  }
  if (kept.size() < need) kept.resize(need);
  gemm_avx2(m, n, k, a, a_row, a_col, b, b_row, b_col, c, kept.data());
}

#else

bool have_gemm_f32() { return false; }

void gemm_f32(int64_t, int64_t, int64_t, const float*, int64_t, int64_t, const float*, int64_t,
              int64_t, float*) {}

#endif

}  // namespace funcol::detail
