// The distributed checkpoint under mpirun, on synthetic state: every
// placement saved once and loaded into every other (other meshes, blocks,
// flat ranges, one process), reading only what overlaps; what a damaged,
// truncated or incomplete checkpoint says; pruning.
#include "meshtrain/checkpoint/reader.h"
#include "meshtrain/checkpoint/writer.h"
#include "meshtrain/comm/agree.h"
#include "meshtrain/util/files.h"
#include "tests/harness/error_of.h"
#include "tests/harness/mpi_env.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <fstream>

namespace meshtrain::checkpoint {
namespace {

using placement::Placement;
using placement::TensorSpec;
using testing::world;

at::Tensor fixed(const std::vector<int64_t>& shape, uint64_t seed) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, g, at::kFloat);
}

// One way to hold tensors on a mesh, and the state it gives this rank.
struct Layout {
  std::string name;
  mesh::MeshLayout mesh;
  std::function<TensorSpec(const std::vector<int64_t>& shape)> spec;  // the tensors' placement
  // Like FSDP: the coordinate c on this axis keeps only part c of its local
  // elements (uneven last part); "" keeps them all.
  std::string flat_axis;

  placement::TrainingState state(const std::map<std::string, at::Tensor>& globals, int rank, bool fill) const {
    placement::TrainingState out;
    for (const auto& [name, global] : globals) {
      placement::StateTensor t{name, spec(global.sizes().vec()), {}, true};
      t.write = placement::writes_once(t.spec, mesh, rank);
      if (!flat_axis.empty()) {
        int64_t numel = 1;
        for (int64_t d : placement::local_shape(t.spec, mesh, rank)) numel *= d;
        const int64_t parts = mesh.axis_size(flat_axis), c = mesh.coordinate(rank)[mesh.axis_index(flat_axis)];
        const int64_t part = (numel + parts - 1) / parts;
        t.spec.flat_begin = std::min(numel, c * part);
        t.spec.flat_end = std::min(numel, (c + 1) * part);
      }
      const at::Tensor local = placement::local_of(global, t.spec, mesh, rank).reshape({-1});
      t.local = fill ? local : at::zeros_like(local);
      out.push_back(t);
    }
    return out;
  }
};

std::vector<Layout> layouts(int n) {
  std::vector<Layout> out;
  const mesh::MeshLayout line({{"x", n}}, n);
  auto on = [](std::vector<std::string> axes, std::vector<Placement> placements) {
    return [axes, placements](const std::vector<int64_t>& s) { return TensorSpec{s, axes, placements}; };
  };
  out.push_back({"replicated", line, on({"x"}, {Placement::replicate()}), ""});
  out.push_back({"rows", line, on({"x"}, {Placement::shard(0)}), ""});
  out.push_back({"columns", line, on({"x"}, {Placement::shard(1)}), ""});
  out.push_back({"three blocks of rows", line, on({"x"}, {Placement::shard(0, 3)}), ""});
  out.push_back({"flat parts", line, on({}, {}), "x"});
  if (n % 2 == 0 && n > 2) {
    const mesh::MeshLayout grid({{"a", 2}, {"b", n / 2}}, n);
    out.push_back({"2-D rows x columns", grid, on({"a", "b"}, {Placement::shard(0), Placement::shard(1)}), ""});
    out.push_back({"columns, flat parts", grid, on({"b"}, {Placement::shard(1)}), "a"});
  }
  return out;
}

// Layouts whose pieces are runs of whole rows: a load between two of them
// reads what it needs and little more.
bool row_contiguous(const Layout& l) { return l.name == "rows" || l.name == "flat parts" || l.name == "replicated"; }

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = meshtrain::testing::shared_temp_directory("meshtrain-dcp-"); }
  void TearDown() override {
    unsetenv("MESHTRAIN_TEST_CHECKPOINT_FAIL_AFTER");
    world()->barrier().wait();
    if (world()->rank() == 0) util::remove_tree(dir_);
  }
  std::string dir_;
};

