// The README quickstart: DESIGN §4's first program on 4 thread ranks; prints "ok".
#include <atomic>
#include <cstdio>

#include <funcol/funcol.h>

int main() {
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
  std::puts(good == 4 ? "ok" : "wrong");
  return good == 4 ? 0 : 1;
}
