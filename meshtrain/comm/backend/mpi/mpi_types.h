// MPI datatypes and reduce ops for at::ScalarType, including the 16-bit float
// types MPI lacks (see Note [MPI 16-bit floats]).
#pragma once

#include "meshtrain/comm/op.h"

#include <mpi.h>

#include <string>
#include <type_traits>

namespace meshtrain::comm::mpi {

// Note [MPI 16-bit floats]
// MPI has no bfloat16 or float16. They travel as MPI_UINT16_T (two bytes, no
// conversion, so bandwidth matches float16 on NCCL) and are reduced by
// user-defined commutative MPI_Ops that widen each pair to float, combine, and
// round back to the 16-bit type. Like NCCL, every combining step rounds; ring
// or tree reductions over n ranks round about log2(n)..n-1 times.

MPI_Datatype datatype_of(at::ScalarType dtype);
// The MPI op for `reduce` on `dtype`; kAvg maps to the sum (the caller divides).
MPI_Op op_of(ReduceOp reduce, at::ScalarType dtype);
// Frees the user-defined ops; call before MPI_Finalize.
void free_custom_ops();

// Throws CommError("<prefix><call> failed: <MPI's error string>").
[[noreturn]] void throw_error(int code, const char* call, const std::string& prefix);

// Throws unless code == MPI_SUCCESS. `prefix` is a string or a callable returning
// one, so hot paths build no message unless the call failed.
template <typename Prefix>
inline void check(int code, const char* call, Prefix&& prefix) {
  if (code == MPI_SUCCESS) return;
  if constexpr (std::is_invocable_v<Prefix>) throw_error(code, call, prefix());
  else throw_error(code, call, prefix);
}

// Converts an element count to MPI's int, or throws naming the op.
int to_int_count(int64_t count, const std::string& what);

}  // namespace meshtrain::comm::mpi
