// Where q, k and v sit among the fused qkv projection's outputs (Note
// [Grouped-query layout]), in one place: the model splits its activations by
// it, the Hugging Face interop its weights, LoRA its q/k/v deltas.
#pragma once

#include "meshtrain/model/gpt_config.h"

#include <ATen/ATen.h>

#include <array>
#include <vector>

namespace meshtrain::model {

// Note [Grouped-query layout]
// The fused qkv projection's outputs are [q | k | v] (a third each) with
// multi-head attention. With grouped-query attention (kv_heads < heads) they
// go by key/value group: for each group, the q of its heads / kv_heads query
// heads, then its k, then its v. Either way a contiguous share of the
// outputs holds whole heads with their keys and values, so tensor parallel
// splits them by rows (in thirds for MHA, in one piece for GQA). The size
// along the fused dimension may be a rank's share: the functions below take
// the number of groups from it.

// q, k and v of `fused`, whose dimension `dim` holds the fused outputs, with
// that dimension split into (heads, head size): q [..., Hq, hd, ...], k and v
// [..., Hkv, hd, ...]. k and v are views of `fused`; q is too without grouping.
std::array<at::Tensor, 3> split_qkv_heads(const at::Tensor& fused, int64_t dim, const GptConfig& config);

// Each q, k and v head's first output along a fused dimension of n outputs
// (a rank's share), in the order split_qkv_heads gives the heads.
std::array<std::vector<int64_t>, 3> qkv_head_offsets(int64_t n, const GptConfig& config);

// The inverse for parts whose dimension `dim` is flat (heads · head size):
// the fused tensor of sizes `fused_sizes`; an undefined part stands for zeros
// (of `options`).
at::Tensor fuse_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t dim,
                    at::IntArrayRef fused_sizes, const at::TensorOptions& options, const GptConfig& config);

}  // namespace meshtrain::model
