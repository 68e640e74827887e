// meshtrain bench comm: our communicator against the raw MPI call, same buffers, same run.
#include "meshtrain/apps/bench_util.h"
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"

#include "meshtrain/comm/backend/mpi/mpi_communicator.h"

#include <ATen/Parallel.h>

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <stdexcept>

namespace meshtrain::apps {

namespace {

using Clock = std::chrono::steady_clock;

struct Buffers {
  at::Tensor input;
  at::Tensor output;
  int64_t bytes = 0;  // the size reported: the full (un-sharded) buffer
};

Buffers make_buffers(const std::string& op, int64_t bytes, int n) {
  int64_t elements = std::max<int64_t>(bytes / 4 / n, 1) * n;
  Buffers b;
  b.bytes = elements * 4;
  at::Tensor full = at::rand({elements});
  if (op == "all_reduce") {
    b.input = b.output = full;
  } else if (op == "reduce_scatter") {
    b.input = full;
    b.output = at::empty({elements / n});
  } else if (op == "all_gather") {
    b.input = at::rand({elements / n});
    b.output = full;
  } else {
    b.input = full;
    b.output = at::empty({elements});
  }
  return b;
}

double bus_factor(const std::string& op, int n) {
  if (n == 1) return 0.0;
  return op == "all_reduce" ? 2.0 * (n - 1) / n : double(n - 1) / n;
}

void run_ours(comm::Communicator& c, const std::string& op, const Buffers& b) {
  if (op == "all_reduce") c.all_reduce(b.input).wait();
  else if (op == "reduce_scatter") c.reduce_scatter(b.output, b.input).wait();
  else if (op == "all_gather") c.all_gather(b.output, b.input).wait();
  else c.all_to_all(b.output, b.input).wait();
}

void run_raw(MPI_Comm raw, int n, const std::string& op, const Buffers& b) {
  const int count = static_cast<int>(b.input.numel());
  if (op == "all_reduce") {
    MPI_Allreduce(MPI_IN_PLACE, b.input.data_ptr(), count, MPI_FLOAT, MPI_SUM, raw);
  } else if (op == "reduce_scatter") {
    MPI_Reduce_scatter_block(b.input.data_ptr(), b.output.data_ptr(), count / n, MPI_FLOAT, MPI_SUM, raw);
  } else if (op == "all_gather") {
    MPI_Allgather(b.input.data_ptr(), count, MPI_FLOAT, b.output.data_ptr(), count, MPI_FLOAT, raw);
  } else {
    MPI_Alltoall(b.input.data_ptr(), count / n, MPI_FLOAT, b.output.data_ptr(), count / n, MPI_FLOAT, raw);
  }
}

// Seconds per iteration, the slowest rank's.
double timed(MPI_Comm raw, int iterations, const std::function<void()>& body) {
  MPI_Barrier(raw);
  const auto start = Clock::now();
  for (int i = 0; i < iterations; ++i) body();
  double seconds = std::chrono::duration<double>(Clock::now() - start).count() / iterations;
  MPI_Allreduce(MPI_IN_PLACE, &seconds, 1, MPI_DOUBLE, MPI_MAX, raw);
  return seconds;
}

std::string human_bytes(int64_t bytes) {
  char text[32];
  auto print = [&](double value, const char* unit) {
    const bool whole = value == static_cast<double>(static_cast<int64_t>(value));
    std::snprintf(text, sizeof text, whole ? "%.0f %s" : "%.2f %s", value, unit);
  };
  if (bytes >= (int64_t{1} << 20)) print(bytes / double(1 << 20), "MiB");
  else if (bytes >= 1024) print(bytes / 1024.0, "KiB");
  else print(double(bytes), "B");
  return text;
}

}  // namespace

int run_comm_bench(comm::Runtime& runtime, const CommBenchOptions& options) {
  auto* world = dynamic_cast<comm::MpiCommunicator*>(runtime.world().get());
  if (!world) throw std::runtime_error("bench comm measures the MPI backend; the world communicator is not MPI");
  const int n = world->size();
  const bool leader = world->rank() == 0;
  MPI_Comm raw = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &raw);

