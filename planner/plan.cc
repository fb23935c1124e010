#include "planner/plan.h"

#include <optional>

#include "planner/data.h"
#include "planner/lower.h"
#include "planner/modality.h"
#include "planner/placement.h"
#include "planner/schedules.h"
#include "planner/workload.h"
#include "simulator/engine.h"

namespace pipeplan {
namespace {

bool Multimodal(const Config& c) {
  return c.model.vision.enabled || c.model.generator.enabled;
}

// Decoupled designs with a generator run every LLM forward before any backward.
PipelineKind EffectivePipeline(const Config& c) {
  if (c.schedule.modality == ModalityPolicy::kDecoupled && c.model.generator.enabled)
    return PipelineKind::kGpipe;
  return c.schedule.pipeline;
}

// The predicted timeline of one DP replica of the same plan without the vision encoder
// (text and generator): nested and bubble-fill anchor vision work on its times and fill
// its idle gaps. Replicas run the same text schedule, so one stands for all (its stages
// sit on neighbouring GPUs, so its p2p transfers are a little optimistic).
StatusOr<std::pair<Table, Timeline>> TextTimeline(const Config& c) {
  Config text = c;
  text.model.vision.enabled = false;
  text.parallel.dp = 1;
  ASSIGN_OR_RETURN(Table t, BuildPlan(text));
  ASSIGN_OR_RETURN(Timeline tl, Simulate(t, CostModel::Real(c.cluster.spec).Durations(t)));
  return std::make_pair(std::move(t), std::move(tl));
}

Status AddModality(const Config& c, const PipelineShape& shape, const StepBatch& batch,
                   TableBuilder* b, std::vector<RankSeq>* seqs, std::vector<ModalitySync>* sync) {
  const ModalityPolicy policy = c.schedule.modality;
  const bool decoupled = policy == ModalityPolicy::kDecoupled;
  const bool timed = policy == ModalityPolicy::kNested || policy == ModalityPolicy::kBubbleFill;
  // Nested and bubble-fill place vision work on the predicted timeline of the plan
  // without it.
  std::optional<std::pair<Table, Timeline>> text;
  VisionPool pool;
  pool.consumer_only = policy == ModalityPolicy::kInline;
  if (timed && c.model.vision.enabled) {
    ASSIGN_OR_RETURN(text, TextTimeline(c));
  }
  ModalityWork w = BuildModalityWork(c, batch, pool, decoupled && c.schedule.decoupled_recompute);
  ModalityWorkIds ids;
  for (const VisionTask& t : w.vision) {
    Work out;
    out.payload_bytes = t.out_bytes;
    ids.vision_f.push_back(b->AddWork(t.f));
    ids.vision_b.push_back(b->AddWork(t.b));
    ids.vision_recompute.push_back(b->AddWork(t.recompute));
    ids.vision_out.push_back(b->AddWork(out));
  }
  for (const GeneratorTask& t : w.generator) {
    ids.generator_f.push_back(b->AddWork(t.f));
    ids.generator_b.push_back(b->AddWork(t.b));
  }
  std::vector<VisionPlacement> vision;
  switch (policy) {
    case ModalityPolicy::kInline:
      vision = PlaceVisionInline(shape, w);
      break;
    case ModalityPolicy::kDecoupled:
      vision = PlaceVisionDecoupled(shape, w, c.schedule.decoupled_recompute);
      break;
    case ModalityPolicy::kNested:
      if (text) vision = PlaceVisionNested(shape, w, text->first, text->second);
      break;
    case ModalityPolicy::kBubbleFill:
      if (text) vision = PlaceVisionBubbleFill(shape, w, text->first, text->second);
      break;
  }
  auto generator = PlaceGenerator(shape, w, decoupled);
  RETURN_IF_ERROR(InsertModality(seqs, shape, w, ids, vision, generator, b));
  // Gradients of the FSDP-sharded modality parameters: full fp32 gradient in, shard out.
  for (auto [module, params] : {std::pair{Module::kVision, w.vision_params},
                                std::pair{Module::kGenerator, w.generator_params}}) {
    if (params <= 0) continue;
    Work reduce;
    reduce.payload_bytes = params * 4;
    sync->push_back({module, b->AddWork(reduce)});
  }
  return Status::Ok();
}

}  // namespace

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

StatusOr<Config> ConfigOfPlan(const Table& plan, const std::string& plan_path,
                              const std::vector<std::string>& sets) {
  ASSIGN_OR_RETURN(YamlDoc doc,
                   YamlDoc::FromString(plan_path + " (embedded config)", plan.meta().config_yaml));
  for (const std::string& s : sets) RETURN_IF_ERROR(doc.ApplySet(s));
  return ParseConfig(std::move(doc));
}

StatusOr<Table> BuildPlan(const Config& c) {
  const ParallelConfig& p = c.parallel;
  PipelineShape shape{p.pp, p.vp, p.dp, c.training.microbatches};
  const PipelineKind pipeline = EffectivePipeline(c);
  ASSIGN_OR_RETURN(auto orders, TextSchedule(pipeline, p.pp, p.vp, shape.m,
                                             p.microbatch_group_size_per_vp_stage));
  TextWorkload tw = BuildTextWorkload(c);
  StepBatch batch;
  if (Multimodal(c)) {
    ASSIGN_OR_RETURN(batch, MakeStepBatch(c));
  }
  std::vector<RankInfo> ranks = MakeRanks(c);
  const double world = c.world();
  ModalityWork params_only =
      Multimodal(c) ? BuildModalityWork(c, StepBatch{}, VisionPool{}, false) : ModalityWork{};
  for (RankInfo& r : ranks) {
    for (int ch = 0; ch < p.vp; ++ch) r.params[0] += tw.params_per_gpu[ch * p.pp + r.pp];
    r.params[1] = params_only.vision_params / world;  // FSDP shards over every GPU
    r.params[2] = params_only.generator_params / world;
  }
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
    double params = (ranks[s].params[1] + ranks[s].params[2]) * shard;
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
  std::vector<ModalitySync> modality_sync;
  int32_t all_ranks = -1;
  if (Multimodal(c)) {
    RETURN_IF_ERROR(AddModality(c, shape, batch, &b, &seqs, &modality_sync));
    if (!modality_sync.empty() && ranks.size() > 1) {
      std::vector<int32_t> members(ranks.size());
      for (size_t r = 0; r < ranks.size(); ++r) members[r] = static_cast<int32_t>(r);
      all_ranks = b.AddGroup(std::move(members));
    }
  }
  AddSendRecv(&seqs, shape, p2p_work);
  AddGradSync(&seqs, shape, c.training.zero_stage, sync, dp_group, modality_sync, all_ranks);
  RETURN_IF_ERROR(Link(std::move(seqs), &b));

  PlanMeta meta;
  meta.schedule = PipelineName(pipeline);
  meta.modality = Multimodal(c) ? std::string(ModalityName(c.schedule.modality)) : "";
  meta.pp = p.pp, meta.vp = p.vp, meta.dp = p.dp, meta.tp = p.tp, meta.cp = p.cp, meta.ep = p.ep;
  meta.microbatches = shape.m;
  meta.gpus_per_node = c.cluster.gpus_per_node;
  meta.tokens_per_step =
      Multimodal(c) ? static_cast<double>(batch.tokens) : tw.tokens_per_mb * shape.m * p.dp;
  meta.samples_per_step = Multimodal(c)
                              ? static_cast<double>(batch.samples)
                              : static_cast<double>(c.training.micro_batch_size) * shape.m * p.dp;
  meta.config_yaml = c.resolved_yaml;
  return b.Finish(std::move(meta));
}

}  // namespace pipeplan
