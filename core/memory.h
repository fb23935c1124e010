// Memory of large plans.
// Large arrays read in random order (the table's columns, the engine's per-op state) are
// backed by huge pages where the kernel allows it (transparent huge pages in "madvise" or
// "always" mode): with 4 KiB pages, a plan of millions of ops costs a TLB miss on almost
// every cross-rank access, and the cost per op grows with the plan.
#pragma once

#include <sys/mman.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <cstdint>
#include <vector>

namespace pipeplan {

inline constexpr size_t kHugePageBytes = size_t{2} << 20;

// Reserves room for n elements in `v`; a new buffer of at least a few huge pages is
// advised for huge pages before its pages are first touched.
template <typename T>
void ReserveHuge(std::vector<T>& v, size_t n) {
  if (v.capacity() >= n) return;
  v.reserve(n);
  if (n * sizeof(T) < 2 * kHugePageBytes) return;
  const auto begin = reinterpret_cast<uintptr_t>(v.data());
  const uintptr_t first = (begin + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
  const uintptr_t last = (begin + n * sizeof(T)) & ~(kHugePageBytes - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
}
template <typename T>
void ResizeHuge(std::vector<T>& v, size_t n) {
  ReserveHuge(v, n);
  v.resize(n);
}

// Hands freed heap memory back to the system. Phases that free many small blocks while
// the next phase allocates large ones (mapped apart from the heap) would otherwise keep
// both resident. It costs page faults when the heap grows again, so it is done for large
// plans only (kReleaseFromOps ops and more), where the peak matters.
inline constexpr size_t kReleaseFromOps = size_t{1} << 19;
inline void ReleaseFreeMemory() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

}  // namespace pipeplan
