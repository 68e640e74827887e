#include "meshtrain/comm/backend/mpi/mpi_types.h"

#include "meshtrain/comm/communicator.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <climits>
#include <cmath>
#include <mutex>

namespace meshtrain::comm::mpi {

namespace {

struct Sum {
  float operator()(float a, float b) const { return a + b; }
};
struct Max {
  float operator()(float a, float b) const { return (std::isnan(a) || a > b) ? a : b; }
};
struct Min {
  float operator()(float a, float b) const { return (std::isnan(a) || a < b) ? a : b; }
};

template <typename T, typename Combine>
void combine16(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  const Combine combine;
  for (int i = 0; i < *len; ++i) b[i] = T(combine(static_cast<float>(a[i]), static_cast<float>(b[i])));
}

struct CustomOps {
  MPI_Op bf16[3] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};  // sum, max, min
  MPI_Op f16[3] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  bool created = false;
};

std::mutex custom_ops_mutex;
CustomOps custom_ops;  // protected by custom_ops_mutex

const CustomOps& ensure_custom_ops() {
  std::lock_guard<std::mutex> lock(custom_ops_mutex);
  if (!custom_ops.created) {
    MPI_Op_create(&combine16<c10::BFloat16, Sum>, 1, &custom_ops.bf16[0]);
    MPI_Op_create(&combine16<c10::BFloat16, Max>, 1, &custom_ops.bf16[1]);
    MPI_Op_create(&combine16<c10::BFloat16, Min>, 1, &custom_ops.bf16[2]);
    MPI_Op_create(&combine16<c10::Half, Sum>, 1, &custom_ops.f16[0]);
    MPI_Op_create(&combine16<c10::Half, Max>, 1, &custom_ops.f16[1]);
    MPI_Op_create(&combine16<c10::Half, Min>, 1, &custom_ops.f16[2]);
    custom_ops.created = true;
  }
  return custom_ops;
}

int op_index(ReduceOp reduce) {
  switch (reduce) {
    case ReduceOp::kSum: case ReduceOp::kAvg: return 0;
    case ReduceOp::kMax: return 1;
    case ReduceOp::kMin: return 2;
  }
  return 0;
}

}  // namespace

MPI_Datatype datatype_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kBFloat16: return MPI_UINT16_T;
    case at::kHalf: return MPI_UINT16_T;
    case at::kInt: return MPI_INT32_T;
    case at::kLong: return MPI_INT64_T;
    case at::kChar: return MPI_INT8_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kBool: return MPI_UINT8_T;  // data movement only (bool is one byte in ATen)
    default:
      throw CommError("MPI backend: no MPI datatype for " + dtype_name(dtype));
  }
}

MPI_Op op_of(ReduceOp reduce, at::ScalarType dtype) {
  if (dtype == at::kBFloat16) return ensure_custom_ops().bf16[op_index(reduce)];
  if (dtype == at::kHalf) return ensure_custom_ops().f16[op_index(reduce)];
  switch (reduce) {
    case ReduceOp::kSum: case ReduceOp::kAvg: return MPI_SUM;
    case ReduceOp::kMax: return MPI_MAX;
    case ReduceOp::kMin: return MPI_MIN;
  }
  return MPI_SUM;
}

void free_custom_ops() {
  std::lock_guard<std::mutex> lock(custom_ops_mutex);
  if (!custom_ops.created) return;
  for (MPI_Op* group : {custom_ops.bf16, custom_ops.f16}) {
    for (int i = 0; i < 3; ++i) {
      if (group[i] != MPI_OP_NULL) MPI_Op_free(&group[i]);
    }
  }
  custom_ops.created = false;
}

void throw_error(int code, const char* call, const std::string& prefix) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw CommError(prefix + call + " failed: " + std::string(text, length));
}

int to_int_count(int64_t count, const std::string& what) {
  if (count > INT_MAX) {
    throw CommError(what + ": " + std::to_string(count) +
                    " elements exceed MPI's limit of 2^31-1 per call; split the tensor");
  }
  return static_cast<int>(count);
}

}  // namespace meshtrain::comm::mpi
