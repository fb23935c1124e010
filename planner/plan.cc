#include "planner/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <functional>
#include <future>
#include <limits>
#include <list>
#include <mutex>
#include <numeric>
#include <optional>
#include <system_error>
#include <tuple>
#include <unordered_map>

#include "core/memory.h"
#include "planner/data.h"
#include "planner/list_schedule.h"
#include "planner/lower.h"
#include "planner/modality.h"
#include "planner/placement.h"
#include "planner/schedules.h"
#include "planner/workload.h"
#include "simulator/engine.h"
#include "simulator/memory.h"

namespace pipeplan {
namespace {

constexpr double kGiB = 1024.0 * 1024 * 1024;

bool Multimodal(const Config& c) {
  return c.model.vision.enabled || c.model.generator.enabled;
}

// Timing inputs of the list scheduler: text compute per global stage, p2p transfers
// between neighbouring ranks, the generator's work on the last stage, each vision task.
// Whether the ranks of replica d's stages span more than one node.
bool ReplicaAcrossNodes(const PipelineShape& shape, const std::vector<RankInfo>& ranks, int d) {
  for (int s = 1; s < shape.pp; ++s)
    if (ranks[shape.rank(d, s)].node != ranks[shape.rank(d, 0)].node) return true;
  return false;
}

// The text work of a step of global stage g.
const Work& StepWork(const TextWorkload& tw, const Step& st, int g) {
  const std::vector<Work>& of = st.kind == OpKind::kF   ? tw.f
                                : st.kind == OpKind::kI ? tw.i
                                : st.kind == OpKind::kW ? tw.w
                                                        : tw.b;
  return of[g];
}

ListInput ListInputOf(const Config& c, const PipelineShape& shape,
                      const std::vector<StageOrder>& orders, const TextWorkload& tw,
                      const std::vector<RankInfo>& ranks, const ModalityWork& w, bool sharded) {
  const CostModel cost = CostModel::Real(c.cluster.spec);
  const int gpus = c.parallel.tp * c.parallel.cp, gpn = c.cluster.gpus_per_node;
  auto compute = [&](const Work& work, bool across = false) {
    return cost.ComputeSeconds(work, gpus, c.parallel.tp, c.parallel.ep, gpn, across);
  };
  ListInput in;
  in.shape = shape;
  in.orders = orders;
  for (int g = 0; g < shape.stages(); ++g) {
    in.f_s.push_back(compute(tw.f[g]));
    in.b_s.push_back(compute(tw.b[g]));
    in.i_s.push_back(compute(tw.i[g]));
    in.w_s.push_back(compute(tw.w[g]));
  }
  // Overlapped pairs timed as the simulator times them.
  auto parts = [&](int s, const Step& st) {
    return cost.ComputeParts(StepWork(tw, st, shape.global(st.chunk, s)), gpus, c.parallel.tp,
                             c.parallel.ep, gpn);
  };
  for (int s = 0; s < shape.pp; ++s)
    for (size_t i = 0; i + 1 < orders[s].size(); ++i)
      if (orders[s][i].overlap_next) {
        if (in.pair_s.empty())
          for (const StageOrder& o : orders) in.pair_s.emplace_back(o.size(), -1.0);
        std::tie(in.pair_s[s][i], in.pair_s[s][i + 1]) =
            CostModel::PairSeconds(parts(s, orders[s][i]), parts(s, orders[s][i + 1]));
      }
  in.next_p2p_s.assign(ranks.size(), 0.0);
  for (size_t r = 0; r + 1 < ranks.size(); ++r)
    in.next_p2p_s[r] = cost.P2PSeconds(tw.p2p_bytes, ranks[r].node == ranks[r + 1].node);
  if (!w.generator.empty() && sharded) {
    in.gen_shard_s.assign(static_cast<size_t>(shape.dp) * shape.m, -1.0);
    for (const GeneratorTask& t : w.generator) {
      const bool across = ReplicaAcrossNodes(shape, ranks, t.d);
      const PieceWork p = GeneratorShard(c, t, shape.pp, across);
      in.gen_shard_s[static_cast<size_t>(t.d) * shape.m + t.mb] =
          compute(p.f, across) + compute(p.b, across);
    }
    in.gen_in_s.assign(ranks.size(), 0.0);
    for (size_t r = 0; r < ranks.size(); ++r) {
      const int last =
          shape.rank(static_cast<int>(r) / shape.pp, shape.home(shape.stages() - 1).pp_rank);
      if (static_cast<int>(r) != last)
        in.gen_in_s[r] = cost.P2PSeconds(tw.p2p_bytes, ranks[r].node == ranks[last].node);
    }
  } else if (!w.generator.empty()) {
    in.after_last_f_s.assign(static_cast<size_t>(shape.dp) * shape.m, 0.0);
    for (const GeneratorTask& t : w.generator)
      in.after_last_f_s[static_cast<size_t>(t.d) * shape.m + t.mb] = compute(t.f) + compute(t.b);
  }
  for (const VisionTask& t : w.vision) {
    bool across = false;
    for (int r : t.gang_ranks) across = across || ranks[r].node != ranks[t.rank].node;
    in.vf_s.push_back(compute(t.f, across));
    in.vb_s.push_back(compute(t.b, across) + (t.recompute.flops > 0 ? compute(t.recompute) : 0));
    in.bytes.push_back(t.act_bytes + t.out_bytes);
    in.largest_whole_bytes = std::max(in.largest_whole_bytes,
                                      in.bytes.back() * std::max<size_t>(1, t.gang_ranks.size()));
    const int consumer = shape.rank(t.d, 0);
    in.out_s.push_back(t.rank == consumer ? 0
                                          : cost.P2PSeconds(t.out_bytes, ranks[t.rank].node ==
                                                                             ranks[consumer].node));
  }
  return in;
}

// Text rounds a micro-batch's encoder work may run ahead of its consumer (nested's window,
// and the latency budget of dynamic CP): `schedule.modality_window`, else 2 pp, the rounds
// an activation of 1F1B's first stage lives (pp) and as many again for the encoder.
int ModalityWindow(const Config& c) {
  return c.schedule.modality_window > 0 ? c.schedule.modality_window : 2 * c.parallel.pp;
}

// Micro-batches the first stage holds between its text F and B of chunk 0 at most (1F1B:
// pp; interleaved: more): encoder outputs cannot be freed sooner.
int InFlight(const StageOrder& first_stage) {
  int alive = 0, most = 0;
  for (const Step& st : first_stage)
    if (st.chunk == 0) most = std::max(most, alive += st.kind == OpKind::kF ? 1 : -1);
  return most;
}

// The list scheduler's rules for a policy (list_schedule.h).
// Nested: a forward runs at most `window` rounds ahead of its consumer, a backward is due
// once the consumer's text backward is `window` micro-batches further, and each rank holds
// at most a budget of encoder activations: `schedule.modality_budget_gib`, else the mean
// encoder bytes per GPU and round times (the first stage's micro-batches in flight +
// window) plus the largest image's (a gang's shards together: the same budget whichever way
// a sizing cuts the images; with the largest task's, a sizing that splits the largest
// images over gangs got less room than one that keeps them whole, 8.64 against 9.98 GiB
// on the understanding workload under ZBV at 16 micro-batches, and lost 3.4 % to that
// alone). A task's activations live from its forward, up to
// `window` rounds before its consumer's text forward, to its backward after the
// consumer's text backward, which comes when the micro-batch leaves the first stage (for
// 1F1B and the default window, 3 pp rounds; the same for any micro-batch count, so the
// peak stays flat).
// Bubble-fill: every gap, whole-image forwards move to ranks in a gap. Optimus: forwards
// only until a rank's first text backward, backwards only after its last text forward
// (Optimus's encoder state of every micro-batch is kept).
ListRules RulesOf(const Config& c, ModalityPolicy policy, const ListInput& in) {
  ListRules r;
  if (policy == ModalityPolicy::kNested) {
    r.window = r.backward_window = ModalityWindow(c);
    if (c.schedule.modality_budget_gib > 0) {
      r.memory_budget_bytes = c.schedule.modality_budget_gib * kGiB;
    } else {
      const double total = std::accumulate(in.bytes.begin(), in.bytes.end(), 0.0);
      const double rounds = double(in.shape.m) * in.shape.dp * in.shape.pp;  // per GPU
      r.memory_budget_bytes =
          (InFlight(in.orders[0]) + r.window) * total / rounds + in.largest_whole_bytes;
    }
  }
  r.steal = r.fill_gangs = policy == ModalityPolicy::kBubbleFill;
  r.phases = policy == ModalityPolicy::kOptimus;
  return r;
}

// Per pipeline stage, the compute seconds of one round of its text ops (each chunk's
// forward and backward).
std::vector<double> TextRoundSeconds(const Config& c, const PipelineShape& shape,
                                     const TextWorkload& tw) {
  const CostModel cost = CostModel::Real(c.cluster.spec);
  const int gpus = c.parallel.tp * c.parallel.cp;
  std::vector<double> round(shape.pp, 0);
  for (int s = 0; s < shape.pp; ++s)
    for (int ch = 0; ch < shape.vp; ++ch) {
      const int g = shape.global(ch, s);
      for (const Work* w : {&tw.f[g], &tw.b[g]})
        round[s] +=
            cost.ComputeSeconds(*w, gpus, c.parallel.tp, c.parallel.ep, c.cluster.gpus_per_node);
    }
  return round;
}

// Latency budget of an image under the pipelined policies: its forward may start `window`
// text rounds (one micro-batch's text F and B on the busiest stage) before its consumer
// needs it, so an image that takes no longer is not split (dynamic CP would only add
// gather-KV and a gang to synchronise).
double PipelinedBudget(const Config& c, const std::vector<double>& text_round_s) {
  return ModalityWindow(c) * *std::max_element(text_round_s.begin(), text_round_s.end());
}

// The shortest text forward: the grain of the text-only timeline's index for the timed
// placement.
double PieceQuantum(const ListInput& in) {
  return *std::min_element(in.f_s.begin(), in.f_s.end());
}

// The longest a layer-group piece may take: the shortest text forward (a piece then never
// stalls the pipeline by more than one text op), or the shortest gap the pipeline's steady
// state leaves where that is shorter: a pipeline rank whose round (its chunks' text F and B)
// is shorter than the slowest rank's idles the difference every round, and pieces that fit
// it fill it. Gaps under a quarter of the shortest text forward are not followed: pieces are
// never cut finer than that (at most four times as many pieces as the text forward asks).
double PieceSeconds(const ListInput& in) {
  const double shortest = PieceQuantum(in);
  std::vector<double> round(in.shape.pp, 0);
  for (int g = 0; g < in.shape.stages(); ++g)
    round[in.shape.home(g).pp_rank] += in.f_s[g] + in.b_s[g];
  const double slowest = *std::max_element(round.begin(), round.end());
  double piece = shortest;
  for (double r : round)
    if (slowest - r >= shortest / 4) piece = std::min(piece, slowest - r);
  return piece;
}

// Layer-group pieces: each task is cut into the fewest layer groups whose forward and
// backward each take no longer than PieceSeconds (as many layers per group as fit, at
// least one; the groups as even as the layer count allows, so none holds more).
std::vector<std::vector<int>> PieceBounds(const Config& c, const ListInput& in) {
  const double quantum = PieceSeconds(in);
  const int layers = c.model.vision.layers;
  std::vector<std::vector<int>> bounds(in.vf_s.size());
  for (size_t i = 0; i < bounds.size(); ++i) {
    const double per_layer = std::max(in.vf_s[i], in.vb_s[i]) / layers;
    int n = 1;
    if (quantum > 0 && per_layer * layers > quantum) {
      const int fit = std::max(1, static_cast<int>(std::floor(quantum / per_layer)));
      n = std::min((layers + fit - 1) / fit, kMaxPieces);
    }
    for (int k = 0; k <= n; ++k) bounds[i].push_back(k * layers / n);
  }
  return bounds;
}

// Per rank, the encoder activation bytes per GPU its device memory has room for: the HBM
// less the rank's static bytes (weights, gradients, optimizer states, reserve) and the peak
// of its text activations over its schedule order (a generator's not counted); empty
// without a capacity. Empty too when a rank has no room for `largest` (the largest task's
// bytes): the plan is then out of memory whatever the placement, and waiting for room
// would only slow it.
std::vector<double> EncoderRoom(const Config& c, const PipelineShape& shape,
                                const std::vector<StageOrder>& orders, const TextWorkload& tw,
                                const std::vector<RankInfo>& ranks, double largest) {
  const MemoryOptions o = SimOptionsFor(c).memory;
  if (o.hbm_bytes <= 0) return {};
  std::vector<double> text_peak(shape.pp, 0);
  for (int s = 0; s < shape.pp; ++s) {
    double alive = 0;
    for (const Step& st : orders[s]) {
      alive += StepWork(tw, st, shape.global(st.chunk, s)).mem_delta_bytes;
      text_peak[s] = std::max(text_peak[s], alive);
    }
  }
  std::vector<double> chunk_params(shape.pp, 0);  // the largest chunk of each pipeline rank
  for (int s = 0; s < shape.pp; ++s)
    for (int k = 0; k < shape.vp; ++k)
      chunk_params[s] = std::max(chunk_params[s], tw.params_per_gpu[shape.global(k, s)]);
  std::vector<double> room;
  for (const RankInfo& ri : ranks) {
    double host;
    const auto fixed = StaticMemory(ri, shape.vp, chunk_params[ri.pp], o, &host);
    const double left =
        o.hbm_bytes - std::accumulate(fixed.begin(), fixed.end(), 0.0) - text_peak[ri.pp];
    if (left < largest) return {};
    room.push_back(left);
  }
  return room;
}

// Nested's alternatives: its rules, with Optimus's phases, and, when no window was asked
// for, its budget alone without windows (with and without phases); each within `room`
// (EncoderRoom).
std::vector<ListRules> NestedAlternatives(const Config& c, const ListInput& in,
                                          const std::vector<double>& room) {
  ListRules nested = RulesOf(c, ModalityPolicy::kNested, in);
  nested.memory_room_bytes = room;
  std::vector<ListRules> all{nested};
  nested.phases = true;
  all.push_back(nested);
  if (c.schedule.modality_window == 0) {
    nested.window = nested.backward_window = 0;
    all.push_back(nested);
    nested.phases = false;
    all.push_back(nested);
  }
  return all;
}

// The rule sets a probe of nested runs on a sizing of the images: its own rules and, when
// no window was asked for, its budget alone (NestedAlternatives' last). On some images the
// windows cost more than they save there, and a probe of the windowed rules alone would
// pass over a sizing nested's search keeps (`configs/default.yaml` under interleaved ZB,
// vp 2, 32 micro-batches: 3.17 s against 2.94 s).
std::vector<ListRules> NestedProbes(const Config& c, const ListInput& in,
                                    const std::vector<double>& room) {
  const std::vector<ListRules> nested = NestedAlternatives(c, in, room);
  std::vector<ListRules> all{nested.front()};
  if (c.schedule.modality_window == 0) all.push_back(nested.back());
  return all;
}

// The rule sets the list scheduler tries for a policy (the search keeps the fastest): the
// policy's own; nested's alternatives for nested and bubble-fill (it may keep Optimus's
// phases under its windows and budget, and, when no window was asked for, let its budget
// alone bound the memory); bubble-fill's own again without moving tasks, and moving them
// without starting gangs only in common gaps. Nested's and bubble-fill's sets keep every
// rank's encoder activations within `room` (EncoderRoom; Optimus keeps its encoder state).
std::vector<ListRules> Alternatives(const Config& c, ModalityPolicy policy, const ListInput& in,
                                    const std::vector<double>& room, bool move_tail) {
  std::vector<ListRules> all{RulesOf(c, policy, in)};
  if (policy == ModalityPolicy::kNested || policy == ModalityPolicy::kBubbleFill) {
    const std::vector<ListRules> nested = NestedAlternatives(c, in, room);
    all.insert(all.end(), nested.begin(), nested.end());
    all[0].memory_room_bytes = room;
  }
  if (policy != ModalityPolicy::kBubbleFill) return all;
  ListRules own = all[0];
  own.steal = false;
  all.push_back(own);
  own.steal = true, own.fill_gangs = false;
  all.push_back(own);
  for (ListRules& r : all) r.move_tail = move_tail;
  return all;
}

// The list-scheduled placement of a policy: its alternatives (above), the shortest
// predicted step kept (so bubble-fill's prediction is never above nested's on the same
// images). `text`: the text-only pass.
// `nested_s` (bubble-fill): nested's own predicted step on these images (its alternatives,
// in the same room); `nested_kept`: the placement kept is nested's own before any tail
// move (one of those runs).
StatusOr<ListResult> PlaceListed(const Config& c, ModalityPolicy policy, const ListInput& in,
                                 const ModalityWork& w, const TextTimeline& text,
                                 const std::vector<double>& room, bool move_tail,
                                 double* nested_s = nullptr, bool* nested_kept = nullptr) {
  const std::vector<ListRules> all = Alternatives(c, policy, in, room, move_tail);
  if (policy != ModalityPolicy::kBubbleFill) return ScheduleModality(in, w, all, text);
  ASSIGN_OR_RETURN(ListResult placed, ScheduleModality(in, w, all, text));
  if (nested_s) {  // nested's alternatives come after bubble-fill's own, in the same room
    const int n = static_cast<int>(NestedAlternatives(c, in, room).size());
    const auto first = placed.alternative_s.begin() + 1;
    *nested_s = *std::min_element(first, first + n);
    if (nested_kept) *nested_kept = placed.alternative >= 1 && placed.alternative < 1 + n;
  }
  return placed;
}

// What tells two sizings of the same images apart: per vision task its rank, gang and
// forward FLOPs (equal keys: the same tasks). A few numbers per task, where a copy of the
// sizing's work would hold all of its tasks' work.
std::vector<double> VisionTasksKey(const ModalityWork& w) {
  std::vector<double> key;
  for (const VisionTask& v : w.vision) {
    key.push_back(v.rank);
    key.push_back(static_cast<double>(v.gang_ranks.size()));
    key.insert(key.end(), v.gang_ranks.begin(), v.gang_ranks.end());
    key.push_back(v.f.flops);
    key.push_back(v.f.attn_flops);
  }
  return key;
}

// The largest sub-groups of the search's sizings with smaller gangs (AddModality): each
// halving of `cp_max_group` down to a rank's own GPUs (tp x cp), exclusive.
std::vector<int> SmallerGangs(const Config& c) {
  const int cp_max = c.model.vision.cp_max_group;
  const int own_gpus = std::min(cp_max, c.parallel.tp * c.parallel.cp);
  std::vector<int> sizes;
  for (int g = cp_max / 2; g > own_gpus; g /= 2) sizes.push_back(g);
  return sizes;
}

// Sizings of the images that do not depend on the policy (AddModality): dynamic CP's (0),
// the five others the search tries (1 to 5) and two per smaller gang size.
size_t SharedSizings(const Config& c) {
  return 6 + 2 * SmallerGangs(c).size();
}

// The fields plans read: all but the file name and the stored YAML.
bool SameInputs(const Config& a, const Config& b) {
  return a.cluster == b.cluster && a.model == b.model && a.parallel == b.parallel &&
         a.training == b.training && a.data == b.data && a.schedule == b.schedule;
}

}  // namespace

struct PlanShare::Impl {
  // The parts the list-scheduled policies share for one config (key: its policy nested).
  struct Parts {
    Config key;
    std::mutex mu;
    std::shared_ptr<const TextTimeline> text;
    std::vector<std::shared_ptr<const ModalityWork>> sized;  // SharedSizings(key) of them
  };
  struct Kept {
    Config key;  // with its policy
    ModalityChoice choice;
  };
  size_t parts_kept = 0, choices_kept = 0;
  std::mutex mu;
  std::list<std::shared_ptr<Parts>> parts;  // most recently used first
  std::list<Kept> choices;                  // most recently used first
  std::atomic<size_t> timelines{0}, sizings{0}, kept{0};

