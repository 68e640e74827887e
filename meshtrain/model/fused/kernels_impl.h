// The bodies of the fused CPU kernels (kernels.h), compiled once per
// instruction set (kernels_avx512.cpp, kernels_default.cpp) with ATen's
// CPU_CAPABILITY set, so at::vec::Vectorized is that set's. Included only there.
//
// Each row is read once into fp32 (converted from bf16 into a row buffer that
// stays in L1), computed on in fp32 vectors, and written once in its dtype.
#pragma once

#include "meshtrain/model/fused/kernels.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <utility>
#include <vector>

namespace meshtrain::model::fused::kernel {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();

// Calls f(i, count) for each vector's worth of [0, n); the last may be partial
// (Vec::loadu(p, count) fills the rest with zeros).
template <typename F>
inline void each_vec(int64_t n, const F& f) {
  for (int64_t i = 0; i < n; i += kW) f(i, std::min(kW, n - i));
}

inline const float* read_row(const void* base, Dt t, int64_t offset, int64_t n, float* scratch) {
  if (t == Dt::kFloat) return static_cast<const float*>(base) + offset;
  at::vec::convert(static_cast<const c10::BFloat16*>(base) + offset, scratch, n);
  return scratch;
}

// Where to compute a row that goes to `base`: the row itself when it is fp32.
inline float* work_row(void* base, Dt t, int64_t offset, float* scratch) {
  return t == Dt::kFloat ? static_cast<float*>(base) + offset : scratch;
}

inline void write_row(const float* row, void* base, Dt t, int64_t offset, int64_t n) {
  if (t == Dt::kFloat) {
    float* out = static_cast<float*>(base) + offset;
    if (out != row) std::memcpy(out, row, n * sizeof(float));
  } else {
    at::vec::convert(row, static_cast<c10::BFloat16*>(base) + offset, n);
  }
}

inline float horizontal_sum(const Vec& v) {
  float lanes[kW];
  v.store(lanes);
  float s = 0;
  for (int64_t i = 0; i < kW; ++i) s += lanes[i];
  return s;
}

inline int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width)); }

// Per-thread partial sums of [width] vectors, added into `total` once per chunk.
struct Accumulator {
  explicit Accumulator(int64_t width) : values(width, 0.0f) {}
  void add_into(float* total, std::mutex& mutex) const {
    const std::lock_guard<std::mutex> lock(mutex);
    for (size_t i = 0; i < values.size(); ++i) total[i] += values[i];
  }
  std::vector<float> values;
};

void add_norm_forward(const Norm& n, const void* x, Dt xt, const void* r, Dt rt, void* h, Dt ht, void* y, Dt yt,
                      float* mean_out, float* rstd_out) {
  const int64_t w = n.width;
  at::parallel_for(0, n.rows, grain_rows(w), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(4 * w);
    float *s0 = scratch.data(), *s1 = s0 + w, *s2 = s1 + w, *s3 = s2 + w;
    for (int64_t row = begin; row < end; ++row) {
      const int64_t offset = row * w;
      const float* hr = read_row(x, xt, offset, w, s0);
      if (r != nullptr) {
        const float* rr = read_row(r, rt, offset, w, s1);
        float* sum = work_row(h, ht, offset, s2);
        each_vec(w, [&](int64_t i, int64_t c) { (Vec::loadu(hr + i, c) + Vec::loadu(rr + i, c)).store(sum + i, c); });
        write_row(sum, h, ht, offset, w);
        hr = sum;
      }
      Vec acc(0);
      float mean = 0;
      if (!n.rms) {
        each_vec(w, [&](int64_t i, int64_t c) { acc += Vec::loadu(hr + i, c); });
        mean = horizontal_sum(acc) / w;
        acc = Vec(0);
      }
      const Vec vmean(mean);
      each_vec(w, [&](int64_t i, int64_t c) {
        const Vec d = Vec::loadu(hr + i, c) - vmean;
        acc += Vec::set(Vec(0), d * d, c);
      });
      const float rstd = 1.0f / std::sqrt(horizontal_sum(acc) / w + n.eps);
      const Vec vrstd(rstd);
      float* out = work_row(y, yt, offset, s3);
      each_vec(w, [&](int64_t i, int64_t c) {
        Vec v = (Vec::loadu(hr + i, c) - vmean) * vrstd * Vec::loadu(n.weight + i, c);
        if (n.bias != nullptr) v += Vec::loadu(n.bias + i, c);
        v.store(out + i, c);
      });
      write_row(out, y, yt, offset, w);
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
  });
}

