// The fused CPU kernels' entry points (kernels_impl.h is compiled once per
// instruction set; kernels.cpp picks the table for the CPU it runs on). Rows
// are contiguous; each tensor is fp32 or bf16 (Dt); the arithmetic is fp32.
#pragma once

#include <cstdint>

namespace meshtrain::model::fused::kernel {

enum class Dt { kFloat, kBFloat16 };

struct Norm {
  int64_t rows = 0, width = 0;
  bool rms = false;
  float eps = 1e-5f;
  const float* weight = nullptr;  // [width]
  const float* bias = nullptr;    // [width] or none
};

// Rows of attention scores [rows, k_len] and the keys each sees. Row r is
// query i = r % q_len, at key position i + key_offset. causal: it sees keys
// 0..i + key_offset, and with window > 0 only the last `window` of those.
// documents (causal only): [batch, columns] int64, the column where each
// query's document starts (Batch::documents); the rows of batch element b are
// b·batch_rows .. (b + 1)·batch_rows, and a query sees no key before its start.
struct ScoreRows {
  int64_t rows = 0, q_len = 0, k_len = 0;
  bool causal = false;
  int64_t key_offset = 0, window = 0;
  const int64_t* documents = nullptr;
  int64_t batch_rows = 0, columns = 0;
};

// A [B, H, T, d] operand of rope, its last dimension contiguous: element
// (b, h, t, i) at b·batch + head(h) + t·step + i, where head(h) is
// head_offsets[h] when given (q, k or v among a fused projection's outputs)
// and h·heads otherwise.
struct HeadsView {
  int64_t batch = 0, heads = 0, step = 0;
  const int64_t* head_offsets = nullptr;
  int64_t head(int64_t h) const { return head_offsets != nullptr ? head_offsets[h] : h * heads; }
};

struct Table {
  // h = x + r (r may be null: h is x, not written); y = norm(h) · weight + bias;
  // mean, rstd [rows] kept for backward.
  void (*add_norm_forward)(const Norm& n, const void* x, Dt xt, const void* r, Dt rt, void* h, Dt ht, void* y, Dt yt,
                           float* mean, float* rstd);
  // dx = dh (may be null) + norm's backward of dy; written to dx and, when
  // given, dr. dweight, dbias [width] (may be null) are accumulated into.
  void (*add_norm_backward)(const Norm& n, const void* h, Dt ht, const void* dy, Dt dyt, const void* dh, Dt dht,
                            const float* mean, const float* rstd, void* dx, Dt dxt, void* dr, Dt drt, float* dweight,
                            float* dbias);
  // y = gelu_tanh(a + bias) over rows x width (bias [width] or null).
  void (*bias_gelu_forward)(int64_t rows, int64_t width, const void* a, Dt at, const float* bias, void* y, Dt yt);
  // da = dy · gelu'(a + bias); dbias (may be null) accumulates the column sums of da.
  void (*bias_gelu_backward)(int64_t rows, int64_t width, const void* a, Dt at, const float* bias, const void* dy,
                             Dt dyt, void* da, Dt dat, float* dbias);
  // y = act(g) · u over n elements, act silu (SwiGLU) or, with `gelu`,
  // gelu_tanh (GeGLU); backward gives dg, du.
  void (*glu_forward)(int64_t n, const void* g, const void* u, void* y, Dt t, bool gelu);
  void (*glu_backward)(int64_t n, const void* g, const void* u, const void* dy, void* dg, void* du, Dt t, bool gelu);
  // Per row: lse = logsumexp(logits), loss = lse - logits[target] (0 where
  // target == ignore; lse where the target is outside the vocabulary, as the
  // chunked loss's composition counts a target no share holds). Backward:
  // dlogits = (softmax - onehot) · scale (0 rows where ignored).
  void (*cross_entropy_forward)(int64_t rows, int64_t vocab, const void* logits, Dt lt, const int64_t* targets,
                                int64_t ignore, float* lse, float* loss);
  void (*cross_entropy_backward)(int64_t rows, int64_t vocab, const void* logits, Dt lt, const int64_t* targets,
                                 int64_t ignore, const float* lse, float scale, void* dlogits);
  // Rotary embedding of x [B, H, T, d] (sizes) into y, both as their views
  // say: pairs (i, i + d/2) rotated by sign·angle of positions offset + t
  // (cos, sin [*, d/2]). sign -1 is the backward.
  void (*rope)(const int64_t* sizes, const void* x, const HeadsView& xv, void* y, const HeadsView& yv,
               const float* cos, const float* sin, int64_t offset, float sign, Dt t);
  // Softmax of z = scale · s over each row of attention scores [rows, k_len],
  // the keys of `r` only (the rest of the row is 0); softcap > 0: of
  // c·tanh(z/c) (Gemma 2). Backward: ds = scale · p · (dp - rowsum(p · dp)),
  // times 1 - tanh²(z/c) under a soft-cap, for which it reads the scores s
  // again (else s is unused). p may be s, ds may be dp.
  void (*attention_softmax_forward)(const ScoreRows& r, const void* s, Dt st, float scale, float softcap, void* p,
                                    Dt pt);
  void (*attention_softmax_backward)(const ScoreRows& r, const void* p, Dt pt, const void* dp, Dt dpt, const void* s,
                                     Dt st, float scale, float softcap, void* ds, Dt dst);
  // Σ x² over n contiguous elements in double (each square exact), summed in
  // an order fixed by n alone (the gradient norm: parallel/grad_norm.cpp).
  double (*sum_squares)(int64_t n, const void* x, Dt t);
  // y += x over n contiguous elements: one pass, x read in its dtype
  // (Note [Weight gradients under autocast]).
  void (*add_into)(int64_t n, const void* x, Dt t, float* y);
};

extern const Table avx512_table;   // built on x86-64
extern const Table avx2_table;     // built on x86-64
extern const Table default_table;  // any CPU
// Device pointers, launched on ATen's current stream (kernels_cuda.cu, Note
// [Fused CUDA kernels]); built with -DMESHTRAIN_CUDA_KERNELS=ON. Its rope,
// attention softmax and squared sum are null.
extern const Table cuda_table;

// The table for this CPU.
const Table& table();
// The GPU's table where the build has one, else null.
const Table* gpu_table();

}  // namespace meshtrain::model::fused::kernel