  // Null when no parts are kept.
  std::shared_ptr<Parts> PartsOf(const Config& c) {
    if (parts_kept == 0) return nullptr;
    Config key = c;
    key.schedule.modality = ModalityPolicy::kNested;
    key.source.clear(), key.resolved_yaml = YamlText();
    std::lock_guard<std::mutex> lock(mu);
    for (auto it = parts.begin(); it != parts.end(); ++it)
      if (SameInputs((*it)->key, key)) {
        parts.splice(parts.begin(), parts, it);
        return parts.front();
      }
    parts.push_front(std::make_shared<Parts>());
    parts.front()->sized.resize(SharedSizings(key));
    parts.front()->key = std::move(key);
    if (parts.size() > parts_kept) parts.pop_back();
    return parts.front();
  }
  std::optional<ModalityChoice> ChoiceOf(const Config& c) {
    if (choices_kept == 0) return std::nullopt;
    std::lock_guard<std::mutex> lock(mu);
    for (auto it = choices.begin(); it != choices.end(); ++it)
      if (SameInputs(it->key, c)) {
        choices.splice(choices.begin(), choices, it);
        ++kept;
        return it->choice;
      }
    return std::nullopt;
  }
  void Keep(const Config& c, const ModalityChoice& choice) {
    if (choices_kept == 0) return;
    std::lock_guard<std::mutex> lock(mu);
    for (const Kept& k : choices)
      if (SameInputs(k.key, c)) return;  // another thread's search of the same config
    choices.push_front({c, choice});
    choices.front().key.source.clear(), choices.front().key.resolved_yaml = YamlText();
    if (choices.size() > choices_kept) choices.pop_back();
  }
};

PlanShare::PlanShare(size_t parts, size_t choices) : impl_(std::make_unique<Impl>()) {
  impl_->parts_kept = parts, impl_->choices_kept = choices;
}
PlanShare::~PlanShare() = default;
PlanShare::Reused PlanShare::reused() const {
  return {impl_->timelines.load(), impl_->sizings.load(), impl_->kept.load()};
}

namespace {

// The part `slot` of `parts` (null: nothing shared), made by `make` (which returns a
// StatusOr<T>) where no plan has made it yet; `count` counts the reuses.
template <typename T, typename Make>
StatusOr<T> SharedPart(PlanShare::Impl::Parts* parts, std::shared_ptr<const T>* slot,
                       std::atomic<size_t>* count, Make make) {
  if (!parts) return make();
  {
    std::lock_guard<std::mutex> lock(parts->mu);
    if (*slot) return ++*count, **slot;
  }
  ASSIGN_OR_RETURN(T made, make());
  std::lock_guard<std::mutex> lock(parts->mu);
  if (!*slot) *slot = std::make_shared<const T>(made);
  return made;
}

// What a plan's placement is given and reports besides its config, all optional.
struct PlanHooks {
  // The sizing, rule set and room repairs (ModalityChoice) to place the images with.
  const ModalityChoice* hint = nullptr;
  ModalityChoice* chosen = nullptr;    // receives those the search kept (or the hint)
  bool* nested_close = nullptr;        // see AddModality
  TextTimeline* text_cache = nullptr;  // the text-only timeline of earlier steps, or empty
  PlanShare::Impl* share = nullptr;
  bool tail_moves = true;      // bubble-fill may move images off the tail (ListRules::move_tail)
  bool* tail_moved = nullptr;  // receives whether the placement kept moved any
  // Receives the room of the kept sizing's tasks before any repair (nested, bubble-fill).
  struct Room {
    std::vector<double> per_rank;  // EncoderRoom; empty: none
    double largest = 0;            // the largest task's bytes: no repair goes below it
    // Whether the room left after taking `a` off differs from it after taking `b` off.
    bool Differs(const std::vector<double>& a, const std::vector<double>& b) const {
      auto left = [&](const std::vector<double>& less, size_t r) {
        return std::max(largest, per_rank[r] - (r < less.size() ? less[r] : 0.0));
      };
      for (size_t r = 0; r < per_rank.size(); ++r)
        if (left(a, r) != left(b, r)) return true;
      return false;
    }
  };
  Room* room = nullptr;
  // Set, with the hint (one rule set): the list scheduler's second pass, which mostly only
  // shows that the first pass's placement is kept, runs beside the lowering of that
  // placement (Speculation); where it is faster the plan is made again, without this, and
  // *lowered_again is set.
  bool* lowered_again = nullptr;
};

// The list scheduler's first pass lowered before its second is known not to be faster
// (PlanHooks::lowered_again): the second pass's inputs, and whether it is faster, found on
// another thread. The result is declared last: its destruction waits for the thread, which
// reads the rest.
struct Speculation {
  ListInput in;
  ModalityWork w;
  ListRules rules;
  std::vector<double> deadline;
  std::future<StatusOr<bool>> faster;
};

// The list scheduler's predictions of two placements can be misordered by this much (over
// the multimodal seed configs under five schedules at 8 to 64 micro-batches, the largest
// reversal seen was 0.2 %, between predictions 0.01 % apart).
constexpr double kListMargin = 0.01;
// A sizing's first pass (its probe) can end well above what its search finds while another
// sizing is at its best on its first pass: `configs/default.yaml` under interleaved 1F1B at
// 64 micro-batches, the images without gangs balanced against the text probe at 6.51 s, 3.4
// % above the gangs' 6.29 s, and their search finds 5.94 s. Under nested and optimus a
// sizing whose probe comes within this margin of the best probe is searched too (not under
// bubble-fill, which compares its plan with nested's and is searched on far larger jobs;
// its estimate of nested's prediction searches them as nested would).
constexpr double kProbeMargin = 0.05;

// `outputs`: per work id, the bytes of its forward's output that stay on the device for
// their consumer (the encoder's output; not saved activations), where not zero.
// `h.hint`: the sizing and rule set to place the images with, no search; `h.chosen`
// receives those the search kept (or the hint). `h.text_cache`: the text-only timeline of
// earlier steps (see below), or empty. `h.nested_close` (bubble-fill): set when nested's
// own placement is predicted within kListMargin of the one kept before its tail moves, or
// faster (its rules in the same room); only a search sets it (with `h.hint` it is
// left as it is). `h.share`: the text-only timeline and the sizings of other
// list-scheduled policies' plans of the config.
Status AddModality(const Config& c, const PipelineShape& shape, const StepBatch& batch,
                   const std::vector<StageOrder>& orders, const TextWorkload& tw,
                   const TextWorkIds& text_work, const std::vector<RankInfo>& ranks,
                   TableBuilder* b, std::vector<RankSeq>* seqs,
                   std::unordered_map<WorkId, double>* outputs, const PlanHooks& h,
                   Speculation* speculation) {
  const ModalityChoice* hint = h.hint;
  TextTimeline* text_cache = h.text_cache;
  const ModalityPolicy policy = c.schedule.modality;
  const bool decoupled = policy == ModalityPolicy::kDecoupled;
  // Nested, bubble-fill and optimus are placed by the list scheduler; the generator is
  // then split over its replica's ranks.
  const bool listed = policy == ModalityPolicy::kNested || policy == ModalityPolicy::kBubbleFill ||
                      policy == ModalityPolicy::kOptimus;
  VisionPool pool;
  pool.consumer_only = policy == ModalityPolicy::kInline;
  const std::vector<double> text_round_s =
      listed ? TextRoundSeconds(c, shape, tw) : std::vector<double>{};
  if (listed) {
    pool.latency_budget_s = PipelinedBudget(c, text_round_s);
    pool.window_rounds = ModalityWindow(c);
  }
  // Without a generator (whose work is the step's own) the text-only timeline depends on
  // the config alone: `text_cache` keeps it from one step to the next. Given it and another
  // sizing to use, the images are sized that way only.
  const bool cacheable = listed && text_cache && !c.model.generator.enabled;
  const bool cached = cacheable && !text_cache->due.empty();
  const bool sized_only = cached && hint && hint->sizing > 0;
  // The list-scheduled policies place the same images against the same text.
  const std::shared_ptr<PlanShare::Impl::Parts> parts =
      listed && h.share ? h.share->PartsOf(c) : nullptr;
  // The images in the search's sizing `sizing` (below), `make` where no plan made it yet.
  auto shared_work = [&](int sizing, auto make) {
    return SharedPart<ModalityWork>(parts.get(), parts ? &parts->sized[sizing] : nullptr,
                                    h.share ? &h.share->sizings : nullptr, make);
  };
  ModalityWork w;
  if (!sized_only) {
    ASSIGN_OR_RETURN(w, shared_work(0, [&]() -> StatusOr<ModalityWork> {
                       return BuildModalityWork(c, batch, pool,
                                                decoupled && c.schedule.decoupled_recompute);
                     }));
  }
  const bool sharded = listed && !w.generator.empty() && shape.pp > 1;
  std::vector<VisionPlacement> vision;
  std::vector<std::vector<GeneratorPlacement>> shards;
  std::vector<std::vector<int>> bounds;  // listed: each task's layer-group pieces
  switch (policy) {
    case ModalityPolicy::kInline:
      vision = PlaceVisionInline(shape, w);
      break;
    case ModalityPolicy::kDecoupled:
      vision = PlaceVisionDecoupled(shape, w, c.schedule.decoupled_recompute);
      break;
    case ModalityPolicy::kNested:
    case ModalityPolicy::kBubbleFill:
    case ModalityPolicy::kOptimus:
      if (sized_only || !w.vision.empty() || sharded) {
        auto input_of = [&](const ModalityWork& x) {
          ListInput xin = ListInputOf(c, shape, orders, tw, ranks, x, sharded);
          xin.bounds = PieceBounds(c, xin);
          return xin;
        };
        ListInput in = input_of(w);
        const bool timed_too =
            policy == ModalityPolicy::kBubbleFill && !w.vision.empty() && TimedPlacementFits(c);
        TextTimeline tl;
        if (cached) {
          tl = *text_cache;
        } else {
          ASSIGN_OR_RETURN(tl, SharedPart<TextTimeline>(parts.get(), parts ? &parts->text : nullptr,
                                                        h.share ? &h.share->timelines : nullptr,
                                                        [&] { return ScheduleText(in); }));
        }
        // Nested's and bubble-fill's room, less what a repair took off (PlanHooks).
        auto room_before = [&](const ListInput& x) {
          PlanHooks::Room room;
          if (policy == ModalityPolicy::kOptimus) return room;
          room.largest = x.bytes.empty() ? 0 : *std::max_element(x.bytes.begin(), x.bytes.end());
          room.per_rank = EncoderRoom(c, shape, orders, tw, ranks, room.largest);
          return room;
        };
        auto room_for = [&](const ListInput& x) {
          PlanHooks::Room before = room_before(x);
          std::vector<double> room = std::move(before.per_rank);
          if (hint)
            for (size_t r = 0; r < room.size() && r < hint->room_less.size(); ++r)
              room[r] = std::max(before.largest, room[r] - hint->room_less[r]);
          return room;
        };
        // Dynamic CP sizes the images by their shard times, which say nothing of what a
        // gang costs in the pipeline (each of its ranks reaches it between its own text
        // ops; the first waits for the others) or of how evenly the ranks' encoder work
        // then falls. Other sizings of the same images are placed too and kept where
        // the step is shorter: K3's rule alone (the round's per-GPU share as the target,
        // not raised to the latency budget: more gangs), no gangs (images split only
        // over a rank's own GPUs), and dynamic CP's sizing, K3's rule and no gangs with each
        // round's images balanced against the text (VisionPool::text_round_s: ranks with
        // less text take more encoder work); a sizing that makes the same tasks as one
        // before is skipped. A probe comes first: one pass of the policy's own rules
        // (alternative 0 of the search; deadlines from the text-only timeline; nested's
        // also without windows, NestedProbes); the search runs on a sizing only where the
        // probe beats those first passes on the sizings before (comes within kProbeMargin
        // of them under nested and optimus). Sizing 0 is dynamic CP's, 1 to 5 these, then
        // the smaller gangs (below), the last the timed placement's (below).
        VisionPool k3_rule = pool;
        k3_rule.latency_budget_s = 0;
        VisionPool balanced = pool, k3_balanced = k3_rule;
        balanced.text_round_s = k3_balanced.text_round_s = text_round_s;
        const int cp_max = c.model.vision.cp_max_group;
        const int own_gpus = std::min(cp_max, c.parallel.tp * c.parallel.cp);
        std::vector<std::pair<int, VisionPool>> sizings = {// (cp_max_group, pool)
                                                           {cp_max, k3_rule},
                                                           {own_gpus, pool},
                                                           {cp_max, balanced},
                                                           {cp_max, k3_balanced}};
        if (own_gpus != cp_max) sizings.push_back({own_gpus, balanced});  // else sizing 3
        // Smaller gangs: K3's rule (alone and balanced) with each halving of the largest
        // sub-group down to a rank's own GPUs. A gang holds its ranks together from the
        // first arrival to the slowest shard's end; ranks of other stages or other replicas
        // reach it at different points of their text, and a large gang can idle most of
        // the job while one image's forward is due (`configs/default.yaml` with
        // `data.seed=162`: gangs of 8 span all four stages, `nested` 1.057 s against
        // `decoupled`'s 0.951 s; with gangs of at most 2 it takes 0.942 s).
        for (int g : SmallerGangs(c))
          sizings.push_back({g, k3_rule}), sizings.push_back({g, k3_balanced});
        const int timed_sizing = static_cast<int>(sizings.size()) + 1;
        auto sized_work = [&](int sizing) {
          return shared_work(sizing, [&]() -> StatusOr<ModalityWork> {
            const auto& [cp_max_group, sized_pool] = sizings[sizing - 1];
            Config sized = c;
            sized.model.vision.cp_max_group = cp_max_group;
            return BuildModalityWork(sized, batch, sized_pool, false);
          });
        };
        auto timed_work = [&] {  // the images on the stages idle when they are due
          tl.Index(PieceQuantum(in));
          VisionPool timed = pool;
          timed.timeline = &tl;
          return BuildModalityWork(c, batch, timed, false);
        };
        ListResult placed;
        bool nested_kept = false;
        double nested_s = 0;
        // Not with host copies: they are placed by the compute ops' times in the same plan
        // without them, whose room differs, and so could its moves.
        const bool tail_moves = h.tail_moves && !OffloadsAny(c);
        if (hint) {  // the sizing and rule set given: no search
          if (hint->sizing < 0 || hint->sizing > timed_sizing ||
              (!hint->room_less.empty() && hint->room_less.size() != ranks.size()))
            return Internal("a modality choice of another plan");
          if (hint->sizing == timed_sizing) {
            w = timed_work();
          } else if (hint->sizing > 0) {
            ASSIGN_OR_RETURN(w, sized_work(hint->sizing));
          }
          if (hint->sizing > 0) in = input_of(w);
          const std::vector<ListRules> all =
              Alternatives(c, policy, in, room_for(in), hint->tail_moves && !OffloadsAny(c));
          if (hint->rules < 0 || hint->rules >= static_cast<int>(all.size()))
            return Internal("a modality choice of another plan");
          ListRules rules = all[hint->rules];
          const bool speculate = speculation && rules.passes > 1;
          if (speculate) rules.passes = 1;
          ASSIGN_OR_RETURN(placed, ScheduleModality(in, w, {rules}, tl));
          if (speculate) {
            Speculation& s = *speculation;
            s.in = in, s.w = w, s.rules = all[hint->rules];
            s.deadline = std::move(placed.next_deadline);
            auto second = [&s, first = placed.unmoved_s] {
              return NextPassFaster(s.in, s.w, s.rules, s.deadline, first);
            };
            try {
              s.faster = std::async(std::launch::async, second);
            } catch (const std::system_error&) {  // no thread to be had: at the join
              s.faster = std::async(std::launch::deferred, second);
            }
          }
          if (h.chosen) *h.chosen = *hint;
        } else {
          const std::vector<double> room = room_for(in);
          ASSIGN_OR_RETURN(
              placed, PlaceListed(c, policy, in, w, tl, room, tail_moves, &nested_s, &nested_kept));
          int sizing_kept = 0;
          const bool bubble = policy == ModalityPolicy::kBubbleFill;
          constexpr double kNever = std::numeric_limits<double>::infinity();
          // The probes of nested on a sizing (NestedProbes), as rule sets of `oin`, bounded.
          auto nested_probes = [&](const ListInput* oin, const ModalityWork* other,
                                   const std::vector<double>& oroom, double bound) {
            std::vector<ListProbe> probes;
            for (const ListRules& r : NestedProbes(c, *oin, oroom))
              probes.push_back({oin, other, r, bound});
            return probes;
          };
          // Nested's best first pass on the images as first sized: its probes' alternatives
          // (a windowless twin that did not run made the same decisions as its twin).
          double own_best = placed.first_pass_s[0];
          if (policy == ModalityPolicy::kNested) {
            const std::vector<ListRules> all = Alternatives(c, policy, in, room, false);
            for (const ListRules& r : NestedProbes(c, in, room))
              for (size_t k = 0; k < all.size(); ++k)
                if (all[k] == r) own_best = std::min(own_best, placed.first_pass_s[k]);
          }
          // Bubble-fill also probes nested's rules (in the same room): nested, planned on
          // its own, may keep a sizing bubble-fill's probe rejects, and bubble-fill's plan is
          // compared with nested's prediction.
          double nested_best = kNever;
          if (bubble) {
            ASSIGN_OR_RETURN(const auto probe, Probe(nested_probes(&in, &w, room, kNever), tl));
            nested_best = *std::min_element(probe.begin(), probe.end());
          }
          std::vector<std::vector<double>> seen{VisionTasksKey(w)};
          for (int sizing = 1; sizing < timed_sizing; ++sizing) {
            ASSIGN_OR_RETURN(ModalityWork other, sized_work(sizing));
            std::vector<double> key = VisionTasksKey(other);
            if (std::find(seen.begin(), seen.end(), key) != seen.end()) continue;
            seen.push_back(std::move(key));
            ListInput oin = input_of(other);
            const std::vector<double> oroom = room_for(oin);
            // Larger tasks than any rank has room for: out of memory where the images as
            // first sized were not.
            if (oroom.empty() && !room.empty()) continue;
            // A probe matters only where it comes within kProbeMargin of the best before
            // (+inf where it cannot).
            const double own_bound = own_best * (bubble ? 1 : 1 + kProbeMargin);
            const double nested_bound = nested_best * (1 + kProbeMargin);
            // The policy's own probes (bubble-fill's within its room), then bubble-fill's of
            // nested.
            std::vector<ListProbe> probes =
                policy == ModalityPolicy::kNested
                    ? nested_probes(&oin, &other, oroom, own_bound)
                    : std::vector<ListProbe>{{&oin, &other, RulesOf(c, policy, oin), own_bound}};
            if (bubble) {
              probes[0].rules.memory_room_bytes = oroom;
              for (ListProbe& p : nested_probes(&oin, &other, oroom, nested_bound))
                probes.push_back(p);
            }
            ASSIGN_OR_RETURN(const std::vector<double> probe, Probe(probes, tl));
            const double own_probe =
                bubble ? probe[0] : *std::min_element(probe.begin(), probe.end());
            const double nested_probe =
                bubble ? *std::min_element(probe.begin() + 1, probe.end()) : kNever;
            if (own_probe >= own_bound && nested_probe >= nested_bound) continue;
            nested_best = std::min(nested_best, nested_probe);
            if (own_probe >= own_bound) {  // only nested's prediction can change
              ASSIGN_OR_RETURN(const ListResult n,
                               ScheduleModality(oin, other, NestedAlternatives(c, oin, oroom), tl));
              nested_s = std::min(nested_s, n.makespan_s);
              continue;
            }
            own_best = std::min(own_best, own_probe);
            double other_nested_s = kNever;
            bool other_nested_kept = false;
            ASSIGN_OR_RETURN(ListResult oplaced,
                             PlaceListed(c, policy, oin, other, tl, oroom, tail_moves,
                                         &other_nested_s, &other_nested_kept));
            nested_s = std::min(nested_s, other_nested_s);
            if (oplaced.makespan_s < placed.makespan_s) {
              w = std::move(other), in = std::move(oin), placed = std::move(oplaced);
              nested_kept = other_nested_kept, sizing_kept = sizing;
            }
          }
          if (timed_too) {
            // The same images placed on the stages where they can be hidden (the text-only
            // timeline's idle time), kept if the step is shorter.
            ModalityWork timed = timed_work();
            ListInput tin = input_of(timed);
            ASSIGN_OR_RETURN(ListResult tplaced,
                             PlaceListed(c, policy, tin, timed, tl, room_for(tin), tail_moves));
            if (tplaced.makespan_s < placed.makespan_s) {
              w = std::move(timed), in = std::move(tin), placed = std::move(tplaced);
              nested_kept = false, sizing_kept = timed_sizing;
            }
          }
          // The placement kept may be nested's rules on one sizing while nested's own search
          // predicts another sizing faster: then too nested's plan is compared (by the
          // prediction before any tail move: a plan with moves is compared with the same
          // placement without them, PlanOrdered, and that one with nested's where this
          // says so).
          if (h.nested_close)
            *h.nested_close =
                bubble && nested_s < placed.unmoved_s * (nested_kept ? 1 : 1 + kListMargin);
          if (h.chosen) *h.chosen = {policy, sizing_kept, placed.alternative, tail_moves};
        }
        if (cacheable && !cached) *text_cache = tl;
        if (h.tail_moved) *h.tail_moved = placed.tail_moves > 0;
        // The scheduler's working state (freed, partly in its threads' heaps) goes back
        // before the table is built; for large plans (text compute, SEND and RECV: about
        // three ops per text step).
        size_t steps = 0;
        for (const StageOrder& o : orders) steps += o.size();
        if (3 * steps * shape.dp >= kReleaseFromOps) ReleaseFreeMemory();
        // W passes the list scheduler moved into gaps: the text ops in the order they ran.
        if (!placed.rank_orders.empty()) *seqs = ExpandStages(placed.rank_orders, shape, text_work);
        placed.rank_orders.clear();
        vision = std::move(placed.vision);
        shards = std::move(placed.generator);
        if (h.room) *h.room = room_before(in);
        bounds = std::move(in.bounds);
      }
      break;
  }
  ModalityWorkIds ids;
  for (const VisionTask& t : w.vision) {
    Work out;
    out.payload_bytes = t.out_bytes;
    ids.vision_f.push_back(b->AddWork(t.f));
    (*outputs)[ids.vision_f.back()] = t.out_bytes;
    ids.vision_b.push_back(b->AddWork(t.b));
    ids.vision_recompute.push_back(b->AddWork(t.recompute));
    ids.vision_out.push_back(b->AddWork(out));
  }
  for (const GeneratorTask& t : w.generator) {
    const PieceWork p = sharded
                            ? GeneratorShard(c, t, shape.pp, ReplicaAcrossNodes(shape, ranks, t.d))
                            : PieceWork{t.f, t.b};
    ids.generator_f.push_back(b->AddWork(p.f));
    ids.generator_b.push_back(b->AddWork(p.b));
  }
  Work io;
  io.payload_bytes = tw.p2p_bytes;  // the last stage's hidden states, or their gradient
  ids.generator_io = b->AddWork(io);
  if (!bounds.empty()) {
    ids.piece_f.resize(w.vision.size()), ids.piece_b.resize(w.vision.size());
    for (size_t i = 0; i < w.vision.size(); ++i) {
      if (bounds[i].size() <= 2) continue;
      for (const PieceWork& p : SplitTask(w.vision[i], bounds[i])) {
        ids.piece_f[i].push_back(b->AddWork(p.f));
        ids.piece_b[i].push_back(b->AddWork(p.b));
      }
      (*outputs)[ids.piece_f[i].back()] = w.vision[i].out_bytes;  // the last piece's
    }
  }
  auto generator = PlaceGenerator(shape, w);
  // The text sequences, built once the placement's working state is gone (unless the
  // placement moved W passes: then from its orders, above).
  if (seqs->empty()) *seqs = ExpandStages(orders, shape, text_work);
  return InsertModality(seqs, shape, w, ids, vision, generator, shards, b);
}

// Where a modality's parameters live (ParamPlacement): the ranks that hold them and sync
// their gradients, and the parameters each holds per GPU.
struct ModalityLayout {
  Module module;
  ParamPlacement placement;
  double params = 0;  // the whole module
  int tp = 1;         // GPUs of a rank one copy is split over (replicated)
  std::vector<bool> member;
  double per_gpu(int32_t r, double world) const {
    if (placement == ParamPlacement::kFsdp) return params / world;
    return member[r] ? params / tp : 0;
  }
  int members() const { return static_cast<int>(std::count(member.begin(), member.end(), true)); }
};

// FSDP spans the job. A replicated encoder lives on the ranks that run it: the first
// stages under `inline`, every rank otherwise (decoupled and the list-scheduled policies
// place encoder work anywhere); the generator on the last stages, or on every rank when
// the list-scheduled policies split it over its replica.
std::vector<ModalityLayout> ModalityLayouts(const Config& c, const PipelineShape& shape,
                                            const std::vector<RankInfo>& ranks,
                                            const ModalityWork& params_only) {
  const ModalityPolicy policy = c.schedule.modality;
  const bool listed = policy == ModalityPolicy::kNested || policy == ModalityPolicy::kBubbleFill ||
                      policy == ModalityPolicy::kOptimus;
  std::vector<ModalityLayout> out;
  auto add = [&](Module m, ParamPlacement placement, double params, int tp, auto holds) {
    if (params <= 0) return;
    ModalityLayout l{m, placement, params, tp, std::vector<bool>(ranks.size(), true)};
    if (placement == ParamPlacement::kReplicated)
      for (size_t r = 0; r < ranks.size(); ++r) l.member[r] = holds(ranks[r]);
    out.push_back(std::move(l));
  };
  add(Module::kVision, c.model.vision.placement, params_only.vision_params, c.model.vision.tp,
      [&](const RankInfo& r) { return policy != ModalityPolicy::kInline || r.pp == 0; });
  add(Module::kGenerator, c.model.generator.placement, params_only.generator_params, c.parallel.tp,
      [&](const RankInfo& r) {
        return (listed && c.parallel.pp > 1) || r.pp == shape.home(shape.stages() - 1).pp_rank;
      });
  return out;
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
      r.state_shard[0] = p.dp;  // text gradients and optimizer states shard over DP (ZeRO)
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
  o.memory.grads_on_host = c.training.grad_offload;
  o.memory.grad_bucket_params = c.training.grad_bucket_size;
  o.memory.grad_bytes = c.training.GradBytes();
  return o;
}

StatusOr<Config> ConfigOfPlan(const Table& plan, const std::string& plan_path,
                              const std::vector<std::string>& sets) {
  ASSIGN_OR_RETURN(YamlDoc doc,
                   YamlDoc::FromString(plan_path + " (embedded config)", plan.meta().config_yaml));
  for (const std::string& s : sets) RETURN_IF_ERROR(doc.ApplySet(s));
  return ParseConfig(std::move(doc));
}

namespace {

// `nested_close`, `hint`, `chosen`, `text_cache`: see AddModality.
StatusOr<Table> PlanOnce(const Config& c, const PlanHooks& h = {});

struct OpKeyHash {
  size_t operator()(const OpKey& k) const {
    size_t h = std::hash<int64_t>()(int64_t{k.rank} << 32 | static_cast<uint32_t>(k.mb));
    for (int32_t x : {static_cast<int32_t>(k.kind), static_cast<int32_t>(k.module), k.chunk, k.task,
                      k.peer, k.piece})
      h = h * 1000003 ^ std::hash<int32_t>()(x);
    return h;
  }
};
// c's plan with nothing offloaded, simulated: every compute op's start and end, every rank's
// peak memory per GPU.
struct Predicted {
  std::unordered_map<OpKey, std::pair<double, double>, OpKeyHash> times;
  std::vector<double> peak;
  std::vector<std::vector<std::pair<double, double>>> curve;  // per rank: (time, bytes) steps
};
StatusOr<Predicted> PredictWithoutOffload(const Config& c) {
  Config k = c;
  k.training.offload = ActPlace::kDevice, k.training.offload_by_rank.clear();
  k.model.vision.offload = k.model.generator.offload = ActPlace::kDevice;
  ASSIGN_OR_RETURN(const Table t, PlanOnce(k, {.tail_moves = false}));  // as c's plan (PlanOnce)
  SimOptions o = SimOptionsFor(k);
  o.exposure = false;
  o.memory_curves = true;
  ASSIGN_OR_RETURN(const SimResult r, RunSimulation(t, o));
  Predicted p;
  p.times.reserve(t.size());
  for (OpId i = 0; i < t.size(); ++i)
    if (IsCompute(t.kind(i))) p.times[t.key(i)] = {r.timeline.start[i], r.timeline.end[i]};
  for (const RankMemory& m : r.memory) {
    p.peak.push_back(m.peak_bytes);
    auto& curve = p.curve.emplace_back();
    for (const MemorySample& s : m.curve)
      curve.push_back({s.time_s, std::accumulate(s.bytes.begin(), s.bytes.end(), 0.0)});
  }
  return p;
}

StatusOr<Table> PlanOnce(const Config& c, const PlanHooks& h) {
  const ParallelConfig& p = c.parallel;
  PipelineShape shape{p.pp, p.vp, p.dp, c.training.microbatches, PlacementOf(c.schedule.pipeline)};
  const PipelineKind pipeline = c.schedule.pipeline;
  std::vector<StageOrder> orders;
  if (pipeline == PipelineKind::kCsv) {
    ASSIGN_OR_RETURN(TorchCsvSchedule csv,
                     ReadTorchCsvSchedule(c.schedule.csv, p.pp, p.vp, shape.m));
    orders = std::move(csv.orders);
    shape.placement = csv.placement;
  } else {
    ASSIGN_OR_RETURN(
        orders, TextSchedule(pipeline, p.pp, p.vp, shape.m, p.microbatch_group_size_per_vp_stage,
                             c.schedule.zb_max_pending));
  }
  TextWorkload tw = BuildTextWorkload(c, shape.placement);
  StepBatch batch;
  if (Multimodal(c)) {
    ASSIGN_OR_RETURN(batch, MakeStepBatch(c));
  }
  std::vector<RankInfo> ranks = MakeRanks(c);
  const double world = c.world();
  ModalityWork params_only =
      Multimodal(c) ? BuildModalityWork(c, StepBatch{}, VisionPool{}, false) : ModalityWork{};
  const std::vector<ModalityLayout> layouts = ModalityLayouts(c, shape, ranks, params_only);
  for (int32_t r = 0; r < static_cast<int32_t>(ranks.size()); ++r) {
    for (int ch = 0; ch < p.vp; ++ch) {
      const int g = shape.global(ch, ranks[r].pp);
      ranks[r].params[0] += tw.params_per_gpu[g];
      if (c.training.muon) ranks[r].muon_params += MuonOfStage(c, p.stages[g]).params_per_gpu;
    }
    for (const ModalityLayout& l : layouts) {
      const int m = static_cast<int>(l.module);
      ranks[r].params[m] = l.per_gpu(r, world);
      if (l.placement == ParamPlacement::kReplicated) ranks[r].state_shard[m] = l.members();
    }
  }
  TableBuilder b(ranks);

  // Split backwards (I and W) get their own work; other schedules do not carry it.
  bool split = false;
  for (const StageOrder& o : orders)
    for (const Step& st : o) split = split || st.kind == OpKind::kI || st.kind == OpKind::kW;
  TextWorkIds text_work;
  GradSyncWorks sync;
  const double grad_bytes = c.training.GradBytes();
  for (int g = 0; g < shape.stages(); ++g) {
    text_work.f.push_back(b.AddWork(tw.f[g]));
    text_work.b.push_back(b.AddWork(tw.b[g]));
    if (split) {
      text_work.i.push_back(b.AddWork(tw.i[g]));
      text_work.w.push_back(b.AddWork(tw.w[g]));
    }
    Work reduce, gather;
    reduce.payload_bytes = tw.params_per_gpu[g] * grad_bytes;
    gather.payload_bytes = tw.params_per_gpu[g] * 2;  // bf16 parameters
    sync.reduce.push_back(b.AddWork(reduce));
    sync.gather.push_back(b.AddWork(gather));
    // ZeRO-2 (dp > 1): the same reduction per micro-batch (each rank keeps only its shard);
    // with host gradients, the fp32 shards go to host memory.
    if (c.training.zero_stage >= 2 && p.dp > 1) sync.mb_reduce.push_back(sync.reduce.back());
    if (c.training.grad_offload) {
      Work shard;
      shard.payload_bytes = tw.params_per_gpu[g] * 4 / p.dp;
      sync.grad_out.push_back(b.AddWork(shard));
      sync.grad_in.push_back(sync.grad_out.back());
    }
  }
  if (c.training.overlap_grad_reduce && p.dp > 1) {
    // Buckets of grad_bucket_size parameters, filled from the last layer backwards, each
    // reduced as soon as the last micro-batch's backward has produced it. A bucket holds
    // whole layers (the backward is split at layer boundaries), at most kMaxBuckets.
    for (int g = 0; g < shape.stages(); ++g) {
      const Work& bw = tw.b[g];
      const int L = bw.layer_end - bw.layer_begin;
      const int want = static_cast<int>(
          std::ceil(tw.params_per_gpu[g] / static_cast<double>(c.training.grad_bucket_size)));
      const int n = L == 0 ? 1 : std::clamp(want, 1, std::min(L, kMaxBuckets));
      std::vector<WorkId> pieces, pieces_w, reduces;
      for (int k = 0; k < n; ++k) {
        const int lo = L - (k + 1) * L / n, hi = L - k * L / n;
        Work reduce;
        reduce.payload_bytes =
            tw.params_per_gpu[g] * grad_bytes * (L == 0 ? 1.0 : double(hi - lo) / L);
        pieces.push_back(b.AddWork(L == 0 ? bw : LayerShare(bw, lo, hi)));
        if (split) pieces_w.push_back(b.AddWork(L == 0 ? tw.w[g] : LayerShare(tw.w[g], lo, hi)));
        reduces.push_back(b.AddWork(reduce));
      }
      sync.bucket_piece.push_back(std::move(pieces));
      sync.bucket_piece_w.push_back(std::move(pieces_w));
      sync.bucket_reduce.push_back(std::move(reduces));
    }
    sync.gather_first = c.training.overlap_param_gather;
  }
  for (int s = 0; s < p.pp; ++s) {
    // Adam over the parameters whose optimizer states the GPU holds: reads grad, master,
    // two moments, writes them and the bf16 weight: about 34 bytes and 10 FLOPs each.
    const double text_shard = c.training.zero_stage >= 1 ? ranks[s].state_shard[0] : 1;
    double params = 0;
    for (int m = 0; m < 3; ++m)
      params += ranks[s].params[m] / (c.training.zero_stage >= 1 ? ranks[s].state_shard[m] : 1);
    // Muon: the momentum update (read gradient and momentum, write momentum: 12 bytes per
    // parameter) and the update applied (read master, write it and the bf16 weight: 10) over
    // the GPU's shard, plus Newton-Schulz (bf16 GEMMs) on the matrices it owns; the cp GPUs
    // of a rank hold the same matrices and split their owners.
    std::vector<MuonCost> muon(c.training.muon ? shape.vp : 0);
    double on_muon = 0, ns_flops = 0, tp_sharded = 0;
    for (int ch = 0; ch < static_cast<int>(muon.size()); ++ch) {
      muon[ch] = MuonOfStage(c, p.stages[shape.global(ch, s)]);
      on_muon += muon[ch].params_per_gpu / text_shard, ns_flops += muon[ch].ns_flops_per_gpu;
      tp_sharded += muon[ch].tp_sharded_per_gpu;
    }
    auto step = [&](double adam_params, double muon_params, double ns) {
      Work w;
      w.hbm_bytes = 34 * adam_params + 22 * muon_params;
      w.flops = 10 * (adam_params + muon_params) * p.tp * p.cp + ns * p.tp;
      w.kernels = 4;
      return w;
    };
    // Each owner needs its matrices whole: the fp32 momentum-updated gradients of the
    // GPU's shards. all_gather: all of them on every GPU, one buffer of the whole stage
    // (freed by the step): the GPU's shards over the DP group, then the TP-split matrices'
    // other tp - 1 shards from the TP peers (tp x their bytes held). p2p: per model chunk,
    // only the matrices it owns into a buffer that the updates sent back leave, in two
    // legs: an all-to-all over the DP group brings each GPU its shard of the matrices its
    // TP group owns (a 1/dp share of its shards), then one over the TP group gives each
    // owner the other tp - 1 shards of its TP-split matrices ((tp - 1) / tp of its 1/dp
    // share of them), the updates going back the same way; Adam's step first, then each
    // chunk's Newton-Schulz while the next chunk's matrices arrive. The TP leg runs over
    // NVLink inside the collective (Work::tp_bytes); with dp 1 there is no DP exchange and
    // the step itself carries the TP legs (their time; the buffer is not counted).
    const bool exchange = c.training.muon && p.dp > 1;
    const bool pipelined = exchange && !c.training.muon_all_gather;
    const double tp_rest = (p.tp - 1.0) / p.tp;
    const int tp_calls = p.tp > 1 ? 1 : 0;
    Work opt = step(params - on_muon, pipelined ? 0 : on_muon, pipelined ? 0 : ns_flops);
    Work all;  // all_gather
    all.payload_bytes = 4 * ranks[s].muon_params;
    all.tp_bytes = 4 * tp_sharded * (p.tp - 1), all.tp_calls = tp_calls;
    if (c.training.muon && p.dp == 1) {
      opt.tp_bytes = c.training.muon_all_gather ? all.tp_bytes : 2 * 4 * tp_sharded * tp_rest;
      opt.tp_calls = (c.training.muon_all_gather ? 1 : 2) * tp_calls;
    }
    all.mem_delta_bytes = all.payload_bytes + all.tp_bytes;
    if (exchange && !pipelined) opt.mem_delta_bytes = -all.mem_delta_bytes;
    sync.opt_step.push_back(b.AddWork(opt));
    sync.muon_gather.emplace_back(), sync.muon_step.emplace_back();
    sync.muon_scatter.emplace_back();
    if (exchange && !pipelined) sync.muon_gather[s].push_back(b.AddWork(all));
    for (size_t ch = 0; pipelined && ch < muon.size(); ++ch) {
      Work gather, back;
      gather.payload_bytes = gather.mem_delta_bytes = 4 * muon[ch].params_per_gpu / p.dp;
      gather.tp_bytes = 4 * muon[ch].tp_sharded_per_gpu / p.dp * tp_rest;
      gather.tp_calls = tp_calls;
      back = gather, back.mem_delta_bytes = -gather.mem_delta_bytes;
      sync.muon_gather[s].push_back(b.AddWork(gather));
      sync.muon_step[s].push_back(
          b.AddWork(step(0, muon[ch].params_per_gpu / text_shard, muon[ch].ns_flops_per_gpu)));
      sync.muon_scatter[s].push_back(b.AddWork(back));
    }
  }
  sync.muon_kind = c.training.muon_all_gather ? OpKind::kAllGather : OpKind::kAllToAll;
  Work p2p;
  p2p.payload_bytes = tw.p2p_bytes;
  if (tw.p2p_gather_bytes > 0) p2p.tp_bytes = tw.p2p_gather_bytes, p2p.tp_calls = 1;
  WorkId p2p_work = b.AddWork(p2p);
  std::vector<int32_t> dp_group(p.pp, -1);
  if (p.dp > 1) {
    for (int s = 0; s < p.pp; ++s) {
      std::vector<int32_t> members;
      for (int d = 0; d < p.dp; ++d) members.push_back(shape.rank(d, s));
      dp_group[s] = b.AddGroup(std::move(members));
    }
  }

  std::vector<RankSeq> seqs;  // per rank, its ops in order
  Speculation speculation;
  std::vector<ModalitySync> modality_sync;
  std::unordered_map<WorkId, double> outputs;  // encoder outputs kept on the device
  if (!Multimodal(c)) seqs = ExpandStages(orders, shape, text_work);
  if (Multimodal(c)) {
    RETURN_IF_ERROR(AddModality(c, shape, batch, orders, tw, text_work, ranks, &b, &seqs, &outputs,
                                h, h.lowered_again ? &speculation : nullptr));
    // FSDP: full gradients reduce-scattered over the job, full bf16 parameters gathered
    // before the step's first use. Replicated: the copy's gradients all-reduced over its
    // holders (reduce-scattered with ZeRO >= 1, the updated shards gathered after the
    // optimizer step).
    for (const ModalityLayout& l : layouts) {
      if (l.members() < 2) continue;
      ModalitySync ms{l.module};
      ms.member = l.member;
      std::vector<int32_t> members;
      for (int32_t r = 0; r < static_cast<int32_t>(ranks.size()); ++r)
        if (l.member[r]) members.push_back(r);
      ms.group = b.AddGroup(std::move(members));
      const bool fsdp = l.placement == ParamPlacement::kFsdp;
      const double copy = fsdp ? l.params : l.params / l.tp;
      Work reduce, gather;
      reduce.payload_bytes = copy * grad_bytes;
      gather.payload_bytes = copy * 2;
      ms.reduce = fsdp || c.training.zero_stage >= 1 ? OpKind::kReduceScatter : OpKind::kAllReduce;
      ms.reduce_work = b.AddWork(reduce);
      if (fsdp || c.training.zero_stage >= 1) ms.gather_work = b.AddWork(gather);
      ms.gather_first = fsdp;
      modality_sync.push_back(std::move(ms));
    }
  }
  // Tied embeddings across stages: the first stage holds the word embedding, the last the
  // LM head, two copies of one weight. Megatron all-reduces their gradient over the pair
  // (the embedding group of each replica) after the data-parallel reduction, before the
  // optimizer step (finalize_model_grads: _allreduce_word_embedding_grads): the full
  // vocab x hidden / tp gradient in the reduction's dtype.
  if (c.model.llm.tie_embeddings && p.pp > 1) {
    const int32_t last = shape.home(shape.stages() - 1).pp_rank;
    if (last == 0)
      return InvalidInput(
          "model.llm.tie_embeddings: the first and last stage share a rank (V placement); tied "
          "embeddings are modelled for stages on different ranks, or pp 1");
    Work reduce;
    reduce.payload_bytes =
        static_cast<double>(c.model.llm.vocab) * c.model.llm.hidden / p.tp * grad_bytes;
    const WorkId work = b.AddWork(reduce);
    for (int d = 0; d < p.dp; ++d) {
      ModalitySync ms{Module::kText, OpKind::kAllReduce, work};
      ms.member.assign(ranks.size(), false);
      ms.member[shape.rank(d, 0)] = ms.member[shape.rank(d, last)] = true;
      ms.group = b.AddGroup({shape.rank(d, 0), shape.rank(d, last)});
      modality_sync.push_back(std::move(ms));
    }
  }
  size_t ops = 0;
  for (const RankSeq& s : seqs) ops += s.size();
  if (ops >= kReleaseFromOps) ReleaseFreeMemory();  // the placement's working state
  AddSendRecv(&seqs, shape, p2p_work);
  AddGradSync(&seqs, shape, c.training.zero_stage, sync, dp_group, modality_sync);
  if (OffloadsAny(c)) {
    // The saved activations of each offloading module and pipeline rank go to host memory.
    // Copies are placed by the compute ops' times in the same plan without them.
    ASSIGN_OR_RETURN(const Predicted predicted, PredictWithoutOffload(c));
    const CostModel cost = CostModel::Real(c.cluster.spec);
    HostCopyModel copies;
    auto place_of = [&](const OpKey& k) {
      return k.module == Module::kVision ? c.model.vision.offload
             : k.module == Module::kGenerator
                 ? c.model.generator.offload
                 : c.training.OffloadOf(k.rank % p.pp, shape.global(k.chunk, k.rank % p.pp));
    };
    // Remote: in each replica, the stages that lend activations to another (any chunk of
    // their LLM layers, or the encoder's or generator's forwards they run), from the
    // highest predicted peak down, each paired with a stage that does not, from the lowest
    // peak up, while the holder's peak is the lower.
    std::vector<int32_t> holder(ranks.size(), -1);
    auto lends = [&](int32_t rank) {
      const int s = rank % p.pp;
      for (int k = 0; k < shape.vp; ++k)
        if (c.training.OffloadOf(s, shape.global(k, s)) == ActPlace::kRemote) return true;
      for (const PendingOp& op : seqs[rank])
        if (op.key.kind == OpKind::kF && op.key.module != Module::kText &&
            place_of(op.key) == ActPlace::kRemote)
          return true;
      return false;
    };
    for (int d = 0; d < p.dp; ++d) {
      std::vector<int32_t> from, to;
      for (int s = 0; s < p.pp; ++s)
        (lends(shape.rank(d, s)) ? from : to).push_back(shape.rank(d, s));
      auto peak = [&](int32_t r) { return predicted.peak[r]; };
      std::stable_sort(from.begin(), from.end(),
                       [&](int32_t x, int32_t y) { return peak(x) > peak(y); });
      std::stable_sort(to.begin(), to.end(),
                       [&](int32_t x, int32_t y) { return peak(x) < peak(y); });
      for (size_t i = 0; i < std::min(from.size(), to.size()) && peak(to[i]) < peak(from[i]); ++i)
        holder[from[i]] = to[i];
    }
    copies.holder = [&](const PendingOp& op) {
      return place_of(op.key) == ActPlace::kRemote ? holder[op.key.rank] : -1;
    };
    // training.offload_modules: a text forward moves only the bytes of the named classes.
    std::unordered_map<WorkId, double> classes;
    if (c.training.offload_modules)
      for (int g = 0; g < shape.stages(); ++g) classes[text_work.f[g]] = tw.offload_bytes[g];
    copies.saved = [&](const PendingOp& op) {
      const ActPlace place = place_of(op.key);
      if (place == ActPlace::kDevice || (place == ActPlace::kRemote && holder[op.key.rank] < 0))
        return 0.0;
      auto out = outputs.find(op.work);
      const double saved =
          b.work(op.work).mem_delta_bytes - (out == outputs.end() ? 0 : out->second);
      auto named = op.key.module == Module::kText ? classes.find(op.work) : classes.end();
      return named == classes.end() ? saved : std::min(saved, named->second);
    };
    copies.times = [&](const PendingOp& op) {
      auto it = predicted.times.find(op.key);
      return it == predicted.times.end() ? std::pair{-1.0, -1.0} : it->second;
    };
    // A holder takes what evens the two ranks' peaks, within its HBM.
    copies.curve = [&](int32_t rank) -> const std::vector<std::pair<double, double>>& {
      return predicted.curve[rank];
    };
    copies.hold_cap = [&](int32_t rank) {
      const double mine = predicted.peak[rank], its = predicted.peak[holder[rank]];
      return std::max(0.0, std::min((mine - its) / 2, c.cluster.spec.hbm_bytes - its));
    };
    copies.copy_seconds = [&](double bytes, int32_t rank, int32_t to) {
      return to < 0 ? cost.CopySeconds(bytes)
                    : cost.P2PSeconds(bytes, ranks[rank].node == ranks[to].node);
    };
    RETURN_IF_ERROR(AddHostCopies(&seqs, copies, &b));
  }
  RETURN_IF_ERROR(Link(std::move(seqs), &b));
  if (speculation.faster.valid()) {
    ASSIGN_OR_RETURN(const bool faster, speculation.faster.get());
    if (faster) {  // the passes go on from there: the placement they keep, lowered
      *h.lowered_again = true;
      PlanHooks again = h;
      again.lowered_again = nullptr;
      return PlanOnce(c, again);
    }
  }

  PlanMeta meta;
  meta.schedule = PipelineName(pipeline);
  meta.modality = Multimodal(c) ? std::string(ModalityName(c.schedule.modality)) : "";
  meta.pp = p.pp, meta.vp = p.vp, meta.dp = p.dp, meta.tp = p.tp, meta.cp = p.cp, meta.ep = p.ep;
  meta.microbatches = shape.m;
  meta.placement = shape.placement;
  meta.gpus_per_node = c.cluster.gpus_per_node;
  meta.tokens_per_step =
      Multimodal(c) ? static_cast<double>(batch.tokens) : tw.tokens_per_mb * shape.m * p.dp;
  meta.samples_per_step = Multimodal(c)
                              ? static_cast<double>(batch.samples)
                              : static_cast<double>(c.training.micro_batch_size) * shape.m * p.dp;
  meta.megatron_flops_per_step = MegatronFlopsPerStep(c);
  meta.megatron_model_flops_per_step = MegatronFlopsPerStep(c, false);
  meta.config_yaml = c.resolved_yaml.str();
  StatusOr<Table> t = b.Finish(std::move(meta));
  if (t.ok() && t->size() >= kReleaseFromOps) ReleaseFreeMemory();  // all but the table
  return t;
}

// The modes the memory search may use for one module (a pipeline rank's LLM layers, the
// encoder, the generator): its configured mode, then the modes the allowed policies
// (training.memory_policies) reach that keep fewer bytes (`bytes_of`, per layer and token
// or per layer), fewest last, without the dominated ones: a mode is left out when one
// keeping fewer bytes costs no more (cost order: recompute none < selective < full, then
// bf16 < fp8: FP8 storage adds only HBM traffic). With fused attention (`fused`: and
// selective recompute of the core attention alone), selective recompute
// is left out when none is allowed: it keeps only the fp32 log-sum-exp less and recomputes
// the attention core. `remote`: the module may lend activations to another stage (the LLM's
// layers).
std::vector<MemoryMode> Ladder(const Config& c, MemoryMode start, bool fused, bool remote,
                               const std::function<double(MemoryMode)>& bytes_of) {
  auto cost = [](MemoryMode m) {
    return 2 * static_cast<int>(m.recompute) + static_cast<int>(m.storage);
  };
  const double start_bytes = bytes_of(start);
  std::vector<std::pair<double, MemoryMode>> modes;  // (bytes, mode)
  for (int r = 0; r < 3; ++r) {
    for (int s = 0; s < 2; ++s) {
      const MemoryMode m{static_cast<Recompute>(r), static_cast<ActStorage>(s), start.place};
      if (!c.training.memory_recompute && m.recompute != start.recompute) continue;
      if (!c.training.memory_fp8 && m.storage != start.storage) continue;
      if (fused && m.recompute == Recompute::kSelective && c.training.memory_recompute) continue;
      if (bytes_of(m) < start_bytes) modes.push_back({bytes_of(m), m});
    }
  }
  std::sort(modes.begin(), modes.end(), [&](const auto& x, const auto& y) {
    return x.first != y.first ? x.first > y.first : cost(x.second) < cost(y.second);
  });
  std::vector<MemoryMode> ladder;  // from the fewest bytes up, dominated modes left out
  int cheapest = std::numeric_limits<int>::max();
  for (auto it = modes.rbegin(); it != modes.rend(); ++it)
    if (cost(it->second) < cheapest) cheapest = cost(it->second), ladder.push_back(it->second);
  ladder.push_back(start);
  std::reverse(ladder.begin(), ladder.end());
  // Offload (when allowed and not already configured): each mode, then (the LLM's layers)
  // the same mode lending its activations to another stage, then the same mode offloaded
  // to host (what offload saves depends on how long activations wait for their backward,
  // how fast the copies run and, remote, how much the other stages can hold, not on their
  // bytes per token: the simulation of each candidate tells).
  for (MemoryMode& m : ladder) m.place = start.place;
  if (!c.training.memory_offload || start.place != ActPlace::kDevice) return ladder;
  std::vector<MemoryMode> with_offload;
  for (MemoryMode m : ladder) {
    with_offload.push_back(m);
    for (ActPlace place : {ActPlace::kRemote, ActPlace::kHost})
      if (place != ActPlace::kRemote || remote) m.place = place, with_offload.push_back(m);
  }
  return with_offload;
}

// Where each module stands on its ladder: items 0..pp-1 are the pipeline ranks' LLM layers,
// then the encoder and the generator.
struct MemoryLevels {
  std::vector<std::vector<MemoryMode>> ladders;
  std::vector<GradMode> grad_ladder;  // the configured gradients first
  std::vector<int> at;                // per ladder, then the gradient ladder's last
  int pp = 0;
  int vision() const { return pp; }
  int generator() const { return pp + 1; }
  int gradients() const { return pp + 2; }
  MemoryMode mode(int item) const { return ladders[item][at[item]]; }
  GradMode grad() const { return grad_ladder[at[gradients()]]; }
  int size(int item) const {
    return static_cast<int>(item == gradients() ? grad_ladder.size() : ladders[item].size());
  }
};

// The gradient ladder (training.memory_policies: gradients): the configured gradients,
// then ZeRO-2 (each micro-batch's gradients reduce-scattered as produced: 4 bytes per
// parameter / dp on the GPU, plus two buckets; from ZeRO-0 it shards the optimizer states
// too), then host gradients (the GPU keeps two of a chunk's fp32 gradients; the shards
// accumulate in host memory). A rung that does not keep fewer bytes on this job (host
// gradients hold more than ZeRO-2's shard and buckets when dp is large) is still there:
// the search steps up only while a rank is out of memory and keeps the lowest rung that
// fits. The config rules refuse `gradients` without dp > 1 or with overlap_grad_reduce.
std::vector<GradMode> GradLadder(const Config& c) {
  const TrainingConfig& t = c.training;
  std::vector<GradMode> ladder{{t.zero_stage, t.grad_offload}};
  if (!GradientsMovable(c)) return ladder;
  if (t.zero_stage < 2) ladder.push_back({2, false});
  if (!t.grad_offload) ladder.push_back({2, true});
  return ladder;
}

MemoryLevels LevelsOf(const Config& c) {
  MemoryLevels m;
  m.pp = c.parallel.pp;
  // Selective recompute of the core attention alone keeps only the log-sum-exp less with
  // FlashAttention; other recompute_modules make it a rung of its own.
  const bool flash =
      c.model.attention == Attention::kFlash && c.training.recompute_modules == kRecCoreAttn;
  const bool moe = c.model.llm.moe.experts > 0;  // most layers are MoE layers
  auto text_bytes = [&](MemoryMode mode) {
    return TextLayerCost(c, moe, mode.recompute, mode.storage).act_bytes;
  };
  for (int r = 0; r < m.pp; ++r)
    m.ladders.push_back(Ladder(
        c,  // per pipeline rank (memory: auto refuses per-stage lists)
        {c.training.RecomputeOf(r, r), c.training.StorageOf(r, r), c.training.OffloadOf(r, r)},
        flash, true, text_bytes));
  const VisionConfig& v = c.model.vision;
  const GeneratorConfig& g = c.model.generator;
  m.ladders.push_back(
      Ladder(c, {v.recompute, v.saved_activations, v.offload}, true, false, [&](MemoryMode mode) {
        return SavedPerToken(mode.recompute, mode.storage, v.hidden, v.mlp, v.heads).kept;
      }));
  m.ladders.push_back(
      Ladder(c, {g.recompute, g.saved_activations, g.offload}, true, false, [&](MemoryMode mode) {
        return SavedPerToken(mode.recompute, mode.storage, g.hidden, g.mlp, g.heads).kept;
      }));
  m.grad_ladder = GradLadder(c);
  m.at.assign(m.ladders.size() + 1, 0);
  return m;
}

// The config with these modes, its stored YAML saying so (and `memory: manual`).
StatusOr<Config> WithLevels(const Config& c, const MemoryLevels& m) {
  Config k = c;
  k.training.memory_auto = false;
  k.training.recompute_by_rank.clear(), k.training.saved_activations_by_rank.clear();
  k.training.offload_by_rank.clear();
  std::string recompute, storage, offload;
  for (int r = 0; r < m.pp; ++r) {
    k.training.recompute_by_rank.push_back(m.mode(r).recompute);
    k.training.saved_activations_by_rank.push_back(m.mode(r).storage);
    k.training.offload_by_rank.push_back(m.mode(r).place);
    recompute += fmt::format("{}{}", r ? ", " : "", RecomputeName(m.mode(r).recompute));
    storage += fmt::format("{}{}", r ? ", " : "", ActStorageName(m.mode(r).storage));
    offload += fmt::format("{}{}", r ? ", " : "", ActPlaceName(m.mode(r).place));
  }
  ASSIGN_OR_RETURN(YamlDoc doc, YamlDoc::FromString(c.source, c.resolved_yaml.str()));
  RETURN_IF_ERROR(doc.ApplySet("training.memory=manual"));
  doc.Erase("training.memory_policies");  // a key of memory: auto only
  RETURN_IF_ERROR(doc.ApplySet(fmt::format("training.recompute=[{}]", recompute)));
  RETURN_IF_ERROR(doc.ApplySet(fmt::format("training.saved_activations=[{}]", storage)));
  if (OffloadsAny(k) || c.training.memory_offload)
    RETURN_IF_ERROR(doc.ApplySet(fmt::format("training.offload=[{}]", offload)));
  // Keys that refine a mode no LLM rank was given would not load as a manual config.
  bool selective = false, full = false, fp8 = false, offloads = false;
  for (int r = 0; r < m.pp; ++r) {
    selective = selective || m.mode(r).recompute == Recompute::kSelective;
    full = full || m.mode(r).recompute == Recompute::kFull;
    fp8 = fp8 || m.mode(r).storage == ActStorage::kFp8;
    offloads = offloads || m.mode(r).place != ActPlace::kDevice;
  }
  for (auto [key, applies] :
       {std::pair{"training.recompute_modules", selective},
        std::pair{"training.overlap_moe_recompute", selective},
        std::pair{"training.recompute_method", full},
        std::pair{"training.recompute_num_layers", full}, std::pair{"training.fp8_modules", fp8},
        std::pair{"training.offload_modules", offloads}})
    if (!applies) doc.Erase(key);
  auto module = [&](const char* key, bool enabled, MemoryMode mode, Recompute* rc, ActStorage* st,
                    ActPlace* place) -> Status {
    *rc = mode.recompute, *st = mode.storage, *place = mode.place;
    if (!enabled) return Status::Ok();
    RETURN_IF_ERROR(
        doc.ApplySet(fmt::format("model.{}.recompute={}", key, RecomputeName(mode.recompute))));
    if (mode.place == ActPlace::kHost || c.training.memory_offload)
      RETURN_IF_ERROR(
          doc.ApplySet(fmt::format("model.{}.offload={}", key, ActPlaceName(mode.place))));
    return doc.ApplySet(
        fmt::format("model.{}.saved_activations={}", key, ActStorageName(mode.storage)));
  };
  VisionConfig& v = k.model.vision;
  GeneratorConfig& g = k.model.generator;
  RETURN_IF_ERROR(module("vision", v.enabled, m.mode(m.vision()), &v.recompute,
                         &v.saved_activations, &v.offload));
  RETURN_IF_ERROR(module("generator", g.enabled, m.mode(m.generator()), &g.recompute,
                         &g.saved_activations, &g.offload));
  if (m.grad() != m.grad_ladder[0]) {
    k.training.zero_stage = m.grad().zero_stage, k.training.grad_offload = m.grad().host;
    RETURN_IF_ERROR(doc.ApplySet(fmt::format("training.zero_stage={}", m.grad().zero_stage)));
    doc.Erase("training.use_distributed_optimizer");  // says ZeRO-1; zero_stage now decides
    if (m.grad().host) RETURN_IF_ERROR(doc.ApplySet("training.grad_offload=host"));
  }
  k.resolved_yaml = YamlText(doc);
  return k;
}

// Bubble-fill may use every placement nested may, in the same room, and the list scheduler
// keeps the placement it predicts fastest; nested's own search can keep another sizing (it
// probes the sizings by its own rules), and the prediction can misorder close candidates
// (it does not model the receive a transfer waits for, or NICs shared by transfers), so
// nested's plan can be faster. So where nested's placement is
// predicted faster or within kListMargin (faster only, where bubble-fill kept nested's
// rules on one sizing of the images), bubble-fill's plan and nested's are both
// simulated and the faster is kept, as bubble-fill's plan (a plan that fits the device
// memory before one that does not; bubble-fill's own on a tie).
// How plans of c compare: out of memory after fitting, then the simulated step.
struct Judged {
  bool oom = false;
  double step_s = 0;
  bool operator<(const Judged& o) const {
    return std::tie(oom, step_s) < std::tie(o.oom, o.step_s);
  }
};
// `over`: per rank, the bytes its peak is above the device memory (0 where it fits).
StatusOr<Judged> Judge(const Config& c, const Table& t, std::vector<double>* over = nullptr) {
  SimOptions o = SimOptionsFor(c);
  o.exposure = false;
  Judged judged;
  {
    ASSIGN_OR_RETURN(const SimResult r, RunSimulation(t, o));
    if (over) {
      over->assign(r.memory.size(), 0);
      for (size_t k = 0; k < r.memory.size(); ++k)
        (*over)[k] = std::max(0.0, r.memory[k].peak_bytes - o.memory.hbm_bytes);
    }
    judged = {r.metrics.oom, r.metrics.step_time_s};
  }
  if (t.size() >= kReleaseFromOps) ReleaseFreeMemory();  // the simulation's arrays
  return judged;
}
// Whether plan b of c is better than plan a: it fits where a does not, or is faster.
StatusOr<bool> Better(const Config& c, const Table& a, const Table& b) {
  ASSIGN_OR_RETURN(const Judged x, Judge(c, a));
  ASSIGN_OR_RETURN(const Judged y, Judge(c, b));
  return y < x;
}

// c's plan with its images placed by `choice` (what a search of c chose), under the
// choice's policy (bubble-fill may keep nested's placement), named as c's; c's own plan
// where nothing was searched for the images (no sizing).
// `lowered_again`: see PlanHooks.
StatusOr<Table> PlanChosen(const Config& c, const ModalityChoice& choice, TextTimeline* text_cache,
                           PlanShare::Impl* share, bool* lowered_again = nullptr) {
  if (choice.sizing < 0) return PlanOnce(c);
  Config k = c;
  k.schedule.modality = choice.policy;
  ASSIGN_OR_RETURN(Table t, PlanOnce(k, {.hint = &choice,
                                         .text_cache = text_cache,
                                         .share = share,
                                         .lowered_again = lowered_again}));
  t.mutable_meta().modality = std::string(ModalityName(c.schedule.modality));
  return t;
}

// Repairs of the encoder's room of a plan out of device memory (PlanOrdered).
constexpr int kRoomRepairs = 3;

// One plan of c's policy, for c's micro-batch order. `chosen`: what placed its images;
// `text_cache`: see AddModality. With `share`, a config searched before is placed with what
// its search chose, and what this search chooses is kept there.
StatusOr<Table> PlanOrdered(const Config& c, PlanShare::Impl* share,
                            ModalityChoice* chosen = nullptr, TextTimeline* text_cache = nullptr) {
  if (std::optional<ModalityChoice> kept = share ? share->ChoiceOf(c) : std::nullopt) {
    if (chosen) *chosen = *kept;
    return PlanChosen(c, *kept, text_cache, share);
  }
  auto done = [&](Table t, const ModalityChoice& kept) {
    if (share && kept.sizing >= 0) share->Keep(c, kept);
    if (chosen) *chosen = kept;
    return t;
  };
  bool close = false, moved = false;
  ModalityChoice own_choice;
  PlanHooks::Room room;
  ASSIGN_OR_RETURN(Table own, PlanOnce(c, {.chosen = &own_choice,
                                           .nested_close = &close,
                                           .text_cache = text_cache,
                                           .share = share,
                                           .tail_moved = &moved,
                                           .room = &room}));
  std::optional<Judged> own_judged;  // own's simulation, once
  std::vector<double> over;          // its bytes above the device memory, per rank
  if (moved) {
    // Images moved off the tail are judged by the list scheduler's times and the encoder's
    // saved bytes alone: the same placement without the moves (the sizing and rules the
    // search chose) is simulated too, the better kept.
    ModalityChoice unmoved_choice = own_choice;
    unmoved_choice.tail_moves = false;
    ASSIGN_OR_RETURN(Table unmoved, PlanChosen(c, unmoved_choice, text_cache, share));
    ASSIGN_OR_RETURN(own_judged, Judge(c, own, &over));
    std::vector<double> unmoved_over;
    ASSIGN_OR_RETURN(const Judged other, Judge(c, unmoved, &unmoved_over));
    if (other < *own_judged) {
      own = std::move(unmoved), own_choice = unmoved_choice, own_judged = other;
      over = std::move(unmoved_over);
    }
  }
  // Nested's and bubble-fill's room counts the encoder's saved bytes against the text's
  // peak alone (not a generator's activations, nor when the peaks meet): where the plan
  // runs out of device memory, the ranks above it lose their excess from their room (the
  // room admits whole tasks, so the same excess can leave the same placement: repair k
  // takes 2^k times the excess left) and the images are placed again with the same
  // choice, up to kRoomRepairs times; the best plan is kept (one that fits before one that
  // does not, then the faster). A repair that leaves every rank's room as it was (no room at
  // all, or rooms already down to the largest task) would place the same plan: the repairs
  // stop there.
  if (own_choice.sizing >= 0 && c.schedule.modality != ModalityPolicy::kOptimus) {
    if (!own_judged) {
      ASSIGN_OR_RETURN(own_judged, Judge(c, own, &over));
    }
    ModalityChoice repaired = own_choice;
    for (int k = 0; k < kRoomRepairs && own_judged->oom; ++k) {
      const std::vector<double> before = repaired.room_less;
      repaired.room_less.resize(over.size(), 0);
      for (size_t r = 0; r < over.size(); ++r) repaired.room_less[r] += over[r] * (1 << k);
      if (!room.Differs(before, repaired.room_less)) break;  // also: out of host memory only
      ASSIGN_OR_RETURN(Table t, PlanChosen(c, repaired, text_cache, share));
      ASSIGN_OR_RETURN(const Judged j, Judge(c, t, &over));
      if (j < *own_judged) own = std::move(t), own_choice = repaired, own_judged = j;
    }
  }
  // Bubble-fill still out of memory after its repairs: nested's plan may fit.
  const bool oom =
      c.schedule.modality == ModalityPolicy::kBubbleFill && own_judged && own_judged->oom;
  if (!close && !oom) return done(std::move(own), own_choice);
  Config n = c;
  n.schedule.modality = ModalityPolicy::kNested;
  ModalityChoice nested_choice;
  ASSIGN_OR_RETURN(Table nested, PlanOrdered(n, share, &nested_choice));
  if (!own_judged) {
    ASSIGN_OR_RETURN(own_judged, Judge(c, own));
  }
  ASSIGN_OR_RETURN(const Judged other, Judge(c, nested));
  if (!(other < *own_judged)) return done(std::move(own), own_choice);
  nested.mutable_meta().modality = own.meta().modality;
  nested.mutable_meta().config_yaml = own.meta().config_yaml;
  return done(std::move(nested), nested_choice);
}

// c's plan; under `data.microbatch_order: auto` both orders are planned and simulated and
// the faster kept (one that fits before one that does not; the data's order on a tie), its
// config naming the order it kept. Text-only plans keep the data's order: without images
// the order changes nothing.
StatusOr<Table> PlanPolicy(const Config& c, PlanShare::Impl* share) {
  if (c.data.order != MicrobatchOrder::kAuto) return PlanOrdered(c, share);
  Config drawn = c, light = c;
  drawn.data.order = MicrobatchOrder::kDrawn, light.data.order = MicrobatchOrder::kLightEnds;
  ASSIGN_OR_RETURN(Table kept, PlanOrdered(drawn, share));
  std::string_view name = "drawn";
  if (Multimodal(c)) {
    ASSIGN_OR_RETURN(Table other, PlanOrdered(light, share));
    ASSIGN_OR_RETURN(const bool better, Better(c, kept, other));
    if (better) kept = std::move(other), name = "light_ends";
  }
  ASSIGN_OR_RETURN(YamlDoc doc, YamlDoc::FromString(c.source, kept.meta().config_yaml));
  RETURN_IF_ERROR(doc.ApplySet(fmt::format("data.microbatch_order={}", name)));
  kept.mutable_meta().config_yaml = YamlText(doc).str();
  return kept;
}

struct Trial {
  Table table;
  Metrics metrics;
  std::vector<RankMemory> memory;
};

StatusOr<Trial> TryLevels(const Config& c, const MemoryLevels& m, int* plans,
                          PlanShare::Impl* share) {
  ASSIGN_OR_RETURN(Config k, WithLevels(c, m));
  ASSIGN_OR_RETURN(Table t, PlanPolicy(k, share));
  SimOptions o = SimOptionsFor(k);
  o.exposure = false;
  ASSIGN_OR_RETURN(SimResult r, RunSimulation(t, o));
  ++*plans;
  return Trial{std::move(t), std::move(r.metrics), std::move(r.memory)};
}

// One greedy search over the ladders of c's policies, from `start` (the configured modes'
// trial).
StatusOr<Trial> SearchLadders(const Config& c, const Trial& start, MemoryChoice* mc,
                              PlanShare::Impl* share) {
  MemoryLevels m = LevelsOf(c);
  const int items = static_cast<int>(m.at.size());
  Trial cur = start;
  // Raise: for each rank out of memory, the module (or the gradients) with the most bytes at its
  // peak that can still go up its ladder (each module at most one step per round).
  while (cur.metrics.oom) {
    std::vector<bool> raised(items, false);
    for (size_t r = 0; r < cur.memory.size(); ++r) {
      if (!cur.memory[r].oom) continue;
      const std::array<std::pair<int, int>, 4> owners = {
          std::pair{static_cast<int>(cur.table.ranks()[r].pp), kActText},
          std::pair{m.vision(), kActVision}, std::pair{m.generator(), kActGenerator},
          std::pair{m.gradients(), kGrads}};
      int best = -1;
      double best_bytes = 0;
      for (auto [item, cat] : owners) {
        const double bytes = cur.memory[r].at_peak[cat];
        const bool can = m.at[item] + 1 < m.size(item);
        if (bytes > best_bytes && can && !raised[item]) best = item, best_bytes = bytes;
      }
      if (best >= 0) raised[best] = true, ++m.at[best];
    }
    if (std::find(raised.begin(), raised.end(), true) == raised.end()) break;  // nothing left
    ASSIGN_OR_RETURN(cur, TryLevels(c, m, &mc->plans, share));
  }
  // Lower: each raised module one step down where the plan still fits and is no slower,
  // over all modules again until none moves (a step down frees room for another).
  for (bool moved = !cur.metrics.oom; moved;) {
    moved = false;
    for (int item = 0; item < items;) {
      if (m.at[item] == 0) {
        ++item;
        continue;
      }
      MemoryLevels lower = m;
      --lower.at[item];
      ASSIGN_OR_RETURN(Trial t, TryLevels(c, lower, &mc->plans, share));
      if (t.metrics.oom || t.metrics.step_time_s > cur.metrics.step_time_s) {
        ++item;
      } else {  // kept; the same module may go lower again
        m = std::move(lower);
        cur = std::move(t);
        moved = true;
      }
    }
  }
  mc->text.clear();
  for (int r = 0; r < m.pp; ++r) mc->text.push_back(m.mode(r));
  mc->vision = m.mode(m.vision()), mc->generator = m.mode(m.generator());
  mc->gradients = m.grad();
  mc->gradients_searched = m.grad_ladder.size() > 1;
  mc->has_vision = c.model.vision.enabled, mc->has_generator = c.model.generator.enabled;
  mc->fits = !cur.metrics.oom;
  mc->step_s = cur.metrics.step_time_s;
  mc->peak_bytes = cur.metrics.peak_memory_bytes;
  mc->hbm_bytes = cur.metrics.hbm_bytes;
  return cur;
}

// The greedy search can end worse with more policies (fp8's smaller steps raise more
// modules), so with more than one allowed it runs once per non-empty subset of the allowed
// policies (all of them first) and keeps the fastest plan that fits (or, if none fits, the
// one with the lowest peak).
StatusOr<Table> PlanAutoMemory(const Config& c, MemoryChoice* choice, PlanShare::Impl* share) {
  MemoryChoice best;
  ASSIGN_OR_RETURN(const Trial start, TryLevels(c, LevelsOf(c), &best.plans, share));
  best.start_step_s = start.metrics.step_time_s;
  best.start_peak_bytes = start.metrics.peak_memory_bytes;
  const TrainingConfig& tc = c.training;
  const std::array<bool, 3> allowed = {tc.memory_recompute, tc.memory_fp8, tc.memory_offload};
  std::vector<std::array<bool, 3>> subsets = {allowed};
  for (int bits = 6; bits >= 1; --bits) {
    const std::array<bool, 3> s = {(bits & 4) != 0, (bits & 2) != 0, (bits & 1) != 0};
    bool within = s != allowed;
    for (int k = 0; k < 3; ++k) within = within && (allowed[k] || !s[k]);
    if (within) subsets.push_back(s);
  }
  std::optional<Trial> kept;
  int plans = best.plans;
  for (auto [recompute, fp8, offload] : subsets) {
    Config k = c;
    k.training.memory_recompute = recompute, k.training.memory_fp8 = fp8;
    k.training.memory_offload = offload;
    MemoryChoice mc = best;
    mc.plans = 0;
    ASSIGN_OR_RETURN(Trial t, SearchLadders(k, start, &mc, share));
    plans += mc.plans;
    const bool better = !kept || (mc.fits && !best.fits) ||
                        (mc.fits == best.fits &&
                         (mc.fits ? mc.step_s < best.step_s : mc.peak_bytes < best.peak_bytes));
    if (better) best = mc, kept = std::move(t);
  }
  best.plans = plans;
  if (choice) *choice = best;
  return std::move(kept->table);
}

}  // namespace

StatusOr<Table> BuildPlan(const Config& c, MemoryChoice* choice, PlanShare* shared) {
  PlanShare own_share(0);  // the choices: the memory search plans some configs again
  PlanShare::Impl* share = &(shared ? *shared : own_share).impl();
  if (!c.training.memory_auto) return PlanPolicy(c, share);
  MemoryChoice own;
  ASSIGN_OR_RETURN(Table t, PlanAutoMemory(c, &own, share));
  // Bubble-fill may use every placement nested may, under any modes: nested's own search
  // (its greedy path can differ) is run too and its plan kept, as bubble-fill's, where it
  // fits when bubble-fill's does not or is faster. Its start is bubble-fill's.
  if (c.schedule.modality == ModalityPolicy::kBubbleFill && Multimodal(c)) {
    Config n = c;
    n.schedule.modality = ModalityPolicy::kNested;
    MemoryChoice nested;
    ASSIGN_OR_RETURN(Table nt, PlanAutoMemory(n, &nested, share));
    const int plans = own.plans + nested.plans;
    const bool better = nested.fits != own.fits ? nested.fits
                        : nested.fits           ? nested.step_s < own.step_s
                                                : nested.peak_bytes < own.peak_bytes;
    if (better) {
      ASSIGN_OR_RETURN(YamlDoc doc, YamlDoc::FromString(c.source, nt.meta().config_yaml));
      RETURN_IF_ERROR(doc.ApplySet("schedule.modality=bubble-fill"));
      nt.mutable_meta().modality = t.meta().modality;
      nt.mutable_meta().config_yaml = YamlText(doc).str();
      nested.start_step_s = own.start_step_s, nested.start_peak_bytes = own.start_peak_bytes;
      own = nested, t = std::move(nt);
    }
    own.plans = plans;
  }
  if (choice) *choice = own;
  return t;
}

StatusOr<Table> PlanWithChoice(const Config& c, const ModalityChoice& choice) {
  return PlanChosen(c, choice, nullptr, nullptr);
}

StatusOr<Replanner> Replanner::Start(const Config& c, Options options) {
  Replanner r;
  r.options_ = options;
  r.config_ = c;
  r.text_ = std::make_shared<TextTimeline>();
  PlanShare share(0);
  if (c.training.memory_auto || c.data.order == MicrobatchOrder::kAuto) {
    // The searched modes and order, as the plan's config stores them.
    ASSIGN_OR_RETURN(const Table searched, BuildPlan(c, nullptr, &share));
    ASSIGN_OR_RETURN(r.config_, ConfigOfPlan(searched, c.source));
  }
  ASSIGN_OR_RETURN(r.first_, PlanOrdered(r.config_, &share.impl(), &r.choice_, r.text_.get()));
  if (options.keep_memory) KeepFreedMemory();
  if (!options.check) return r;
  ASSIGN_OR_RETURN(const Judged judged, Judge(r.config_, r.first_));
  r.first_fits_ = !judged.oom;
  r.last_ = ReplanStep{.step_s = judged.step_s, .oom = judged.oom};
  return r;
}

StatusOr<Table> Replanner::Plan(uint64_t seed, const std::string& manifest) {
  last_.reset();
  ASSIGN_OR_RETURN(YamlDoc doc, YamlDoc::FromString(config_.source, config_.resolved_yaml.str()));
  RETURN_IF_ERROR(doc.ApplySet(fmt::format("data.seed={}", seed)));
  Config k = config_;
  k.data.seed = seed;
  if (!manifest.empty()) {
    RETURN_IF_ERROR(doc.ApplySet(fmt::format("data.manifest={}", manifest)));
    k.data.manifest = manifest;
  }
  k.resolved_yaml = YamlText(doc);
  // The list scheduler's second pass beside the lowering: the same plan, sooner.
  bool again = false;
  ASSIGN_OR_RETURN(Table t, PlanChosen(k, choice_, text_.get(), nullptr, &again));
  lowered_again_ += again;
  if (!options_.check) return t;
  ASSIGN_OR_RETURN(Judged judged, Judge(k, t));
  bool searched = false;
  // The first step's choices were searched on its own images: on this step's they can run
  // out of device memory where the first step's plan fits (the list scheduler's room
  // counts the encoder's saved bytes alone; bubble-fill's moves off the tail are judged by
  // its times). Then this step's own search (every search of the first step but the
  // memory modes and the order) is run, and its plan kept where it is better.
  if (judged.oom && first_fits_ && choice_.sizing >= 0) {
    ASSIGN_OR_RETURN(Table own, PlanOrdered(k, nullptr, nullptr, text_.get()));
    ASSIGN_OR_RETURN(const Judged o, Judge(k, own));
    if (o < judged) t = std::move(own), judged = o, searched = true;
  }
  last_ = ReplanStep{.step_s = judged.step_s, .oom = judged.oom, .searched = searched};
  return t;
}

std::string MemoryModeName(MemoryMode m) {
  std::string name(RecomputeName(m.recompute));
  if (m.storage == ActStorage::kFp8) name += "+fp8";
  if (m.place != ActPlace::kDevice) name += fmt::format("+{}", ActPlaceName(m.place));
  return name;
}

bool GradientsMovable(const Config& c) {
  const TrainingConfig& t = c.training;
  return t.memory_auto && t.memory_gradients && c.parallel.dp > 1 && !t.overlap_grad_reduce &&
         t.microbatches < TrainingConfig::kMaxGradMicroBatches;
}

Config WithChoice(Config c, const MemoryChoice& m) {
  if (!c.training.memory_auto) return c;
  c.training.zero_stage = m.gradients.zero_stage, c.training.grad_offload = m.gradients.host;
  return c;
}

std::string GradModeName(GradMode g) {
  return fmt::format("ZeRO-{}{}", g.zero_stage, g.host ? "+host" : "");
}

std::string MemoryChoiceText(const MemoryChoice& m) {
  std::string text;
  for (size_t r = 0; r < m.text.size(); ++r)
    text += fmt::format("{}{}", r ? " " : "", MemoryModeName(m.text[r]));
  std::string modules = fmt::format("LLM by pp rank [{}]", text);
  if (m.has_vision) modules += fmt::format(", vision {}", MemoryModeName(m.vision));
  if (m.has_generator) modules += fmt::format(", generator {}", MemoryModeName(m.generator));
  if (m.gradients_searched) modules += fmt::format(", gradients {}", GradModeName(m.gradients));
  if (!m.fits)
    return fmt::format(
        "does not fit: {} (no module of a rank out of memory can save more) peaks at {:.2f} GiB of "
        "{:.2f} GiB; {} plan{} simulated",
        modules, m.peak_bytes / kGiB, m.hbm_bytes / kGiB, m.plans, m.plans == 1 ? "" : "s");
  return fmt::format(
      "{}: peak {:.2f} GiB of {:.2f} GiB (from {:.2f} GiB), step {:+.3f} s over the "
      "configured modes ({:.3f} -> {:.3f} s); {} plan{} simulated",
      modules, m.peak_bytes / kGiB, m.hbm_bytes / kGiB, m.start_peak_bytes / kGiB,
      m.step_s - m.start_step_s, m.start_step_s, m.step_s, m.plans, m.plans == 1 ? "" : "s");
}

nlohmann::json MemoryChoiceJson(const MemoryChoice& m) {
  nlohmann::json j;
  std::vector<std::string> text;
  for (MemoryMode r : m.text) text.push_back(MemoryModeName(r));
  j["by_pp_rank"] = text;
  if (m.has_vision) j["vision"] = MemoryModeName(m.vision);
  if (m.has_generator) j["generator"] = MemoryModeName(m.generator);
  if (m.gradients_searched) j["gradients"] = GradModeName(m.gradients);
  j["cost_model"] = "real";  // the search's, whatever the simulation's
  j["fits"] = m.fits;
  j["plans_simulated"] = m.plans;
  j["start_step_time_s"] = m.start_step_s;
  j["start_peak_memory_bytes"] = m.start_peak_bytes;
  j["step_time_s"] = m.step_s;
  j["peak_memory_bytes"] = m.peak_bytes;
  j["added_step_time_s"] = m.step_s - m.start_step_s;
  return j;
}

}  // namespace pipeplan
