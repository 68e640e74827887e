// meshtrain checkpoint inspect DIR: what a checkpoint holds; gather (checkpoint_gather.cpp).
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"

#include "meshtrain/checkpoint/store.h"
#include "meshtrain/util/files.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <functional>

namespace meshtrain::apps {

namespace {

std::string mib(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f MiB", bytes / 1048576.0);
  return text;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

int64_t tensor_bytes(const checkpoint::TensorEntry& t) {
  int64_t bytes = 0;
  for (const auto& c : t.chunks) bytes += c.bytes;
  return bytes;
}

}  // namespace

int run_checkpoint_inspect(const std::string& path, bool json) {
  const std::string folder = checkpoint::CheckpointStore::resolve(path);
  const checkpoint::Metadata meta = checkpoint::CheckpointStore::read_metadata(folder);
  std::map<std::string, int64_t> files;
  for (const auto& [name, t] : meta.tensors) {
    for (const auto& c : t.chunks) files[c.file] += c.bytes;
  }
  if (json) {
    nlohmann::json out = {{"folder", folder}, {"step", meta.step}, {"cursor", meta.cursor}, {"model", meta.model},
                          {"layout", meta.layout}, {"world", meta.world}, {"files", files}};
    for (const auto& [name, t] : meta.tensors) {
      out["tensors"][name] = {{"shape", t.shape}, {"dtype", t.dtype}, {"chunks", t.chunks.size()}, {"bytes", tensor_bytes(t)}};
    }
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  int64_t model_bytes = 0, optimizer_bytes = 0, other_bytes = 0, model_elements = 0;
  for (const auto& [name, t] : meta.tensors) {
    const int64_t bytes = tensor_bytes(t);
    if (name.rfind("model/", 0) == 0) model_bytes += bytes, model_elements += t.numel();
    else if (name.rfind("optim/", 0) == 0) optimizer_bytes += bytes;
    else other_bytes += bytes;
  }
  std::printf("checkpoint %s (format %d)\n", folder.c_str(), meta.format);
  std::printf("  step %lld, data cursor %lld\n", (long long)meta.step, (long long)meta.cursor);
  std::printf("  saved by %lld rank(s) with layout: %s\n", (long long)meta.world, meta.layout.c_str());
  std::printf("  model: %s, %.2fM parameters\n", meta.model.c_str(), model_elements / 1e6);
  std::printf("  %zu tensors: parameters %s, optimizer %s, random streams %s\n", meta.tensors.size(),
              mib(model_bytes).c_str(), mib(optimizer_bytes).c_str(), mib(other_bytes).c_str());
  std::printf("  files:");
  for (const auto& [file, bytes] : files) std::printf(" %s (%s)", file.c_str(), mib(bytes).c_str());
  std::printf("\n\n  %-48s %-16s %-8s %6s %12s\n", "tensor", "shape", "dtype", "chunks", "bytes");
  for (const auto& [name, t] : meta.tensors) {
    std::printf("  %-48s %-16s %-8s %6zu %12lld\n", name.c_str(), shape_text(t.shape).c_str(), t.dtype.c_str(),
                t.chunks.size(), (long long)tensor_bytes(t));
  }
  return 0;
}

namespace {

// inspect runs as one process; gather on the ranks of a job, one on each host that holds part of a checkpoint.
class CheckpointCommand : public Command {
 public:
  CheckpointCommand(CLI::App* checkpoint, CLI::App* gather, std::function<int()> run_inspect,
                    std::function<int(comm::Runtime&)> run_gather)
      : checkpoint_(checkpoint), gather_(gather), run_inspect_(std::move(run_inspect)),
        run_gather_(std::move(run_gather)) {}
  bool chosen() const override { return checkpoint_->parsed(); }
  bool on_ranks() const override { return gather_->parsed(); }
  int run(comm::Runtime* runtime) override { return runtime ? run_gather_(*runtime) : run_inspect_(); }

 private:
  CLI::App *checkpoint_, *gather_;
  std::function<int()> run_inspect_;
  std::function<int(comm::Runtime&)> run_gather_;
};

}  // namespace

CommandPtr add_checkpoint(CLI::App& app) {
  struct Args {
    std::string path;
    bool json = false;
    std::vector<std::string> sources;
    std::string out;
  };
  auto a = std::make_shared<Args>();
  CLI::App* checkpoint = app.add_subcommand("checkpoint", "Look into distributed checkpoints, gather local ones");
  checkpoint->require_subcommand(1);
  CLI::App* inspect = checkpoint->add_subcommand(
      "inspect", "What a checkpoint holds: its step, the layout and rank count it was saved with, its files, and every "
                 "tensor with its global shape, dtype, chunks and size. Any layout can resume from it.");
  inspect->add_option("checkpoint", a->path, "Checkpoint folder, or a checkpoint directory (its latest is used)")
      ->required();
  inspect->add_flag("--json", a->json, "Print JSON instead of a table");
  CLI::App* gather = checkpoint->add_subcommand(
      "gather", "Copy a local checkpoint (checkpoint.local = true: each host's files on its own disk) into one folder "
                "any layout can resume from. Run a rank on every host that holds part of it, e.g. `meshtrain run -n 2 "
                "--hosts hostA:1,hostB:1 checkpoint gather /local/ckpt --out /shared/ckpt`, or give one process "
                "every host's copy.");
  gather->add_option("checkpoint", a->sources,
                     "The checkpoint folder, or its checkpoint directory (rank 0's latest is used), as each host sees "
                     "it; several: copies of hosts' folders")
      ->required();
  gather->add_option("--out", a->out, "Checkpoint directory to write step-N and `latest` into (on rank 0's host)")
      ->required();
  return std::make_unique<CheckpointCommand>(
      checkpoint, gather, [a] { return run_checkpoint_inspect(a->path, a->json); },
      [a](comm::Runtime& runtime) { return run_checkpoint_gather(runtime, a->sources, a->out); });
}

}  // namespace meshtrain::apps
