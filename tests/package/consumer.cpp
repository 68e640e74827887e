// Uses the installed library: one rank, started without mpirun.
#include <meshtrain/comm/runtime.h>
#include <meshtrain/mesh/device_mesh.h>

#include <cstdio>

int main(int argc, char** argv) {
  meshtrain::comm::Runtime runtime(&argc, &argv);
  meshtrain::mesh::DeviceMesh mesh(runtime.world(), meshtrain::mesh::MeshLayout({{"dp", 1}}, 1));
  at::Tensor x = at::full({3}, 2.0f);
  mesh.comm("dp")->all_reduce(x).wait();
  std::printf("consumer: %s, all_reduce -> %.1f\n", mesh.describe().c_str(), x[0].item<float>());
  return x[0].item<float>() == 2.0f ? 0 : 1;
}
