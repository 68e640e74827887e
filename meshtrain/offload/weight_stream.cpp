#include "meshtrain/offload/weight_stream.h"

#include "meshtrain/model/call_sites.h"

#include <c10/core/StorageImpl.h>

#include <chrono>
#include <stdexcept>

namespace meshtrain::offload {

namespace {

void free_storage(const at::Tensor& flat) {
  c10::StorageImpl* storage = flat.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, flat.device()));
  storage->set_nbytes(0);
}

}  // namespace

WeightStream::WeightStream(model::Gpt& model, std::shared_ptr<TieredStore> store, Tier tier, int prefetch)
    : store_(std::move(store)), prefetch_(prefetch) {
  if (tier == Tier::kDevice) throw std::invalid_argument("weight stream: the weights go to the cpu or nvme tier");
  if (prefetch < 0) throw std::invalid_argument("offload.prefetch must be >= 0");
  if (store_->options().max_in_flight < std::max(prefetch, 1)) {
    throw std::invalid_argument("weight stream: the store's max_in_flight must be at least offload.prefetch");
  }
  torch::NoGradGuard no_grad;
  const int64_t count = static_cast<int64_t>(model->blocks->size());
  for (int64_t i = 0; i < count; ++i) {
    Block block;
    block.name = "blocks." + std::to_string(i);
    std::vector<at::Tensor> params;
    for (auto& item : model->blocks[i]->named_parameters()) params.push_back(item.value());
    if (params.empty()) continue;
    const at::TensorOptions options = params.front().options();
    int64_t numel = 0;
    for (const at::Tensor& p : params) {
      if (p.scalar_type() != params.front().scalar_type()) {
        throw std::invalid_argument("weight stream: " + block.name + " mixes parameter dtypes");
      }
      numel += p.numel();
    }
    // The flat copy is written to the tier, then its storage becomes the
    // parameters' storage (freed until fetched).
    block.flat = at::empty({numel}, options);
    int64_t offset = 0;
    for (const at::Tensor& p : params) {
      block.flat.narrow(0, offset, p.numel()).copy_(p.reshape({-1}));
      offset += p.numel();
    }
    block.slot = store_->put(block.flat, tier);
    offset = 0;
    for (at::Tensor& p : params) {
      const std::vector<int64_t> shape = p.sizes().vec();
      p.set_data(block.flat.narrow(0, offset, p.numel()).view(shape));
      offset += p.numel();
    }
    free_storage(block.flat);
    blocks_.push_back(std::move(block));
  }
}

WeightStream::~WeightStream() {
  for (Block& block : blocks_) block.ticket.wait();
}

// Device buffers are recycled, not freed: a fresh allocation of a block's
// size is fresh pages from the kernel, which the copy would fault in one by
// one (measured: streaming from host memory ran at a third of its speed).
void WeightStream::allocate_storage(const at::Tensor& flat) {
  const size_t bytes = static_cast<size_t>(flat.numel()) * flat.element_size();
  c10::StorageImpl* storage = flat.storage().unsafeGetStorageImpl();
  at::DataPtr buffer;
  for (size_t i = 0; i < free_.size(); ++i) {
    if (free_[i].second >= bytes) {
      buffer = std::move(free_[i].first);
      free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
      break;
    }
  }
  if (!buffer) buffer = storage->allocator()->allocate(bytes);
  storage->set_data_ptr_noswap(std::move(buffer));
  storage->set_nbytes(bytes);
}

void WeightStream::recycle_storage(const at::Tensor& flat) {
  c10::StorageImpl* storage = flat.storage().unsafeGetStorageImpl();
  const size_t bytes = storage->nbytes();
  free_.emplace_back(storage->set_data_ptr(at::DataPtr(nullptr, flat.device())), bytes);
  storage->set_nbytes(0);
}

void WeightStream::fetch(Block& block) {
  if (block.fetching) return;
  allocate_storage(block.flat);
  block.ticket = store_->fetch(block.slot, block.flat);
  block.fetching = true;
}

void WeightStream::release(Block& block) {
  if (!block.fetching) return;
  block.ticket.wait();
  recycle_storage(block.flat);
  block.fetching = false;
}

at::Tensor WeightStream::around(const std::string& module, const at::Tensor& input, const Forward& forward) {
  const int64_t index = model::block_call_site(module);
  if (index < 0 || index >= static_cast<int64_t>(blocks_.size())) return forward(input);
  Block& block = blocks_[static_cast<size_t>(index)];
  fetch(block);
  const auto start = std::chrono::steady_clock::now();
  block.ticket.wait();
  exposed_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int k = 1; k <= prefetch_ && k < static_cast<int>(blocks_.size()); ++k) {
    fetch(blocks_[(index + static_cast<size_t>(k)) % blocks_.size()]);
  }
  at::Tensor out = forward(input);
  release(block);
  return out;
}

int64_t WeightStream::streamed_bytes() const {
  int64_t total = 0;
  for (const Block& block : blocks_) total += block.flat.numel() * block.flat.element_size();
  return total;
}

int64_t WeightStream::largest_block_bytes() const {
  int64_t most = 0;
  for (const Block& block : blocks_) most = std::max(most, block.flat.numel() * block.flat.element_size());
  return most;
}

}  // namespace meshtrain::offload