void add_norm_backward(const Norm& n, const void* h, Dt ht, const void* dy, Dt dyt, const void* dh, Dt dht,
                       const float* mean_in, const float* rstd_in, void* dx, Dt dxt, void* dr, Dt drt, float* dweight,
                       float* dbias) {
  const int64_t w = n.width;
  std::mutex mutex;
  at::parallel_for(0, n.rows, grain_rows(w), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(4 * w);
    float *s0 = scratch.data(), *s1 = s0 + w, *s2 = s1 + w, *s3 = s2 + w;
    Accumulator gw(dweight ? w : 0), gb(dbias ? w : 0);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t offset = row * w;
      const float* hr = read_row(h, ht, offset, w, s0);
      const float* gr = read_row(dy, dyt, offset, w, s1);
      const Vec vmean(mean_in[row]), vrstd(rstd_in[row]);
      Vec dot(0), sum(0);
      each_vec(w, [&](int64_t i, int64_t c) {
        const Vec xhat = (Vec::loadu(hr + i, c) - vmean) * vrstd;
        const Vec dyv = Vec::loadu(gr + i, c);
        const Vec g = dyv * Vec::loadu(n.weight + i, c);
        dot += Vec::set(Vec(0), g * xhat, c);
        sum += g;
        if (dweight) (Vec::loadu(gw.values.data() + i, c) + dyv * xhat).store(gw.values.data() + i, c);
        if (dbias) (Vec::loadu(gb.values.data() + i, c) + dyv).store(gb.values.data() + i, c);
      });
      const Vec c1(horizontal_sum(dot) / w), c2(n.rms ? 0.0f : horizontal_sum(sum) / w);
      const float* extra = dh ? read_row(dh, dht, offset, w, s2) : nullptr;
      float* out = work_row(dx, dxt, offset, s3);
      each_vec(w, [&](int64_t i, int64_t c) {
        const Vec xhat = (Vec::loadu(hr + i, c) - vmean) * vrstd;
        const Vec g = Vec::loadu(gr + i, c) * Vec::loadu(n.weight + i, c);
        Vec d = vrstd * (g - c2 - xhat * c1);
        if (extra) d += Vec::loadu(extra + i, c);
        d.store(out + i, c);
      });
      write_row(out, dx, dxt, offset, w);
      if (dr) write_row(out, dr, drt, offset, w);
    }
    if (dweight) gw.add_into(dweight, mutex);
    if (dbias) gb.add_into(dbias, mutex);
  });
}

// GELU, tanh approximation: 0.5·z·(1 + tanh(u)), u = k0·(z + k1·z³), computed
// as z·sigmoid(2u) with ATen's polynomial exp (exp_u20): Sleef's tanh is about
// three times slower here.
constexpr float kK0 = 0.7978845608028654f, kK1 = 0.044715f;

inline Vec sigmoid(const Vec& g) { return Vec(1.0f) / (Vec(1.0f) + (Vec(0.0f) - g).exp_u20()); }

