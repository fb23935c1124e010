// What-if sweeps: plan + simulate over the cartesian product of --vary lists.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/status.h"
#include "simulator/metrics.h"

namespace pipeplan {

struct VaryAxis {
  std::string key;                  // config key path, as for --set
  std::vector<std::string> values;  // YAML scalars
};

StatusOr<VaryAxis> ParseVary(const std::string& spec);  // "KEY=V1,V2,..."

struct SweepPoint {
  std::vector<std::string> values;  // one per axis
  bool ok = false;
  std::string error;  // first line of the error when !ok
  Metrics metrics;
  bool pareto = false;  // on the (tokens/s, peak memory) frontier of feasible points
};

// Grid in row-major order (last axis fastest).
std::vector<SweepPoint> ExpandGrid(const std::vector<VaryAxis>& axes);
// The grid's size, or an error above kMaxSweepPoints (each point is a whole plan).
inline constexpr size_t kMaxSweepPoints = 100000;
StatusOr<size_t> GridSize(const std::vector<VaryAxis>& axes);

// Runs every point with `jobs` threads; `progress(done, total)` is called after each point.
std::vector<SweepPoint> RunSweep(const std::string& config_path,
                                 const std::vector<std::string>& sets,
                                 const std::vector<VaryAxis>& axes, int jobs,
                                 const std::function<void(size_t, size_t)>& progress);

// Whether each point is on the Pareto frontier of (tokens/s, peak memory): no other point
// is at least as good in both and better in one.
std::vector<bool> ParetoFront(const std::vector<const Metrics*>& points);

// Marks points not dominated in (step time, peak memory) among ok, non-OOM points.
void MarkPareto(std::vector<SweepPoint>* points);

std::string SweepCsv(const std::vector<VaryAxis>& axes, const std::vector<SweepPoint>& points);

}  // namespace pipeplan
