// Config -> operator table: workload, text schedule, lowering passes, linking.
#pragma once

#include "core/table.h"
#include "planner/config.h"
#include "simulator/metrics.h"

namespace pipeplan {

StatusOr<Table> BuildPlan(const Config& config);

// Ranks of a config: (replica d, stage s) -> rank d*pp + s with GPU placement in
// Megatron's tp-cp-dp-pp order.
std::vector<RankInfo> MakeRanks(const Config& config);

// Simulation options of a config: its GPU (with overrides), ZeRO stage, reserve.
SimOptions SimOptionsFor(const Config& config, bool unit_costs = false);

// The config a plan was made from (stored in the plan), parsed again.
StatusOr<Config> ConfigOfPlan(const Table& plan, const std::string& plan_path,
                              const std::vector<std::string>& sets = {});

}  // namespace pipeplan
