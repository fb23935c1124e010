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

#include "core/table.h"
#include "core/timeline.h"
#include "simulator/cost_model.h"

namespace pipeplan {

inline constexpr int kContentionPasses = 4;

// The durations with contention, from the uncontended `base` and a timeline.
std::vector<double> ContendedDurations(const Table& t, const Timeline& tl,
                                       const std::vector<double>& base, const CostModel& cost);

}  // namespace pipeplan
