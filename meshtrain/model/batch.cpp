#include "meshtrain/model/batch.h"

namespace meshtrain::model {

namespace {

at::Tensor moved(const at::Tensor& t, at::Device device) { return t.defined() ? t.to(device) : t; }

}  // namespace

Batch Batch::packed(at::Tensor tokens, at::Tensor targets, at::Tensor positions, double weight) {
  Batch b(std::move(tokens), std::move(targets), weight);
  // A document starts at its first token's column: the column less the position inside it.
  const at::Tensor columns = at::arange(b.length(), positions.options()).unsqueeze(0);
  b.documents = columns - positions;
  b.positions = std::move(positions);
  return b;
}

at::Tensor Batch::positions_or_default() const {
  if (positions.defined()) return positions;
  return at::arange(length(), tokens.options().dtype(at::kLong)).unsqueeze(0).expand({rows(), length()});
}

at::Tensor Batch::columns_or_default() const {
  return columns.defined() ? columns : at::arange(length(), tokens.options().dtype(at::kLong));
}

Batch Batch::to(at::Device device) const {
  Batch b = *this;
  b.tokens = moved(tokens, device);
  b.targets = moved(targets, device);
  b.positions = moved(positions, device);
  b.columns = moved(columns, device);
  b.documents = moved(documents, device);
  return b;
}

Batch Batch::select(const at::Tensor& keep_anywhere) const {
  const at::Tensor keep = keep_anywhere.to(tokens.device());
  auto cut = [&](const at::Tensor& t) { return t.defined() ? t.index_select(1, keep.to(t.device())) : t; };
  Batch b = *this;
  b.tokens = cut(tokens);
  b.targets = cut(targets);
  b.positions = cut(positions_or_default().contiguous());
  b.documents = cut(documents);
  b.columns = columns_or_default().index_select(0, keep);
  return b;
}

}  // namespace meshtrain::model
