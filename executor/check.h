// A local CPU run of a plan and its gradient check against the sequential reference.
#pragma once

#include "core/table.h"
#include "core/timeline.h"
#include "executor/runner.h"
#include "executor/tiny_model.h"

namespace pipeplan {

struct CheckResult {
  double loss = 0, reference_loss = 0;
  double loss_error = 0;      // relative
  double max_grad_error = 0;  // max relative error over every parameter gradient
  std::string worst;          // which gradient
};

// Loss and gradients of a run (grads[r]: rank r's, after its collectives) against the
// sequential reference.
CheckResult CompareWithReference(const Table& t, const TinyModel& model,
                                 const std::vector<ParamSet>& grads, double loss);

// Runs every rank of `t` as a thread with the CPU backend; with `check`, also the
// sequential reference, and compares loss and every gradient.
StatusOr<CheckResult> RunCpuLocal(const Table& t, const RunOptions& o, bool check,
                                  Timeline* measured);

}  // namespace pipeplan
