#include "meshtrain/checkpoint/reader.h"

#include "meshtrain/checkpoint/store.h"
#include "meshtrain/checkpoint/writer.h"
#include "meshtrain/util/files.h"

#include <ATen/core/grad_mode.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace meshtrain::checkpoint {

namespace {

struct Region {
  std::vector<int64_t> offsets, sizes;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : sizes) n *= s;
    return n;
  }
};

// The common part of two boxes (sizes 0 somewhere when they do not meet).
Region intersect(const std::vector<int64_t>& a_off, const std::vector<int64_t>& a_size, const std::vector<int64_t>& b_off,
                 const std::vector<int64_t>& b_size) {
  Region r;
  for (size_t d = 0; d < a_off.size(); ++d) {
    const int64_t lo = std::max(a_off[d], b_off[d]), hi = std::min(a_off[d] + a_size[d], b_off[d] + b_size[d]);
    r.offsets.push_back(lo);
    r.sizes.push_back(std::max<int64_t>(0, hi - lo));
  }
  return r;
}

// Row-major positions, within the box (offsets, sizes), of the elements of `region`.
at::Tensor positions(const Region& region, const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes) {
  const int64_t dims = static_cast<int64_t>(sizes.size());
  at::Tensor index = at::zeros({1}, at::kLong);
  int64_t stride = 1;
  std::vector<int64_t> strides(dims);
  for (int64_t d = dims - 1; d >= 0; --d) {
    strides[d] = stride;
    stride *= sizes[d];
  }
  std::vector<int64_t> shape(dims, 1);
  index = index.view(shape);
  for (int64_t d = 0; d < dims; ++d) {
    std::vector<int64_t> along(dims, 1);
    along[d] = region.sizes[d];
    index = index + (at::arange(region.offsets[d] - offsets[d], region.offsets[d] - offsets[d] + region.sizes[d], at::kLong) *
                     strides[d])
                        .view(along);
  }
  return index.reshape({-1});
}

bool same_box(const ChunkEntry& s, const placement::Chunk& t) { return s.offsets == t.box.offsets && s.sizes == t.box.sizes; }

bool same_chunk(const ChunkEntry& a, const ChunkEntry& b) {
  return a.offsets == b.offsets && a.sizes == b.sizes && a.begin == b.begin && a.end == b.end;
}

constexpr int64_t kSlabElements = int64_t{1} << 21;  // bounds the index tensors of one overlap

}  // namespace

CheckpointReader::CheckpointReader(std::string folder)
    : folder_(std::move(folder)), metadata_(CheckpointStore::read_metadata(folder_)) {}

CheckpointReader::~CheckpointReader() {
  for (const auto& [name, fd] : files_) ::close(fd);
}

bool CheckpointReader::here(const std::string& file) {
  if (metadata_.hosts.count(file) == 0) return true;  // not a local checkpoint's file: it must be here
  auto it = present_.find(file);
  if (it == present_.end()) it = present_.emplace(file, util::is_regular_file(util::join_path(folder_, file))).first;
  return it->second;
}

const TensorEntry& CheckpointReader::entry(const std::string& name) const {
  auto it = metadata_.tensors.find(name);
  if (it == metadata_.tensors.end()) {
    throw CheckpointError("checkpoint " + folder_ + " has no tensor " + name + " (saved with layout '" +
                          metadata_.layout + "')");
  }
  return it->second;
}

