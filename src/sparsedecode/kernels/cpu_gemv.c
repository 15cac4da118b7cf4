/* Input-sparse GEMV on CPU: y = sum over kept i of x[i] * W[i, :] (+ bias), reading only the
 * rows of kept input channels (ByteCross §3.2; TEAL's one-token decode kernel, on CPU).
 *
 * W is (K, N) row-major with leading dimension ldw (the (in, out) layout SparseLinear keeps, so a
 * kept channel is one contiguous row and a dropped one is a row never touched). Channel i is kept
 * iff |x[i]| > t in float32 (a NaN channel is dropped, as the Triton kernel and keep_mask do).
 * x, bias and y are float32; W is float32, bfloat16 or float16 (widened in registers).
 *
 * The kept rows are listed once; each thread takes a contiguous run of them and streams each
 * whole row (long sequential reads the prefetchers follow), four rows per pass over its float32
 * accumulator of N, which stays in L1/L2; thread 0 accumulates into y, the others into their own
 * partial sums, added into y at the end (why not column tiles: docs/kernels/cpu_gemv.md). Built at first use by
 * kernels/cpu_gemv.py with the host compiler (-O3 -march=native -fopenmp), against the libgomp
 * torch has already loaded.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

#define AS_IS(v) (v)

/* acc[0..N) += sum over r in [r0, r1) of x[idx[r]] * widen(W[idx[r], 0..N)) */
#define ROWS_FN(NAME, ELEM_T, WIDEN)                                                           \
  static void NAME(float *restrict acc, const ELEM_T *restrict w, long ldw,                   \
                   const int32_t *idx, const float *x, long r0, long r1, long N) {           \
    long r = r0;                                                                               \
    for (; r + 4 <= r1; r += 4) {                                                              \
      const ELEM_T *restrict w0 = w + (long)idx[r] * ldw, *restrict w1 = w + (long)idx[r + 1] * ldw; \
      const ELEM_T *restrict w2 = w + (long)idx[r + 2] * ldw, *restrict w3 = w + (long)idx[r + 3] * ldw; \
      float x0 = x[idx[r]], x1 = x[idx[r + 1]], x2 = x[idx[r + 2]], x3 = x[idx[r + 3]];        \
      _Pragma("omp simd") for (long j = 0; j < N; j++)                                         \
        acc[j] += x0 * WIDEN(w0[j]) + x1 * WIDEN(w1[j]) + x2 * WIDEN(w2[j]) + x3 * WIDEN(w3[j]); \
    }                                                                                          \
    for (; r < r1; r++) {                                                                      \
      const ELEM_T *restrict w0 = w + (long)idx[r] * ldw;                                      \
      float x0 = x[idx[r]];                                                                    \
      _Pragma("omp simd") for (long j = 0; j < N; j++) acc[j] += x0 * WIDEN(w0[j]);           \
    }                                                                                          \
  }

/* The entry: returns the number of kept rows; -1 when memory could not be allocated.
 * With an adapter (a != NULL: a LoRA update of the same site, kernels/lora_gemv.py) it adds
 * s * B (A x_m): A^T (K, r) row-major is read only in the rows of kept channels, as W is (each thread
 * adds its share of them into its own u partial of r floats), then the r rows of B^T (r, N) are
 * streamed into y, weighted by s * u, the threads splitting the columns. */
