// Fused CPU operators for the model (Note [Fused operators]), each an autograd
// function with its own forward and backward over the kernels in kernels.h.
// The model uses them where `model.fused` is on and the tensors are plain CPU
// tensors of fp32 or bf16; otherwise it composes the reference ATen operators.
#pragma once

#include "meshtrain/model/batch.h"

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <utility>
#include <vector>

namespace meshtrain::model::fused {

// Note [Fused operators]
// Around the matrix multiplies, a step spends its time on passes over
// activations: residual adds, norms, GELU, casts between fp32 and bf16,
// softmax and cross-entropy over the vocabulary. Each operator here reads its
// inputs once and writes its outputs once, converting bf16 to fp32 in
// registers (fp32 arithmetic and accumulation) and back:
//   add_norm       h = x + r and y = LayerNorm/RMSNorm(h), y written in the
//                  autocast dtype when autocast is on (no cast before the next
//                  linear); backward adds the residual's gradient in the same pass
//   bias_gelu      gelu_tanh(a + bias), with the bias' gradient as column sums
//   swiglu, geglu  silu(g) · u, gelu_tanh(g) · u
//   cross_entropy  mean over rows of logsumexp - target logit, row by row: no
//                  fp32 copy of the logits, no log-softmax materialised
//   rope           the rotation, reading q/k through their strides
//   attention      on the CPU, scaled-dot-product attention as batched matrix
//                  multiplies around a fused causal softmax, causal rows split
//                  in blocks that skip most of the masked half (Note [CPU
//                  attention], attention.cpp)
// AdamW's fused kernel is offload/cpu_adam.h (used by every CPU optimizer step).

// Whether the fused kernels take these tensors: defined, plain (no dispatch
// subclass such as a distributed tensor) CPU tensors of fp32 or bf16, with
// CPU autocast, when on, to fp32 or bf16 (under fp16: ATen's compositions).
bool eligible(const at::Tensor& t);
// eligible(), or a CUDA tensor of the same kinds where the build has the GPU's
// kernels (Note [Fused CUDA kernels]): for the operators both have, add_norm,
// bias_gelu, swiglu and geglu (not rope or attention; cross_entropy counts its
// targets on the host, and on a GPU the chunked loss takes the kernel instead).
bool eligible_anywhere(const at::Tensor& t);
// Not a dispatch subclass (a distributed tensor): the model may reorder its
// operators around such a tensor (bias added after the linear, with the GELU).
bool plain(const at::Tensor& t);

// (h, y) with h = x + residual, y = norm(h) over the last dim (rms: RMSNorm,
// else LayerNorm with `bias` if defined). `residual` undefined: y = norm(x), h = x.
std::pair<at::Tensor, at::Tensor> add_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                           const at::Tensor& bias, bool rms, double eps);
// gelu_tanh(a + bias) (bias [width] or undefined), in a's dtype.
at::Tensor bias_gelu(const at::Tensor& a, const at::Tensor& bias);
// silu(g) · u, in g's dtype.
at::Tensor swiglu(const at::Tensor& g, const at::Tensor& u);
// gelu_tanh(g) · u, in g's dtype (Gemma's GeGLU).
at::Tensor geglu(const at::Tensor& g, const at::Tensor& u);
// The tensors swiglu() or geglu() made y from, as its autograd node keeps
// them, where y is that node's output; empty for any other tensor. A product
// of y may keep these in place of y and make y again in its backward (Note
// [The GLU's output made again] in linear.h).
struct GluInputs {
  at::Tensor g, u;
  bool gelu = false;
};
std::optional<GluInputs> glu_inputs(const at::Tensor& y);
// Mean cross-entropy of logits [N, V] (fp32 or bf16) against targets [N]
// (entries equal to ignore_index are left out), in fp32.
at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index = kIgnoredTarget);
// Rotary embedding of x [B, H, T, d] with tables cos / sin [context, d/2] (fp32)
// at positions offset..offset+T-1; the result is contiguous.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t offset = 0);
// Note [Heads from the fused projection]
// q, k and v of the qkv projection's output `fused` [B, T, N] (contiguous)
// as the attention takes them, contiguous [B, heads, T, hd], q and k rotated
// (RoPE over whole heads at positions 0..T-1, tables cos / sin [context, hd/2]);
// offsets[0..2]: each q, k and v head's first output in N (qkv_head_offsets).
// One node: its backward writes dq and dk rotated back, and dv, straight into
// one [B, T, N] gradient. Through the split, grouped q's reshape and two rope
// nodes, q's gradient took three passes (the rotation, the reshape's copy, the
// split's concatenation) and k's and v's two and one.
std::array<at::Tensor, 3> rotated_heads(const at::Tensor& fused, const std::array<std::vector<int64_t>, 3>& offsets,
                                        int64_t head_dim, const at::Tensor& cos, const at::Tensor& sin);
// Causal or full scaled-dot-product attention of q [B, H, T, d] and k, v
// [B, Hkv, T, d], Hkv dividing H (grouped queries, Note [Grouped queries]);
// causal with window > 0: each query sees itself and the window - 1 keys
// before it; scale > 0 replaces 1/sqrt(d); softcap > 0 caps the scores,
// c·tanh(s/c), and needs the batched path (batched_attention_applies);
// documents [B, T] (causal, as many queries as keys): rows of documents side
// by side, each query seeing only its own document's keys (Batch::documents).
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout, bool causal,
                     int64_t window = 0, double scale = 0, double softcap = 0, const at::Tensor& documents = {});
// Whether attention() takes its batched path (Note [CPU attention]), which
// keeps the softmax for backward: on the CPU, without dropout, keys <= 4 *
// head_dim.
bool batched_attention_applies(bool cpu, int64_t keys, int64_t head_dim, double dropout);
// How many softmax entries per head that path keeps: q_len · k_len, or causal
// with q_len = k_len = T, Σ rows_i · keys_i over its n blocks of about 64
// queries, 128 under bf16 ((n+1)T²/2n where n divides T: 5T²/8 at T = 256,
// 3T²/4 under bf16).
int64_t batched_attention_scores(int64_t q_len, int64_t k_len, bool causal, bool bf16 = false);

// Which kernel copy runs: "avx512", "avx2" or "default" (Note [Kernel copies]).
const char* kernel_set();

}  // namespace meshtrain::model::fused
