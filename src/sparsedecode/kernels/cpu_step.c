/* The whole one-token decode step of a Llama-family decoder on CPU in one call (issue 46 item 2;
 * ByteCross App. A's decode step, the modes of §3.2-3.3).
 *
 * Why: the projections of smollm2-135m stream near the CPU ceiling through cpu_gemv.c, yet the
 * eager PyTorch step around them (norms, RoPE, the cache write, SDPA, SiLU, residual adds: some
 * forty operator calls per layer) cost more than the projections did
 * (benchmarks/records/cpu/decode/cpu_step_split_*). Here every layer runs in C: RMSNorm, the
 * fused q|k|v GEMV, q/k norms (Qwen3), RoPE from the model's own tables, the cache write, attention
 * over the valid prefix (or the compact buffer of a KV selection), o, the fused gate|up, SwiGLU,
 * down, and the residual adds; then the final norm and the LM head. The projections are the
 * input-sparse GEMVs of cpu_gemv.c, each site with its own threshold read through a pointer (a
 * dense site's is -inf), so the same call is the dense step and TEAL's.
 *
 * The residual stream and every intermediate stay float32; weights and the cache are float32,
 * bfloat16 or float16, widened in registers (the cache is written in its own dtype). Attention is
 * flash-decoding on the host: each thread takes a contiguous share of the keys for every head,
 * and the shares are merged by log-sum-exp.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NSITES 7 /* q, k, v, o, gate, up, down: the order of kept[] and thr[] */

typedef struct {
  const void *w_qkv, *w_o, *w_gu, *w_down;   /* (in, out) row-major, leading dims below */
  long ld_qkv, ld_o, ld_gu, ld_down;
  const float *b_qkv, *b_o, *b_gu, *b_down;  /* float32 biases or NULL */
  const float *norm_attn, *norm_mlp;         /* (dim,) float32 */
  const float *q_norm, *k_norm;              /* (head_dim,) float32, or NULL */
  const float *thr[NSITES];                  /* each site's threshold (|x| > t keeps a channel) */
  void *k_cache, *v_cache;                   /* (Hkv, t_cache, D): the cache's row 0 */
  long t_cache;
  void *k_comp, *v_comp;                     /* (Hkv, t_comp, D) compact buffer of a selection, or NULL */
  long t_comp;
  const int64_t *comp_offset;                /* slot = position - *comp_offset */
} sd_layer;

typedef struct {
  long n_layers, dim, n_heads, n_kv_heads, head_dim, d_ff, vocab;
  float eps, scale;
  const float *rope_cos, *rope_sin;  /* (rope_len, head_dim) float32 */
  long rope_len;
  const void *embed;                 /* element (token, i) at token * embed_row + i * embed_col */
  long embed_row, embed_col;
  const float *norm_final;           /* (dim,) */
  const void *w_head;                /* (dim, vocab) row-major, or NULL: the step returns the normed state */
  long ld_head;
  const float *b_head;
} sd_model;

/* cpu_gemv.c's entries */
#define GEMV_DECL(S, T)                                                                         \
  long sd_gemv_rows_##S(const float *, const T *, const float *, float *, long, long, long, float, int); \
  long sd_gemv_segs_##S(const float *, const T *, const float *, float *, long, long, long, long, \
                        const long *, const float *, long *, int);
GEMV_DECL(f32, float)
GEMV_DECL(bf16, uint16_t)
#ifdef __FLT16_MAX__
GEMV_DECL(f16, _Float16)
#endif

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to(bfloat16) */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* a quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

#define AS_IS(v) (v)
#define TO_F16(v) ((_Float16)(v))
#define F16_TO_F32(v) ((float)(v))

