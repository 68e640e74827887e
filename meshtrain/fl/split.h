// Client data for federated runs, from one text: iid, Dirichlet(α) over
// speakers (label skew, Hsu et al. 2019), or one client per speaking role of
// a play script (LEAF's Shakespeare benchmark, Caldas et al. 2018).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::fl {

struct Speech {
  std::string speaker;  // the "NAME:" line without the colon
  std::string text;     // the whole block, speaker line included
};
// A script's speeches: blocks separated by blank lines whose first line ends in ':'.
std::vector<Speech> parse_speeches(const std::string& script);

struct ClientText {
  std::string name;
  std::vector<const Speech*> speeches;
};
std::vector<ClientText> split_by_speaker(const std::vector<Speech>& speeches);
std::vector<ClientText> split_iid(const std::vector<Speech>& speeches, int clients, uint64_t seed);
std::vector<ClientText> split_dirichlet(const std::vector<Speech>& speeches, int clients, double alpha, uint64_t seed);

struct SplitOptions {
  std::string by = "speaker";  // "speaker" | "iid" | "dirichlet"
  int clients = 10;            // iid, dirichlet
  double alpha = 0.5;          // dirichlet
  uint64_t seed = 1;
  double val_fraction = 0.1;   // of each client's text, as its last speeches, pooled into val.bin
  int64_t min_bytes = 2048;    // clients with less training text are left out
};
struct SplitSummary {
  int64_t clients = 0, dropped = 0, train_bytes = 0, val_bytes = 0;
};
// Writes OUT/<client>/train.bin (byte tokens), OUT/val.bin and OUT/clients.json
// (name, training bytes, speeches per client). Throws std::runtime_error with
// what is wrong (no speeches found, nothing left after min_bytes, ...).
SplitSummary write_split(const std::string& text_path, const std::string& out_dir, const SplitOptions& options);

}  // namespace meshtrain::fl
