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

}  // namespace

namespace {

// Collective: rank 0 writes a probe with a random token into each folder, every
// rank reads them back; each rank's answer, one character per folder ('1': seen).
std::vector<std::string> probe(comm::Communicator& world, const std::vector<SharedFolder>& folders) {
  std::string token;
  const auto probe_path = [&](const SharedFolder& folder) {
    return util::join_path(folder.path, ".meshtrain-probe-" + token);
  };
  comm::on_root_or_all_fail(world, 0, [&] {
    token = random_token();
    for (const SharedFolder& folder : folders) {
      util::make_directories(folder.path);
      util::write_text_file(probe_path(folder), token);
    }
  });
  token = comm::all_gather_strings(world, world.rank() == 0 ? token : "").front();
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
  const std::vector<std::string> all = probe(world, {folder});
  std::vector<int> elsewhere;  // ranks on other hosts than rank 0 that see rank 0's probe
  for (size_t r = 0; r < all.size(); ++r) {
    const std::string host = placement.host_of(static_cast<int>(r));
    if (all[r][0] == '1' && !host.empty() && host != placement.host_of(0)) elsewhere.push_back(static_cast<int>(r));
  }
  if (elsewhere.empty()) return;
  throw comm::AgreedError(folder.key + " = " + folder.path + " is shared between hosts (" +
                          placement.describe(elsewhere) + " see the file rank 0 on " + placement.host_of(0) +
                          " wrote there), but checkpoint.local = true has the first rank of each host write its "
                          "checkpoint folder there: set checkpoint.local = false for a shared file system");
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