TEST_F(CheckpointTest, EveryPlacementLoadsIntoEveryOther) {
  const int n = world()->size();
  const std::map<std::string, at::Tensor> globals = {{"model/w", fixed({90, 70}, 1)}, {"optim/w/exp_avg", fixed({120, 5}, 2)}};
  constexpr int64_t block = 256;  // bytes per checksum: small, so that what is read shows
  int64_t case_ = 0;
  for (const Layout& saved : layouts(n)) {
    const std::string folder_dir = util::join_path(dir_, "save-" + std::to_string(case_++));
    {
      CheckpointWriter writer(CheckpointStore(folder_dir, 1), world(), /*async=*/case_ % 2 == 0, block);
      Metadata meta;
      meta.step = 7;
      writer.save(meta, saved.state(globals, world()->rank(), true), saved.mesh);
      writer.wait();
    }
    const std::string folder = CheckpointStore(folder_dir, 1).latest();
    for (const Layout& loaded : layouts(n)) {
      CheckpointReader reader(folder);
      EXPECT_EQ(reader.metadata().step, 7);
      const placement::TrainingState state = loaded.state(globals, world()->rank(), false);
      reader.load(state, loaded.mesh, world()->rank());
      for (const placement::StateTensor& t : state) {
        const at::Tensor want = placement::local_of(globals.at(t.name), t.spec, loaded.mesh, world()->rank()).reshape({-1});
        EXPECT_TRUE(at::equal(t.local, want)) << saved.name << " -> " << loaded.name << ": " << t.name;
      }
      // Only what overlaps is read: between row-contiguous layouts, what this
      // rank holds plus whole blocks at the edges of each saved chunk.
      int64_t local_bytes = 0;
      for (const auto& t : state) local_bytes += t.local.numel() * 4;
      if (row_contiguous(saved) && row_contiguous(loaded)) {
        EXPECT_LE(reader.bytes_read(), local_bytes + 2 * 2 * block * (n + 1)) << saved.name << " -> " << loaded.name;
      }
      // A whole tensor for a program without a mesh (generate, export).
      EXPECT_TRUE(at::equal(reader.read("model/w"), globals.at("model/w")));
    }
  }
}

// Note [Local checkpoints]: every rank writes all it holds, replicas too, and
// the metadata names each file's host; a reader takes one copy of each chunk
// (into any layout), and names the host of a file it needs that is not there.
TEST_F(CheckpointTest, LocalCheckpointsHoldReplicasAndNameTheHostsOfMissingFiles) {
  const int n = world()->size();
  const std::map<std::string, at::Tensor> globals = {{"model/w", fixed({90, 70}, 5)}};
  int64_t case_ = 0;
  for (const Layout& saved : layouts(n)) {
    const std::string folder_dir = util::join_path(dir_, "local-" + std::to_string(case_++));
    {
      CheckpointWriter writer(CheckpointStore(folder_dir, 1), world(), /*async=*/false, 256, /*local=*/true);
      Metadata meta;
      meta.step = 3;
      writer.save(meta, saved.state(globals, world()->rank(), true), saved.mesh);
    }
    const std::string folder = CheckpointStore(folder_dir, 1).latest();
    CheckpointReader reader(folder);
    ASSERT_EQ(reader.metadata().hosts.size(), static_cast<size_t>(n)) << saved.name;
    if (saved.name == "replicated") {
      EXPECT_EQ(reader.metadata().tensors.at("model/w").chunks.size(), static_cast<size_t>(n));  // one copy per rank
    }
    for (const Layout& loaded : layouts(n)) {
      const placement::TrainingState state = loaded.state(globals, world()->rank(), false);
      reader.load(state, loaded.mesh, world()->rank());
      const at::Tensor want = placement::local_of(globals.at("model/w"), state[0].spec, loaded.mesh, world()->rank());
      EXPECT_TRUE(at::equal(state[0].local, want.reshape({-1}))) << saved.name << " -> " << loaded.name;
    }
    world()->barrier().wait();
    if (saved.name != "rows" || n < 2) continue;
    // The last rank's file gone, as on a host that is not there: its rows are missing, named with their host.
    const std::string last = rank_file_name(n - 1);
    if (world()->rank() == 0) {
      std::remove(util::join_path(folder, last).c_str());
      const std::string manifest_path = util::join_path(folder, "MANIFEST.json");
      nlohmann::json manifest = nlohmann::json::parse(util::read_text_file(manifest_path));
      manifest["files"].erase(last);
      util::write_text_file(manifest_path, manifest.dump());
    }
    world()->barrier().wait();
    CheckpointReader partial(folder);
    const placement::TrainingState state = saved.state(globals, world()->rank(), false);
    const std::string error = meshtrain::testing::error_of<CheckpointError>(
        [&] { partial.load(state, saved.mesh, world()->rank()); });
    if (world()->rank() == n - 1) {
      EXPECT_NE(error.find("are in files on other hosts (" + last + " on " + partial.metadata().hosts.at(last) +
                           "): a local checkpoint"),
                std::string::npos)
          << error;
    } else {
      EXPECT_EQ(error, "no error");
    }
  }
}

