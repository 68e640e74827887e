#include "meshtrain/plan/operator_time.h"

#include "meshtrain/plan/activation_memory.h"
#include "meshtrain/plan/layout.h"
#include "meshtrain/plan/memory_model.h"
#include "meshtrain/parallel/attention_tiles.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace meshtrain::plan {

namespace {

// One rank's shape of a micro-batch under a layout.
struct Shape {
  double b, s, t, cp, a2a, ring;
  bool sp;
  double tokens;  // rows of a block's products on the rank: b·s/cp
};

Shape shape_of(const model::GptConfig& model, const Layout& l) {
  Shape z{};
  z.b = static_cast<double>(l.micro_batch);
  z.s = static_cast<double>(model.context);
  z.t = static_cast<double>(l.dims.tp);
  z.cp = static_cast<double>(l.dims.cp);
  z.a2a = static_cast<double>(all_to_all_group(model, l));
  z.ring = z.cp / z.a2a;
  z.sp = l.dims.sequence_parallel;
  z.tokens = z.b * z.s / z.cp;
  return z;
}

double product(const OperatorRates& r, double calls, double flops) { return calls * r.matmul_call + flops / r.matmul_flops; }
double kernel(const OperatorRates& r, double calls, double flops) { return calls * r.attention_call + flops / r.attention_flops; }
double elementwise(const OperatorRates& r, double calls, double bytes) {
  return calls * r.elementwise_call + (r.elementwise_bytes > 0 ? bytes / r.elementwise_bytes : 0);
}

// The attention core's forward and backward on one rank (Note [Operator time]).
Work attention(const model::GptConfig& model, const Shape& z, const OperatorRates& r) {
  const double heads = static_cast<double>(model.heads) / z.t / z.a2a, d = static_cast<double>(model.head_dim());
  auto tile = [&](double rows) { return 4 * z.b * heads * rows * rows * d; };  // forward FLOPs of a full tile
  Work w;
  if (z.ring == 1) {  // one causal call over the sequence: half a tile's work
    const double half = tile(z.s) / 2;
    w.forward = kernel(r, 1, half);
    w.backward = kernel(r, 1, 2 * half);
    return w;
  }
  // Zigzag: a rank's two chunks of s/2·ring each meet 2·ring key chunks over the
  // ring, causally 2·ring+1 pairs, and the ring splits chunks into segments of
  // at most kTileRows (Note [Attention tiles]). A pair off the diagonal is
  // n² tiles, one on it n(n+1)/2: its masked tiles are skipped, its diagonal
  // ones cost a full tile (the kernel runs them with an additive mask).
  const double chunk = z.s / (2 * z.ring), n = std::ceil(chunk / static_cast<double>(parallel::tiles::kTileRows));
  const double tiles = (2 * z.ring - 1) * n * n + 2 * n * (n + 1) / 2, rows = chunk / n;
  const double merges = tiles - 2 * n;  // every tile of a query segment but its first
  const double out_bytes = 4 * z.b * heads * rows * d;  // one tile's fp32 partial output
  // A merge is 17 calls, 7 passes of the output (two products and their sum), the rest over the log-sum-exp.
  w.forward = kernel(r, tiles, tiles * tile(rows)) + elementwise(r, 17 * merges, 7 * out_bytes * merges);
  w.backward = kernel(r, tiles, 2 * tiles * tile(rows)) + elementwise(r, 3 * tiles, 9 * out_bytes * tiles);  // dq, dk, dv sums
  return w;
}

// A block's elementwise passes forward, as calls and bytes; backward moves
// about 1.5 times the bytes in twice the calls.
struct Passes {
  double calls = 0, bytes = 0;
};
Passes elementwise_forward(const model::GptConfig& model, bool moe, const Shape& z, const Workload& w, int64_t ep,
                          double experts) {
  const double h = static_cast<double>(model.width), e = w.precision.activation;
  const double rows_h = z.sp ? z.tokens / z.t : z.tokens;  // the norms' rows: split under sequence parallel
  const double per_row = model.gated_mlp() ? 3 : 2;        // the activation's words in and out per hidden unit
  double words = 2 * 4 * h * rows_h, calls = 2;            // two add-norms: x and the residual in, both out
  if (!moe) {
    words += per_row * static_cast<double>(model.mlp_hidden()) / z.t * z.tokens, calls += 1;
  } else {  // once per local expert over its assignments, and the shared expert over every token
    words += per_row * static_cast<double>(model.expert_hidden()) / z.t * assignments(model, z.tokens, rank_moe_load(model, w, ep));
    calls += experts;
    if (model.moe_shared_hidden > 0) words += 3 * static_cast<double>(model.moe_shared_hidden) / z.t * z.tokens, calls += 1;
  }
  if (!model.learned_positions()) {
    words += 2 * static_cast<double>(model.q_width() + model.kv_width()) / z.t * z.tokens;  // RoPE on q and k
    calls += 2;
  }
  return {calls, e * words};
}

}  // namespace

