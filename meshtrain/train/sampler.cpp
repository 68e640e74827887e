// The Sampler of data.h: windows, packing, loss masks and mixtures.
#include "meshtrain/train/data.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>

namespace meshtrain::train {

// Note [Packing]
// packing = "concat": a source's tokens are one stream cut into windows of
// context + 1 at stride context, crossing document ends (the end-of-text token
// prepare puts between documents marks them). packing = "padded": a window is
// one document from its start, cut at context + 1 tokens; a shorter one is
// padded, and the padding's targets count toward no loss. packing = "packed":
// windows as concat, with each token's position inside its document (Note
// [Batch]) and no target across a document end. Always a target
// whose token's mask flag is 0 counts toward no loss, and the loss of a step
// is the mean over the targets that count in the whole global batch
// (Trainer::micro_batches weights each micro-batch by its share).

Sampler::Sampler(const TokenFile& file, int64_t context, uint64_t seed, bool shuffle)
    : Sampler({SamplerSource{&file, nullptr, nullptr, 1.0}}, context, seed, shuffle, Packing::kConcat) {}

Sampler::Sampler(std::vector<SamplerSource> sources, int64_t context, uint64_t seed, bool shuffle, Packing packing,
                 int64_t pad_id)
    : context_(context), seed_(seed), shuffle_(shuffle), packing_(packing), pad_id_(pad_id) {
  TORCH_CHECK(!sources.empty(), "a sampler needs a source");
  for (const SamplerSource& source : sources) {
    const TokenFile& file = *source.tokens;
    if (!(source.weight > 0)) data_error(file.path(), "a mixture weight must be > 0");
    Stream stream;
    stream.source = source;
    if (packing != Packing::kConcat && (!source.dataset || !source.dataset->has_index())) {
      data_error(file.path(), std::string("data.packing = \"") + (packing == Packing::kPadded ? "padded" : "packed") +
                      "\" needs its document index (" + companion_path(file.path(), "idx") +
                      "); prepare the data again, or use packing \"concat\"");
    }
    if (packing == Packing::kPadded) {
      stream.windows = source.dataset->documents();
    } else {
      if (file.size() < context + 1) {
        data_error(file.path(), "has " + std::to_string(file.size()) +
                        " tokens, fewer than one sequence needs (model.context + 1 = " + std::to_string(context + 1) +
                        "); use more text or a shorter context");
      }
      stream.windows = (file.size() - 1) / context;
    }
    streams_.push_back(std::move(stream));
  }
  taken_.assign(streams_.size(), 0);
  anchor_taken_ = taken_;
}

int64_t Sampler::windows() const { return streams_.front().windows; }

bool Sampler::ignores_targets() const {
  if (packing_ != Packing::kConcat) return true;
  return std::any_of(streams_.begin(), streams_.end(), [](const Stream& s) { return s.source.mask != nullptr; });
}

std::pair<int, int64_t> Sampler::locate(int64_t position) {
  if (streams_.size() == 1) return {0, position};
  if (position < blended_) {  // going back: to the anchor when that is not past it, else to the start
    if (position >= anchor_) {
      blended_ = anchor_;
      taken_ = anchor_taken_;
    } else {
      blended_ = 0;
      std::fill(taken_.begin(), taken_.end(), 0);
    }
  }
  double total = 0;
  for (const Stream& s : streams_) total += s.source.weight;
  for (;;) {
    int best = 0;
    double best_gap = -1e300;
    for (size_t s = 0; s < streams_.size(); ++s) {
      const double gap = streams_[s].source.weight / total * static_cast<double>(blended_ + 1) - taken_[s];
      if (gap > best_gap) best_gap = gap, best = static_cast<int>(s);
    }
    if (blended_ == position) return {best, taken_[best]};
    ++taken_[best];
    ++blended_;
  }
}

int64_t Sampler::window_at(Stream& stream, int s, int64_t position) {
  const int64_t epoch = position / stream.windows;
  const int64_t index = position % stream.windows;
  if (!shuffle_) return index;
  if (epoch != stream.cached_epoch) {
    // Source 0 keeps the seeds of a single-source run; the others get their own.
    const uint64_t seed = (seed_ + 7919ULL * static_cast<uint64_t>(s)) * 1000003ULL + epoch;
    at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
    stream.order = at::randperm(stream.windows, generator, at::kLong);
    stream.cached_epoch = epoch;
  }
  return stream.order.data_ptr<int64_t>()[index];
}

void Sampler::window(const Stream& stream, int64_t w, int64_t* input, int64_t* target) const {
  const SamplerSource& source = stream.source;
  int64_t begin = w * context_, length = context_ + 1;
  if (packing_ == Packing::kPadded) {
    const auto [start, end] = source.dataset->document(w);
    begin = start;
    length = std::min(end - start, context_ + 1);
  }
  const at::Tensor tokens = source.tokens->slice(begin, length);
  const at::Tensor flags = source.mask ? source.mask->slice(begin, length) : at::Tensor();
  const int64_t* t = tokens.data_ptr<int64_t>();
  const int64_t* f = flags.defined() ? flags.data_ptr<int64_t>() : nullptr;
  // Packed rows: no target predicts the first token of the next document from the last one's end.
  const std::vector<bool> starts = packing_ == Packing::kPacked ? document_starts(stream, w) : std::vector<bool>();
  for (int64_t j = 0; j < context_; ++j) {
    const bool real = j + 1 < length && (starts.empty() || !starts[j + 1]);
    input[j] = j < length ? t[j] : pad_id_;
    target[j] = real && (!f || f[j + 1]) ? t[j + 1] : kIgnoredTarget;
  }
}

std::vector<bool> Sampler::document_starts(const Stream& stream, int64_t w) const {
  const TokenDataset& data = *stream.source.dataset;
  const int64_t begin = w * context_, end = begin + context_ + 1;
  std::vector<bool> starts(context_ + 1, false);
  for (int64_t d = data.document_of(begin); d < data.documents(); ++d) {
    const int64_t start = data.document(d).first;
    if (start >= end) break;
    if (start >= begin) starts[start - begin] = true;
  }
  return starts;
}

void Sampler::each_window(int64_t cursor, int64_t rows, const std::function<void(int64_t, const Stream&, int64_t)>& f) {
  for (int64_t i = 0; i < rows; ++i) {
    const auto [s, k] = locate(cursor + i);
    Stream& stream = streams_[s];
    f(i, stream, window_at(stream, s, k));
  }
}

at::Tensor Sampler::positions(int64_t cursor, int64_t rows) {
  if (packing_ != Packing::kPacked) return {};
  at::Tensor out = at::empty({rows, context_}, at::kLong);
  each_window(cursor, rows, [&](int64_t i, const Stream& stream, int64_t w) {
    const std::vector<bool> starts = document_starts(stream, w);
    int64_t* p = out[i].data_ptr<int64_t>();
    for (int64_t j = 0, since = 0; j < context_; ++j, ++since) {
      if (starts[j]) since = 0;
      p[j] = since;  // a document begun before the window counts from the window's start
    }
  });
  return out;
}

void Sampler::set_anchor(int64_t position) {
  if (streams_.size() == 1) return;
  locate(position);
  anchor_ = blended_;
  anchor_taken_ = taken_;
}

std::pair<at::Tensor, at::Tensor> Sampler::rows(int64_t cursor, int64_t rows) {
  if (cursor < anchor_ || cursor >= blended_) set_anchor(cursor);  // a step reads its batch's rows, then the ranks'
  at::Tensor inputs = at::empty({rows, context_}, at::kLong), targets = at::empty({rows, context_}, at::kLong);
  each_window(cursor, rows, [&](int64_t i, const Stream& stream, int64_t w) {
    window(stream, w, inputs[i].data_ptr<int64_t>(), targets[i].data_ptr<int64_t>());
  });
  return {inputs, targets};
}

int64_t Sampler::counted_targets(int64_t cursor, int64_t rows) {
  if (!ignores_targets()) return rows * context_;
  return (this->rows(cursor, rows).second != kIgnoredTarget).sum().item<int64_t>();
}

std::vector<int> Sampler::sources_of(int64_t cursor, int64_t rows) {
  std::vector<int> out;
  for (int64_t i = 0; i < rows; ++i) out.push_back(locate(cursor + i).first);
  return out;
}

}  // namespace meshtrain::train