void bias_gelu_forward(int64_t rows, int64_t width, const void* a, Dt at, const float* bias, void* y, Dt yt) {
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(2 * width);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t offset = row * width;
      const float* in = read_row(a, at, offset, width, scratch.data());
      float* out = work_row(y, yt, offset, scratch.data() + width);
      each_vec(width, [&](int64_t i, int64_t c) {
        Vec z = Vec::loadu(in + i, c);
        if (bias) z += Vec::loadu(bias + i, c);
        const Vec s = sigmoid(Vec(2 * kK0) * (z + Vec(kK1) * z * z * z));
        (z * s).store(out + i, c);
      });
      write_row(out, y, yt, offset, width);
    }
  });
}

void bias_gelu_backward(int64_t rows, int64_t width, const void* a, Dt at, const float* bias, const void* dy, Dt dyt,
                        void* da, Dt dat, float* dbias) {
  std::mutex mutex;
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(3 * width);
    Accumulator gb(dbias ? width : 0);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t offset = row * width;
      const float* in = read_row(a, at, offset, width, scratch.data());
      const float* grad = read_row(dy, dyt, offset, width, scratch.data() + width);
      float* out = work_row(da, dat, offset, scratch.data() + 2 * width);
      each_vec(width, [&](int64_t i, int64_t c) {
        Vec z = Vec::loadu(in + i, c);
        if (bias) z += Vec::loadu(bias + i, c);
        const Vec z2 = z * z;
        const Vec s = sigmoid(Vec(2 * kK0) * (z + Vec(kK1) * z2 * z));
        const Vec derivative = s + z * s * (Vec(1.0f) - s) * Vec(2 * kK0) * (Vec(1.0f) + Vec(3 * kK1) * z2);
        const Vec d = Vec::loadu(grad + i, c) * derivative;
        d.store(out + i, c);
        if (dbias) (Vec::loadu(gb.values.data() + i, c) + d).store(gb.values.data() + i, c);
      });
      write_row(out, da, dat, offset, width);
    }
    if (dbias) gb.add_into(dbias, mutex);
  });
}

constexpr int64_t kBlock = 4096;

// The gate's activation: silu(g) = g·sigmoid(g) (SwiGLU), or gelu_tanh(g) =
// g·sigmoid(2u) (GeGLU), and its derivative.
inline Vec gate(const Vec& g, bool gelu) {
  return gelu ? g * sigmoid(Vec(2 * kK0) * (g + Vec(kK1) * g * g * g)) : g * sigmoid(g);
}
// The gate's activation and its derivative, from one sigmoid.
inline std::pair<Vec, Vec> gate_and_derivative(const Vec& g, bool gelu) {
  if (!gelu) {
    const Vec s = sigmoid(g);
    return {g * s, s * (Vec(1.0f) + g * (Vec(1.0f) - s))};
  }
  const Vec g2 = g * g;
  const Vec s = sigmoid(Vec(2 * kK0) * (g + Vec(kK1) * g2 * g));
  return {g * s, s + g * s * (Vec(1.0f) - s) * Vec(2 * kK0) * (Vec(1.0f) + Vec(3 * kK1) * g2)};
}

void glu_forward(int64_t n, const void* g, const void* u, void* y, Dt t, bool gelu) {
  at::parallel_for(0, n, kBlock, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(3 * kBlock);
    for (int64_t b = begin; b < end; b += kBlock) {
      const int64_t m = std::min(end, b + kBlock) - b;
      const float* gr = read_row(g, t, b, m, scratch.data());
      const float* ur = read_row(u, t, b, m, scratch.data() + kBlock);
      float* out = work_row(y, t, b, scratch.data() + 2 * kBlock);
      each_vec(m, [&](int64_t i, int64_t c) {
        (gate(Vec::loadu(gr + i, c), gelu) * Vec::loadu(ur + i, c)).store(out + i, c);
      });
      write_row(out, y, t, b, m);
    }
  });
}

