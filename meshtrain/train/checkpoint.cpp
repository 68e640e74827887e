#include "meshtrain/train/checkpoint.h"

#include "meshtrain/comm/agree.h"
#include "meshtrain/util/files.h"

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

namespace meshtrain::train {

using nlohmann::json;

namespace {

constexpr int kFormat = 1;

std::string step_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  return name;
}

std::string fnv1a64(const std::string& path, int64_t& bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CheckpointError("checkpoint file " + path + " is missing or unreadable");
  uint64_t hash = 1469598103934665603ULL;
  bytes = 0;
  std::vector<char> buffer(1 << 20);
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    const std::streamsize n = in.gcount();
    for (std::streamsize i = 0; i < n; ++i) {
      hash ^= static_cast<unsigned char>(buffer[i]);
      hash *= 1099511628211ULL;
    }
    bytes += n;
  }
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(hash));
  return text;
}

void maybe_fail_after(const std::string& file) {
  const char* target = std::getenv("MESHTRAIN_TEST_CHECKPOINT_FAIL_AFTER");
  if (target && file == target) throw CheckpointError("injected failure after writing " + file + " (test hook)");
}

void write_text_atomically(const std::string& path, const std::string& text) {
  try {
    util::write_text_file(path, text);
  } catch (const std::runtime_error& e) {
    throw CheckpointError(e.what());
  }
}

}  // namespace

CheckpointStore::CheckpointStore(std::string dir, int64_t keep) : dir_(std::move(dir)), keep_(std::max<int64_t>(1, keep)) {}

void write_model_archive(const std::string& path, const std::map<std::string, at::Tensor>& parameters,
                         const std::map<std::string, at::Tensor>& buffers) {
  torch::serialize::OutputArchive archive;
  for (const auto& [name, value] : parameters) archive.write(name, value.detach());
  for (const auto& [name, value] : buffers) archive.write("buffer." + name, value);
  archive.write("rng.cpu", at::detail::getDefaultCPUGenerator().get_state());
  archive.save_to(path);
}

namespace {

json file_entry(const std::string& path) {
  int64_t bytes = 0;
  const std::string hash = fnv1a64(path, bytes);
  util::fsync_path(path);
  return {{"bytes", bytes}, {"fnv1a64", hash}};
}

}  // namespace

std::string CheckpointStore::staging_path(int64_t step) const {
  return util::join_path(dir_, ".incomplete-" + step_name(step));
}

std::string CheckpointStore::prepare_staging(int64_t step) const {
  util::make_directories(dir_);
  const std::string staging = staging_path(step);
  util::remove_tree(staging);
  util::make_directories(staging);
  return staging;
}

void CheckpointStore::publish(const CheckpointMeta& meta, const std::string& staging, const std::string& files) const {
  const std::string name = step_name(meta.step);
  const std::string final_dir = util::join_path(dir_, name);
  json manifest = {{"format", kFormat},
                   {"step", meta.step},
                   {"cursor", meta.cursor},
                   {"model", meta.model},
                   {"model_config", meta.model_config.empty() ? json::object() : json::parse(meta.model_config)},
                   {"layout", meta.layout},
                   {"files", json::parse(files)}};
  write_text_atomically(util::join_path(staging, "MANIFEST.json"), manifest.dump(2) + "\n");
  util::fsync_path(staging);

  util::remove_tree(final_dir);  // re-saving the same step
  util::rename_path(staging, final_dir);
  util::fsync_path(dir_);
  write_text_atomically(util::join_path(dir_, "latest"), name + "\n");
  util::fsync_path(dir_);

  // Prune: keep the newest `keep` complete checkpoints; drop stale staging folders.
  std::vector<std::string> complete;
  for (const std::string& entry : util::list_directory(dir_)) {
    if (entry.rfind("step-", 0) == 0 && util::is_directory(util::join_path(dir_, entry))) complete.push_back(entry);
    if (entry.rfind(".incomplete-", 0) == 0) util::remove_tree(util::join_path(dir_, entry));
  }
  for (size_t i = 0; i + keep_ < complete.size(); ++i) {
    if (complete[i] != name) util::remove_tree(util::join_path(dir_, complete[i]));
  }
}

void CheckpointStore::save(const CheckpointMeta& meta, torch::nn::Module& model,
                           torch::optim::Optimizer& optimizer) const {
  const std::string staging = prepare_staging(meta.step);
  auto in_staging = [&](const std::string& file) { return util::join_path(staging, file); };
  std::map<std::string, at::Tensor> parameters, buffers;
  for (const auto& item : model.named_parameters()) parameters[item.key()] = item.value();
  for (const auto& item : model.named_buffers()) buffers[item.key()] = item.value();
  write_model_archive(in_staging("model.pt"), parameters, buffers);
  maybe_fail_after("model.pt");
  torch::save(optimizer, in_staging("optimizer.pt"));
  maybe_fail_after("optimizer.pt");
  json files;
  for (const char* file : {"model.pt", "optimizer.pt"}) files[file] = file_entry(in_staging(file));
  publish(meta, staging, files.dump());
}

