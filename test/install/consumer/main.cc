// DESIGN §4's first program, checked: prints "ok" when every rank got the expected values.
#include <atomic>
#include <cstdio>

#include <Eigen/Core>  // the package's flags find the Eigen funcol's headers take
#include <funcol/funcol.h>
#include <funcol/runtime/executor.h>

int main(int argc, char** argv) {
  // `consumer mpi` / `consumer gloo`: links the process backends too (pkg-config must list
  // their libraries); the install test runs the threads part, and with gloo this one under the
  // installed funcol-gloo-launch.
  if (argc > 1) {
    auto world = funcol::init_process_group(argv[1]);
    std::printf("rank %d of %d\n", world->rank(), world->size());
    funcol::destroy_process_group();
    return 0;
  }
  std::atomic<int> good{0};
  funcol::run_local(4, [&](funcol::ProcessGroup& world) {
    using funcol::DType;
    funcol::Tensor x = funcol::Tensor::full({4, 8}, DType::F32, world.rank());
    funcol::Tensor s = funcol::all_reduce(x, "sum", "world");   // returns at once
    funcol::Tensor g = funcol::all_gather_tensor(x, 1, world);  // any group spec
    funcol::DeviceMesh mesh(world, {{"dp", 2}, {"tp", 2}});
    funcol::Tensor r = funcol::reduce_scatter_tensor(g, "avg", 0, mesh.group("tp"));
    std::vector<float> v = s.to_vector<float>();  // waits here
    bool ok = v.size() == 32 && v[0] == 6.0f && g.sizes() == funcol::Shape{4, 32} &&
              r.sizes() == funcol::Shape{2, 32};
    if (ok) good++;
  });
  // Eigen's half and bfloat16, which the public headers take, compile and convert.
  const std::vector<Eigen::half> h =
      funcol::Tensor::full({2}, funcol::DType::F16, 1.5).to_vector<Eigen::half>();
  const Eigen::bfloat16 b =
      funcol::Tensor::full({}, funcol::DType::BF16, -2).item<Eigen::bfloat16>();
  if (h.size() != 2 || static_cast<float>(h[1]) != 1.5f || static_cast<float>(b) != -2.0f) good = 0;
  // The runtime's own dependencies link too (tensor_digest hashes with xxHash).
  const std::string digest = funcol::tensor_digest(funcol::Tensor::zeros({4}, funcol::DType::F32));
  if (digest.empty()) good = 0;
  std::puts(good == 4 ? "ok" : "wrong");
  return good == 4 ? 0 : 1;
}
