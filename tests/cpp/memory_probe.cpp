// Peak extra memory of one cpu-backend call, measured, not computed: the process's
// resident high-water mark (VmHWM) after inputs and outputs are allocated and touched,
// against the mark after the call. Usage: qkv_memory_probe [forward|backward] N
// [limit MiB]. Prints "extra_mib=X" and fails (exit 1) above the limit.
#include <qkv/qkv.hpp>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>

namespace {

double high_water_mib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // kB
  return -1.0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string pass = argc > 1 ? argv[1] : "forward";
  const int64_t n = argc > 2 ? std::atoll(argv[2]) : 16384;
  const double limit_mib = argc > 3 ? std::atof(argv[3]) : 64.0;
  constexpr int64_t kBatch = 1, kHeads = 8, kDim = 64;
  qkv::Tensor<float, 4> q({kBatch, n, kHeads, kDim}), k(q.shape()), v(q.shape()), out(q.shape());
  qkv::Tensor<float, 3> lse({kBatch, kHeads, n});
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (auto* t : {&q, &k, &v})
    for (std::size_t i = 0; i < t->size(); ++i) (*t)[i] = normal(rng);
  qkv::AttentionOptions options;
  options.execution.backend = qkv::Backend::cpu;
  qkv::Tensor<float, 4> dout, dq, dk, dv;
  if (pass == "backward") {
    qkv::attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                            .lse = lse.view()},
                           options);
    dout = q;
    dq = qkv::Tensor<float, 4>(q.shape());
    dk = qkv::Tensor<float, 4>(q.shape());
    dv = qkv::Tensor<float, 4>(q.shape());
  }
  const double before = high_water_mib();
  if (pass == "backward") {
    qkv::attention_backward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.cview(),
                             .lse = lse.cview(), .dout = dout.cview(), .dq = dq.view(),
                             .dk = dk.view(), .dv = dv.view()},
                            options);
  } else {
    qkv::attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                            .lse = lse.view()},
                           options);
  }
  const double extra = high_water_mib() - before;
  std::printf("%s B=%lld H=%lld N=%lld d=%lld: inputs+outputs %.0f MiB, extra_mib=%.1f (limit %.0f)\n",
              pass.c_str(), static_cast<long long>(kBatch), static_cast<long long>(kHeads),
              static_cast<long long>(n), static_cast<long long>(kDim), before, extra, limit_mib);
  return extra <= limit_mib ? 0 : 1;
}
