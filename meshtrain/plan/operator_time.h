// A step's compute from measured operator rates. See Note [Operator time].
#pragma once

#include "meshtrain/model/gpt_config.h"

#include <string>
#include <vector>

namespace meshtrain::plan {

struct Layout;
struct Workload;

// Note [Operator time]
// ~~~~~~~~~~~~~~~~~~~~
// One MFU for a whole step says nothing about why one layout is slower than
// another on the same FLOPs: tensor and context parallel split the work into
// smaller operators, a ring calls the attention kernel 2·cp+1 times per layer
// and merges partial outputs, sequence parallel splits the norms, ZeRO
// shards the optimizer's pass. `plan --calibrate` therefore times each class
// of operator on every rank at once (as the ranks share the machine when
// they train) and fits each to a fixed cost per call plus its work:
//   products     call + 2·m·k·n / matmul_flops, over shapes a step uses;
//   attention    the flash kernel's forward and backward (non-causal tiles):
//                call + its FLOPs (4·b·heads·lq·lk·d forward, twice that
//                backward) / attention_flops;
//   elementwise  call + bytes moved / elementwise_bytes (an add, small and large).
// A block's forward is then its products (q, k, v, out, the MLP's; a MoE
// block's router and each local expert's product over its share of the
// assignments), its attention tiles (one causal call, counted at half its
// FLOPs; a ring's 2·cp+1 tiles of s/2cp, two of them causal, with the
// merges of partial outputs), and its elementwise passes (two fused
// add-norms, the activation, RoPE; over [tokens/tp, h] under sequence
// parallel). Backward: every product twice (input and weight gradients),
// attention's backward, one and a half times the elementwise bytes in twice
// the calls. The head: three
// products over the vocabulary (a fourth where the loss makes the logits
// again) and the softmax passes. The optimizer: AdamW's pass over the
// rank's parameters (its shard under ZeRO), a term of its own. What none of these covers (the
// autograd engine, views, gradient accumulation, launch gaps) is one factor,
// `overhead`: the calibration's training run measured against this sum.
// Without measured rates (the built-in GPU profiles), or measured in another
// precision than the plan's, the step is its FLOPs at peak x MFU (Note [Time model]).
struct OperatorRates {
  double matmul_flops = 0, matmul_call = 0;        // FLOP/s; seconds per product
  double attention_flops = 0, attention_call = 0;  // FLOP/s; seconds per kernel call (forward or backward)
  double elementwise_bytes = 0, elementwise_call = 0;  // bytes/s; seconds per call
  double overhead = 1;  // measured step / the operators' sum, on the calibration run
  std::string precision = "fp32";  // what was measured: a plan in another precision counts FLOPs at peak x MFU

  bool measured() const { return matmul_flops > 0; }
  // Measured in the products' dtype of a plan whose activations are `activation_bytes` wide:
  // fp32, or bfloat16 for bf16-mixed and bf16-autocast alike.
  bool measured_for(double activation_bytes) const { return measured() && (precision == "fp32") == (activation_bytes == 4); }
};

// Seconds of work on one rank, split as the pipeline schedule needs them.
struct Work {
  double forward = 0, backward = 0;
  double recompute = 0;  // forward work repeated in the backward (inside `backward`)
};

// One rank's share of one micro-batch of `micro_batch` sequences through
// one block (`moe`: a mixture-of-experts block), forward and backward, with
// what the layout's recompute repeats.
Work block_work(const model::GptConfig& model, bool moe, const Layout& layout, const Workload& workload,
                const OperatorRates& rates);

// The head (output projection and loss) on one micro-batch; `loss_in_backward`:
// the chunked loss makes the logits again in the backward (Note [Chunked loss]).
Work head_work(const model::GptConfig& model, const Layout& layout, const Workload& workload, bool loss_in_backward,
               const OperatorRates& rates);

// AdamW's pass over `parameters` held by the rank, once per step.
double optimizer_seconds(double parameters, const Workload& workload, const OperatorRates& rates);

// Least-squares fit of seconds = call + work / rate (work: FLOPs or bytes) to
// timed runs, relative errors weighted alike. Returns {rate, call}; call >= 0.
struct Fit {
  double rate = 0, call = 0;
};
Fit fit_rate(const std::vector<double>& work, const std::vector<double>& seconds);

}  // namespace meshtrain::plan
