// Binding threads to CPUs: the threads backend's ranks (LocalOptions::bind_threads) and the
// benchmarks' reference threads. Two threads that hand a cache line back and forth run 10x
// slower when the scheduler puts them on one core (every handoff waits for a context switch),
// which it does now and then on an idle machine too: binding rules that out.
#pragma once

#include <pthread.h>
#include <sched.h>

#include <vector>

namespace funcol::dist_detail {

// The CPUs the calling thread may run on, in increasing order.
inline std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (pthread_getaffinity_np(pthread_self(), sizeof set, &set) != 0) return cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
}

// Pins the calling thread to `cpu` while it lives, then restores the thread's own mask (the
// calling thread of run_local is the user's). No-op for cpu < 0 or when the kernel refuses.
class CpuBinding {
 public:
  explicit CpuBinding(int cpu) {
    if (cpu < 0 || pthread_getaffinity_np(pthread_self(), sizeof saved_, &saved_) != 0) return;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    bound_ = pthread_setaffinity_np(pthread_self(), sizeof one, &one) == 0;
  }
  ~CpuBinding() {
    if (bound_) pthread_setaffinity_np(pthread_self(), sizeof saved_, &saved_);
  }
  CpuBinding(const CpuBinding&) = delete;
  CpuBinding& operator=(const CpuBinding&) = delete;
  bool bound() const { return bound_; }

 private:
  cpu_set_t saved_;
  bool bound_ = false;
};

}  // namespace funcol::dist_detail
