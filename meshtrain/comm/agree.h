// Small collective agreements built on a Communicator: making every rank fail
// together, and exchanging strings.
#pragma once

#include "meshtrain/comm/communicator.h"

#include <functional>
#include <string>
#include <vector>

namespace meshtrain::comm {

// Runs `work` on `root` only; if it throws, every rank throws a
// std::runtime_error with the same message (so a bad input on one rank never
// leaves the others waiting in the next collective).
void on_root_or_all_fail(Communicator& comm, int root, const std::function<void()>& work);

// Runs `work` on every rank; if it throws anywhere, every rank throws, with the
// messages of all ranks that failed ("rank 2: ...").
void on_all_or_all_fail(Communicator& comm, const std::function<void()>& work);

// Every rank's `text`, in rank order, on every rank.
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& text);

}  // namespace meshtrain::comm