static void rms_norm(const float *x, const float *w, float *y, long n, float eps) {
  float ss = 0.0f;
  for (long i = 0; i < n; i++) ss += x[i] * x[i];
  float r = 1.0f / sqrtf(ss / (float)n + eps);
  for (long i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

/* x' = x * cos + rotate_half(x) * sin over one head, rotate_half([a, b]) = [-b, a] (models/rope.py) */
static void rope(float *x, const float *c, const float *s, long D) {
  long h = D / 2;
  for (long i = 0; i < h; i++) {
    float a = x[i], b = x[i + h];
    x[i] = a * c[i] - b * s[i];
    x[i + h] = b * c[i + h] + a * s[i + h];
  }
}

static long max_l(long a, long b) { return a > b ? a : b; }

/* Attention of the Hq queries q (Hq, D) over entries [0, len) of kc, vc (Hkv, T, D), head h
 * reading KV head h / (Hq / Hkv); out (Hq, D). Thread `tid` of `nt` scores its share of the keys
 * into s (G x its share), then its (max, sum, weighted values) per head go to m, l, acc and the
 * shares are merged. Returns -1 when the scratch could not be allocated. */
#define ATTEND_FN(NAME, ELEM_T, WIDEN)                                                          \
  static int NAME(const float *q, const ELEM_T *kc, const ELEM_T *vc, long T, long len, long Hq, \
                  long Hkv, long D, float scale, float *out, int nthreads) {                    \
    long G = Hq / Hkv;                                                                          \
    long nt = nthreads > 0 ? nthreads : 1;                                                      \
    if (nt > len / 64) nt = len / 64 > 0 ? len / 64 : 1; /* a thread reads at least 64 keys */  \
    long share = (len + nt - 1) / nt;                                                           \
    float *s = malloc(max_l(nt * G * share, 1) * sizeof(float));                                \
    float *m = malloc(nt * Hq * sizeof(float)), *l = malloc(nt * Hq * sizeof(float));          \
    float *acc = calloc(nt * Hq * D, sizeof(float));                                            \
    if (!s || !m || !l || !acc) { free(s); free(m); free(l); free(acc); return -1; }            \
    _Pragma("omp parallel for num_threads(nt) schedule(static)")                               \
    for (long tid = 0; tid < nt; tid++) {                                                       \
      long lo = len * tid / nt, hi = len * (tid + 1) / nt, n = hi - lo;                         \
      float *st = s + tid * G * share;                                                          \
      for (long g = 0; g < Hkv; g++) {                                                          \
        const ELEM_T *kg = kc + g * T * D, *vg = vc + g * T * D;                                \
        for (long t = 0; t < n; t++) {                                                          \
          const ELEM_T *restrict kr = kg + (lo + t) * D;                                        \
          for (long j = 0; j < G; j++) {                                                        \
            const float *restrict qh = q + (g * G + j) * D;                                     \
            float dot = 0.0f;                                                                   \
            _Pragma("omp simd reduction(+ : dot)") for (long d = 0; d < D; d++) dot += qh[d] * WIDEN(kr[d]); \
            st[j * share + t] = dot * scale;                                                    \
          }                                                                                     \
        }                                                                                       \
        for (long j = 0; j < G; j++) {                                                          \
          long h = g * G + j;                                                                   \
          float *sj = st + j * share, mx = -INFINITY, sum = 0.0f;                               \
          for (long t = 0; t < n; t++) mx = sj[t] > mx ? sj[t] : mx;                            \
          for (long t = 0; t < n; t++) { sj[t] = expf(sj[t] - mx); sum += sj[t]; }              \
          m[tid * Hq + h] = mx;                                                                 \
          l[tid * Hq + h] = sum;                                                                \
        }                                                                                       \
        for (long t = 0; t < n; t++) {                                                          \
          const ELEM_T *restrict vr = vg + (lo + t) * D;                                        \
          for (long j = 0; j < G; j++) {                                                        \
            float p = st[j * share + t], *restrict a = acc + (tid * Hq + g * G + j) * D;        \
            _Pragma("omp simd") for (long d = 0; d < D; d++) a[d] += p * WIDEN(vr[d]);          \
          }                                                                                     \
        }                                                                                       \
      }                                                                                         \
    }                                                                                           \
    for (long h = 0; h < Hq; h++) {                                                             \
      float M = -INFINITY, L = 0.0f;                                                            \
      for (long p = 0; p < nt; p++) M = m[p * Hq + h] > M ? m[p * Hq + h] : M;                  \
      float *o = out + h * D;                                                                   \
      for (long d = 0; d < D; d++) o[d] = 0.0f;                                                 \
      for (long p = 0; p < nt; p++) {                                                           \
        if (!(l[p * Hq + h] > 0.0f)) continue; /* an empty share */                             \
        float w = expf(m[p * Hq + h] - M);                                                      \
        L += w * l[p * Hq + h];                                                                 \
        const float *a = acc + (p * Hq + h) * D;                                                \
        for (long d = 0; d < D; d++) o[d] += w * a[d];                                          \
      }                                                                                         \
      for (long d = 0; d < D; d++) o[d] /= L;                                                   \
    }                                                                                           \
    free(s); free(m); free(l); free(acc);                                                       \
    return 0;                                                                                   \
  }

/* y (sum of widths) = the sites side by side in w (K, N), each reading the rows its own threshold
 * keeps: one pass over each kept row where every threshold is equal (a dense step), else the
 * segmented call. kept[j] receives site j's kept rows. Returns -1 on a failed allocation. */
#define PROJ_FN(NAME, ELEM_T, S)                                                                \
  static int NAME(const float *x, const ELEM_T *w, long ldw, const float *bias, float *y, long K, \
                  long nseg, const long *widths, const float *const *thr, long *kept, int nth) { \
    long ends[3], N = 0;                                                                        \
    float t[3];                                                                                 \
    int same = 1;                                                                               \
    for (long j = 0; j < nseg; j++) {                                                           \
      N += widths[j];                                                                           \
      ends[j] = N;                                                                              \
      t[j] = *thr[j];                                                                           \
      same &= t[j] == t[0];                                                                     \
    }                                                                                           \
    if (same || nseg == 1) {                                                                    \
      long n = sd_gemv_rows_##S(x, w, bias, y, K, N, ldw, t[0], nth);                           \
      for (long j = 0; j < nseg; j++) kept[j] = n;                                              \
      return n < 0 ? -1 : 0;                                                                    \
    }                                                                                           \
    return sd_gemv_segs_##S(x, w, bias, y, K, N, ldw, nseg, ends, t, kept, nth) < 0 ? -1 : 0;   \
  }

/* The step: token at position pos; out receives the float32 logits (vocab), or the normed final
 * state (dim) where the model has no w_head. kept (NSITES per layer, may be NULL) receives each
 * site's kept input channels. Returns 0; -1 when scratch could not be allocated; -2 when pos is
 * outside the cache, the compact buffer or the RoPE tables. */
#define STEP_FN(NAME, ELEM_T, WIDEN, NARROW, ATTEND, PROJ, HEAD)                                    \
  long NAME(const sd_model *md, const sd_layer *layers, long token, long pos, float *out,       \
            long *kept, int nthreads) {                                                         \
    long dim = md->dim, Hq = md->n_heads, Hkv = md->n_kv_heads, D = md->head_dim, ff = md->d_ff; \
    long nq = Hq * D, nkv = Hkv * D;                                                            \
    if (pos < 0 || pos >= md->rope_len) return -2;                                              \
    float *buf = malloc((2 * dim + (nq + 2 * nkv) + nq + 2 * ff + max_l(dim, ff)) * sizeof(float)); \
    if (!buf) return -1;                                                                        \
    float *x = buf, *h = x + dim, *qkv = h + dim, *att = qkv + nq + 2 * nkv, *gu = att + nq;    \
    float *tmp = gu + 2 * ff;                                                                   \
    const ELEM_T *emb = md->embed;                                                              \
    for (long i = 0; i < dim; i++) x[i] = WIDEN(emb[token * md->embed_row + i * md->embed_col]); \
    const float *c = md->rope_cos + pos * D, *sn = md->rope_sin + pos * D;                      \
    long k_dummy[NSITES];                                                                       \
    long rc = 0;                                                                                \
    for (long li = 0; li < md->n_layers && rc == 0; li++) {                                     \
      const sd_layer *L = layers + li;                                                          \
      long *kp = kept ? kept + li * NSITES : k_dummy;                                           \
      long slot = L->k_comp ? pos - *L->comp_offset : 0;                                        \
      if (pos >= L->t_cache || (L->k_comp && (slot < 0 || slot >= L->t_comp))) { rc = -2; break; } \
      rms_norm(x, L->norm_attn, h, dim, md->eps);                                               \
      long wq[3] = {nq, nkv, nkv};                                                              \
      if (PROJ(h, L->w_qkv, L->ld_qkv, L->b_qkv, qkv, dim, 3, wq, L->thr, kp, nthreads)) { rc = -1; break; } \
      float *q = qkv, *k = qkv + nq, *v = k + nkv;                                              \
      for (long hd = 0; hd < Hq; hd++) {                                                        \
        if (L->q_norm) { rms_norm(q + hd * D, L->q_norm, tmp, D, md->eps); memcpy(q + hd * D, tmp, D * sizeof(float)); } \
        rope(q + hd * D, c, sn, D);                                                             \
      }                                                                                         \
      for (long g = 0; g < Hkv; g++) {                                                          \
        if (L->k_norm) { rms_norm(k + g * D, L->k_norm, tmp, D, md->eps); memcpy(k + g * D, tmp, D * sizeof(float)); } \
        rope(k + g * D, c, sn, D);                                                              \
        ELEM_T *kd = (ELEM_T *)L->k_cache + (g * L->t_cache + pos) * D;                         \
        ELEM_T *vd = (ELEM_T *)L->v_cache + (g * L->t_cache + pos) * D;                         \
        for (long d = 0; d < D; d++) { kd[d] = NARROW(k[g * D + d]); vd[d] = NARROW(v[g * D + d]); } \
        if (L->k_comp) {                                                                        \
          ELEM_T *kc = (ELEM_T *)L->k_comp + (g * L->t_comp + slot) * D;                        \
          ELEM_T *vc = (ELEM_T *)L->v_comp + (g * L->t_comp + slot) * D;                        \
          for (long d = 0; d < D; d++) { kc[d] = NARROW(k[g * D + d]); vc[d] = NARROW(v[g * D + d]); } \
        }                                                                                       \
      }                                                                                         \
      int a = L->k_comp                                                                         \
        ? ATTEND(q, L->k_comp, L->v_comp, L->t_comp, slot + 1, Hq, Hkv, D, md->scale, att, nthreads) \
        : ATTEND(q, L->k_cache, L->v_cache, L->t_cache, pos + 1, Hq, Hkv, D, md->scale, att, nthreads); \
      if (a) { rc = -1; break; }                                                                \
      long wo[1] = {dim};                                                                       \
      if (PROJ(att, L->w_o, L->ld_o, L->b_o, h, nq, 1, wo, L->thr + 3, kp + 3, nthreads)) { rc = -1; break; } \
      for (long i = 0; i < dim; i++) x[i] += h[i];                                              \
      rms_norm(x, L->norm_mlp, h, dim, md->eps);                                                \
      long wg[2] = {ff, ff};                                                                    \
      if (PROJ(h, L->w_gu, L->ld_gu, L->b_gu, gu, dim, 2, wg, L->thr + 4, kp + 4, nthreads)) { rc = -1; break; } \
      for (long i = 0; i < ff; i++) { float g = gu[i]; tmp[i] = g / (1.0f + expf(-g)) * gu[ff + i]; } \
      long wd[1] = {dim};                                                                       \
      if (PROJ(tmp, L->w_down, L->ld_down, L->b_down, h, ff, 1, wd, L->thr + 6, kp + 6, nthreads)) { rc = -1; break; } \
      for (long i = 0; i < dim; i++) x[i] += h[i];                                              \
    }                                                                                           \
    if (rc == 0) {                                                                              \
      rms_norm(x, md->norm_final, h, dim, md->eps);                                             \
      if (md->w_head) {                                                                         \
        if (HEAD(h, md->w_head, md->b_head, out, dim, md->vocab, md->ld_head, -INFINITY, nthreads) < 0) \
          rc = -1;                                                                              \
      } else {                                                                                  \
        memcpy(out, h, dim * sizeof(float));                                                    \
      }                                                                                         \
    }                                                                                           \
    free(buf);                                                                                  \
    return rc;                                                                                  \
  }

ATTEND_FN(attend_f32, float, AS_IS)
PROJ_FN(proj_f32, float, f32)
STEP_FN(sd_step_f32, float, AS_IS, AS_IS, attend_f32, proj_f32, sd_gemv_rows_f32)
ATTEND_FN(attend_bf16, uint16_t, bf16_to_f32)
PROJ_FN(proj_bf16, uint16_t, bf16)
STEP_FN(sd_step_bf16, uint16_t, bf16_to_f32, f32_to_bf16, attend_bf16, proj_bf16, sd_gemv_rows_bf16)
#ifdef __FLT16_MAX__
ATTEND_FN(attend_f16, _Float16, F16_TO_F32)
PROJ_FN(proj_f16, _Float16, f16)
STEP_FN(sd_step_f16, _Float16, F16_TO_F32, TO_F16, attend_f16, proj_f16, sd_gemv_rows_f16)
#endif
