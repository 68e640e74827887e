// Placements and redistribute under mpirun: every transition along one axis,
// and every pair of placements on 2-axis meshes (a sample on 3 axes), with
// uneven chunks and blocks, against values cut out of the global tensor;
// the backward of each against its dual.
#include "meshtrain/placement/redistribute.h"
#include "tests/harness/mpi_env.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <functional>
#include <random>

namespace meshtrain::placement {
namespace {

using testing::world;

// Meshes of up to three axes over the world, every factorisation.
std::vector<std::vector<mesh::MeshAxis>> meshes(int n, int axes) {
  std::vector<std::vector<mesh::MeshAxis>> out;
  const std::vector<std::string> names = {"a", "b", "c"};
  std::function<void(std::vector<mesh::MeshAxis>, int)> grow = [&](std::vector<mesh::MeshAxis> so_far, int left) {
    if (static_cast<int>(so_far.size()) == axes) {
      if (left == 1) out.push_back(so_far);
      return;
    }
    for (int s = 1; s <= left; ++s) {
      if (left % s != 0) continue;
      auto next = so_far;
      next.push_back({names[so_far.size()], s});
      grow(next, left / s);
    }
  };
  grow({}, n);
  return out;
}

at::Tensor fixed(const std::vector<int64_t>& shape, uint64_t seed) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, g, at::kDouble);
}

std::vector<std::string> axis_names(const mesh::MeshLayout& layout) {
  std::vector<std::string> names;
  for (const auto& a : layout.axes()) names.push_back(a.name);
  return names;
}

TensorSpec with_partial_as_replicate(TensorSpec spec) {
  for (Placement& p : spec.placements) {
    if (p.is_partial()) p = Placement::replicate();
  }
  return spec;
}

// This rank's local tensor of `global` under `spec`; along a Partial axis the
// value is split into unequal parts that sum to it.
at::Tensor make_local(const at::Tensor& global, const TensorSpec& spec, const mesh::DeviceMesh& mesh) {
  at::Tensor x = local_of(global, with_partial_as_replicate(spec), mesh.layout(), mesh.rank());
  for (size_t i = 0; i < spec.axes.size(); ++i) {
    if (!spec.placements[i].is_partial()) continue;
    const double n = mesh.layout().axis_size(spec.axes[i]), c = mesh.coordinate(spec.axes[i]);
    x = x / n + (c - (n - 1) / 2) * fixed(x.sizes().vec(), 100 + i);
  }
  return x;
}

// Whether `local` is `global` under `spec` (Partial axes summed first).
::testing::AssertionResult holds(const at::Tensor& local, const at::Tensor& global, const TensorSpec& spec,
                                 const mesh::DeviceMesh& mesh) {
  at::Tensor got = local.detach().contiguous().clone();
  std::vector<std::string> partial;
  for (size_t i = 0; i < spec.axes.size(); ++i) {
    if (spec.placements[i].is_partial()) partial.push_back(spec.axes[i]);
  }
  if (!partial.empty()) mesh.comm(partial)->all_reduce(got).wait();
  const at::Tensor want = local_of(global, with_partial_as_replicate(spec), mesh.layout(), mesh.rank());
  if (got.sizes() != want.sizes()) {
    return ::testing::AssertionFailure() << "shape " << got.sizes() << ", want " << want.sizes();
  }
  const double error = want.numel() ? (got - want).abs().max().item<double>() : 0.0;
  if (error > 1e-9) return ::testing::AssertionFailure() << "largest error " << error;
  return ::testing::AssertionSuccess();
}

std::vector<Placement> choices(const std::vector<int64_t>& shape) {
  std::vector<Placement> out = {Placement::replicate(), Placement::partial()};
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) out.push_back(Placement::shard(d));
  out.push_back(Placement::shard(0, 3));
  return out;
}

// Every spec over `axes`: each axis any choice, blocks-split dim 0 on one axis only.
std::vector<std::vector<Placement>> all_placements(const std::vector<int64_t>& shape, size_t axes) {
  std::vector<std::vector<Placement>> out = {{}};
  for (size_t a = 0; a < axes; ++a) {
    std::vector<std::vector<Placement>> next;
    for (const auto& so_far : out) {
      for (const Placement& p : choices(shape)) {
        auto grown = so_far;
        grown.push_back(p);
        int dim0 = 0, blocked = 0;
        for (const Placement& q : grown) dim0 += q.is_shard(0), blocked += q.is_shard(0) && q.blocks > 1;
        if (blocked && dim0 > 1) continue;
        next.push_back(grown);
      }
    }
    out = next;
  }
  return out;
}

