#include "core/parallel.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace pipeplan {

void RunParallel(size_t n, const std::function<void(size_t)>& f, size_t most) {
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::mutex mu;
  auto worker = [&] {
    try {
      for (size_t i; (i = next++) < n;) f(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!error) error = std::current_exception();
      next = n;
    }
  };
  const size_t want =
      std::min<size_t>(n, most > 0 ? most : std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> threads;
  for (size_t j = 1; j < want; ++j) {
    try {
      threads.emplace_back(worker);
    } catch (const std::system_error&) {
      break;
    }
  }
  worker();
  for (auto& th : threads) th.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace pipeplan
