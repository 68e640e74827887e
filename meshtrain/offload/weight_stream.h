// ZeRO-Inference: a model's transformer blocks kept in the host or NVMe tier
// and streamed to the device one block at a time. See Note [Weight streaming].
#pragma once

#include "meshtrain/model/gpt.h"
#include "meshtrain/offload/tiered_store.h"

#include <memory>
#include <string>
#include <vector>

namespace meshtrain::offload {

// Note [Weight streaming]
// Installed on a Gpt, the stream moves every block's parameters into one
// flat slot of the tiered store each and frees their device storage; the
// parameters stay the module's tensors, views of a per-block flat buffer
// whose storage comes and goes (as fully sharded's units; the buffers are
// recycled among the blocks). Around each
// "blocks.N" call it waits for block N's fetch, issues the fetches of the
// next `prefetch` blocks (wrapping to the first ones for the next forward,
// as decoding runs forward after forward), computes, and frees block N. So
// at most prefetch + 1 blocks are on the device, and a block's transfer
// overlaps the compute of the blocks before it. The embeddings, final norm
// and head stay resident. Each forward moves the blocks' bytes once, for the
// whole batch: tokens/s grows with the batch until compute outweighs the
// transfer (the bound is block bytes / tier bandwidth per forward).
class WeightStream : public model::ForwardHooks {
 public:
  // Moves the blocks of `model` (in eval mode, no gradients) into `tier` of `store`.
  WeightStream(model::Gpt& model, std::shared_ptr<TieredStore> store, Tier tier, int prefetch = 1);
  ~WeightStream() override;
  at::Tensor around(const std::string& module, const at::Tensor& input, const Forward& forward) override;
  bool wraps_head() const override { return false; }  // blocks only

  int64_t streamed_bytes() const;   // the blocks' bytes: moved once per forward
  int64_t largest_block_bytes() const;
  int64_t blocks() const { return static_cast<int64_t>(blocks_.size()); }
  // Seconds the forward waited for a block's fetch (transfer not hidden by compute).
  double exposed_seconds() const { return exposed_; }

 private:
  struct Block {
    std::string name;   // "blocks.N"
    at::Tensor flat;    // the parameters' storage, allocated while fetched
    TieredStore::Id slot = 0;
    Ticket ticket;
    bool fetching = false;  // storage allocated, fetch issued (maybe done)
  };
  void fetch(Block& block);
  void release(Block& block);
  void allocate_storage(const at::Tensor& flat);
  void recycle_storage(const at::Tensor& flat);

  std::shared_ptr<TieredStore> store_;
  std::vector<Block> blocks_;
  int prefetch_;
  double exposed_ = 0;
  // Released blocks' device buffers (with their sizes), reused by the next
  // fetches: at most prefetch + 1 exist, so the counted memory is theirs.
  std::vector<std::pair<at::DataPtr, size_t>> free_;
};

}  // namespace meshtrain::offload