#define GEMV_FN(NAME, LORA_NAME, ROWS, ELEM_T)                                                 \
  long LORA_NAME(const float *x, const ELEM_T *w, const float *bias, float *y, long K, long N, \
                 long ldw, float t, const ELEM_T *a, const ELEM_T *b, long r, float s,         \
                 int nthreads) {                                                               \
    long most = K > r ? K : r;                                                                 \
    int32_t *idx = malloc((most > 0 ? most : 1) * sizeof(int32_t));                            \
    if (!idx) return -1;                                                                       \
    long n = 0;                                                                                \
    for (long i = 0; i < K; i++)                                                               \
      if (fabsf(x[i]) > t) idx[n++] = (int32_t)i;                                              \
    long nth = nthreads > 0 ? nthreads : 1;                                                    \
    if (nth > n / 8) nth = n / 8 > 0 ? n / 8 : 1; /* a thread streams at least 8 rows */       \
    float *part = nth > 1 ? malloc((nth - 1) * N * sizeof(float)) : NULL;                      \
    float *u = a ? calloc((nth + 1) * r, sizeof(float)) : NULL; /* nth partials, then u */    \
    if ((nth > 1 && !part) || (a && !u)) { free(u); free(part); free(idx); return -1; }        \
    _Pragma("omp parallel for num_threads(nth) schedule(static)")                              \
    for (long tid = 0; tid < nth; tid++) {                                                     \
      float *acc = tid == 0 ? y : part + (tid - 1) * N;                                        \
      for (long j = 0; j < N; j++) acc[j] = (tid == 0 && bias) ? bias[j] : 0.0f;              \
      ROWS(acc, w, ldw, idx, x, n * tid / nth, n * (tid + 1) / nth, N);                        \
      if (a) ROWS(u + tid * r, a, r, idx, x, n * tid / nth, n * (tid + 1) / nth, r);           \
    }                                                                                          \
    for (long p = 0; p + 1 < nth; p++) {                                                       \
      const float *restrict ps = part + p * N;                                                 \
      _Pragma("omp simd") for (long j = 0; j < N; j++) y[j] += ps[j];                          \
    }                                                                                          \
    if (a) {                                                                                   \
      float *us = u + nth * r;                                                                 \
      for (long k = 0; k < r; k++) {                                                           \
        float sum = 0.0f;                                                                      \
        for (long p = 0; p < nth; p++) sum += u[p * r + k];                                    \
        us[k] = s * sum;                                                                       \
        idx[k] = (int32_t)k;                                                                   \
      }                                                                                        \
      long cth = nthreads > 0 ? nthreads : 1;                                                  \
      if (cth > N / 256) cth = N / 256 > 0 ? N / 256 : 1;                                      \
      _Pragma("omp parallel for num_threads(cth) schedule(static)")                            \
      for (long tid = 0; tid < cth; tid++) {                                                   \
        long lo = N * tid / cth, hi = N * (tid + 1) / cth;                                     \
        ROWS(y + lo, b + lo, N, idx, us, 0, r, hi - lo);                                       \
      }                                                                                        \
    }                                                                                          \
    free(u);                                                                                   \
    free(part);                                                                                \
    free(idx);                                                                                 \
    return n;                                                                                  \
  }                                                                                            \
  long NAME(const float *x, const ELEM_T *w, const float *bias, float *y, long K, long N,     \
            long ldw, float t, int nthreads) {                                                 \
    return LORA_NAME(x, w, bias, y, K, N, ldw, t, NULL, NULL, 0, 0.0f, nthreads);              \
  }

/* Segmented: the columns of W are nseg sites side by side (q|k|v or gate|up, one fused weight),
 * columns [ends[j-1], ends[j]) of site j, each with its own threshold t[j] (one threshold per
 * (layer, projection), ByteCross §3.2). Site j reads its column slice of the rows kept under
 * t[j]; each thread takes its share of every site's kept list: one call where there were two or
 * three. kept[j] receives site j's kept rows; returns 0, or -1 when memory could not be allocated.
 * (Where every site holds the same threshold, sd_gemv_rows over all N columns reads each kept row
 * in one pass: a dense step.) */
