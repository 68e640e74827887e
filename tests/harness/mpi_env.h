// Access to the MPI runtime from multi-rank tests (see mpi_main.cpp).
#pragma once

#include "meshtrain/comm/runtime.h"

#include <memory>

namespace meshtrain::testing {

comm::Runtime& runtime();
inline const std::shared_ptr<comm::Communicator>& world() { return runtime().world(); }

}  // namespace meshtrain::testing