void glu_backward(int64_t n, const void* g, const void* u, const void* dy, void* dg, void* du, Dt t, bool gelu) {
  at::parallel_for(0, n, kBlock, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(5 * kBlock);
    float* s = scratch.data();
    for (int64_t b = begin; b < end; b += kBlock) {
      const int64_t m = std::min(end, b + kBlock) - b;
      const float* gr = read_row(g, t, b, m, s);
      const float* ur = read_row(u, t, b, m, s + kBlock);
      const float* dyr = read_row(dy, t, b, m, s + 2 * kBlock);
      float* dgw = work_row(dg, t, b, s + 3 * kBlock);
      float* duw = work_row(du, t, b, s + 4 * kBlock);
      each_vec(m, [&](int64_t i, int64_t c) {
        const Vec dyv = Vec::loadu(dyr + i, c);
        const auto [value, derivative] = gate_and_derivative(Vec::loadu(gr + i, c), gelu);
        (dyv * Vec::loadu(ur + i, c) * derivative).store(dgw + i, c);
        (dyv * value).store(duw + i, c);
      });
      write_row(dgw, dg, t, b, m);
      write_row(duw, du, t, b, m);
    }
  });
}

// The row's maximum: full vectors, then a scalar tail (zero-filled lanes would count).
inline float row_max(const float* x, int64_t n) {
  const int64_t full = n / kW * kW;
  float m = -std::numeric_limits<float>::infinity();
  if (full > 0) {
    Vec vm = Vec::loadu(x);
    for (int64_t i = kW; i < full; i += kW) vm = at::vec::maximum(vm, Vec::loadu(x + i));
    float lanes[kW];
    vm.store(lanes);
    m = *std::max_element(lanes, lanes + kW);
  }
  for (int64_t i = full; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// The row's maximum and sum of exp(x - max).
inline void max_and_sum_exp(const float* x, int64_t n, float& max_out, float& sum_out) {
  const int64_t full = n / kW * kW;
  const float m = row_max(x, n);
  Vec acc(0);
  const Vec vm(m);
  for (int64_t i = 0; i < full; i += kW) acc += (Vec::loadu(x + i) - vm).exp();
  float s = horizontal_sum(acc);
  for (int64_t i = full; i < n; ++i) s += std::exp(x[i] - m);
  max_out = m;
  sum_out = s;
}

void cross_entropy_forward(int64_t rows, int64_t vocab, const void* logits, Dt lt, const int64_t* targets,
                           int64_t ignore, float* lse, float* loss) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(vocab);
    for (int64_t row = begin; row < end; ++row) {
      const float* x = read_row(logits, lt, row * vocab, vocab, scratch.data());
      float m = 0, s = 0;
      max_and_sum_exp(x, vocab, m, s);
      lse[row] = m + std::log(s);
      const int64_t t = targets[row];
      loss[row] = t == ignore ? 0.0f : (t >= 0 && t < vocab ? lse[row] - x[t] : lse[row]);
    }
  });
}

void cross_entropy_backward(int64_t rows, int64_t vocab, const void* logits, Dt lt, const int64_t* targets,
                            int64_t ignore, const float* lse, float scale, void* dlogits) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(2 * vocab);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t offset = row * vocab;
      float* out = work_row(dlogits, lt, offset, scratch.data() + vocab);
      if (targets[row] == ignore) {
        std::fill(out, out + vocab, 0.0f);
      } else {
        const float* x = read_row(logits, lt, offset, vocab, scratch.data());
        const Vec vlse(lse[row]), vscale(scale);
        each_vec(vocab, [&](int64_t i, int64_t c) { ((Vec::loadu(x + i, c) - vlse).exp() * vscale).store(out + i, c); });
        if (targets[row] >= 0 && targets[row] < vocab) out[targets[row]] -= scale;
      }
      write_row(out, dlogits, lt, offset, vocab);
    }
  });
}

