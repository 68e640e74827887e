// meshtrain checkpoint gather: a local checkpoint's files, spread over the
// hosts that wrote them (Note [Local checkpoints]), copied into one folder.
#include "meshtrain/apps/commands.h"

#include "meshtrain/checkpoint/store.h"
#include "meshtrain/comm/agree.h"
#include "meshtrain/comm/job_environment.h"
#include "meshtrain/util/files.h"

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <tuple>

namespace meshtrain::apps {

namespace {

using checkpoint::CheckpointError;

constexpr int64_t kPieceBytes = int64_t{8} << 20;

// Note [Gathering a checkpoint]
// Run with a rank on each host that holds part of the checkpoint (or as one
// process given every copy's folder): rank 0 picks the step (its latest, or
// the folder given), every rank offers the files its folders of that step
// hold (verified against their host's manifest), and each file needed comes
// from the first rank that has it, in 8 MiB pieces, to rank 0. A local
// checkpoint holds replicas once per host: only files holding a chunk no
// earlier file holds are copied, and the metadata keeps one copy of each
// chunk, so the result is a checkpoint like a shared one. Rank 0 writes the
// files, metadata.json without the hosts map, and publishes OUT/step-N
// atomically (Note [Checkpoint atomicity]). A file no
// rank holds stops it before anything is published, naming the file and
// the host the metadata says holds it.

// The folder of step `name` under each path this rank can see.
std::vector<std::string> folders_of(const std::vector<std::string>& paths, const std::string& name) {
  std::vector<std::string> out;
  for (const std::string& path : paths) {
    if (util::base_name(path) == name && util::is_directory(path)) out.push_back(path);
    else if (util::is_directory(util::join_path(path, name))) out.push_back(util::join_path(path, name));
  }
  return out;
}

struct Offered {
  std::string folder;  // where this rank has it
  int64_t bytes = 0;
};

// The data files the manifests of `folders` list (verified), with the folder that holds each and its size.
std::map<std::string, Offered> offered_files(const std::vector<std::string>& folders) {
  std::map<std::string, Offered> files;
  for (const std::string& folder : folders) {
    checkpoint::CheckpointStore::verify(folder);
    const nlohmann::json manifest = nlohmann::json::parse(util::read_text_file(util::join_path(folder, "MANIFEST.json")));
    for (const auto& [file, entry] : manifest.at("files").items()) {
      if (file != "metadata.json") files.emplace(file, Offered{folder, entry.at("bytes").get<int64_t>()});
    }
  }
  return files;
}

struct Source {
  int rank = 0;  // the first rank that holds the file
  int64_t bytes = 0;
};

// Collective: where each needed file comes from. Throws AgreedError naming the files no rank holds.
std::map<std::string, Source> sources(comm::Communicator& world, const std::map<std::string, Offered>& mine,
                                      const std::set<std::string>& needed, const checkpoint::Metadata& meta,
                                      const std::string& name) {
  std::string offer;
  for (const auto& [file, offered] : mine) offer += file + " " + std::to_string(offered.bytes) + "\n";
  const std::vector<std::string> offers = comm::all_gather_strings(world, offer);
  std::map<std::string, Source> found;
  for (int r = static_cast<int>(offers.size()) - 1; r >= 0; --r) {  // the lowest rank last, so it wins
    for (size_t start = 0, end; (end = offers[r].find('\n', start)) != std::string::npos; start = end + 1) {
      const std::string line = offers[r].substr(start, end - start);
      const size_t space = line.rfind(' ');
      found[line.substr(0, space)] = Source{r, std::stoll(line.substr(space + 1))};
    }
  }
  std::map<std::string, Source> out;
  std::string missing;
  for (const std::string& file : needed) {
    if (found.count(file)) {
      out[file] = found.at(file);
      continue;
    }
    missing += (missing.empty() ? "" : ", ") + file + (meta.hosts.count(file) ? " (written on " + meta.hosts.at(file) + ")" : "");
  }
  if (!missing.empty()) {
    throw comm::AgreedError("checkpoint " + name + ": no rank holds " + missing + ". Run a rank on every host that "
                            "holds part of it (meshtrain run -n H --hosts hostA:1,hostB:1 checkpoint gather DIR --out "
                            "SHARED), or give every copy's folder");
  }
  return out;
}

void read_piece(int fd, const std::string& path, char* data, int64_t offset, int64_t bytes) {
  for (int64_t done = 0; done < bytes;) {
    const ssize_t n = ::pread(fd, data + done, static_cast<size_t>(bytes - done), static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw CheckpointError("cannot read " + path + ": " + (n == 0 ? "shorter than its manifest says" : std::strerror(errno)));
    }
    done += n;
  }
}

void write_all(int fd, const std::string& path, const char* data, int64_t bytes) {
  for (int64_t done = 0; done < bytes;) {
    const ssize_t n = ::write(fd, data + done, static_cast<size_t>(bytes - done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw CheckpointError("cannot write " + path + ": " + std::strerror(errno));
    done += n;
  }
}

// Copies `file` (`bytes` long) from rank `owner`'s `source` to rank 0's `target`, piece by piece.
void copy_file(comm::Communicator& world, int owner, const std::string& source, const std::string& target, int64_t bytes) {
  const int me = world.rank();
  int in = -1, out = -1;
  at::Tensor piece = at::empty({std::max<int64_t>(1, std::min(bytes, kPieceBytes))}, at::kByte);
  try {
    comm::on_all_or_all_fail(world, [&] {
      if (me == owner && (in = ::open(source.c_str(), O_RDONLY)) < 0) {
        throw CheckpointError("cannot read " + source + ": " + std::strerror(errno));
      }
      if (me == 0 && (out = ::open(target.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644)) < 0) {
        throw CheckpointError("cannot create " + target + ": " + std::strerror(errno));
      }
    });
    for (int64_t offset = 0; offset < bytes; offset += kPieceBytes) {
      const int64_t n = std::min(kPieceBytes, bytes - offset);
      at::Tensor part = piece.narrow(0, 0, n);
      char* data = static_cast<char*>(part.data_ptr());
      comm::on_all_or_all_fail(world, [&] {
        if (me == owner) read_piece(in, source, data, offset, n);
      });
      if (owner != 0 && me == owner) world.send(part, 0, 7).wait();
      if (owner != 0 && me == 0) world.recv(part, owner, 7).wait();
      comm::on_all_or_all_fail(world, [&] {
        if (me == 0) write_all(out, target, data, n);
      });
    }
    comm::on_all_or_all_fail(world, [&] {
      if (me == 0 && ::fsync(out) != 0) throw CheckpointError("cannot sync " + target + ": " + std::strerror(errno));
    });
  } catch (...) {
    if (in >= 0) ::close(in);
    if (out >= 0) ::close(out);
    throw;
  }
  if (in >= 0) ::close(in);
  if (out >= 0) ::close(out);
}

// The files to copy: in name order, each that holds a chunk no file before it
// holds. `meta` keeps one copy of each chunk, so the gathered checkpoint's
// chunks never overlap, as in a shared checkpoint.
std::set<std::string> keep_one_copy(checkpoint::Metadata& meta) {
  using Key = std::tuple<std::string, std::vector<int64_t>, std::vector<int64_t>, int64_t, int64_t>;
  std::map<std::string, std::vector<Key>> keys_of_file;
  for (const auto& [name, entry] : meta.tensors) {
    for (const auto& c : entry.chunks) keys_of_file[c.file].emplace_back(name, c.offsets, c.sizes, c.begin, c.end);
  }
  std::set<Key> covered;
  std::set<std::string> files;
  for (const auto& [file, keys] : keys_of_file) {
    if (std::all_of(keys.begin(), keys.end(), [&](const Key& k) { return covered.count(k) > 0; })) continue;
    files.insert(file);
    covered.insert(keys.begin(), keys.end());
  }
  std::set<Key> kept;
  for (auto& [name, entry] : meta.tensors) {
    std::vector<checkpoint::ChunkEntry> chunks;
    for (auto& c : entry.chunks) {
      if (files.count(c.file) && kept.emplace(name, c.offsets, c.sizes, c.begin, c.end).second) chunks.push_back(c);
    }
    entry.chunks = std::move(chunks);
  }
  return files;
}

}  // namespace

int run_checkpoint_gather(comm::Runtime& runtime, const std::vector<std::string>& paths, const std::string& out_dir) {
  comm::Communicator& world = *runtime.world();
  const int me = world.rank();
  // Rank 0's step and metadata, for every rank.
  std::string chosen, metadata_text;
  comm::on_root_or_all_fail(world, 0, [&] {
    chosen = checkpoint::CheckpointStore::resolve(paths.front());
    checkpoint::CheckpointStore::verify(chosen);
    metadata_text = util::read_text_file(util::join_path(chosen, "metadata.json"));
  });
  const std::string name = comm::all_gather_strings(world, me == 0 ? util::base_name(chosen) : "").front();
  metadata_text = comm::all_gather_strings(world, me == 0 ? metadata_text : "").front();
  checkpoint::Metadata meta = checkpoint::Metadata::from_json(metadata_text, "metadata.json of " + name);
  // What every rank holds of it, and where each file comes from.
  std::map<std::string, Offered> mine;
  comm::on_all_or_all_fail(world, [&] { mine = offered_files(folders_of(paths, name)); });
  const std::set<std::string> needed = keep_one_copy(meta);
  const std::map<std::string, Source> from = sources(world, mine, needed, meta, name);
  const checkpoint::CheckpointStore store(out_dir, 1 << 30);
  std::string staging;
  comm::on_root_or_all_fail(world, 0, [&] { staging = store.prepare_staging(meta.step); });
  int64_t total = 0;
  for (const auto& [file, source] : from) {
    copy_file(world, source.rank, me == source.rank ? util::join_path(mine.at(file).folder, file) : "",
              util::join_path(staging, file), source.bytes);
    total += source.bytes;
  }
  comm::on_root_or_all_fail(world, 0, [&] {
    meta.hosts.clear();
    util::write_text_file(util::join_path(staging, "metadata.json"), meta.to_json());
    store.publish(meta.step, staging);
    std::printf("gathered %s (step %lld): %zu files, %.1f MiB, from %s into %s\n", name.c_str(), (long long)meta.step,
                needed.size(), total / 1048576.0, comm::job_placement().summary().c_str(),
                util::join_path(out_dir, name).c_str());
  });
  return 0;
}

}  // namespace meshtrain::apps
