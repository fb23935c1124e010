// Work spread over the machine's cores.
#pragma once

#include <cstddef>
#include <functional>

namespace pipeplan {

// Work over this many items (ops, transfers) or more is worth a second thread: starting
// one costs about as much as walking some thousands of ops.
inline constexpr size_t kParallelFromOps = size_t{1} << 16;

// Runs f(0..n-1) on up to one thread per core (the calling thread among them), in no
// particular order; an exception in one (out of memory) is rethrown here once all have
// stopped. A thread the machine refuses is simply not used. `parallel` false: one after
// the other on the calling thread (work too small to pay for starting threads).
void RunParallel(size_t n, const std::function<void(size_t)>& f, bool parallel = true);

}  // namespace pipeplan
