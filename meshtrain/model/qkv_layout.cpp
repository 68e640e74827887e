#include "meshtrain/model/qkv_layout.h"

#include <vector>

namespace meshtrain::model {

namespace {

// `sizes` with dimension `dim` replaced by `inner`.
std::vector<int64_t> replaced(at::IntArrayRef sizes, int64_t dim, std::initializer_list<int64_t> inner) {
  std::vector<int64_t> out(sizes.begin(), sizes.begin() + dim);
  out.insert(out.end(), inner);
  out.insert(out.end(), sizes.begin() + dim + 1, sizes.end());
  return out;
}

}  // namespace

std::array<at::Tensor, 3> split_qkv_heads(const at::Tensor& fused, int64_t dim, const GptConfig& config) {
  dim = at::maybe_wrap_dim(dim, fused.dim());
  const int64_t n = fused.size(dim), hd = config.head_dim();
  if (!config.grouped_query()) {
    std::vector<at::Tensor> parts = fused.split(n / 3, dim);
    auto heads = [&](const at::Tensor& part) { return part.view(replaced(part.sizes(), dim, {-1, hd})); };
    return {heads(parts[0]), heads(parts[1]), heads(parts[2])};
  }
  const int64_t per_group = config.heads / config.key_value_heads();
  const at::Tensor grouped = fused.view(replaced(fused.sizes(), dim, {-1, per_group + 2, hd}));  // [.., G, rep + 2, hd, ..]
  // One split, not a narrow and two selects: its backward writes the three
  // gradients into one tensor, where each view's wrote a zeroed copy of the
  // whole qkv output and autograd summed the three.
  const std::vector<at::Tensor> parts = grouped.split_with_sizes({per_group, 1, 1}, dim + 1);  // [.., G, rep, hd, ..]
  return {parts[0].reshape(replaced(fused.sizes(), dim, {-1, hd})), parts[1].squeeze(dim + 1), parts[2].squeeze(dim + 1)};
}

std::array<std::vector<int64_t>, 3> qkv_head_offsets(int64_t n, const GptConfig& config) {
  const int64_t hd = config.head_dim();
  std::array<std::vector<int64_t>, 3> offsets;
  if (!config.grouped_query()) {
    const int64_t heads = n / 3 / hd;
    for (int64_t part = 0; part < 3; ++part) {
      for (int64_t h = 0; h < heads; ++h) offsets[part].push_back((part * heads + h) * hd);
    }
    return offsets;
  }
  const int64_t per_group = config.heads / config.key_value_heads(), groups = n / ((per_group + 2) * hd);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t first = g * (per_group + 2) * hd;
    for (int64_t j = 0; j < per_group; ++j) offsets[0].push_back(first + j * hd);
    offsets[1].push_back(first + per_group * hd);
    offsets[2].push_back(first + (per_group + 1) * hd);
  }
  return offsets;
}

at::Tensor fuse_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t dim,
                    at::IntArrayRef fused_sizes, const at::TensorOptions& options, const GptConfig& config) {
  dim = at::maybe_wrap_dim(dim, static_cast<int64_t>(fused_sizes.size()));
  const int64_t n = fused_sizes[dim];
  auto part = [&](const at::Tensor& t, int64_t size) {
    return t.defined() ? t : at::zeros(replaced(fused_sizes, dim, {size}), options);
  };
  if (!config.grouped_query()) return at::cat({part(q, n / 3), part(k, n / 3), part(v, n / 3)}, dim);
  const int64_t hd = config.head_dim(), per_group = config.heads / config.key_value_heads();
  const int64_t groups = n / ((per_group + 2) * hd);
  auto grouped = [&](const at::Tensor& t, int64_t heads) {
    return part(t, groups * heads * hd).reshape(replaced(fused_sizes, dim, {groups, heads, hd}));
  };
  return at::cat({grouped(q, per_group), grouped(k, 1), grouped(v, 1)}, dim + 1).reshape(fused_sizes);
}

}  // namespace meshtrain::model