#define SEGS_FN(NAME, ROWS, ELEM_T)                                                            \
  long NAME(const float *x, const ELEM_T *w, const float *bias, float *y, long K, long N,     \
            long ldw, long nseg, const long *ends, const float *t, long *kept, int nthreads) { \
    int32_t *idx = malloc((K > 0 ? K : 1) * (nseg > 0 ? nseg : 1) * sizeof(int32_t));         \
    if (!idx) return -1;                                                                       \
    long most = 0;                                                                             \
    for (long j = 0; j < nseg; j++) {                                                          \
      long n = 0;                                                                              \
      for (long i = 0; i < K; i++)                                                             \
        if (fabsf(x[i]) > t[j]) idx[j * K + n++] = (int32_t)i;                                 \
      kept[j] = n;                                                                             \
      if (n > most) most = n;                                                                  \
    }                                                                                          \
    long nth = nthreads > 0 ? nthreads : 1;                                                    \
    if (nth > most / 8) nth = most / 8 > 0 ? most / 8 : 1;                                    \
    float *part = nth > 1 ? malloc((nth - 1) * N * sizeof(float)) : NULL;                      \
    if (nth > 1 && !part) { free(idx); return -1; }                                            \
    _Pragma("omp parallel for num_threads(nth) schedule(static)")                              \
    for (long tid = 0; tid < nth; tid++) {                                                     \
      float *acc = tid == 0 ? y : part + (tid - 1) * N;                                        \
      for (long c = 0; c < N; c++) acc[c] = (tid == 0 && bias) ? bias[c] : 0.0f;              \
      for (long j = 0; j < nseg; j++) {                                                        \
        long lo = j ? ends[j - 1] : 0, n = kept[j];                                            \
        ROWS(acc + lo, w + lo, ldw, idx + j * K, x, n * tid / nth, n * (tid + 1) / nth, ends[j] - lo); \
      }                                                                                        \
    }                                                                                          \
    for (long p = 0; p + 1 < nth; p++) {                                                       \
      const float *restrict s = part + p * N;                                                  \
      _Pragma("omp simd") for (long c = 0; c < N; c++) y[c] += s[c];                           \
    }                                                                                          \
    free(part);                                                                                \
    free(idx);                                                                                 \
    return 0;                                                                                  \
  }

ROWS_FN(rows_f32, float, AS_IS)
GEMV_FN(sd_gemv_rows_f32, sd_gemv_lora_f32, rows_f32, float)
SEGS_FN(sd_gemv_segs_f32, rows_f32, float)
ROWS_FN(rows_bf16, uint16_t, bf16_f32)
GEMV_FN(sd_gemv_rows_bf16, sd_gemv_lora_bf16, rows_bf16, uint16_t)
SEGS_FN(sd_gemv_segs_bf16, rows_bf16, uint16_t)
#ifdef __FLT16_MAX__
#define F16_F32(v) ((float)(v))
ROWS_FN(rows_f16, _Float16, F16_F32)
GEMV_FN(sd_gemv_rows_f16, sd_gemv_lora_f16, rows_f16, _Float16)
SEGS_FN(sd_gemv_segs_f16, rows_f16, _Float16)
#endif

/* CATS's up projection on CPU (SATS paper §2): h[j] = act[j] * (W[j, :] . x + bias[j]) for the
 * kept channels |act[j]| > t, and exactly 0 for the others, whose rows of the row-major (N, K) up
 * weight are never read. Returns the number of kept channels. */
#define GATHER_FN(NAME, ELEM_T, WIDEN)                                                         \
  long NAME(const float *x, const ELEM_T *w, const float *act, const float *bias, float *h,   \
            long K, long N, long ldw, float t, int nthreads) {                                 \
    long n = 0;                                                                                \
    long nth = nthreads > 0 ? nthreads : 1;                                                    \
    if (nth > N / 64) nth = N / 64 > 0 ? N / 64 : 1;                                           \
    _Pragma("omp parallel for num_threads(nth) schedule(static) reduction(+ : n)")             \
    for (long j = 0; j < N; j++) {                                                             \
      if (!(fabsf(act[j]) > t)) {                                                              \
        h[j] = 0.0f;                                                                           \
        continue;                                                                              \
      }                                                                                        \
      const ELEM_T *restrict wj = w + j * ldw;                                                  \
      float s = 0.0f;                                                                          \
      _Pragma("omp simd reduction(+ : s)") for (long k = 0; k < K; k++) s += WIDEN(wj[k]) * x[k]; \
      h[j] = act[j] * (s + (bias ? bias[j] : 0.0f));                                           \
      n++;                                                                                     \
    }                                                                                          \
    return n;                                                                                  \
  }

GATHER_FN(sd_gather_rows_f32, float, AS_IS)
GATHER_FN(sd_gather_rows_bf16, uint16_t, bf16_f32)
#ifdef __FLT16_MAX__
GATHER_FN(sd_gather_rows_f16, _Float16, F16_F32)
#endif

