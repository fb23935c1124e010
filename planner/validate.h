// The validator: a pure function of a const table. It checks, in order:
//  1. dependencies name existing ops and, with same-stream order, form no cycle
//     (Boost.Graph depth-first search);
//  2. every SEND has exactly one matching RECV (peer, tag, payload, micro-batch) and every
//     collective instance has each member of its group exactly once;
//  3. each micro-batch passes through every chunk forward, then backward, with data
//     arriving (locally or through a SEND/RECV pair) before it is used;
//  4. the per-rank sequences complete with blocking receives and eager sends (zero-time simulation
//     with the engine's rules: no deadlock).
// The first failure is returned as InvalidPlan naming the op in its string form.
#pragma once

#include "core/status.h"
#include "core/table.h"

namespace pipeplan {

Status ValidatePlan(const Table& t);

}  // namespace pipeplan
