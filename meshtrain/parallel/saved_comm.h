// A communicator kept in an autograd function's saved data for its backward
// (autograd saves IValues only: the communicator travels in a capsule).
#pragma once

#include "meshtrain/comm/communicator.h"

#include <torch/torch.h>

#include <memory>

namespace meshtrain::parallel {

struct CommCapsule : torch::CustomClassHolder {
  explicit CommCapsule(std::shared_ptr<comm::Communicator> c) : comm(std::move(c)) {}
  std::shared_ptr<comm::Communicator> comm;
};

inline void save_comm(torch::autograd::AutogradContext* ctx, const std::shared_ptr<comm::Communicator>& comm) {
  ctx->saved_data["comm"] = at::IValue::make_capsule(c10::make_intrusive<CommCapsule>(comm));
}

inline std::shared_ptr<comm::Communicator> saved_comm(torch::autograd::AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<CommCapsule>(ctx->saved_data["comm"].toCapsule())->comm;
}

}  // namespace meshtrain::parallel