/* Batched (ByteCross §3.3 and App. F): B tokens x (B, K), one per sequence of a decode batch, each
 * with its own mask |x[b, i]| > t. The weight rows read are those of the union of the channels any
 * token keeps (u_B >= r_P of the rows), each row once for the whole batch; token b adds only the
 * rows it keeps itself, so row b of y is that token's own input-sparse GEMV (summed in another
 * order than sd_gemv_rows: equal to float32 rounding, not bitwise). y is (B, N); kept[b] (may be
 * NULL) receives token b's kept channels. Returns the union's size; -1 when memory could not be
 * allocated. Threads split the union's rows, each with its own (B, N) partial sums. */
#define UNION_FN(NAME, ELEM_T, WIDEN)                                                          \
  long NAME(const float *x, const ELEM_T *w, const float *bias, float *y, long B, long K,     \
            long N, long ldw, float t, long *kept, int nthreads) {                             \
    int32_t *idx = malloc((K > 0 ? K : 1) * sizeof(int32_t));                                  \
    float *xm = malloc((B * K > 0 ? B * K : 1) * sizeof(float));                               \
    if (!idx || !xm) { free(idx); free(xm); return -1; }                                       \
    for (long b = 0; b < B; b++) if (kept) kept[b] = 0;                                        \
    long n = 0;                                                                                \
    for (long i = 0; i < K; i++) {                                                             \
      int any = 0;                                                                             \
      for (long b = 0; b < B; b++) {                                                           \
        float v = x[b * K + i];                                                                \
        int keep = fabsf(v) > t;                                                               \
        xm[b * K + i] = keep ? v : NAN; /* NaN marks a dropped channel of token b */           \
        any |= keep;                                                                           \
        if (kept && keep) kept[b]++;                                                           \
      }                                                                                        \
      if (any) idx[n++] = (int32_t)i;                                                          \
    }                                                                                          \
    long nth = nthreads > 0 ? nthreads : 1;                                                    \
    if (nth > n / 8) nth = n / 8 > 0 ? n / 8 : 1;                                              \
    float *part = nth > 1 ? malloc((nth - 1) * B * N * sizeof(float)) : NULL;                  \
    if (nth > 1 && !part) { free(idx); free(xm); return -1; }                                  \
    _Pragma("omp parallel for num_threads(nth) schedule(static)")                              \
    for (long tid = 0; tid < nth; tid++) {                                                     \
      float *acc = tid == 0 ? y : part + (tid - 1) * B * N;                                    \
      for (long b = 0; b < B; b++)                                                             \
        for (long j = 0; j < N; j++) acc[b * N + j] = (tid == 0 && bias) ? bias[j] : 0.0f;    \
      for (long r = n * tid / nth; r < n * (tid + 1) / nth; r++) {                             \
        const ELEM_T *restrict wi = w + (long)idx[r] * ldw;                                    \
        for (long b = 0; b < B; b++) {                                                         \
          float v = xm[b * K + idx[r]];                                                        \
          if (isnan(v)) continue;                                                              \
          float *restrict a = acc + b * N;                                                     \
          _Pragma("omp simd") for (long j = 0; j < N; j++) a[j] += v * WIDEN(wi[j]);           \
        }                                                                                      \
      }                                                                                        \
    }                                                                                          \
    for (long p = 0; p + 1 < nth; p++) {                                                       \
      const float *restrict s = part + p * B * N;                                              \
      _Pragma("omp simd") for (long c = 0; c < B * N; c++) y[c] += s[c];                       \
    }                                                                                          \
    free(part);                                                                                \
    free(xm);                                                                                  \
    free(idx);                                                                                 \
    return n;                                                                                  \
  }

UNION_FN(sd_gemv_union_f32, float, AS_IS)
UNION_FN(sd_gemv_union_bf16, uint16_t, bf16_f32)
#ifdef __FLT16_MAX__
UNION_FN(sd_gemv_union_f16, _Float16, F16_F32)
#endif
