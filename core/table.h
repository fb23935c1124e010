// The operator table: every op of one training step on every pipeline rank.
//
// Invariants (checked by the planner's validator, relied on everywhere else):
// - Op ids are dense, rank-major: the ops of rank r are [rank_begin(r), rank_begin(r+1))
//   and that range IS rank r's execution sequence, in order.
// - Ops with identical work share one Work entry (work class); durations and memory
//   effects are computed per class.
// - deps(op) lists explicit dependencies: a RECV lists its matching SEND (exactly one);
//   a collective lists same-rank ops it must wait for; OPT_STEP lists its rank's
//   gradient collectives. A same-rank dependency is an earlier op. Same-stream order on a
//   rank is implicit.
// - Collectives are matched across ranks by (group id in `peer`, tag).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/memory.h"
#include "core/op.h"

namespace pipeplan {

using OpId = uint32_t;
using WorkId = uint32_t;

// The tag of a text compute op that runs together with the next compute op of its rank
// (an overlapped forward/backward pair of DualPipeV): the two start together and end
// together, each one's communication hidden behind the other's compute.
inline constexpr uint32_t kOverlapNextTag = 1;

// What one op does, shared by all ops doing the same thing. Units in the names.
struct Work {
  double flops = 0;            // FLOPs over all GPUs of the rank, recompute included
  double attn_flops = 0;       // part of `flops` in attention kernels (own efficiency)
  double model_flops = 0;      // FLOPs counted by MFU (no recompute)
  double hbm_bytes = 0;        // bytes each GPU moves in memory-bound kernels (norms,
                               // activations, residual adds, optimizer), bytes
  double payload_bytes = 0;    // SEND/RECV or collective payload per GPU, bytes
  double mem_delta_bytes = 0;  // activation bytes per GPU that become live (>0) or are
                               // freed (<0) when the op ends
  double tp_bytes = 0;         // folded TP/CP collectives: bytes per GPU over the ring
  double ep_bytes = 0;         // folded MoE dispatch/combine all-to-all bytes per GPU
  int32_t tp_calls = 0;        // number of folded TP/CP collective calls
  int32_t ep_calls = 0;        // number of folded all-to-all calls
  int32_t kernels = 1;         // kernel launches (launch overhead)
  int32_t layer_begin = -1;    // module layers covered, [begin, end); -1 = none
  int32_t layer_end = -1;
  double fp8_flops = 0;  // part of `flops` in FP8 GEMMs (training.precision: fp8)
  // A forward whose saved activations are stored FP8 block-quantised until its backward
  // (saved_activations: fp8); the executor quantises them, the costs are in the amounts.
  bool saved_fp8 = false;
  // Of ep_bytes / ep_calls, the all-to-alls that run beside the GEMMs of ep_overlap_flops
  // (FLOPs over all GPUs of the rank) on a stream of their own: hidden up to those GEMMs'
  // time (training.overlap_moe_recompute: the recomputed dispatch beside the experts'
  // data-gradient GEMMs).
  double ep_overlap_bytes = 0, ep_overlap_flops = 0;
  int32_t ep_overlap_calls = 0;
  friend bool operator==(const Work&, const Work&) = default;
};

// The share of `w` (whose layers are [w.layer_begin, w.layer_end)) that covers the
// layers [begin, end) counted from w.layer_begin: every amount in proportion to the layers
// (memory effect included), call counts rounded down, at least one kernel.
Work LayerShare(const Work& w, int begin, int end);

struct WorkHash {
  size_t operator()(const Work& w) const;
};

// One pipeline position: (dp replica, pp stage); its tp*cp GPUs run in lock-step.
struct RankInfo {
  int32_t dp = 0;
  int32_t pp = 0;
  int32_t gpus = 1;       // GPUs of the rank (tp * cp)
  int32_t first_gpu = 0;  // global index of the rank's first GPU (Megatron order tp-cp-dp-pp)
  int32_t node = 0;       // node of the first GPU
  double params[3] = {0, 0, 0};  // parameters held per GPU, by module (text, vision, generator)
  // Ranks over which a module's fp32 gradients (ZeRO-2) and optimizer states (ZeRO >= 1)
  // are further sharded: text: dp; a replicated encoder: its sync group; FSDP: 1 (`params`
  // are already shards).
  double state_shard[3] = {1, 1, 1};
  // Of params[0], the 2-D weights Muon updates (training.optimizer: muon): an fp32 momentum
  // each instead of Adam's two moments.
  double muon_params = 0;
  friend bool operator==(const RankInfo&, const RankInfo&) = default;
};

// Where the pipeline's virtual stages live. Loop: chunk c of pp rank s holds global stage
// c*pp + s (Megatron, interleaved 1F1B). V: even chunks run down the ranks and odd chunks
// back up (chunk 1 of rank s holds stage 2*pp - 1 - s), so the first and last stages share
// rank 0 (ZB-V, DualPipeV).
enum class StagePlacement : uint8_t { kLoop = 0, kV = 1 };
std::string_view PlacementName(StagePlacement p);
bool ParsePlacement(std::string_view s, StagePlacement* out);
inline int32_t GlobalStage(StagePlacement p, int32_t pp, int32_t chunk, int32_t pp_rank) {
  return chunk * pp + ((p == StagePlacement::kV && chunk % 2 == 1) ? pp - 1 - pp_rank : pp_rank);
}
// The pp rank and chunk that hold global stage g.
struct StageHome {
  int32_t pp_rank, chunk;
};
inline StageHome HomeOf(StagePlacement p, int32_t pp, int32_t g) {
  const int32_t c = g / pp, s = g % pp;
  return {(p == StagePlacement::kV && c % 2 == 1) ? pp - 1 - s : s, c};
}

// Plan-wide facts the simulator and executor need without the config.
struct PlanMeta {
  std::string schedule;  // gpipe | 1f1b | interleaved-1f1b | zb-h1 | ...
  std::string modality;  // placement policy of vision/generator ops ("" if none)
  int32_t pp = 1, vp = 1, dp = 1, tp = 1, cp = 1, ep = 1;
  int32_t microbatches = 1;  // per DP replica
  int32_t gpus_per_node = 8;
  StagePlacement placement = StagePlacement::kLoop;
  int32_t global_stage(int32_t chunk, int32_t pp_rank) const {
    return GlobalStage(placement, pp, chunk, pp_rank);
  }
  StageHome home(int32_t g) const { return HomeOf(placement, pp, g); }
  double tokens_per_step = 0;   // LLM tokens processed per step (all replicas)
  double samples_per_step = 0;  // samples per step (all replicas)
  // LLM FLOPs per step as Megatron reports them: eq. (3) of Narayanan et al. (SC21),
  // generalised as Megatron-LM's num_floating_point_operations (GQA, gated FFN, MoE top-k),
  // with the recompute forward the equation assumes. All GPUs.
  double megatron_flops_per_step = 0;
  double megatron_model_flops_per_step = 0;  // the same without the recompute forward (MFU)
  std::string config_yaml;                   // the resolved config the plan was made from
  friend bool operator==(const PlanMeta&, const PlanMeta&) = default;
};

class Table {
 public:
  size_t size() const { return kind_.size(); }
  int32_t num_ranks() const { return static_cast<int32_t>(ranks_.size()); }
  OpId rank_begin(int32_t r) const { return rank_begin_[r]; }
  OpId rank_end(int32_t r) const { return rank_begin_[r + 1]; }

