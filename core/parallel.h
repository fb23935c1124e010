// Work spread over the machine's cores.
#pragma once

#include <cstddef>
#include <functional>

namespace pipeplan {

// Work over this many items (ops, transfers) or more is worth a second thread: starting
// one costs about as much as walking some thousands of ops.
inline constexpr size_t kParallelFromOps = size_t{1} << 16;

// Runs f(0..n-1) on up to `most` threads (0: one per core; the calling thread among
// them; 1: one after the other on the calling thread, for work too small to pay for
// starting threads), in no particular order; an exception in one (out of memory) is
// rethrown here once all have stopped. A thread the machine refuses is simply not used.
void RunParallel(size_t n, const std::function<void(size_t)>& f, size_t most = 0);

}  // namespace pipeplan