  std::ofstream json;
  if (leader && !options.json_path.empty()) {
    json.open(options.json_path);
    if (!json) throw std::runtime_error("cannot write " + options.json_path);
  }
  if (leader) {
    std::printf("meshtrain bench comm: %d ranks, %s backend, float32, %d intra-op threads per rank, medians of %d "
                "trials per side\n",
                n, world->backend_name(), at::get_num_threads(), options.trials);
    std::printf("busbw = algbw * 2(n-1)/n for all_reduce, * (n-1)/n for the others; ratio = raw MPI time / "
                "meshtrain time (>= 1: no overhead)\n\n");
    std::printf("%-15s %11s %14s %12s %12s %12s %14s %7s\n", "op", "size", "meshtrain_us", "algbw_GB/s",
                "busbw_GB/s", "raw_mpi_us", "raw_busbw_GB/s", "ratio");
  }
  std::vector<double> large_ratios;
  for (const std::string& op : options.ops) {
    for (int64_t bytes = options.min_bytes; bytes <= options.max_bytes; bytes *= 4) {
      const Buffers buffers = make_buffers(op, bytes, n);
      auto ours = [&] { run_ours(*world, op, buffers); };
      auto theirs = [&] { run_raw(raw, n, op, buffers); };
      // Warm up both sides, then size trials to about trial_seconds.
      timed(raw, 2, ours);
      timed(raw, 2, theirs);
      const double once = std::max(timed(raw, 1, ours), 1e-7);
      const int iterations = static_cast<int>(std::clamp(options.trial_seconds / once, 1.0, 10000.0));
      std::vector<double> ours_s, raw_s;
      for (int t = 0; t < options.trials; ++t) {  // alternate so drifts hit both sides alike
        ours_s.push_back(timed(raw, iterations, ours));
        raw_s.push_back(timed(raw, iterations, theirs));
      }
      const double ours_median = median_of_middle(ours_s), raw_median = median_of_middle(raw_s);
      const double algbw = buffers.bytes / ours_median / 1e9;
      const double busbw = algbw * bus_factor(op, n);
      const double raw_busbw = buffers.bytes / raw_median / 1e9 * bus_factor(op, n);
      const double ratio = raw_median / ours_median;
      if (bytes >= (int64_t{4} << 20)) large_ratios.push_back(ratio);  // requested size: n may round it down
      if (leader) {
        std::printf("%-15s %11s %14.1f %12.3f %12.3f %12.1f %14.3f %7.3f\n", op.c_str(),
                    human_bytes(buffers.bytes).c_str(), ours_median * 1e6, algbw, busbw, raw_median * 1e6, raw_busbw,
                    ratio);
        std::fflush(stdout);
        if (json.is_open()) {
          json << "{\"op\":\"" << op << "\",\"bytes\":" << buffers.bytes << ",\"ranks\":" << n
               << ",\"meshtrain_s\":" << ours_median << ",\"raw_mpi_s\":" << raw_median << ",\"busbw_gbs\":" << busbw
               << ",\"raw_busbw_gbs\":" << raw_busbw << ",\"ratio\":" << ratio << "}\n";
        }
      }
    }
  }
  if (leader && !large_ratios.empty()) {
    std::printf("\nratio at >= 4 MiB over %zu rows: min %.3f, median %.3f (goal >= 0.95)\n", large_ratios.size(),
                *std::min_element(large_ratios.begin(), large_ratios.end()), median_of_middle(large_ratios));
  }
  MPI_Comm_free(&raw);
  return 0;
}

CommandPtr add_bench_comm(CLI::App& bench) {
  struct Args {
    CommBenchOptions options;
    std::string min_size = "4K", max_size = "256M";
  };
  auto a = std::make_shared<Args>();
  CLI::App* sub = bench.add_subcommand(
      "comm", "Bus bandwidth of all_reduce, reduce_scatter, all_gather and all_to_all, and the ratio to raw MPI on "
              "the same buffers");
  sub->add_option("--min-size", a->min_size, "Smallest message, bytes with optional K/M/G")->capture_default_str();
  sub->add_option("--max-size", a->max_size, "Largest message (sizes grow by 4x)")->capture_default_str();
  sub->add_option("--trials", a->options.trials, "Timed trials per side; medians are reported")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  sub->add_option("--trial-seconds", a->options.trial_seconds, "Target length of one trial")
      ->check(CLI::Range(0.001, 60.0))
      ->capture_default_str();
  sub->add_option("--ops", a->options.ops, "Ops to measure")
      ->check(CLI::IsMember({"all_reduce", "reduce_scatter", "all_gather", "all_to_all"}))
      ->capture_default_str();
  sub->add_option("--json", a->options.json_path, "Also write each row as a JSON line to this file");
  return command(sub, [a](comm::Runtime& runtime) {
    a->options.min_bytes = parse_size(a->min_size);
    a->options.max_bytes = parse_size(a->max_size);
    if (a->options.min_bytes < 4 || a->options.min_bytes > a->options.max_bytes) {
      throw std::invalid_argument("--min-size must be at least 4 bytes and at most --max-size");
    }
    return run_comm_bench(runtime, a->options);
  });
}

}  // namespace meshtrain::apps
