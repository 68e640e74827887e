// The fused kernels of kernels.h for a GPU (Note [Fused CUDA kernels]): the
// same entry points and arithmetic as the CPU's kernels_impl.h, over device
// pointers. Written once for two compilers: kernels_cuda.cu defines the MT_
// macros as CUDA's and builds `cuda_table`; the unit tests define them as a
// CPU emulation of blocks and threads (tests/harness/cuda_emulation.h) and
// check every entry against the CPU's default table on machines without a GPU.
//
// The includer defines: MT_GLOBAL (a kernel's `void` and qualifiers), MT_DEVICE (a device function),
// MT_SHARED (a block's shared array), MT_SYNC() (the block's barrier),
// MT_TID / MT_BID_X / MT_BID_Y / MT_GRID_X (thread and block indices),
// MT_ATOMIC_ADD(float*, float) and MT_LAUNCH(kernel, grid_x, grid_y, args...)
// (MT_THREADS, 256 unless set, threads a block
// on the current stream), and MT_VARIANT, the
// namespace that keeps the two compilers' copies apart in one program.
#pragma once

#include "meshtrain/model/fused/kernels.h"

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>

namespace meshtrain::model::fused::kernel::gpu::MT_VARIANT {

// Note [Fused CUDA kernels]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A row's operators (the norms, cross-entropy) take one block of kThreads
// threads a row: each thread strides over the row's columns and the block adds
// or takes the maximum of their partials in shared memory. A residual sum in
// a 16-bit h is made again from x and r in each pass, so the norm reads the
// fp32 sum the CPU's kernel keeps in its row buffer. Elementwise operators
// stride over their elements from a grid of at most kMaxBlocks blocks. Column
// sums (a norm's weight and bias gradients, the GELU's bias gradient) take a
// thread a column over kRowsPerBlock rows, added into the fp32 total
// atomically. The arithmetic is fp32 as on the CPU; the tanh-GELU and the
// sigmoid are the same formulas, so the two agree to rounding. RoPE, the
// attention softmax and the squared sum have no GPU kernel (null in the table):
// on a GPU attention is ATen's flash kernel and the callers compose the rest.
#ifndef MT_THREADS
#define MT_THREADS 256
#endif
constexpr int kThreads = MT_THREADS;  // a power of two (block_reduce halves it)
constexpr int64_t kMaxBlocks = 65535;
constexpr int64_t kRowsPerBlock = 64;

MT_DEVICE float ld(const void* p, Dt t, int64_t i) {
  return t == Dt::kFloat ? static_cast<const float*>(p)[i]
                         : static_cast<float>(static_cast<const c10::BFloat16*>(p)[i]);
}

MT_DEVICE void st(void* p, Dt t, int64_t i, float v) {
  if (t == Dt::kFloat) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<c10::BFloat16*>(p)[i] = c10::BFloat16(v);
  }
}

// The block's sum (or maximum) of each thread's v, returned to every thread.
MT_DEVICE float block_reduce(float v, float* buffer, bool maximum) {
  const int t = MT_TID;
  buffer[t] = v;
  MT_SYNC();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (t < s) buffer[t] = maximum ? fmaxf(buffer[t], buffer[t + s]) : buffer[t] + buffer[t + s];
    MT_SYNC();
  }
  const float out = buffer[0];
  MT_SYNC();  // every thread has read it before the buffer is used again
  return out;
}

constexpr float kK0 = 0.7978845608028654f, kK1 = 0.044715f;

MT_DEVICE float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// gelu_tanh(z) = z·sigmoid(2u), u = k0·(z + k1·z³), and its derivative.
MT_DEVICE float gelu(float z) { return z * sigmoid(2 * kK0 * (z + kK1 * z * z * z)); }
MT_DEVICE float gelu_derivative(float z) {
  const float z2 = z * z, s = sigmoid(2 * kK0 * (z + kK1 * z2 * z));
  return s + z * s * (1.0f - s) * (2 * kK0) * (1.0f + 3 * kK1 * z2);
}