Work block_work(const model::GptConfig& model, bool moe, const Layout& l, const Workload& w, const OperatorRates& r) {
  const Shape z = shape_of(model, l);
  Work work;
  const double local_experts = std::max(1.0, static_cast<double>(model.moe_experts) / static_cast<double>(l.dims.ep));
  double unkept = 0;  // op-level recompute: the forward of the products it does not keep
  for (const BlockProduct& p : op_level_products(model, moe)) {
    double rows = z.tokens, calls = 1, k = p.in, n = p.out;
    if (p.expert) rows = assignments(model, z.tokens, rank_moe_load(model, w, l.dims.ep)), calls = local_experts;
    if (!p.router) (p.row_parallel ? k : n) /= z.t;
    const double flops = 2 * rows * k * n;
    work.forward += product(r, calls, flops);
    work.backward += product(r, 2 * calls, 2 * flops);  // input and weight gradients
    if (!p.kept) unkept += product(r, calls, flops);
  }
  const Work core = attention(model, z, r);
  const Passes passes = elementwise_forward(model, moe, z, w, l.dims.ep, local_experts);
  work.forward += core.forward + elementwise(r, passes.calls, passes.bytes);
  work.backward += core.backward + elementwise(r, 2 * passes.calls, 1.5 * passes.bytes);
  switch (l.activation_checkpoint) {
    case parallel::CheckpointMode::kNone: break;
    case parallel::CheckpointMode::kSelective: {
      if (op_level_recompute(l, w)) {
        work.recompute = unkept;
        break;
      }
      work.recompute = core.forward;
      const model::GptConfig ran = as_run(model, w);
      if (!moe && glu_output_made_again(ran, activation_options(ran, w, l))) {
        // The GLU's output made again for the down projection's backward: g and u in, the product out.
        const double hidden = static_cast<double>(model.mlp_hidden()) / z.t * z.tokens;
        work.recompute += elementwise(r, 1, 3 * hidden * w.precision.activation);
      }
      break;
    }
    case parallel::CheckpointMode::kFull: work.recompute = work.forward; break;
  }
  work.backward += work.recompute;
  return work;
}

Work head_work(const model::GptConfig& model, const Layout& l, const Workload& w, bool loss_in_backward,
               const OperatorRates& r) {
  const Shape z = shape_of(model, l);
  const double h = static_cast<double>(model.width), vocab = static_cast<double>(model.vocab_size) / z.t;
  const double flops = 2 * z.tokens * h * vocab, rows_h = z.sp ? z.tokens / z.t : z.tokens;
  const double norm = elementwise(r, 1, w.precision.activation * 2 * h * rows_h);
  // The softmax over the rank's logits (fp32): two passes and three calls each way.
  const double softmax = elementwise(r, 3, 4 * 2 * z.tokens * vocab);
  Work work;
  work.forward = product(r, 1, flops) + norm + softmax;
  work.backward = product(r, 2, 2 * flops) + 2 * norm + softmax;
  if (loss_in_backward) work.recompute = product(r, 1, flops) + softmax, work.backward += work.recompute;
  return work;
}

double optimizer_seconds(double parameters, const Workload& w, const OperatorRates& r) {
  // Parameters and states read and written, gradients read twice (the norm, the update).
  const Precision& p = w.precision;
  return elementwise(r, 0, parameters * (2 * (p.param + p.optimizer) + 2 * p.grad));
}

Fit fit_rate(const std::vector<double>& work, const std::vector<double>& seconds) {
  // Minimise sum ((call + x·w - t) / t)^2 over call >= 0 and x = 1/rate: normal equations in (call, x).
  if (work.size() != seconds.size() || work.empty()) throw std::invalid_argument("fit_rate: one time per work");
  double a = 0, b = 0, c = 0, u = 0, v = 0;
  for (size_t i = 0; i < work.size(); ++i) {
    const double p = 1 / seconds[i], q = work[i] / seconds[i];  // the weighted columns; the target is 1
    a += p * p, b += p * q, c += q * q, u += p, v += q;
  }
  const double det = a * c - b * b;
  const bool solvable = std::abs(det) > 1e-12 * a * c;  // not a single work size
  Fit fit;
  double call = solvable ? (u * c - b * v) / det : 0, x = solvable ? (a * v - b * u) / det : 0;
  if (call < 0 || x <= 0) call = 0, x = c > 0 ? v / c : 0;
  fit.call = call;
  fit.rate = x > 0 ? 1 / x : 0;
  return fit;
}

}  // namespace meshtrain::plan