at::Tensor CheckpointReader::read_elements(const TensorEntry& tensor, const ChunkEntry& chunk, int64_t first,
                                           int64_t last) {
  const at::ScalarType dtype = stored_dtype(tensor.dtype);
  const int64_t element = c10::elementSize(dtype), block = chunk.block_bytes;
  const int64_t begin = first * element, end = last * element;
  const int64_t read_begin = begin / block * block, read_end = std::min(chunk.bytes, (end + block - 1) / block * block);
  const std::string path = util::join_path(folder_, chunk.file);
  auto it = files_.find(chunk.file);
  if (it == files_.end()) {
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) throw CheckpointError("checkpoint file " + path + " cannot be read: " + std::strerror(errno));
    it = files_.emplace(chunk.file, fd).first;
  }
  std::vector<char> bytes(static_cast<size_t>(read_end - read_begin));
  int64_t done = 0;
  while (done < read_end - read_begin) {
    const ssize_t n = ::pread(it->second, bytes.data() + done, static_cast<size_t>(read_end - read_begin - done),
                              static_cast<off_t>(chunk.offset + read_begin + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw CheckpointError("checkpoint file " + path + " is truncated: a chunk ends past its end");
    done += n;
  }
  bytes_read_ += done;
  for (int64_t b = read_begin; b < read_end; b += block) {
    const int64_t k = b / block;
    if (k >= static_cast<int64_t>(chunk.checksums.size()) ||
        checksum(bytes.data() + (b - read_begin), std::min(block, read_end - b)) != chunk.checksums[k]) {
      throw CheckpointError("checkpoint file " + path + " is corrupt: bytes " + std::to_string(chunk.offset + b) + "-" +
                            std::to_string(chunk.offset + std::min(read_end, b + block)) +
                            " do not match their checksum in metadata.json");
    }
  }
  at::Tensor out = at::empty({last - first}, at::TensorOptions().dtype(dtype));
  std::memcpy(out.data_ptr(), bytes.data() + (begin - read_begin), static_cast<size_t>(end - begin));
  return out;
}

void CheckpointReader::load(const placement::TrainingState& state, const mesh::MeshLayout& layout, int rank,
                            const std::function<bool(const std::string&)>& wanted) {
  at::NoGradGuard no_grad;
  for (const placement::StateTensor& t : state) {
    if (wanted && !wanted(t.name)) continue;
    const TensorEntry& saved = entry(t.name);
    if (saved.shape != t.spec.shape) {
      throw CheckpointError("checkpoint " + folder_ + ": tensor " + t.name + " has shape " + c10::str(saved.shape) +
                            " there and " + c10::str(t.spec.shape) + " in this model");
    }
    if (!t.local.is_contiguous()) throw std::logic_error("checkpoint load: the local tensor of " + t.name + " is not contiguous");
    at::Tensor local = t.local.view({-1});
    int64_t base = 0, filled = 0, wanted_elements = 0;
    std::string elsewhere;  // files of a local checkpoint this host does not hold, that the chunks below needed
    for (const placement::Chunk& target : placement::local_chunks(t.spec, layout, rank)) {
      wanted_elements += target.numel();
      std::vector<const ChunkEntry*> used;  // a local checkpoint holds a chunk once per host that held it
      for (const ChunkEntry& source : saved.chunks) {
        if (std::any_of(used.begin(), used.end(), [&](const ChunkEntry* u) { return same_chunk(*u, source); })) continue;
        if (!here(source.file)) {
          if (elsewhere.find(source.file) == std::string::npos) {
            elsewhere += (elsewhere.empty() ? "" : ", ") + source.file + " on " + metadata_.hosts.at(source.file);
          }
          continue;
        }
        used.push_back(&source);
        if (same_box(source, target)) {
          const int64_t lo = std::max(source.begin, target.begin), hi = std::min(source.end, target.end);
          if (lo >= hi) continue;
          local.narrow(0, base + lo - target.begin, hi - lo)
              .copy_(read_elements(saved, source, lo - source.begin, hi - source.begin));
          filled += hi - lo;
          continue;
        }
        const Region common = intersect(source.offsets, source.sizes, target.box.offsets, target.box.sizes);
        if (common.numel() == 0) continue;
        // Slabs along dim 0 keep the index tensors small.
        const int64_t row = common.sizes.empty() || common.sizes[0] == 0 ? 1 : common.numel() / common.sizes[0];
        const int64_t rows_per_slab = std::max<int64_t>(1, kSlabElements / std::max<int64_t>(1, row));
        const int64_t total_rows = common.sizes.empty() ? 1 : common.sizes[0];
        for (int64_t r0 = 0; r0 < total_rows; r0 += rows_per_slab) {
          Region slab = common;
          if (!slab.sizes.empty()) {
            slab.offsets[0] += r0;
            slab.sizes[0] = std::min(rows_per_slab, total_rows - r0);
          }
          const at::Tensor in_source = positions(slab, source.offsets, source.sizes);
          const at::Tensor in_target = positions(slab, target.box.offsets, target.box.sizes);
          const at::Tensor keep = (in_source >= source.begin) & (in_source < source.end) & (in_target >= target.begin) &
                                  (in_target < target.end);
          const at::Tensor from = in_source.masked_select(keep) - source.begin;
          if (from.numel() == 0) continue;
          const at::Tensor to = in_target.masked_select(keep) - target.begin + base;
          const int64_t first = from.min().item<int64_t>(), last = from.max().item<int64_t>() + 1;
          const at::Tensor values = read_elements(saved, source, first, last).index_select(0, from - first);
          local.index_copy_(0, to.to(local.device()), values.to(local.options()));
          filled += from.numel();
        }
      }
      base += target.numel();
    }
    if (filled > wanted_elements) {
      throw CheckpointError("checkpoint " + folder_ + ": tensor " + t.name + " has chunks that overlap without being "
                            "alike; the checkpoint is malformed");
    }
    if (filled != wanted_elements) {
      const std::string missing = "checkpoint " + folder_ + ": tensor " + t.name + ": " +
                                  std::to_string(wanted_elements - filled) + " of the " +
                                  std::to_string(wanted_elements) + " elements rank " + std::to_string(rank) + " needs";
      if (elsewhere.empty()) throw CheckpointError(missing + " are in no chunk");
      throw CheckpointError(missing + " are in files on other hosts (" + elsewhere +
                            "): a local checkpoint (checkpoint.local = true) resumes on the hosts that wrote it, in "
                            "its layout; `meshtrain checkpoint gather` copies it into one folder any layout can read");
    }
  }
}

at::Tensor CheckpointReader::read(const std::string& name) {
  const TensorEntry& saved = entry(name);
  placement::StateTensor whole{name, placement::TensorSpec{saved.shape, {}, {}}, at::empty({saved.numel()}, at::TensorOptions().dtype(stored_dtype(saved.dtype))), true};
  load({whole}, mesh::MeshLayout({{"all", 1}}, 1), 0);
  return whole.local.view(saved.shape);
}

}  // namespace meshtrain::checkpoint