void check_pairs(const mesh::DeviceMesh& mesh, const std::vector<int64_t>& shape,
                 const std::vector<std::pair<std::vector<Placement>, std::vector<Placement>>>& pairs, bool backward) {
  const at::Tensor global = fixed(shape, 7), gradient = fixed(shape, 8);
  for (const auto& [from_p, to_p] : pairs) {
    TensorSpec from{shape, axis_names(mesh.layout()), from_p};
    TensorSpec to = from;
    to.placements = to_p;
    const at::Tensor x = make_local(global, from, mesh).requires_grad_(backward);
    const at::Tensor y = redistribute(x, mesh, from, to_p);
    ASSERT_TRUE(holds(y, global, to, mesh)) << mesh.layout().describe() << ": " << from.str() << " -> " << to.str();
    if (!backward) continue;
    // The gradient of `to` arrives as dual(to) and leaves as dual(from).
    TensorSpec grad_to = to, grad_from = from;
    grad_to.placements = dual(to_p);
    grad_from.placements = dual(from_p);
    const at::Tensor g = torch::autograd::grad({y}, {x}, {make_local(gradient, grad_to, mesh)})[0];
    ASSERT_TRUE(holds(g, gradient, grad_from, mesh))
        << mesh.layout().describe() << ": backward of " << from.str() << " -> " << to.str();
  }
}

TEST(Redistribute, EveryTransitionAlongOneAxis) {
  const int n = world()->size();
  const mesh::DeviceMesh mesh(world(), mesh::MeshLayout({{"a", n}}, n));
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{{9, 5, 2}, {3, 7}, {12}}) {
    std::vector<std::pair<std::vector<Placement>, std::vector<Placement>>> pairs;
    for (const auto& a : all_placements(shape, 1)) {
      for (const auto& b : all_placements(shape, 1)) pairs.push_back({a, b});
    }
    check_pairs(mesh, shape, pairs, /*backward=*/true);
  }
}

TEST(Redistribute, EveryPairOnTwoAxisMeshes) {
  const int n = world()->size();
  const std::vector<int64_t> shape = {9, 5, 2};
  const auto specs = all_placements(shape, 2);
  for (const auto& axes : meshes(n, 2)) {
    const mesh::DeviceMesh mesh(world(), mesh::MeshLayout(axes, n));
    std::vector<std::pair<std::vector<Placement>, std::vector<Placement>>> pairs;
    for (const auto& a : specs) {
      for (const auto& b : specs) pairs.push_back({a, b});
    }
    check_pairs(mesh, shape, pairs, /*backward=*/false);
    // The backward on a sample.
    pairs.resize(std::min<size_t>(pairs.size(), 200));
    std::mt19937 random(3);
    for (auto& pair : pairs) pair = {specs[random() % specs.size()], specs[random() % specs.size()]};
    check_pairs(mesh, shape, pairs, /*backward=*/true);
  }
}

TEST(Redistribute, SampledPairsOnThreeAxisMeshes) {
  const int n = world()->size();
  const std::vector<int64_t> shape = {6, 7, 5};
  const auto specs = all_placements(shape, 3);
  std::mt19937 random(5);  // the same sample on every rank
  for (const auto& axes : meshes(n, 3)) {
    const mesh::DeviceMesh mesh(world(), mesh::MeshLayout(axes, n));
    std::vector<std::pair<std::vector<Placement>, std::vector<Placement>>> pairs;
    for (int i = 0; i < 150; ++i) pairs.push_back({specs[random() % specs.size()], specs[random() % specs.size()]});
    check_pairs(mesh, shape, pairs, /*backward=*/n <= 4);
  }
}

TEST(Placements, LocalChunksCoverTheTensorOnce) {
  const int n = world()->size();
  for (const auto& axes : meshes(n, 2)) {
    const mesh::MeshLayout layout(axes, n);
    for (const auto& placements : all_placements({9, 4}, 2)) {
      bool partial = false;
      for (const Placement& p : placements) partial |= p.is_partial();
      if (partial) continue;
      TensorSpec spec{{9, 4}, axis_names(layout), placements};
      // Every element written exactly once over the ranks that write.
      at::Tensor count = at::zeros({9, 4}, at::kInt);
      for (int r = 0; r < n; ++r) {
        if (!writes_once(spec, layout, r)) continue;
        for (const Chunk& c : local_chunks(spec, layout, r)) {
          at::Tensor box = count.narrow(0, c.box.offsets[0], c.box.sizes[0]).narrow(1, c.box.offsets[1], c.box.sizes[1]);
          at::Tensor flat = at::zeros({c.box.numel()}, at::kInt);
          flat.narrow(0, c.begin, c.numel()).fill_(1);
          box.add_(flat.view(box.sizes()));
        }
      }
      EXPECT_TRUE(count.eq(1).all().item<bool>()) << layout.describe() << " " << spec.str();
    }
  }
}

}  // namespace
}  // namespace meshtrain::placement
