// Link contention between transfers that overlap in time. Each GPU of a rank has one NIC,
// full duplex: a transfer that leaves the node uses the egress (a SEND), the ingress (a
// RECV) or both (a collective across nodes: a ring sends and receives). Transfers that
// overlap on one direction share its bandwidth (k at once get 1/k each), so each one's
// bandwidth term is stretched by its mean concurrency over its own interval:
//   d' = alpha + (d - alpha) * (1 + sum over others on a shared direction of overlap / d).
// The engine keeps fixed durations, so RunSimulation iterates: simulate, stretch from the
// base durations with the new timeline, simulate again, until nothing changes or
// kContentionPasses passes have run.
#pragma once

#include <vector>

#include "core/status.h"
#include "core/table.h"
#include "core/timeline.h"
#include "simulator/cost_model.h"

namespace pipeplan {

inline constexpr int kContentionPasses = 4;

// The transfers of a table that use a NIC direction, per rank, found once, with their
// uncontended durations: the passes of RunSimulation then look at those ops only.
class LinkContention {
 public:
  LinkContention(const Table& t, const CostModel& cost);
  // The uncontended durations of the table's ops (the transfers' are kept); an Internal
  // error unless there is one per op.
  Status KeepBase(const std::vector<double>& base);
  // `durations` holds the uncontended durations but for the transfers: their contended
  // durations with the timeline tl are written there; whether any of them changed (the
  // passes end where none did, without a second array of durations). An Internal error
  // before KeepBase, or unless `durations` and tl have one entry per op.
  StatusOr<bool> Update(const Timeline& tl, std::vector<double>* durations) const;

 private:
  // Ranks [from, to) into `out`; whether a duration changed.
  bool Sweep(size_t from, size_t to, const Timeline& tl, std::vector<double>* out) const;
  bool unit_ = false;
  size_t size_ = 0;  // the table's ops
  bool kept_ = false;
  double alpha_ = 0;           // the inter-node latency (not stretched)
  std::vector<size_t> begin_;  // per rank r: its transfers at [begin_[r], begin_[r + 1])
  std::vector<OpId> ops_;      // in op order within a rank
  std::vector<uint8_t> dirs_;  // per transfer: kEgress | kIngress bits
  std::vector<double> base_;   // per transfer: its uncontended duration
};

// The same, for one timeline.
StatusOr<std::vector<double>> ContendedDurations(const Table& t, const Timeline& tl,
                                                 const std::vector<double>& base,
                                                 const CostModel& cost);

}  // namespace pipeplan