void CheckpointStore::save_collective(const CheckpointMeta& meta, comm::Communicator& comm,
                                      const std::function<std::vector<std::string>(const std::string&)>& write) const {
  const std::string staging = staging_path(meta.step);
  comm::on_root_or_all_fail(comm, 0, [&] { prepare_staging(meta.step); });
  std::string entries;
  comm::on_all_or_all_fail(comm, [&] {
    json files = json::object();
    for (const std::string& file : write(staging)) {
      maybe_fail_after(file);
      files[file] = file_entry(util::join_path(staging, file));
    }
    entries = files.dump();
  });
  const std::vector<std::string> all = comm::all_gather_strings(comm, entries);
  comm::on_root_or_all_fail(comm, 0, [&] {
    json files = json::object();
    for (const std::string& text : all) files.update(json::parse(text));
    publish(meta, staging, files.dump());
  });
}

std::string CheckpointStore::latest() const {
  const std::string pointer = util::join_path(dir_, "latest");
  if (!util::path_exists(pointer)) return "";
  std::ifstream in(pointer);
  std::string name;
  std::getline(in, name);
  if (name.empty() || name.find('/') != std::string::npos) {
    throw CheckpointError("checkpoint pointer " + pointer + " is empty or malformed; remove it or restore it");
  }
  const std::string folder = util::join_path(dir_, name);
  if (!util::is_directory(folder)) {
    throw CheckpointError("checkpoint pointer " + pointer + " names " + name + ", which does not exist");
  }
  return folder;
}

CheckpointMeta CheckpointStore::read_meta(const std::string& folder) {
  const std::string manifest_path = util::join_path(folder, "MANIFEST.json");
  if (!util::path_exists(manifest_path)) {
    throw CheckpointError("checkpoint " + folder + " is incomplete: " + manifest_path + " is missing");
  }
  json manifest;
  try {
    std::ifstream in(manifest_path);
    manifest = json::parse(in);
  } catch (const std::exception& e) {
    throw CheckpointError("checkpoint file " + manifest_path + " is corrupt: " + e.what());
  }
  if (manifest.value("format", 0) != kFormat) {
    throw CheckpointError("checkpoint " + folder + " has format " + std::to_string(manifest.value("format", 0)) +
                          "; this meshtrain reads format " + std::to_string(kFormat));
  }
  for (const auto& [file, expected] : manifest.at("files").items()) {
    const std::string path = util::join_path(folder, file);
    int64_t bytes = 0;
    const std::string hash = fnv1a64(path, bytes);
    if (bytes != expected.at("bytes").get<int64_t>()) {
      throw CheckpointError("checkpoint file " + path + " is truncated or corrupt: " + std::to_string(bytes) +
                            " bytes, the manifest says " + std::to_string(expected.at("bytes").get<int64_t>()));
    }
    if (hash != expected.at("fnv1a64").get<std::string>()) {
      throw CheckpointError("checkpoint file " + path + " is corrupt: its checksum does not match the manifest");
    }
  }
  CheckpointMeta meta;
  meta.step = manifest.at("step").get<int64_t>();
  meta.cursor = manifest.at("cursor").get<int64_t>();
  meta.model = manifest.at("model").get<std::string>();
  meta.model_config = manifest.value("model_config", json::object()).dump();
  meta.layout = manifest.value("layout", std::string());
  return meta;
}

CheckpointMeta CheckpointStore::load(const std::string& folder, torch::nn::Module& model,
                                     torch::optim::Optimizer* optimizer, const std::string& expected_model) const {
  const CheckpointMeta meta = read_meta(folder);
  if (!expected_model.empty() && meta.model != expected_model) {
    throw CheckpointError("checkpoint " + folder + " holds a different model (" + meta.model + ") than configured (" +
                          expected_model + "); use another checkpoint.dir or set checkpoint.resume = false");
  }
  torch::NoGradGuard no_grad;
  torch::serialize::InputArchive archive;
  archive.load_from(util::join_path(folder, "model.pt"));
  for (auto& item : model.named_parameters()) {
    at::Tensor value;
    if (!archive.try_read(item.key(), value)) {
      throw CheckpointError("checkpoint " + folder + "/model.pt has no parameter " + item.key());
    }
    item.value().copy_(value);
  }
  for (auto& item : model.named_buffers()) {
    at::Tensor value;
    if (archive.try_read("buffer." + item.key(), value)) item.value().copy_(value);
  }
  at::Tensor rng;
  if (archive.try_read("rng.cpu", rng)) {
    at::Generator generator = at::detail::getDefaultCPUGenerator();  // shares the default state
    generator.set_state(rng);
  }
  if (optimizer) torch::load(*optimizer, util::join_path(folder, "optimizer.pt"));
  return meta;
}

}  // namespace meshtrain::train