void rope(const int64_t* sizes, const void* x, const HeadsView& xv, void* y, const HeadsView& yv, const float* cos,
          const float* sin, int64_t offset, float sign, Dt t) {
  const int64_t heads = sizes[1], steps = sizes[2], d = sizes[3], half = d / 2;
  const int64_t rows = sizes[0] * heads * steps;
  at::parallel_for(0, rows, grain_rows(d), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(2 * d);
    const Vec vsign(sign);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / (heads * steps), h = row / steps % heads, s = row % steps;
      const int64_t in_offset = b * xv.batch + xv.head(h) + s * xv.step;
      const int64_t out_offset = b * yv.batch + yv.head(h) + s * yv.step;
      const float* in = read_row(x, t, in_offset, d, scratch.data());
      float* out = work_row(y, t, out_offset, scratch.data() + d);
      const float* c_row = cos + (offset + s) * half;
      const float* s_row = sin + (offset + s) * half;
      each_vec(half, [&](int64_t i, int64_t c) {
        const Vec x1 = Vec::loadu(in + i, c), x2 = Vec::loadu(in + half + i, c);
        const Vec cv = Vec::loadu(c_row + i, c), sv = Vec::loadu(s_row + i, c) * vsign;
        (x1 * cv - x2 * sv).store(out + i, c);
        (x1 * sv + x2 * cv).store(out + half + i, c);
      });
      write_row(out, y, t, out_offset, d);
    }
  });
}

// The keys row `row` of `r` sees: first_visible_key .. visible_keys - 1 (ATen's
// is_causal for offset 0); the rest of the row is written as zeros.
inline int64_t visible_keys(int64_t row, const ScoreRows& r) {
  return r.causal ? std::min(r.k_len, row % r.q_len + r.key_offset + 1) : r.k_len;
}
inline int64_t first_visible_key(int64_t row, const ScoreRows& r) {
  if (!r.causal) return 0;
  const int64_t column = row % r.q_len + r.key_offset;
  const int64_t first = r.window > 0 ? std::max<int64_t>(0, column - r.window + 1) : 0;
  return r.documents ? std::max(first, r.documents[row / r.batch_rows * r.columns + column]) : first;
}

// tanh(y) = 2·sigmoid(2y) − 1 (ATen's exp, as the GELU above).
inline Vec tanh_of(const Vec& y) { return Vec(2.0f) * sigmoid(Vec(2.0f) * y) - Vec(1.0f); }

// A soft-capped score c·tanh(z/c) (c > 0), or z.
inline Vec capped(const Vec& z, float cap) { return cap > 0 ? Vec(cap) * tanh_of(z * Vec(1.0f / cap)) : z; }

void attention_softmax_forward(const ScoreRows& r, const void* s, Dt st, float scale, float softcap, void* p, Dt pt) {
  const int64_t k_len = r.k_len;
  at::parallel_for(0, r.rows, grain_rows(k_len), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(2 * k_len);
    const Vec vscale(scale);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t offset = row * k_len, n = visible_keys(row, r), lo = first_visible_key(row, r), m = n - lo;
      const float* x = read_row(s, st, offset + lo, m, scratch.data());
      float* e = work_row(p, pt, offset, scratch.data() + k_len);
      // scale > 0 and the cap rises with z: the row's largest score gives its largest capped one.
      float top = row_max(x, m) * scale;
      if (softcap > 0) top = softcap * std::tanh(top / softcap);
      const Vec vmax(top);
      Vec acc(0);
      each_vec(m, [&](int64_t i, int64_t c) {
        const Vec v = (capped(Vec::loadu(x + i, c) * vscale, softcap) - vmax).exp_u20();
        v.store(e + lo + i, c);
        acc += Vec::set(Vec(0), v, c);
      });
      const Vec inverse(1.0f / horizontal_sum(acc));
      each_vec(m, [&](int64_t i, int64_t c) { (Vec::loadu(e + lo + i, c) * inverse).store(e + lo + i, c); });
      std::fill(e, e + lo, 0.0f);
      std::fill(e + n, e + k_len, 0.0f);
      write_row(e, p, pt, offset, k_len);
    }
  });
}

