// Access to the MPI runtime from multi-rank tests (see mpi_main.cpp).
#pragma once

#include "meshtrain/comm/runtime.h"

#include <memory>
#include <string>

namespace meshtrain::testing {

comm::Runtime& runtime();
inline const std::shared_ptr<comm::Communicator>& world() { return runtime().world(); }

// Collective: rank 0 creates a fresh directory and every rank gets its path.
std::string shared_temp_directory(const std::string& prefix);

}  // namespace meshtrain::testing