  int32_t rank(OpId i) const { return rank_[i]; }
  OpKind kind(OpId i) const { return kind_[i]; }
  Module module(OpId i) const { return module_[i]; }
  int32_t chunk(OpId i) const { return chunk_[i]; }
  int32_t mb(OpId i) const { return mb_[i]; }
  int32_t task(OpId i) const { return task_[i]; }
  int32_t piece(OpId i) const { return piece_[i]; }
  int32_t peer(OpId i) const { return peer_[i]; }
  // Collectives and gangs: ops matched across the ranks of group peer(i) by tag.
  bool grouped(OpId i) const { return peer_[i] >= 0 && !PeerIsRank(kind_[i]); }
  uint32_t tag(OpId i) const { return tag_[i]; }
  bool overlaps_next(OpId i) const {
    return tag_[i] == kOverlapNextTag && peer_[i] < 0 && IsCompute(kind_[i]);
  }
  WorkId work_id(OpId i) const { return work_[i]; }
  const Work& work(OpId i) const { return works_[work_[i]]; }
  std::span<const OpId> deps(OpId i) const {
    return {deps_.data() + dep_begin_[i], deps_.data() + dep_begin_[i + 1]};
  }
  // The SEND a RECV depends on (UINT32_MAX if none).
  OpId send_of(OpId recv) const {
    for (OpId d : deps(recv))
      if (IsSend(kind_[d])) return d;
    return UINT32_MAX;
  }
  OpKey key(OpId i) const;
  std::string str(OpId i) const { return FormatOp(key(i)); }