void attention_softmax_backward(const ScoreRows& r, const void* p, Dt pt, const void* dp, Dt dpt, const void* s, Dt st,
                                float scale, float softcap, void* ds, Dt dst) {
  const int64_t k_len = r.k_len;
  at::parallel_for(0, r.rows, grain_rows(k_len), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(4 * k_len);
    const Vec vscale(scale);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t offset = row * k_len, n = visible_keys(row, r), lo = first_visible_key(row, r), m = n - lo;
      const float* pr = read_row(p, pt, offset + lo, m, scratch.data());
      const float* gr = read_row(dp, dpt, offset + lo, m, scratch.data() + k_len);
      Vec acc(0);
      each_vec(m, [&](int64_t i, int64_t c) {
        acc += Vec::set(Vec(0), Vec::loadu(pr + i, c) * Vec::loadu(gr + i, c), c);
      });
      const Vec dot(horizontal_sum(acc));
      float* out = work_row(ds, dst, offset, scratch.data() + 2 * k_len);
      if (softcap > 0) {  // d(c·tanh(z/c))/dz = 1 − tanh²(z/c)
        const float* x = read_row(s, st, offset + lo, m, scratch.data() + 3 * k_len);
        const Vec inverse_cap(1.0f / softcap);
        each_vec(m, [&](int64_t i, int64_t c) {
          const Vec t = tanh_of(Vec::loadu(x + i, c) * vscale * inverse_cap);
          (Vec::loadu(pr + i, c) * (Vec::loadu(gr + i, c) - dot) * vscale * (Vec(1.0f) - t * t)).store(out + lo + i, c);
        });
      } else {
        each_vec(m, [&](int64_t i, int64_t c) {
          (Vec::loadu(pr + i, c) * (Vec::loadu(gr + i, c) - dot) * vscale).store(out + lo + i, c);
        });
      }
      std::fill(out, out + lo, 0.0f);
      std::fill(out + n, out + k_len, 0.0f);
      write_row(out, ds, dst, offset, k_len);
    }
  });
}

double sum_squares(int64_t n, const void* x, Dt t) {
  constexpr int64_t kBlock = 16384;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> partial(blocks, 0.0);
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(t == Dt::kFloat ? 0 : kBlock);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t offset = b * kBlock, length = std::min(kBlock, n - offset);
      const float* v = read_row(x, t, offset, length, scratch.data());
      // Four vectors of doubles: four chains of adds the core runs side by side,
      // where one waited on each add's latency.
      double lanes[32] = {};
      int64_t i = 0;
      for (; i + 32 <= length; i += 32) {
        for (int j = 0; j < 32; ++j) lanes[j] += static_cast<double>(v[i + j]) * v[i + j];
      }
      for (; i < length; ++i) lanes[i % 32] += static_cast<double>(v[i]) * v[i];
      for (double lane : lanes) partial[b] += lane;
    }
  });
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

void add_into(int64_t n, const void* x, Dt t, float* y) {
  at::parallel_for(0, (n + kBlock - 1) / kBlock, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(t == Dt::kFloat ? 0 : kBlock);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t offset = b * kBlock, length = std::min(kBlock, n - offset);
      const float* v = read_row(x, t, offset, length, scratch.data());
      float* out = y + offset;
      each_vec(length, [&](int64_t i, int64_t c) { (Vec::loadu(out + i, c) + Vec::loadu(v + i, c)).store(out + i, c); });
    }
  });
}

}  // namespace

constexpr Table make_table() {
  return {add_norm_forward,      add_norm_backward,      bias_gelu_forward, bias_gelu_backward, glu_forward,
          glu_backward,       cross_entropy_forward,  cross_entropy_backward, rope,
          attention_softmax_forward, attention_softmax_backward, sum_squares, add_into};
}

}  // namespace meshtrain::model::fused::kernel