// h = x + r at `i` (x alone without r).
MT_DEVICE float summed(const void* x, Dt xt, const void* r, Dt rt, int64_t i) {
  return r != nullptr ? ld(x, xt, i) + ld(r, rt, i) : ld(x, xt, i);
}

// One block a row.
MT_GLOBAL add_norm_forward_rows(Norm n, const void* x, Dt xt, const void* r, Dt rt, void* h, Dt ht, void* y,
                                     Dt yt, float* mean_out, float* rstd_out) {
  MT_SHARED float buffer[kThreads];
  const int64_t w = n.width;
  for (int64_t row = MT_BID_X; row < n.rows; row += MT_GRID_X) {
    const int64_t offset = row * w;
    float s = 0;
    for (int64_t j = MT_TID; j < w; j += kThreads) {
      const float v = summed(x, xt, r, rt, offset + j);
      if (r != nullptr) st(h, ht, offset + j, v);
      s += v;
    }
    const float mean = n.rms ? 0.0f : block_reduce(s, buffer, false) / static_cast<float>(w);
    float squares = 0;
    for (int64_t j = MT_TID; j < w; j += kThreads) {
      const float d = summed(x, xt, r, rt, offset + j) - mean;
      squares += d * d;
    }
    const float rstd = 1.0f / sqrtf(block_reduce(squares, buffer, false) / static_cast<float>(w) + n.eps);
    for (int64_t j = MT_TID; j < w; j += kThreads) {
      float v = (summed(x, xt, r, rt, offset + j) - mean) * rstd * n.weight[j];
      if (n.bias != nullptr) v += n.bias[j];
      st(y, yt, offset + j, v);
    }
    if (MT_TID == 0) mean_out[row] = mean, rstd_out[row] = rstd;
  }
}

MT_GLOBAL add_norm_backward_rows(Norm n, const void* h, Dt ht, const void* dy, Dt dyt, const void* dh, Dt dht,
                                      const float* mean_in, const float* rstd_in, void* dx, Dt dxt, void* dr,
                                      Dt drt) {
  MT_SHARED float buffer[kThreads];
  const int64_t w = n.width;
  for (int64_t row = MT_BID_X; row < n.rows; row += MT_GRID_X) {
    const int64_t offset = row * w;
    const float mean = mean_in[row], rstd = rstd_in[row];
    float dot = 0, sum = 0;
    for (int64_t j = MT_TID; j < w; j += kThreads) {
      const float g = ld(dy, dyt, offset + j) * n.weight[j];
      dot += g * (ld(h, ht, offset + j) - mean) * rstd;
      sum += g;
    }
    const float c1 = block_reduce(dot, buffer, false) / static_cast<float>(w);
    const float c2 = n.rms ? 0.0f : block_reduce(sum, buffer, false) / static_cast<float>(w);
    for (int64_t j = MT_TID; j < w; j += kThreads) {
      const float xhat = (ld(h, ht, offset + j) - mean) * rstd;
      float d = rstd * (ld(dy, dyt, offset + j) * n.weight[j] - c2 - xhat * c1);
      if (dh != nullptr) d += ld(dh, dht, offset + j);
      st(dx, dxt, offset + j, d);
      if (dr != nullptr) st(dr, drt, offset + j, d);
    }
  }
}

