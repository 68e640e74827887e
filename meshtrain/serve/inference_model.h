// A trained model made ready for generation: loaded from a checkpoint, split
// over a tensor-parallel group when asked, with its tokenizer.
#pragma once

#include "meshtrain/model/generate.h"
#include "meshtrain/parallel/tensor_parallel.h"
#include "meshtrain/text/tokenizer.h"

#include <memory>
#include <string>
#include <vector>

namespace meshtrain::serve {

// Note [Tensor-parallel inference]
// Every rank of the group loads the whole checkpoint and the tensor-parallel
// plan shards it in place (attention by heads, MLP by hidden units, the
// embedding and head by vocabulary), exactly as for training. The KV cache
// then holds only this rank's heads: it sees the width qkv produced. The
// head's logits stay split over the vocabulary; only the last position's
// are gathered (full_vocabulary), so every rank samples from identical
// logits with an identical generator and picks the same token without a
// broadcast.
class InferenceModel {
 public:
  // `checkpoint`: a checkpoint folder or a directory with a 'latest' pointer.
  // `tp_group`: the ranks that split the model (null or size 1: whole).
  InferenceModel(const std::string& checkpoint, parallel::CommPtr tp_group);
  // A model in memory (the same full model on every rank of the group), bytes as its tokenizer.
  InferenceModel(model::Gpt gpt, parallel::CommPtr tp_group, std::string name = "meshtrain");
  ~InferenceModel();

  model::Gpt& gpt() { return gpt_; }
  const model::GptConfig& config() const { return gpt_->config(); }
  // Options with full_vocabulary set for this model's split.
  model::SampleOptions with_split(model::SampleOptions options) const;
  // The model's tokenizer (the one it was trained or imported with).
  const text::Tokenizer& tokenizer() const { return *tokenizer_; }
  std::vector<int64_t> encode(const std::string& text) const;
  std::string decode(const std::vector<int64_t>& tokens) const;
  const std::string& name() const { return name_; }  // the checkpoint folder's name
  int64_t step() const { return step_; }

 private:
  void split();

  model::Gpt gpt_{nullptr};
  std::unique_ptr<parallel::TensorParallel> tp_;
  parallel::CommPtr group_;
  std::unique_ptr<text::Tokenizer> tokenizer_;
  std::string name_;
  int64_t step_ = 0;
};

}  // namespace meshtrain::serve