  const std::vector<RankInfo>& ranks() const { return ranks_; }
  const std::vector<Work>& works() const { return works_; }
  std::span<const int32_t> group(int32_t g) const {
    return {group_ranks_.data() + group_begin_[g], group_ranks_.data() + group_begin_[g + 1]};
  }
  int32_t num_groups() const { return static_cast<int32_t>(group_begin_.size()) - 1; }
  const PlanMeta& meta() const { return meta_; }
  PlanMeta& mutable_meta() { return meta_; }
  std::vector<Work>& mutable_works() { return works_; }
  std::span<const uint32_t> dep_list() const { return deps_; }  // every op's deps, in op order
  std::vector<uint32_t>& mutable_deps() { return deps_; }       // tests break tables by hand
  std::vector<uint32_t>& mutable_dep_begin() { return dep_begin_; }

  size_t MemoryBytes() const;
  friend bool operator==(const Table&, const Table&) = default;

 private:
  friend class TableBuilder;
  friend class TableColumns;
  Column<int32_t> rank_, chunk_, mb_, task_, peer_, piece_;
  Column<OpKind> kind_;
  Column<Module> module_;
  Column<uint32_t> tag_, work_;
  std::vector<uint32_t> dep_begin_{0}, deps_;
  std::vector<uint32_t> rank_begin_{0};
  std::vector<RankInfo> ranks_;
  std::vector<Work> works_;
  std::vector<uint32_t> group_begin_{0};
  std::vector<int32_t> group_ranks_;
  PlanMeta meta_;
};

// Builds a table from ops added in any order and per-rank sequences of them.
// Handles returned by Add are builder-local; Finish renumbers them rank-major.
class TableBuilder {
 public:
  using Handle = uint32_t;

  explicit TableBuilder(std::vector<RankInfo> ranks);
  WorkId AddWork(const Work& w);  // deduplicates identical work
  const Work& work(WorkId id) const { return works_[id]; }
  int32_t AddGroup(std::vector<int32_t> ranks);
  Handle Add(const OpKey& key, WorkId work, uint32_t tag = 0);
  // Appends op h to the end of its rank's sequence.
  void Append(Handle h) { seq_[ops_.rank_[h]].push_back(h); }
  Handle AddAndAppend(const OpKey& key, WorkId work, uint32_t tag = 0) {
    Handle h = Add(key, work, tag);
    Append(h);
    return h;
  }
  void AddDep(Handle op, Handle on) { edges_.push_back({op, on}); }
  // Sizes the op columns for `ops` ops in all: handles from size() to ops - 1 are then set
  // with Set (from several threads, each on its own handles and ranks: Append) and become
  // ops as if added in handle order. Each must be set: the new handles' columns are unset
  // (their memory is taken as they are set).
  void Resize(size_t ops);
  void Set(Handle h, const OpKey& key, WorkId work, uint32_t tag = 0);
  // Adds `deps` (op, on) in order, as AddDep one after another would.
  void AddDeps(std::vector<std::pair<Handle, Handle>> deps);
  std::vector<std::vector<Handle>>& sequences() { return seq_; }
  OpKey key(Handle h) const { return ops_.key(h); }
  size_t size() const { return ops_.size(); }
  // Fails if an added op is not in exactly one sequence. Leaves the builder without ops.
  // When ops were added in rank-major sequence order, their columns become the table's
  // as they are (no copy); otherwise they are permuted one column at a time.
  StatusOr<Table> Finish(PlanMeta meta);

 private:
  std::vector<RankInfo> ranks_;
  Table ops_;  // the ops added, by handle: their columns (rank, kind, ..., tag, work)
  std::vector<std::vector<Handle>> seq_;
  std::vector<std::pair<Handle, Handle>> edges_;
  std::vector<Work> works_;
  std::unordered_map<Work, WorkId, WorkHash> work_index_;
  std::vector<uint32_t> group_begin_{0};
  std::vector<int32_t> group_ranks_;
};

// Raw column access for serialisation (core/table_io.cc) only.
class TableColumns {
 public:
  explicit TableColumns(Table* t) : t_(t) {}
  auto& rank() { return t_->rank_; }
  auto& kind() { return t_->kind_; }
  auto& module() { return t_->module_; }
  auto& chunk() { return t_->chunk_; }
  auto& mb() { return t_->mb_; }
  auto& task() { return t_->task_; }
  auto& piece() { return t_->piece_; }
  auto& peer() { return t_->peer_; }
  auto& tag() { return t_->tag_; }
  auto& work() { return t_->work_; }
  auto& dep_begin() { return t_->dep_begin_; }
  auto& deps() { return t_->deps_; }
  auto& rank_begin() { return t_->rank_begin_; }
  auto& ranks() { return t_->ranks_; }
  auto& works() { return t_->works_; }
  auto& group_begin() { return t_->group_begin_; }
  auto& group_ranks() { return t_->group_ranks_; }
  auto& meta() { return t_->meta_; }
  // Structural checks after loading untrusted data: lengths, id ranges, rank-major order.
  Status CheckConsistent() const;

 private:
  Table* t_;
};

}  // namespace pipeplan