// A thread a column, a block's kRowsPerBlock-row slice of rows (blockIdx.y
// strides over the slices): dweight += Σ dy·xhat, dbias += Σ dy.
MT_GLOBAL add_norm_backward_columns(Norm n, const void* h, Dt ht, const void* dy, Dt dyt, const float* mean_in,
                                         const float* rstd_in, float* dweight, float* dbias, int64_t slices) {
  const int64_t j = static_cast<int64_t>(MT_BID_X) * kThreads + MT_TID;
  if (j >= n.width) return;  // no barrier below
  float gw = 0, gb = 0;
  for (int64_t slice = MT_BID_Y; slice < slices; slice += kMaxBlocks) {
    const int64_t end = slice * kRowsPerBlock + kRowsPerBlock < n.rows ? slice * kRowsPerBlock + kRowsPerBlock : n.rows;
    for (int64_t row = slice * kRowsPerBlock; row < end; ++row) {
      const float g = ld(dy, dyt, row * n.width + j);
      gw += g * (ld(h, ht, row * n.width + j) - mean_in[row]) * rstd_in[row];
      gb += g;
    }
  }
  if (dweight != nullptr) MT_ATOMIC_ADD(dweight + j, gw);
  if (dbias != nullptr) MT_ATOMIC_ADD(dbias + j, gb);
}

MT_GLOBAL bias_gelu_forward_elements(int64_t n, int64_t width, const void* a, Dt at, const float* bias, void* y,
                                          Dt yt) {
  for (int64_t i = static_cast<int64_t>(MT_BID_X) * kThreads + MT_TID; i < n;
       i += static_cast<int64_t>(MT_GRID_X) * kThreads) {
    const float z = bias != nullptr ? ld(a, at, i) + bias[i % width] : ld(a, at, i);
    st(y, yt, i, gelu(z));
  }
}

MT_GLOBAL bias_gelu_backward_elements(int64_t n, int64_t width, const void* a, Dt at, const float* bias,
                                           const void* dy, Dt dyt, void* da, Dt dat) {
  for (int64_t i = static_cast<int64_t>(MT_BID_X) * kThreads + MT_TID; i < n;
       i += static_cast<int64_t>(MT_GRID_X) * kThreads) {
    const float z = bias != nullptr ? ld(a, at, i) + bias[i % width] : ld(a, at, i);
    st(da, dat, i, ld(dy, dyt, i) * gelu_derivative(z));
  }
}

// dbias += the column sums of da, made again in fp32 as the CPU sums them.
MT_GLOBAL bias_gelu_backward_columns(int64_t rows, int64_t width, const void* a, Dt at, const float* bias,
                                          const void* dy, Dt dyt, float* dbias, int64_t slices) {
  const int64_t j = static_cast<int64_t>(MT_BID_X) * kThreads + MT_TID;
  if (j >= width) return;
  float sum = 0;
  for (int64_t slice = MT_BID_Y; slice < slices; slice += kMaxBlocks) {
    const int64_t end = slice * kRowsPerBlock + kRowsPerBlock < rows ? slice * kRowsPerBlock + kRowsPerBlock : rows;
    for (int64_t row = slice * kRowsPerBlock; row < end; ++row) {
      sum += ld(dy, dyt, row * width + j) * gelu_derivative(ld(a, at, row * width + j) + (bias != nullptr ? bias[j] : 0.0f));
    }
  }
  MT_ATOMIC_ADD(dbias + j, sum);
}

MT_GLOBAL glu_forward_elements(int64_t n, const void* g, const void* u, void* y, Dt t, bool use_gelu) {
  for (int64_t i = static_cast<int64_t>(MT_BID_X) * kThreads + MT_TID; i < n;
       i += static_cast<int64_t>(MT_GRID_X) * kThreads) {
    const float gv = ld(g, t, i);
    st(y, t, i, (use_gelu ? gelu(gv) : gv * sigmoid(gv)) * ld(u, t, i));
  }
}

// dg and du may be g and u (Note [GLU gradients in the saved tensors]): each
// element is read before it is written, by the same thread.
MT_GLOBAL glu_backward_elements(int64_t n, const void* g, const void* u, const void* dy, void* dg, void* du, Dt t,
                                     bool use_gelu) {
  for (int64_t i = static_cast<int64_t>(MT_BID_X) * kThreads + MT_TID; i < n;
       i += static_cast<int64_t>(MT_GRID_X) * kThreads) {
    const float gv = ld(g, t, i), uv = ld(u, t, i), d = ld(dy, t, i);
    float value = 0, derivative = 0;
    if (use_gelu) {
      value = gelu(gv), derivative = gelu_derivative(gv);
    } else {
      const float s = sigmoid(gv);
      value = gv * s, derivative = s * (1.0f + gv * (1.0f - s));
    }
    st(dg, t, i, d * uv * derivative);
    st(du, t, i, d * value);
  }
}

