// A key/value cache for generation, as every block's attention object on an
// unchanged model. See Note [KV cache].
#pragma once

#include "meshtrain/model/attention.h"
#include "meshtrain/model/gpt.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain::model {

// Note [KV cache]
// Attached to a Gpt, the cache is each block's attention object (Note
// [Attention object]): it appends the block's keys and values to what the
// block saw before and attends the new queries to all of it (causally among
// themselves). The forwards run on next(tokens), whose Batch places the new
// tokens after what the cache holds, so RoPE and a learned position
// embedding see their true positions. A forward over the prompt (prefill)
// and then over one new token at a time gives the logits a full forward over
// the whole sequence gives, at a fraction of the work. clear() before a new sequence;
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

class KvCache {
 public:
  explicit KvCache(const Gpt& model);
  // Makes the cache every block's attention on `model` until the returned object goes.
  std::unique_ptr<AttentionSwap> attach(GptImpl& model);
  // The Batch of `tokens` [B, t] that come next: positions after the cache's
  // (per row, from its first real token). Throws std::invalid_argument when
  // they exceed the model's context.
  Batch next(const at::Tensor& tokens) const;
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
  class LayerAttention;
  struct Layer {
    // [B, Hkv, T, head_dim]: views of the first T slots of k_room / v_room
    // when those are defined (room to append without copying what is cached).
    at::Tensor k, v;
    at::Tensor k_room, v_room;
    int64_t dropped = 0;  // slots before the first one k holds, left behind by the rolling window
    int64_t window = 0;   // the block's sliding window (0: none)
    void set(at::Tensor keys, at::Tensor values) {  // new contents, without room
      k = std::move(keys), v = std::move(values);
      k_room = v_room = at::Tensor();
    }
  };
  // Appends `fresh` [B, Hkv, t, hd] after `cached` in `room`, which grows
  // (doubling, up to the context) when full: O(t) per call, not O(length).
  void append(at::Tensor& cached, at::Tensor& room, const at::Tensor& fresh) const;
  // The block's attention on the new tokens' heads, after their keys and values join the cache.
  at::Tensor attend(int64_t block, const QkvHeads& heads, const AttentionSpec& spec);
  void check_room(int64_t t) const;  // throws when t more tokens exceed the context
  at::Tensor positions(int64_t t) const;  // [B, t] positions of the next t slots, with padding
  void pad_left(int64_t slots);           // `slots` empty slots before every row's tokens
  at::Tensor pads_or_zeros() const;
  void roll(Layer& layer);        // keeps the last window - 1 slots (Note [Rolling window])
  void check_not_rolled() const;  // throws once a layer has rolled

  GptConfig config_;
  KvCacheStorage storage_;
  std::vector<Layer> layers_;  // by block
  at::Tensor pads_;  // [B] int64, or undefined: no padding
  int64_t length_ = 0;
  int64_t blocks_done_ = 0;  // blocks that appended in the current forward
  bool rolling_ = false;
};

}  // namespace meshtrain::model
