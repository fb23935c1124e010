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
  // Error bounds from the summation (CompareWithReference): the plan and the reference run
  // the same operations per micro-batch but sum the contributions of K micro-batches (and
  // tasks) in other orders; two orders of a K-term sum differ by at most 2(K-1)u sum|t|
  // (u = 2^-53), and each of the L layers a perturbation passes adds one more rounding:
  // bound = 2(K - 1 + L) u max_i sum_k |t_ik| / max_i |sum_k t_ik|, at least 1e-12.
  double loss_tolerance = 1e-12, grad_tolerance = 1e-12;
  // FP8 storage of saved activations (executor/fp8_storage.h): the reference stores the
  // same tensors the same way, so the bounds above hold unchanged. What the storage itself
  // does to the gradients: their max relative difference from unquantised storage.
  bool fp8_storage = false;
  double fp8_effect = 0;
  bool passed() const { return loss_error <= loss_tolerance && max_grad_error <= grad_tolerance; }
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
