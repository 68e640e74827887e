// A key/value cache for generation, as forward hooks on an unchanged model.
// See Note [KV cache].
#pragma once

#include "meshtrain/model/attention_variants.h"
#include "meshtrain/model/gpt.h"

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace meshtrain::model {

// Note [KV cache]
// Installed on a Gpt, the cache replaces each block's attention core (the
// "blocks.N.attn.core" call site): it splits the qkv output into heads,
// rotates q and k at their true positions (RoPE), appends k and v to what
// the block saw before, and attends the new queries to all of it (causally
// among themselves). The learned position embedding ("wpe") is looked up at
// the true positions too. So a forward over the prompt (prefill) and then
// over one new token at a time gives the logits a full forward over the whole
// sequence gives, at a fraction of the work. clear() before a new sequence;
// the cache holds at most the model's context. A batch of prompts of
// different lengths is left-padded (set_padding): each row's positions start
// at its own first token and its padding is masked out, so each row's logits
// are those of the row alone.
//
// Note [Continuous batching]
// A server decodes the sequences it is running one token each per forward,
// and sequences join and leave between forwards. A new sequence is
// prefilled in a cache of its own, then append_rows() puts its rows under
// the running ones: the shorter side gets more left padding, so slot s is
// position s - pad of each row and new tokens still go to one slot for all.
// keep_rows() drops finished rows, then the slots before every remaining
// row's first token, so the cache is as long as its longest row: a request
// that fits the context alone fits it in any batch.
// Allocates room for keys or values of these sizes and options.
using KvCacheStorage = std::function<at::Tensor(at::IntArrayRef sizes, const at::TensorOptions& options)>;

class KvCache : public ForwardHooks {
 public:
  explicit KvCache(const Gpt& model);
  at::Tensor around(const std::string& module, const at::Tensor& input, const Forward& forward) override;
  void clear();
  // Rows of a batch whose prompts are left-padded: row r's first `pads[r]`
  // slots are padding, never attended to, and its positions count from its
  // first real token. Call after clear(), before the prompt's forward.
  void set_padding(const std::vector<int64_t>& pads);
  int64_t length() const { return length_; }  // tokens cached (after a forward has passed every block)
  int64_t rows() const;                        // the batch held (0 when empty)

  // Continuous batching (Note [Continuous batching]): `other`'s rows join
  // this cache's after them, both left-padded to the longer; and only
  // `rows` stay (in that order), slots no row uses any more dropped.
  void append_rows(const KvCache& other);
  void keep_rows(const std::vector<int64_t>& rows);

  // Where the room for keys and values is allocated (unset: at::empty on the
  // model's device). ZeRO-Inference's kv = "cpu" gives host memory here;
  // attention then reads the cache where it lives (on a GPU, copied over per
  // layer and step).
  void set_storage(KvCacheStorage storage) { storage_ = std::move(storage); }

  // Note [Rolling window]: blocks with a sliding window keep only the keys
  // and values the next token can see (window - 1; compacted when twice
  // that is held), so a long generation holds window-sized caches there. For one unpadded sequence; the rows
  // cannot then be joined or kept (append_rows, keep_rows, set_padding throw).
  void set_rolling(bool rolling) { rolling_ = rolling; }

 private:
  struct Layer {
    // [B, Hkv, T, head_dim]: views of the first T slots of k_room / v_room
    // when those are defined (room to append without copying what is cached).
    at::Tensor k, v;
    at::Tensor k_room, v_room;
    int64_t dropped = 0;  // slots before the first one k holds, left behind by the rolling window
    at::Tensor cos, sin;  // the block's rope tables (undefined: learned positions)
    const CausalSelfAttentionImpl* attention = nullptr;  // its q/k norms
    AttentionVariant variant;                            // its window, scale, soft-cap
    void set(at::Tensor keys, at::Tensor values) {  // new contents, without room
      k = std::move(keys), v = std::move(values);
      k_room = v_room = at::Tensor();
    }
  };
  // Appends `fresh` [B, Hkv, t, hd] after `cached` in `room`, which grows
  // (doubling, up to the context) when full: O(t) per call, not O(length).
  void append(at::Tensor& cached, at::Tensor& room, const at::Tensor& fresh) const;
  at::Tensor attend(Layer& layer, const at::Tensor& qkv_out);
  void check_room(int64_t t) const;  // throws when t more tokens exceed the context
  at::Tensor positions(int64_t t) const;  // [B, t] positions of the next t slots, with padding
  void pad_left(int64_t slots);           // `slots` empty slots before every row's tokens
  at::Tensor pads_or_zeros() const;
  void roll(Layer& layer);        // keeps the last window - 1 slots (Note [Rolling window])
  void check_not_rolled() const;  // throws once a layer has rolled

  GptConfig config_;
  KvCacheStorage storage_;
  std::map<std::string, Layer> layers_;  // by call site
  at::Tensor pads_;  // [B] int64, or undefined: no padding
  int64_t length_ = 0;
  int64_t blocks_done_ = 0;  // blocks that appended in the current forward
  bool rolling_ = false;
};

}  // namespace meshtrain::model
