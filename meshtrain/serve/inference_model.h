// A trained model made ready for generation: loaded from a checkpoint, split
// over a tensor-parallel group when asked, with its tokenizer.
#pragma once

#include "meshtrain/model/generate.h"
#include "meshtrain/model/kv_cache.h"
#include "meshtrain/offload/weight_stream.h"
#include "meshtrain/parallel/tensor_parallel.h"
#include "meshtrain/text/tokenizer.h"

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain::checkpoint {
class CheckpointReader;
}

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
// ZeRO-Inference (Note [Weight streaming]): where the weights and the KV cache live.
struct InferenceOffload {
  offload::Tier weights = offload::Tier::kDevice;  // kHost, kNvme: the blocks' weights streamed from that tier
  std::string nvme_dir = "/tmp";
  int prefetch = 1;                                // blocks fetched ahead of the one computing
  offload::Tier kv = offload::Tier::kDevice;       // where the KV cache is kept: the device or kHost
  // Throws std::invalid_argument naming the option.
  void validate() const;
};

// The adapters a checkpoint of LoRA adapters holds, by parameter name ("blocks.0.attn.qkv.lora_q.A").
std::map<std::string, at::Tensor> read_adapters(checkpoint::CheckpointReader& reader);

class InferenceModel {
 public:
  // `checkpoint`: a checkpoint folder or a directory with a 'latest' pointer.
  // `tp_group`: the ranks that split the model (null or size 1: whole).
  // A checkpoint of LoRA adapters is merged into the base it names; `lora`,
  // a PEFT adapter folder, is merged on top (Note [LoRA]).
  InferenceModel(const std::string& checkpoint, parallel::CommPtr tp_group, InferenceOffload offload = {},
                 const std::string& lora = "");
  // A model in memory (the same full model on every rank of the group), bytes as its tokenizer.
  // With offloaded weights, build it under a memory::HostScope so that it is never counted
  // as device memory (the checkpoint constructor loads that way itself).
  InferenceModel(model::Gpt gpt, parallel::CommPtr tp_group, std::string name = "meshtrain", InferenceOffload offload = {});
  ~InferenceModel();

  model::Gpt& gpt() { return gpt_; }
  const model::GptConfig& config() const { return gpt_->config(); }
  // Options with full_vocabulary set for this model's split, kv_storage for
  // its offload, and sampleable: the ids its tokenizer can decode (a padded
  // vocabulary's extra rows are never sampled; Note [Safe sampling]).
  model::SampleOptions with_split(model::SampleOptions options) const;
  // The model's tokenizer (the one it was trained or imported with).
  const text::Tokenizer& tokenizer() const { return *tokenizer_; }
  // With the tokenizer's template tokens (Llama's <s>) unless told not to, as transformers' encode().
  std::vector<int64_t> encode(const std::string& text, bool add_special_tokens = true) const;
  std::string decode(const std::vector<int64_t>& tokens) const;
  // Decodes tokens that continue `prompt`: the text they add after it (a
  // SentencePiece word's leading space kept, which decoding them alone drops);
  // with `skip_special`, the special tokens among them (<|im_start|>) left out.
  std::function<std::string(const std::vector<int64_t>&)> continuation(const std::vector<int64_t>& prompt,
                                                                      bool skip_special = false) const;
  const std::string& name() const { return name_; }  // the checkpoint folder's name
  const std::string& adapter() const { return adapter_; }  // the PEFT adapter merged in, described ("": none)
  int64_t step() const { return step_; }
  // Where KV caches for this model keep keys and values (unset: the device).
  model::KvCacheStorage kv_storage() const;
  // The weight stream when the weights are offloaded (else null).
  const offload::WeightStream* weight_stream() const { return stream_.get(); }
  const InferenceOffload& offload() const { return offload_; }

 private:
  void split();
  // Checks the tokenizer against the model's vocabulary and notes the ids it decodes.
  void check_tokenizer();
  // With weights offloaded: the blocks to the tiered store, the rest to the device.
  void stream_weights();

  model::Gpt gpt_{nullptr};
  std::unique_ptr<parallel::TensorParallel> tp_;
  parallel::CommPtr group_;
  std::unique_ptr<text::Tokenizer> tokenizer_;
  at::Tensor sampleable_;  // bool [vocab]
  std::string name_;
  std::string adapter_;  // "LoRA adapter DIR merged (rank 8, ...)", or "" (none)
  int64_t step_ = 0;
  InferenceOffload offload_;
  std::shared_ptr<offload::TieredStore> store_;
  std::shared_ptr<offload::WeightStream> stream_;
};

}  // namespace meshtrain::serve
