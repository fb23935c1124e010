// The HTML report: one self-contained file (inline SVG, JavaScript and CSS; nothing fetched
// from the network) that shows a simulated step or a sweep.
//
// A step: the summary (the simulator's metrics, with units), the schedule as a rank x time
// chart (one rectangle per op, coloured by module and kind, hover for the op string and its
// numbers; above kMaxDrawnOps ops, aggregated into time bins per rank, or per pipeline
// stage over the DP replicas when there are more than kMaxRows ranks), idle time per rank,
// and device memory over time for the ranks with the highest peaks, with the HBM capacity
// as the out-of-memory line. A sweep (the CSV `pipeplan sweep -o` writes): throughput
// against peak memory per point, the Pareto frontier among points that fit, and the table.
//
// The page draws its charts from a JSON block when it loads; it records what it drew on
// the <body> element (data-drawn-*), which the browser test reads.
#pragma once

#include <string>

#include "core/status.h"
#include "core/table.h"
#include "simulator/metrics.h"

namespace pipeplan {

inline constexpr size_t kMaxDrawnOps = 20000;
inline constexpr int kMaxRows = 256;
inline constexpr int kTimeBins = 400;       // per row, aggregated schedules
inline constexpr int kMemoryRanks = 8;      // memory curves drawn
inline constexpr int kMemoryPoints = 1500;  // samples per curve (the max of each bucket)

struct StepReportInput {
  std::string title;  // e.g. the config's file name
  const Table* table = nullptr;
  const SimResult* sim = nullptr;  // with memory curves
  std::string config_yaml;         // shown folded
};
std::string StepReportHtml(const StepReportInput& in);

// `csv` as `pipeplan sweep -o` writes it, read from `path` (which names errors; the page
// is titled by the file's name).
StatusOr<std::string> SweepReportHtml(const std::string& path, const std::string& csv);

}  // namespace pipeplan
