// The point in time `timeout_s` seconds from now: every bounded wait of the executor.
#pragma once

#include <chrono>

namespace pipeplan {

inline std::chrono::steady_clock::time_point Deadline(double timeout_s) {
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(
             std::chrono::duration<double>(timeout_s));
}

}  // namespace pipeplan
