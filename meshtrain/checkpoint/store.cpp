#include "meshtrain/checkpoint/store.h"

#include "meshtrain/util/files.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace meshtrain::checkpoint {

using nlohmann::json;

std::string step_folder_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  return name;
}

void maybe_fail_after(const std::string& file) {
  const char* target = std::getenv("MESHTRAIN_TEST_CHECKPOINT_FAIL_AFTER");
  if (target && file == target) throw CheckpointError("injected failure after writing " + file + " (test hook)");
}

namespace {

void write_text(const std::string& path, const std::string& text) {
  try {
    util::write_text_file(path, text);
  } catch (const std::runtime_error& e) {
    throw CheckpointError(e.what());
  }
}

}  // namespace

CheckpointStore::CheckpointStore(std::string dir, int64_t keep) : dir_(std::move(dir)), keep_(std::max<int64_t>(1, keep)) {}

std::string CheckpointStore::staging_path(int64_t step) const {
  return util::join_path(dir_, ".incomplete-" + step_folder_name(step));
}

std::string CheckpointStore::prepare_staging(int64_t step) const {
  try {
    util::make_directories(dir_);
    const std::string staging = staging_path(step);
    util::remove_tree(staging);
    util::make_directories(staging);
    return staging;
  } catch (const std::runtime_error& e) {
    throw CheckpointError(std::string("cannot prepare a checkpoint in ") + dir_ + ": " + e.what());
  }
}

void CheckpointStore::publish(int64_t step, const std::string& staging, bool prune_after) const {
  const std::string name = step_folder_name(step);
  const std::string final_dir = util::join_path(dir_, name);
  json files = json::object();
  for (const std::string& file : util::list_directory(staging)) {
    const std::string path = util::join_path(staging, file);
    util::fsync_path(path);
    json entry = {{"bytes", util::file_size(path)}};
    if (file == "metadata.json") {
      const std::string text = util::read_text_file(path);
      entry["checksum"] = hex(checksum(text.data(), static_cast<int64_t>(text.size())));
    }
    files[file] = entry;
  }
  write_text(util::join_path(staging, "MANIFEST.json"),
             json{{"format", kFormat}, {"step", step}, {"files", files}}.dump(2) + "\n");
  maybe_fail_after("MANIFEST.json");
  util::fsync_path(staging);
  util::remove_tree(final_dir);  // re-saving the same step
  util::rename_path(staging, final_dir);
  util::fsync_path(dir_);
  write_text(util::join_path(dir_, "latest"), name + "\n");
  util::fsync_path(dir_);
  if (prune_after) prune(step);
}

void CheckpointStore::prune(int64_t step) const {
  const std::string name = step_folder_name(step);
  std::vector<std::string> folders = complete();
  for (size_t i = static_cast<size_t>(keep_); i < folders.size(); ++i) {
    if (util::base_name(folders[i]) != name) util::remove_tree(folders[i]);
  }
  for (const std::string& entry : util::list_directory(dir_)) {
    if (entry.rfind(".incomplete-", 0) == 0) util::remove_tree(util::join_path(dir_, entry));
  }
}

std::string CheckpointStore::latest() const {
  const std::string pointer = util::join_path(dir_, "latest");
  if (!util::path_exists(pointer)) return "";
  std::string name = util::read_text_file(pointer);
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
  if (name.empty() || name.find('/') != std::string::npos) {
    throw CheckpointError("checkpoint pointer " + pointer + " is empty or malformed; remove it or restore it");
  }
  const std::string folder = util::join_path(dir_, name);
  if (!util::is_directory(folder)) {
    throw CheckpointError("checkpoint pointer " + pointer + " names " + name + ", which does not exist");
  }
  return folder;
}

std::vector<std::string> CheckpointStore::complete() const {
  std::vector<std::string> out;
  if (!util::is_directory(dir_)) return out;
  for (const std::string& entry : util::list_directory(dir_)) {
    const std::string path = util::join_path(dir_, entry);
    if (entry.rfind("step-", 0) == 0 && util::is_directory(path)) out.push_back(path);
  }
  std::reverse(out.begin(), out.end());  // names sort by step
  return out;
}

void CheckpointStore::verify(const std::string& folder) {
  const std::string manifest_path = util::join_path(folder, "MANIFEST.json");
  if (!util::path_exists(manifest_path)) {
    throw CheckpointError("checkpoint " + folder + " is incomplete: " + manifest_path + " is missing");
  }
  json manifest;
  try {
    manifest = json::parse(util::read_text_file(manifest_path));
  } catch (const std::exception& e) {
    throw CheckpointError("checkpoint file " + manifest_path + " is corrupt: " + e.what());
  }
  if (manifest.value("format", 0) != kFormat) {
    throw CheckpointError("checkpoint " + folder + " has format " + std::to_string(manifest.value("format", 0)) +
                          "; this meshtrain reads format " + std::to_string(kFormat));
  }
  for (const auto& [file, expected] : manifest.at("files").items()) {
    const std::string path = util::join_path(folder, file);
    if (!util::is_regular_file(path)) throw CheckpointError("checkpoint file " + path + " is missing");
    const int64_t bytes = util::file_size(path), want = expected.at("bytes").get<int64_t>();
    if (bytes != want) {
      throw CheckpointError("checkpoint file " + path + " is truncated or corrupt: " + std::to_string(bytes) +
                            " bytes, the manifest says " + std::to_string(want));
    }
    if (expected.contains("checksum")) {
      const std::string text = util::read_text_file(path);
      if (hex(checksum(text.data(), static_cast<int64_t>(text.size()))) != expected.at("checksum").get<std::string>()) {
        throw CheckpointError("checkpoint file " + path + " is corrupt: its checksum does not match the manifest");
      }
    }
  }
}

Metadata CheckpointStore::read_metadata(const std::string& folder) {
  verify(folder);
  const std::string path = util::join_path(folder, "metadata.json");
  return Metadata::from_json(util::read_text_file(path), "checkpoint file " + path);
}

std::string CheckpointStore::resolve(const std::string& path) {
  if (util::path_exists(util::join_path(path, "MANIFEST.json")) || util::path_exists(util::join_path(path, "metadata.json"))) {
    return path;
  }
  const std::string folder = CheckpointStore(path, 1).latest();
  if (folder.empty()) {
    throw CheckpointError("no checkpoint in " + path + " (give a checkpoint folder, or a directory with a 'latest' pointer)");
  }
  return folder;
}

}  // namespace meshtrain::checkpoint
