// Simulated vs measured: line up two Chrome traces of the same plan by op string, report
// errors per module and kind, and fit the cost model's efficiency factors to the
// measurement (a calibration file `simulate --calibration` loads).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/status.h"
#include "simulator/hardware.h"

namespace pipeplan {

struct TraceOp {
  std::string module, kind;
  double start_us = 0, dur_us = 0;
};
// Complete events by name (op string form).
StatusOr<std::map<std::string, TraceOp>> ReadTraceOps(const std::string& json_text);

struct ErrorStats {
  size_t ops = 0;
  double predicted_s = 0, measured_s = 0;  // sums
  double mean_abs_rel_error = 0;           // mean |measured - predicted| / predicted over ops
};

struct Comparison {
  size_t matched = 0, only_simulated = 0, only_measured = 0;
  double predicted_step_s = 0, measured_step_s = 0;
  std::map<std::string, ErrorStats> by_module, by_kind;
  std::vector<std::pair<std::string, double>>
      worst;  // op, measured - predicted (s), largest |.| first
};
Comparison Compare(const std::map<std::string, TraceOp>& simulated,
                   const std::map<std::string, TraceOp>& measured, size_t worst = 10);
std::string ComparisonText(const Comparison& c);

// Scales the efficiency factors so that each class of op (compute; communication) has
// the measured total time: factor x predicted / measured.
// Refused when a fitted efficiency would exceed 1 (the measured run beat the GPU's peak:
// it was not measured on this GPU, or not on a GPU at all).
StatusOr<GpuSpec> Calibrate(const GpuSpec& spec, const Comparison& c);
// The calibration file: `cluster.hardware` overrides as YAML.
std::string CalibrationYaml(const GpuSpec& calibrated, const Comparison& c);

}  // namespace pipeplan
