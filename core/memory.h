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

#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace pipeplan {

inline constexpr size_t kHugePageBytes = size_t{2} << 20;

// Reserves room for n elements in `v`; a new buffer of at least a few huge pages is
// advised for huge pages before its pages are first touched.
template <typename T, typename A>
void ReserveHuge(std::vector<T, A>& v, size_t n) {
  if (v.capacity() >= n) return;
  v.reserve(n);
  if (n * sizeof(T) < 2 * kHugePageBytes) return;
  const auto begin = reinterpret_cast<uintptr_t>(v.data());
  const uintptr_t first = (begin + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
  const uintptr_t last = (begin + n * sizeof(T)) & ~(kHugePageBytes - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
}
template <typename T, typename A>
void ResizeHuge(std::vector<T, A>& v, size_t n) {
  ReserveHuge(v, n);
  v.resize(n);
}

// An allocator whose construction without a value leaves an element unset (`resize`
// writes nothing), for arrays sized beforehand and filled afterwards: a large one takes
// memory page by page as it is written, not all at once when sized.
template <typename T>
struct UnsetAllocator : std::allocator<T> {
  static_assert(std::is_trivially_default_constructible_v<T>);
  template <typename U>
  struct rebind {
    using other = UnsetAllocator<U>;
  };
  UnsetAllocator() = default;
  template <typename U>
  UnsetAllocator(const UnsetAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};
// A table column: every element is written after it is sized (TableBuilder::Resize,
// Finish's permutation, a plan read from a file).
template <typename T>
using Column = std::vector<T, UnsetAllocator<T>>;

namespace detail {
inline std::atomic<bool> keep_freed_memory{false};  // KeepFreedMemory was called
}  // namespace detail

// Hands freed heap memory back to the system. Phases that free many small blocks while
// the next phase allocates large ones (mapped apart from the heap) would otherwise keep
// both resident. It costs page faults when the heap grows again, so it is done for large
// plans only (kReleaseFromOps ops and more), where the peak matters; not once the process
// keeps what it frees (KeepFreedMemory).
inline constexpr size_t kReleaseFromOps = size_t{1} << 19;
inline void ReleaseFreeMemory() {
#if defined(__GLIBC__)
  if (!detail::keep_freed_memory.load(std::memory_order_relaxed)) malloc_trim(0);
#endif
}

// Keeps what the process frees for its next allocations, for a process that builds plans
// of one size again and again (a Replanner: every training step). By default glibc hands a
// free top of the heap back to the system and maps large blocks apart (both thresholds
// adapt, up to a few tens of MiB), and ReleaseFreeMemory trims the heap during a large
// plan: each step then faults fresh pages in for the arrays the last step freed (at 1,024
// GPUs, about 225,000 ops, some 2,000 faults a step). From here on, blocks up to 32 MiB
// (glibc's largest mapping threshold) come from the heap, its free top stays and
// ReleaseFreeMemory does nothing: the process keeps the peak its first plan set.
// Process-wide: call it once the memory that matters is the next plan's speed, not the
// resident set.
inline void KeepFreedMemory() {
  detail::keep_freed_memory.store(true, std::memory_order_relaxed);
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
#endif
}

}  // namespace pipeplan