MT_GLOBAL cross_entropy_forward_rows(int64_t rows, int64_t vocab, const void* logits, Dt lt,
                                          const int64_t* targets, int64_t ignore, float* lse, float* loss) {
  MT_SHARED float buffer[kThreads];
  for (int64_t row = MT_BID_X; row < rows; row += MT_GRID_X) {
    const int64_t offset = row * vocab;
    float m = -INFINITY;
    for (int64_t j = MT_TID; j < vocab; j += kThreads) m = fmaxf(m, ld(logits, lt, offset + j));
    m = block_reduce(m, buffer, true);
    float s = 0;
    for (int64_t j = MT_TID; j < vocab; j += kThreads) s += expf(ld(logits, lt, offset + j) - m);
    s = block_reduce(s, buffer, false);
    if (MT_TID == 0) {
      const float l = m + logf(s);
      const int64_t target = targets[row];
      lse[row] = l;
      loss[row] = target == ignore ? 0.0f : (target >= 0 && target < vocab ? l - ld(logits, lt, offset + target) : l);
    }
  }
}

MT_GLOBAL cross_entropy_backward_rows(int64_t rows, int64_t vocab, const void* logits, Dt lt,
                                           const int64_t* targets, int64_t ignore, const float* lse, float scale,
                                           void* dlogits) {
  for (int64_t row = MT_BID_X; row < rows; row += MT_GRID_X) {
    const int64_t offset = row * vocab, target = targets[row];
    for (int64_t j = MT_TID; j < vocab; j += kThreads) {
      float d = 0;
      if (target != ignore) {
        d = expf(ld(logits, lt, offset + j) - lse[row]) * scale;
        if (j == target) d -= scale;
      }
      st(dlogits, lt, offset + j, d);
    }
  }
}

MT_GLOBAL add_into_elements(int64_t n, const void* x, Dt t, float* y) {
  for (int64_t i = static_cast<int64_t>(MT_BID_X) * kThreads + MT_TID; i < n;
       i += static_cast<int64_t>(MT_GRID_X) * kThreads) {
    y[i] += ld(x, t, i);
  }
}

inline int64_t element_blocks(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks);
}
inline int64_t row_blocks(int64_t rows) { return rows < 1 ? 1 : (rows > kMaxBlocks ? kMaxBlocks : rows); }
inline int64_t column_blocks(int64_t width) { return (width + kThreads - 1) / kThreads; }
inline int64_t slices_of(int64_t rows) { return (rows + kRowsPerBlock - 1) / kRowsPerBlock; }
inline int64_t slice_blocks(int64_t rows) {
  const int64_t s = slices_of(rows);
  return s < 1 ? 1 : (s > kMaxBlocks ? kMaxBlocks : s);
}

