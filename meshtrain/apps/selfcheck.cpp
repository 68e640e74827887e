// meshtrain selfcheck: every collective on every dtype, checked against
// hand-computed values on all ranks, then a short bandwidth table.
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"

#include "meshtrain/comm/backend/mpi/mpi_communicator.h"
#include "meshtrain/mesh/device_mesh.h"

#include <cstdio>
#include <functional>

namespace meshtrain::apps {

namespace {

using comm::Communicator;
using comm::ReduceOp;

struct Check {
  std::string name;
  std::function<bool(Communicator&)> run;  // true when this rank saw the right values
};

bool same_values(const at::Tensor& got, const at::Tensor& want) {
  return got.sizes() == want.sizes() && at::allclose(got.to(at::kDouble), want.to(at::kDouble), 1e-2, 1e-2);
}

std::vector<Check> checks_for(at::ScalarType dtype) {
  const auto opts = at::TensorOptions().dtype(dtype);
  const std::string t = comm::dtype_name(dtype);
  std::vector<Check> checks;
  checks.push_back({"all_reduce sum " + t, [=](Communicator& c) {
                      at::Tensor x = at::full({7}, c.rank() + 1, opts);
                      c.all_reduce(x).wait();
                      return same_values(x, at::full({7}, c.size() * (c.size() + 1) / 2, opts));
                    }});
  checks.push_back({"all_reduce max/min " + t, [=](Communicator& c) {
                      at::Tensor hi = at::full({5}, c.rank() + 1, opts), lo = hi.clone();
                      c.all_reduce(hi, ReduceOp::kMax).wait();
                      c.all_reduce(lo, ReduceOp::kMin).wait();
                      return same_values(hi, at::full({5}, c.size(), opts)) && same_values(lo, at::full({5}, 1, opts));
                    }});
  checks.push_back({"reduce_scatter uneven " + t, [=](Communicator& c) {
                      const auto counts = comm::even_counts(2 * c.size() + 1, c.size());
                      at::Tensor in = at::arange(2 * c.size() + 1, opts).unsqueeze(1).repeat({1, 3});
                      at::Tensor out = at::empty({counts[c.rank()], 3}, opts);
                      c.reduce_scatter(out, in, ReduceOp::kSum, counts).wait();
                      int64_t start = 0;
                      for (int r = 0; r < c.rank(); ++r) start += counts[r];
                      return same_values(out, in.narrow(0, start, counts[c.rank()]) * c.size());
                    }});
  checks.push_back({"all_gather uneven " + t, [=](Communicator& c) {
                      const auto counts = comm::even_counts(2 * c.size() + 1, c.size());
                      at::Tensor out = at::empty({2 * c.size() + 1, 2}, opts);
                      c.all_gather(out, at::full({counts[c.rank()], 2}, c.rank(), opts), counts).wait();
                      std::vector<at::Tensor> parts;
                      for (int r = 0; r < c.size(); ++r) parts.push_back(at::full({counts[r], 2}, r, opts));
                      return same_values(out, at::cat(parts));
                    }});
  checks.push_back({"broadcast " + t, [=](Communicator& c) {
                      at::Tensor x = at::full({9}, c.rank() + 3, opts);
                      c.broadcast(x, c.size() - 1).wait();
                      return same_values(x, at::full({9}, c.size() + 2, opts));
                    }});
  checks.push_back({"all_to_all uneven " + t, [=](Communicator& c) {
                      // rank r sends d+1 rows of value r to rank d
                      std::vector<int64_t> in_splits, out_splits;
                      std::vector<at::Tensor> sent, expected;
                      for (int d = 0; d < c.size(); ++d) {
                        in_splits.push_back(d + 1);
                        out_splits.push_back(c.rank() + 1);
                        sent.push_back(at::full({d + 1}, c.rank(), opts));
                        expected.push_back(at::full({c.rank() + 1}, d, opts));
                      }
                      at::Tensor out = at::empty({c.size() * (c.rank() + 1)}, opts);
                      c.all_to_all(out, at::cat(sent), out_splits, in_splits).wait();
                      return same_values(out, at::cat(expected));
                    }});
  checks.push_back({"send/recv ring " + t, [=](Communicator& c) {
                      at::Tensor out = at::full({6}, c.rank(), opts), in = at::empty({6}, opts);
                      comm::Work s = c.send(out, (c.rank() + 1) % c.size());
                      comm::Work r = c.recv(in, (c.rank() + c.size() - 1) % c.size());
                      comm::wait_all({s, r});
                      return same_values(in, at::full({6}, (c.rank() + c.size() - 1) % c.size(), opts));
                    }});
  return checks;
}

}  // namespace

int run_selfcheck(comm::Runtime& runtime, int64_t bench_max_bytes) {
  Communicator& world = *runtime.world();
  const bool leader = world.rank() == 0;
  std::vector<Check> checks;
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kInt, at::kLong}) {
    for (Check& c : checks_for(dtype)) checks.push_back(std::move(c));
  }
  checks.push_back({"barrier", [](Communicator& c) { c.barrier().wait(); return true; }});
  checks.push_back({"split even/odd ranks", [](Communicator& c) {
                      auto half = c.split(c.rank() % 2, c.rank(), "selfcheck:parity");
                      at::Tensor x = at::full({1}, c.rank(), at::kLong);
                      half->all_reduce(x).wait();
                      int64_t want = 0;
                      for (int r = c.rank() % 2; r < c.size(); r += 2) want += r;
                      return x.item<int64_t>() == want && half->size() == (c.size() + 1 - c.rank() % 2) / 2;
                    }});

  // A 2-D mesh when the world size allows one: tp = the smallest factor > 1.
  int tp = world.size();
  for (int f = 2; f < world.size(); ++f) {
    if (world.size() % f == 0) { tp = f; break; }
  }
  mesh::DeviceMesh device_mesh(runtime.world(), mesh::MeshLayout({{"dp", world.size() / tp}, {"tp", tp}}, world.size()));
  for (const std::string axis : {"dp", "tp"}) {
    checks.push_back({"mesh axis " + axis + " all_reduce", [&, axis](Communicator&) {
                        const auto& c = device_mesh.comm(axis);
                        at::Tensor x = at::full({3}, device_mesh.rank(), at::kLong);
                        c->all_reduce(x).wait();
                        int64_t want = 0;
                        for (int r : device_mesh.layout().group_ranks(device_mesh.rank(), {axis})) want += r;
                        return (x == want).all().item<bool>();
                      }});
  }

  if (leader) {
    std::printf("meshtrain selfcheck: %d ranks, %s backend, mesh %s\n\n", world.size(), world.backend_name(),
                device_mesh.layout().describe().c_str());
    std::printf("%-36s %s\n", "check", "result (all ranks)");
  }
  int failed = 0;
  for (Check& check : checks) {
    bool ok = false;
    std::string error;
    try {
      ok = check.run(world);
    } catch (const std::exception& e) {
      error = e.what();
    }
    at::Tensor all_ok = at::full({1}, ok ? 1 : 0, at::kInt);
    world.all_reduce(all_ok, ReduceOp::kMin).wait();
    const bool passed = all_ok.item<int>() == 1;
    failed += passed ? 0 : 1;
    if (!ok && !error.empty()) std::fprintf(stderr, "meshtrain: rank %d: %s: %s\n", world.rank(), check.name.c_str(), error.c_str());
    if (leader) std::printf("%-36s %s\n", check.name.c_str(), passed ? "ok" : "FAILED");
  }
  if (leader) {
    std::printf("\n%zu checks: %zu passed, %d failed on %d ranks\n\n", checks.size(), checks.size() - failed, failed,
                world.size());
    std::fflush(stdout);
  }
  if (failed == 0 && bench_max_bytes > 0) {
    CommBenchOptions bench;
    bench.max_bytes = bench_max_bytes;
    bench.trials = 3;
    bench.trial_seconds = 0.05;
    run_comm_bench(runtime, bench);
  }
  return failed == 0 ? 0 : 1;
}

CommandPtr add_selfcheck(CLI::App& app) {
  auto max_size = std::make_shared<std::string>("16M");
  CLI::App* sub = app.add_subcommand(
      "selfcheck", "Check every collective and dtype on all ranks against hand-computed values, then print a "
                   "bandwidth table");
  sub->add_option("--bench-max-size", *max_size, "Largest message of the bandwidth table (e.g. 16M; 0 skips the table)")
      ->capture_default_str();
  return command(sub, [max_size](comm::Runtime& runtime) {
    return run_selfcheck(runtime, *max_size == "0" ? 0 : parse_size(*max_size));
  });
}

}  // namespace meshtrain::apps