TEST_F(CheckpointTest, DamagedTruncatedAndIncompleteCheckpointsSayWhichFile) {
  const int n = world()->size();
  const std::map<std::string, at::Tensor> globals = {{"model/w", fixed({300, 1000}, 3)}};
  const Layout rows = layouts(n)[1];
  CheckpointStore store(dir_, 3);
  CheckpointWriter writer(store, world(), false);
  for (int64_t step : {1, 2, 3}) {
    Metadata meta;
    meta.step = step;
    writer.save(meta, rows.state(globals, world()->rank(), true), rows.mesh);
  }
  const std::string data = util::join_path(store.latest(), rank_file_name(0));
  std::string error;
  if (world()->rank() == 0) {
    {
      std::fstream f(data, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(100);
      f.put('\x42');
    }
    CheckpointReader reader(store.latest());  // the manifest cannot see a changed byte; the block checksums do
    error = meshtrain::testing::error_of<CheckpointError>(
        [&] { reader.load(rows.state(globals, 0, false), rows.mesh, 0); });
    EXPECT_NE(error.find("checkpoint file " + data + " is corrupt: bytes 0-"), std::string::npos) << error;
    const int64_t size = util::file_size(data);
    ASSERT_EQ(truncate(data.c_str(), size / 2), 0);
    error = meshtrain::testing::error_of<CheckpointError>([&] { CheckpointReader reader(store.latest()); });
    EXPECT_NE(error.find("checkpoint file " + data + " is truncated or corrupt: " + std::to_string(size / 2) +
                         " bytes, the manifest says " + std::to_string(size)),
              std::string::npos)
        << error;
    const std::string older = store.complete().at(1);
    std::remove(util::join_path(older, "MANIFEST.json").c_str());
    error = meshtrain::testing::error_of<CheckpointError>([&] { CheckpointReader reader(older); });
    EXPECT_NE(error.find("is incomplete"), std::string::npos) << error;
    const std::string metadata = util::join_path(store.complete().at(2), "metadata.json");
    {
      std::fstream f(metadata, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(10);
      f.put('#');
    }
    error = meshtrain::testing::error_of<CheckpointError>([&] { CheckpointReader reader(store.complete().at(2)); });
    EXPECT_NE(error.find("checkpoint file " + metadata + " is corrupt: its checksum does not match"), std::string::npos)
        << error;
  }
}

TEST_F(CheckpointTest, FailureMidSaveKeepsThePreviousAndKeepsTheNewest) {
  const int n = world()->size();
  const std::map<std::string, at::Tensor> globals = {{"model/w", fixed({8, 8}, 4)}};
  const Layout rows = layouts(n)[1];
  CheckpointStore store(dir_, 2);
  CheckpointWriter writer(store, world(), true);
  Metadata meta;
  meta.step = 1;
  writer.save(meta, rows.state(globals, world()->rank(), true), rows.mesh);
  writer.wait();
  setenv("MESHTRAIN_TEST_CHECKPOINT_FAIL_AFTER", "metadata.json", 1);
  meta.step = 2;
  writer.save(meta, rows.state(globals, world()->rank(), true), rows.mesh);
  EXPECT_NE(meshtrain::testing::error_of<comm::AgreedError>([&] { writer.wait(); }).find("injected failure"),
            std::string::npos);
  unsetenv("MESHTRAIN_TEST_CHECKPOINT_FAIL_AFTER");
  EXPECT_EQ(util::base_name(store.latest()), "step-00000001");
  for (int64_t step : {3, 4, 5}) {
    meta.step = step;
    writer.save(meta, rows.state(globals, world()->rank(), true), rows.mesh);
  }
  writer.wait();
  EXPECT_EQ(util::base_name(store.latest()), "step-00000005");
  const std::vector<std::string> kept = store.complete();
  ASSERT_EQ(kept.size(), 2u);
  EXPECT_EQ(util::base_name(kept[1]), "step-00000004");
  EXPECT_FALSE(util::path_exists(store.staging_path(2)));
}

}  // namespace
}  // namespace meshtrain::checkpoint