// The table's entries: kernels.h's signatures, launched on the current stream.
struct Launch {
  static void add_norm_forward(const Norm& n, const void* x, Dt xt, const void* r, Dt rt, void* h, Dt ht, void* y,
                               Dt yt, float* mean, float* rstd) {
    if (n.rows == 0) return;
    MT_LAUNCH(add_norm_forward_rows, row_blocks(n.rows), 1, n, x, xt, r, rt, h, ht, y, yt, mean, rstd);
  }
  static void add_norm_backward(const Norm& n, const void* h, Dt ht, const void* dy, Dt dyt, const void* dh, Dt dht,
                                const float* mean, const float* rstd, void* dx, Dt dxt, void* dr, Dt drt,
                                float* dweight, float* dbias) {
    if (n.rows == 0) return;
    // The columns first: with dr or dx written over nothing they read, either order would do.
    if (dweight != nullptr || dbias != nullptr) {
      MT_LAUNCH(add_norm_backward_columns, column_blocks(n.width), slice_blocks(n.rows), n, h, ht, dy, dyt, mean, rstd,
                dweight, dbias, slices_of(n.rows));
    }
    MT_LAUNCH(add_norm_backward_rows, row_blocks(n.rows), 1, n, h, ht, dy, dyt, dh, dht, mean, rstd, dx, dxt, dr, drt);
  }
  static void bias_gelu_forward(int64_t rows, int64_t width, const void* a, Dt at, const float* bias, void* y, Dt yt) {
    if (rows * width == 0) return;
    MT_LAUNCH(bias_gelu_forward_elements, element_blocks(rows * width), 1, rows * width, width, a, at, bias, y, yt);
  }
  static void bias_gelu_backward(int64_t rows, int64_t width, const void* a, Dt at, const float* bias, const void* dy,
                                 Dt dyt, void* da, Dt dat, float* dbias) {
    if (rows * width == 0) return;
    // The column sums read a and dy before da is written: da may be a (Note [GLU gradients in the saved tensors]).
    if (dbias != nullptr) {
      MT_LAUNCH(bias_gelu_backward_columns, column_blocks(width), slice_blocks(rows), rows, width, a, at, bias, dy, dyt,
                dbias, slices_of(rows));
    }
    MT_LAUNCH(bias_gelu_backward_elements, element_blocks(rows * width), 1, rows * width, width, a, at, bias, dy, dyt,
              da, dat);
  }
  static void glu_forward(int64_t n, const void* g, const void* u, void* y, Dt t, bool use_gelu) {
    if (n == 0) return;
    MT_LAUNCH(glu_forward_elements, element_blocks(n), 1, n, g, u, y, t, use_gelu);
  }
  static void glu_backward(int64_t n, const void* g, const void* u, const void* dy, void* dg, void* du, Dt t,
                           bool use_gelu) {
    if (n == 0) return;
    MT_LAUNCH(glu_backward_elements, element_blocks(n), 1, n, g, u, dy, dg, du, t, use_gelu);
  }
  static void cross_entropy_forward(int64_t rows, int64_t vocab, const void* logits, Dt lt, const int64_t* targets,
                                    int64_t ignore, float* lse, float* loss) {
    if (rows == 0) return;
    MT_LAUNCH(cross_entropy_forward_rows, row_blocks(rows), 1, rows, vocab, logits, lt, targets, ignore, lse, loss);
  }
  static void cross_entropy_backward(int64_t rows, int64_t vocab, const void* logits, Dt lt, const int64_t* targets,
                                     int64_t ignore, const float* lse, float scale, void* dlogits) {
    if (rows == 0) return;
    MT_LAUNCH(cross_entropy_backward_rows, row_blocks(rows), 1, rows, vocab, logits, lt, targets, ignore, lse, scale,
              dlogits);
  }
  static void add_into(int64_t n, const void* x, Dt t, float* y) {
    if (n == 0) return;
    MT_LAUNCH(add_into_elements, element_blocks(n), 1, n, x, t, y);
  }
};

// The table of these kernels; RoPE, the attention softmax and the squared sum are null.
inline Table make_gpu_table() {
  Table t{};
  t.add_norm_forward = Launch::add_norm_forward;
  t.add_norm_backward = Launch::add_norm_backward;
  t.bias_gelu_forward = Launch::bias_gelu_forward;
  t.bias_gelu_backward = Launch::bias_gelu_backward;
  t.glu_forward = Launch::glu_forward;
  t.glu_backward = Launch::glu_backward;
  t.cross_entropy_forward = Launch::cross_entropy_forward;
  t.cross_entropy_backward = Launch::cross_entropy_backward;
  t.add_into = Launch::add_into;
  return t;
}

}  // namespace meshtrain::model::fused::kernel::gpu::MT_VARIANT
