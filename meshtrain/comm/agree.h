// Small collective agreements built on a Communicator: making every rank fail
// together, and exchanging strings.
#pragma once

#include "meshtrain/comm/communicator.h"

#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace meshtrain::comm {

// An error every rank of a communicator raised together, with one message:
// reported once (by rank 0), and no rank is left waiting.
class AgreedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Runs `work` on `root` only; if it throws, every rank throws an AgreedError
// with the same message (so a bad input on one rank never leaves the others
// waiting in the next collective).
void on_root_or_all_fail(Communicator& comm, int root, const std::function<void()>& work);

// Runs `work` on every rank; if it throws anywhere, every rank throws an
// AgreedError: the message when every rank failed alike, else the messages
// of the ranks that failed ("rank 2: ...; rank 3: ...").
void on_all_or_all_fail(Communicator& comm, const std::function<void()>& work);

// `values` reduced element-wise over every rank (kMax, kMin, kSum, kAvg), on
// every rank: a few numbers the ranks must decide on alike.
std::vector<double> agree_values(Communicator& comm, const std::vector<double>& values, ReduceOp op);

// Every rank's `text`, in rank order, on every rank.
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& text);

}  // namespace meshtrain::comm
