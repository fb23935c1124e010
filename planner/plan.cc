#include "planner/plan.h"

#include "planner/lower.h"
#include "planner/schedules.h"
#include "planner/workload.h"

namespace pipeplan {

std::vector<RankInfo> MakeRanks(const Config& c) {
  const ParallelConfig& p = c.parallel;
  const int gpus = p.tp * p.cp;
  std::vector<RankInfo> ranks;
  ranks.reserve(static_cast<size_t>(p.dp) * p.pp);
  for (int d = 0; d < p.dp; ++d) {
    for (int s = 0; s < p.pp; ++s) {
      RankInfo r;
      r.dp = d, r.pp = s, r.gpus = gpus;
      r.first_gpu = s * p.dp * gpus + d * gpus;
      r.node = r.first_gpu / c.cluster.gpus_per_node;
      ranks.push_back(r);
    }
  }
  return ranks;
}

SimOptions SimOptionsFor(const Config& c, bool unit_costs) {
  SimOptions o;
  o.cost = unit_costs ? CostModel::Unit() : CostModel::Real(c.cluster.spec);
  o.memory.zero_stage = c.training.zero_stage;
  o.memory.reserve_bytes = c.training.comm_reserve_gb * 1024.0 * 1024 * 1024;
  o.memory.hbm_bytes = c.cluster.spec.hbm_bytes;
  return o;
}

StatusOr<Config> ConfigOfPlan(const Table& plan, const std::string& plan_path) {
  ASSIGN_OR_RETURN(YamlDoc doc,
                   YamlDoc::FromString(plan_path + " (embedded config)", plan.meta().config_yaml));
  return ParseConfig(std::move(doc));
}

StatusOr<Table> BuildPlan(const Config& c) {
  const ParallelConfig& p = c.parallel;
  PipelineShape shape{p.pp, p.vp, p.dp, c.training.microbatches};
  ASSIGN_OR_RETURN(auto orders, TextSchedule(c.schedule.pipeline, p.pp, p.vp, shape.m,
                                             p.microbatch_group_size_per_vp_stage));
  TextWorkload tw = BuildTextWorkload(c);
  std::vector<RankInfo> ranks = MakeRanks(c);
  for (RankInfo& r : ranks)
    for (int ch = 0; ch < p.vp; ++ch) r.params[0] += tw.params_per_gpu[ch * p.pp + r.pp];
  TableBuilder b(ranks);

  std::vector<WorkId> f_work, b_work;
  GradSyncWorks sync;
  for (int g = 0; g < shape.stages(); ++g) {
    f_work.push_back(b.AddWork(tw.f[g]));
    b_work.push_back(b.AddWork(tw.b[g]));
    Work reduce, gather;
    reduce.payload_bytes = tw.params_per_gpu[g] * 4;  // fp32 main gradients (Megatron default)
    gather.payload_bytes = tw.params_per_gpu[g] * 2;  // bf16 parameters
    sync.reduce.push_back(b.AddWork(reduce));
    sync.gather.push_back(b.AddWork(gather));
  }
  const double shard = c.training.zero_stage >= 1 ? p.dp : 1;
  for (int s = 0; s < p.pp; ++s) {
    // Adam over the rank's shard: reads grad, master, two moments, writes them and the
    // bf16 weight: about 34 bytes and 10 FLOPs per parameter.
    double params = 0;
    for (int ch = 0; ch < p.vp; ++ch) params += tw.params_per_gpu[ch * p.pp + s];
    Work opt;
    opt.hbm_bytes = 34 * params / shard;
    opt.flops = 10 * params / shard * p.tp * p.cp;
    opt.kernels = 4;
    sync.opt_step.push_back(b.AddWork(opt));
  }
  Work p2p;
  p2p.payload_bytes = tw.p2p_bytes;
  WorkId p2p_work = b.AddWork(p2p);
  std::vector<int32_t> dp_group(p.pp, -1);
  if (p.dp > 1) {
    for (int s = 0; s < p.pp; ++s) {
      std::vector<int32_t> members;
      for (int d = 0; d < p.dp; ++d) members.push_back(shape.rank(d, s));
      dp_group[s] = b.AddGroup(std::move(members));
    }
  }

  std::vector<RankSeq> seqs = ExpandStages(orders, shape, f_work, b_work);
  AddSendRecv(&seqs, shape, p2p_work);
  AddGradSync(&seqs, shape, c.training.zero_stage, sync, dp_group);
  RETURN_IF_ERROR(Link(std::move(seqs), &b));

  PlanMeta meta;
  meta.schedule = PipelineName(c.schedule.pipeline);
  meta.pp = p.pp, meta.vp = p.vp, meta.dp = p.dp, meta.tp = p.tp, meta.cp = p.cp, meta.ep = p.ep;
  meta.microbatches = shape.m;
  meta.gpus_per_node = c.cluster.gpus_per_node;
  meta.tokens_per_step = tw.tokens_per_mb * shape.m * p.dp;
  meta.samples_per_step = static_cast<double>(c.training.micro_batch_size) * shape.m * p.dp;
  meta.config_yaml = c.resolved_yaml;
  return b.Finish(std::move(meta));
}

}  // namespace pipeplan
