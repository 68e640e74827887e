// A small MPI program that misbehaves on purpose; fault_test.cpp runs it under
// mpirun and checks that the job ends, non-zero, with a clear message.
//   skip-collective: rank 1 never joins the second all_reduce (it hangs elsewhere)
//   die:             rank 1 exits abruptly before the second all_reduce
//   desync-shape:    rank 0 reduces float32[4, 8], the others float32[4, 9]
//   segfault:        rank 1 reads through a null pointer during "step 3"
#include "meshtrain/comm/runtime.h"
#include "meshtrain/comm/watchdog.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: meshtrain_fault_helper skip-collective|die|desync-shape|segfault\n");
    return 2;
  }
  const std::string scenario = argv[1];
  meshtrain::comm::Runtime runtime(&argc, &argv);
  try {
    auto& world = *runtime.world();
    at::Tensor x = at::ones({4});
    world.all_reduce(x).wait();  // collective #0: everyone
    if (scenario == "skip-collective") {
      if (world.rank() == 1) {
        std::this_thread::sleep_for(std::chrono::minutes(5));  // hung elsewhere, never joins #1
        return 0;
      }
      world.all_reduce(x).wait();
    } else if (scenario == "die") {
      if (world.rank() == 1) std::_Exit(3);
      world.all_reduce(x).wait();
    } else if (scenario == "segfault") {
      meshtrain::comm::WatchdogContext step("step 3");
      if (world.rank() == 1) {
        volatile int* nowhere = nullptr;
        *nowhere = 1;
      }
      world.all_reduce(x).wait();
    } else if (scenario == "desync-shape") {
      at::Tensor y = at::ones({4, world.rank() == 0 ? 8 : 9});
      world.all_reduce(y).wait();
    } else {
      std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
      return 2;
    }
  } catch (const std::exception& e) {
    runtime.abort(1, std::string("error: ") + e.what());
  }
  return 0;
}
