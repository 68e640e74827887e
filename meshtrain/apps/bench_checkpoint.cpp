// meshtrain bench checkpoint: what saving costs the training loop, with the
// write in the background (checkpoint.async) and in the loop, against steps
// without saving and against the disk's own speed, in one run.
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"

#include "meshtrain/apps/bench_util.h"

#include "meshtrain/checkpoint/writer.h"
#include "meshtrain/parallel/parallel_state.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/util/files.h"

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace meshtrain::apps {

namespace {

using Clock = BenchClock;

// The slowest rank's value (every rank gets it).
double slowest(comm::Communicator& comm, double value) {
  at::Tensor t = at::full({1}, value, at::kDouble);
  comm.all_reduce(t, comm::ReduceOp::kMax).wait();
  return t.item<double>();
}

// Seconds to write and sync `bytes` bytes to a fresh file in `dir` (the disk's own speed).
double raw_write_seconds(const std::string& dir, int64_t bytes, int rank) {
  const std::string path = util::join_path(dir, "raw-" + std::to_string(rank) + ".bin");
  std::vector<char> buffer(static_cast<size_t>(std::min<int64_t>(bytes, int64_t{64} << 20)), 1);
  const auto start = Clock::now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw std::runtime_error("cannot write " + path);
  for (int64_t done = 0; done < bytes;) {
    const ssize_t n = ::write(fd, buffer.data(), static_cast<size_t>(std::min<int64_t>(bytes - done, buffer.size())));
    if (n <= 0) break;
    done += n;
  }
  ::fsync(fd);
  ::close(fd);
  const double seconds = seconds_since(start);
  std::remove(path.c_str());
  return seconds;
}

}  // namespace

int run_bench_checkpoint(comm::Runtime& runtime, const std::vector<std::string>& overrides, int warmup_steps,
                         int timed_steps) {
  train::TrainConfig config = train::TrainConfig::load("", overrides);
  config.steps = warmup_steps + 3 * timed_steps;  // the learning-rate schedule runs over all of them
  config.resume = false;
  config.checkpoint_every = 0;
  config.validate(runtime.size());
  const auto& world = runtime.world();
  train::Trainer trainer(config, world);
  for (int s = 0; s < warmup_steps; ++s) trainer.step();
  const std::string dir = config.out + "/bench-checkpoints";

  // Steps without a save, with a background save (save, step, wait for the
  // write: the worst case, a save right after the last one) and with a save in
  // the loop, taken in turn so that the machine's drift touches all three alike.
  struct Side {
    std::unique_ptr<checkpoint::CheckpointWriter> writer;
    std::vector<double> seconds, blocking, writes;
    int64_t bytes = 0;
  };
  Side none, async, sync;
  async.writer = std::make_unique<checkpoint::CheckpointWriter>(checkpoint::CheckpointStore(dir + "/async", 1), world, true);
  sync.writer = std::make_unique<checkpoint::CheckpointWriter>(checkpoint::CheckpointStore(dir + "/sync", 1), world, false);
  auto save = [&](Side& side) {
    checkpoint::Metadata meta;
    meta.step = trainer.completed_steps();
    meta.layout = config.parallel.dims.str();
    meta.world = world->size();
    side.writer->save(meta, parallel::training_state(trainer.parts()), trainer.mesh().layout());
    side.blocking.push_back(side.writer->last_blocking_seconds());
  };
  for (int s = 0; s < timed_steps; ++s) {
    auto start = Clock::now();
    trainer.step();
    none.seconds.push_back(seconds_since(start));
    start = Clock::now();
    save(async);
    trainer.step();
    async.writer->wait();
    async.seconds.push_back(seconds_since(start));
    async.writes.push_back(async.writer->last_write_seconds());
    start = Clock::now();
    save(sync);
    trainer.step();
    sync.seconds.push_back(seconds_since(start));
    sync.writes.push_back(sync.writer->last_write_seconds());
  }
  sync.bytes = sync.writer->last_bytes();
  std::vector<double> raws;
  for (int i = 0; i < 3; ++i) raws.push_back(raw_write_seconds(config.out, std::max<int64_t>(sync.bytes, 1), world->rank()));
  const double raw = median(raws);
  const double base = slowest(*world, median(none.seconds));
  const double async_step = slowest(*world, median(async.seconds));
  const double sync_step = slowest(*world, median(sync.seconds));
  const double snapshot = slowest(*world, median(async.blocking));
  const double write = slowest(*world, median(sync.writes));
  const double raw_slowest = slowest(*world, raw);
  at::Tensor bytes = at::full({1}, static_cast<double>(sync.bytes), at::kDouble);
  world->all_reduce(bytes).wait();
  if (world->rank() == 0) {
    util::remove_tree(dir);
    const double every = 50;  // checkpoint.every's default
    nlohmann::json line = {{"preset", config.preset},
                           {"ranks", world->size()},
                           {"layout", config.parallel.dims.str()},
                           {"checkpoint_mib", bytes.item<double>() / 1048576.0},
                           {"step_s", base},
                           {"step_s_with_async_save", async_step},
                           {"step_s_with_sync_save", sync_step},
                           {"async_save_cost_s", async_step - base},
                           {"sync_save_cost_s", sync_step - base},
                           {"async_over_sync_cost", (async_step - base) / std::max(1e-9, sync_step - base)},
                           {"snapshot_s", snapshot},
                           {"write_s", write},
                           {"raw_write_s_same_bytes", raw_slowest},
                           {"write_over_raw", write / std::max(1e-9, raw_slowest)},
                           {"async_cost_per_step_every_50", (async_step - base) / every / base}};
    std::printf("%s\n", line.dump().c_str());
    std::printf("checkpoint of %.1f MiB on %d rank(s): a step takes %.3f s; a save costs the loop %.3f s written in "
                "the background (snapshot %.3f s; the write waited for after one step) and %.3f s written in the "
                "loop; the write takes %.3f s, %.2fx a raw write of the same bytes; saved every 50 steps in the "
                "background it costs %.2f%% per step\n",
                bytes.item<double>() / 1048576.0, world->size(), base, async_step - base, snapshot, sync_step - base,
                write, write / std::max(1e-9, raw_slowest), 100 * (async_step - base) / every / base);
  }
  return 0;
}

CommandPtr add_bench_checkpoint(CLI::App& bench) {
  return timed_bench_command(
      bench, "checkpoint",
      "What saving a checkpoint costs the training loop, in one run: median times of a step alone, of a save written "
      "in the background (checkpoint.async, the default) + a step + waiting for the write, and of a save written in "
      "the loop + a step, taken in turn; the snapshot and write times; the write against a raw write of the same bytes "
      "on the same disk. Config overrides as for train.",
      TimedSteps{2, 5}, run_bench_checkpoint);
}

}  // namespace meshtrain::apps
