#include "meshtrain/train/shared_folders.h"

#include "meshtrain/comm/agree.h"
#include "meshtrain/comm/job_environment.h"
#include "meshtrain/util/files.h"

#include <unistd.h>

#include <random>

namespace meshtrain::train {

// Note [Shared folders]
// Rank 0 prepares the data in <run.out>/data, every rank writes its share of
// a checkpoint into checkpoint.dir and reads its share back on resume. On
// hosts that do not share those folders this used to fail late and
// misleadingly: a remote rank's save failed one checkpoint.every later,
// resume reported a missing MANIFEST.json and advised moving checkpoints
// away, data prepared by rank 0 was missing elsewhere. So at start-up rank 0
// writes a probe file holding a random token into each folder, and every
// rank reads it back (one gather); a folder some ranks cannot see stops the
// run at once, naming those ranks and their hosts. On one host the check
// still runs: a folder on a rank-private mount (a container's tmpfs) fails
// the same way.

namespace {

std::string random_token() {
  std::random_device device;
  return std::to_string(device()) + "-" + std::to_string(device()) + "-" + std::to_string(getpid());
}

// Collective: rank 0's random token, on every rank.
std::string agreed_token(comm::Communicator& world) {
  std::string token;
  comm::on_root_or_all_fail(world, 0, [&] { token = random_token(); });
  return comm::all_gather_strings(world, token).front();
}

// Collective: rank 0 writes a probe with a random token into each folder, every
// rank reads them back; each rank's answer, one character per folder ('1': seen).
std::vector<std::string> probe(comm::Communicator& world, const std::vector<SharedFolder>& folders) {
  const std::string token = agreed_token(world);
  const auto probe_path = [&](const SharedFolder& folder) {
    return util::join_path(folder.path, ".meshtrain-probe-" + token);
  };
  comm::on_root_or_all_fail(world, 0, [&] {
    for (const SharedFolder& folder : folders) {
      util::make_directories(folder.path);
      util::write_text_file(probe_path(folder), token);
    }
  });
  std::string seen;
  for (const SharedFolder& folder : folders) {
    bool ok = false;
    try {
      ok = util::read_text_file(probe_path(folder)) == token;
    } catch (const std::runtime_error&) {
      ok = false;
    }
    seen += ok ? '1' : '0';
  }
  const std::vector<std::string> all = comm::all_gather_strings(world, seen);
  if (world.rank() == 0) {
    for (const SharedFolder& folder : folders) ::unlink(probe_path(folder).c_str());
  }
  return all;
}

}  // namespace

void check_local_folder(comm::Communicator& world, const SharedFolder& folder) {
  if (world.size() == 1) return;
  const comm::Placement& placement = comm::job_placement();
  // Every rank leaves a probe of its own; a rank that sees one of a rank on another host shares the folder with it.
  const std::string token = agreed_token(world);
  const auto probe_of = [&](int rank) {
    return util::join_path(folder.path, ".meshtrain-probe-" + token + "-" + std::to_string(rank));
  };
  comm::on_all_or_all_fail(world, [&] {
    util::make_directories(folder.path);
    util::write_text_file(probe_of(world.rank()), token);
  });
  int seen = -1;  // a rank on another host whose probe this rank sees
  for (int r = 0; r < world.size() && seen < 0; ++r) {
    if (placement.host_of(r) != placement.host_of(world.rank()) && util::path_exists(probe_of(r))) seen = r;
  }
  const std::vector<std::string> all = comm::all_gather_strings(world, std::to_string(seen));
  ::unlink(probe_of(world.rank()).c_str());
  for (size_t r = 0; r < all.size(); ++r) {
    const int other = std::stoi(all[r]);
    if (other < 0) continue;
    throw comm::AgreedError(folder.key + " = " + folder.path + " is shared between hosts (" +
                            placement.describe({static_cast<int>(r)}) + " sees the file " +
                            placement.describe({other}) + " wrote there), but checkpoint.local = true has the first "
                            "rank of each host write its checkpoint folder there: set checkpoint.local = false for a "
                            "shared file system");
  }
}

void check_shared_folders(comm::Communicator& world, const std::vector<SharedFolder>& folders) {
  if (world.size() == 1) return;
  const std::vector<std::string> all = probe(world, folders);
  std::string problems;
  for (size_t f = 0; f < folders.size(); ++f) {
    std::vector<int> missing;
    for (size_t r = 0; r < all.size(); ++r) {
      if (all[r][f] != '1') missing.push_back(static_cast<int>(r));
    }
    if (missing.empty()) continue;
    problems += (problems.empty() ? "" : "; ") + folders[f].key + " = " + folders[f].path + " is not shared: " +
                comm::job_placement().describe(missing) + " cannot see the file rank 0 wrote there";
  }
  if (!problems.empty()) {
    throw comm::AgreedError(problems + ". Every rank writes and reads its share of the checkpoints and data there: "
                            "put these folders on a file system every host mounts at the same path (NFS, Lustre, "
                            "a cluster's shared scratch)" +
                            std::string(problems.find("checkpoint.dir") != std::string::npos
                                            ? ", or set checkpoint.local = true to keep checkpoints on each host's disk"
                                            : ""));
  }
}

}  // namespace meshtrain::train
