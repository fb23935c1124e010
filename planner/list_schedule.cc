#include "planner/list_schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <mutex>
#include <queue>
#include <set>
#include <thread>
#include <tuple>

#include "core/parallel.h"
#include "planner/decision_queue.h"

namespace pipeplan {
namespace {

constexpr double kUnknown = -1;
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int kNone = -1;
constexpr int kScan = 16;      // forwards looked at per decision (earliest deadlines first)
constexpr int kTailMoves = 8;  // images moved off the step's tail (ListRules::move_tail)

// Where and when one op of a piece was placed.
struct Slot {
  double at = 0;  // planned start, s
  int pos = 0;    // text position on the rank (the op runs before that text op)
};
struct PieceSlot {
  Slot f, b;
};

// One pass of the list scheduler.
class Pass {
 public:
  // `deadline`: per (d * m + mb), predicted start of the consumer's text F(0, mb);
  // empty = a text-only pass.
  // `moved`: per vision task, the rank it runs on instead of its own (kNone: its own);
  // null = none moved.
  Pass(const ListInput& in, const ModalityWork& w, const ListRules& rules,
       const std::vector<double>& deadline, const std::vector<int>* moved = nullptr)
      : in_(in), w_(w), rules_(rules), s_(in.shape), deadline_(deadline), moved_to_(moved) {}

  // Stops once a rank's clock passes `cutoff` (the makespan is then +inf).
  Status Run(double cutoff = kInf);
  double makespan() const { return makespan_; }
  // Whether a window acted: held a forward back, made a backward due, or woke a parked
  // rank. If not, the same rules without windows make the same decisions.
  bool window_bound() const { return window_bound_; }
  // Start of each consumer's text F(0, mb), per (d * m + mb).
  std::vector<double> ConsumerStarts() const;
  std::vector<VisionPlacement> Placements() const;
  TextTimeline Timeline() const;
  std::vector<std::vector<GeneratorPlacement>> GeneratorPlacements() const;
  // Per rank, its text order as run (W passes pulled into gaps moved there); empty when
  // no W moved.
  std::vector<StageOrder> RankOrders() const;
  // The step's last op where it is the backward of a whole image (not a gang's shard), and
  // the rank that could end that backward first by this pass's times: the rank free
  // earliest at or after the gradient's return, its backward run from then ({kNone, kNone}
  // where the step ends otherwise or no other rank would end it sooner).
  std::pair<int, int> TailMove() const;

 private:
  // A task runs as pieces (layer groups): forwards first to last, backwards last to first.
  struct Job {
    int rank = 0;
    int f_next = 0, b_next = 0;  // pieces placed, forward and backward
    double release = kUnknown;   // when the gradient is back on `rank`
    std::vector<PieceSlot> slots;
    int gang = kNone;
  };
  struct Gang {
    std::vector<int> tasks;  // vision shards (empty for a generator gang)
    int posted = 0;
    double ready = 0;
    int number = 0;  // initiation order (followers post in this order)
    bool backward = false;
    int generator = kNone;   // (d * m + mb) of a generator gang: F and B of every shard
    std::vector<int> ranks;  // its ranks (generator gangs)
  };
  // What the hot paths need of one text op of a stage's order, computed once per pass (a
  // rank reads its own stage's entries; ranks are d * pp + stage).
  struct TextLink {
    enum Wait : uint8_t { kNothing, kVision, kText };  // what its input waits for
    double dur = 0;  // its seconds, without the work after the last stage's F
    int mb = 0;
    int dep_stage = 0;    // kText: the pp stage of the rank whose output it waits for
    int dep_pos = 0;      // ... and the position there of the op whose end sends it
    int wake_stage = -1;  // the pp stage of the rank its output goes to (-1: none)
    Wait wait = kNothing;
    bool after_last_f = false;       // F of the last stage with work right after it
    bool generator_grad = false;     // B of the last stage: waits for the generator's gradient
    bool release_generator = false;  // F of the last stage: starts the generator gang
    bool release_vision = false;     // backward of the first stage: encoder gradients back
    bool first_f = false;            // F of the first stage (a vision window may open)
    bool overlap_next = false, overlap_prev = false;  // halves of an overlapped pair
  };
  void BuildLinks();
  bool Sharded() const { return !in_.gen_shard_s.empty(); }
  void ReleaseGenerator(int r, int mb);
  bool vision() const { return !deadline_.empty(); }
  int Stage(int r) const { return stage_[r]; }
  int Replica(int r) const { return replica_[r]; }
  static bool Backward(OpKind k) { return k == OpKind::kB || k == OpKind::kI; }
  // Position in its stage's order of a text F, or of the backward that produces the input
  // gradient (B, or I of a split backward).
  int PosOf(int stage, OpKind k, int chunk, int mb) const {
    return pos_of_[stage][(static_cast<size_t>(chunk) * s_.m + mb) * 2 + Backward(k)];
  }
  double Duration(int r, int i) const;
  double Transfer(int a, int b) const;
  double ReadyTime(int r) const;
  double ReadyAt(int r, int i) const;
  void Push(int r) { queue_.Push(r, free_[r]); }
  void Wake(int r) {
    if (parked_[r]) parked_[r] = 0, Push(r);
  }
  bool Decide(int r);
  void Park(int r);
  bool FollowDue(int r, bool now);
  bool OwnFirst(int r, double t);
  void RunText(int r, double start);
  void Deliver(int r, int i);
  // Place the task's next piece at `start`; return its seconds.
  double RunForward(int task, int r, double start);
  double RunBackward(int task, double start);
  // `urgent`: a forward due or a backward overdue, or the fallback when every rank waits.
  bool TryGang(int r, int gang, bool urgent);
  std::pair<int, bool> GangBackfill(int r, int g, double t, double until);
  // Whether r's next text op, ready at t, ends before gang g could start (its other
  // members are busy until then): running the text first costs the gang nothing, so r
  // leaves the gang for later and decides as if it were not there. `initiate`: r would
  // start the gang (else it follows it).
  bool TextFirst(int r, int g, double t, bool initiate) const;
  void Post(int r, int gang);
  int PickForward(int r, double t, double gap, bool any_window = false, bool solo = false);
  int PickBackward(int r, double t, double gap);
  int WaitedGang(int r, double t) const;
  int Steal(int r, double t, double gap);
  // Between the two ops of an overlapped pair (dualpipev's F and B run as one unit).
  bool InsidePair(int r) const {
    const auto& order = in_.orders[Stage(r)];
    return pos_[r] > 0 && pos_[r] < static_cast<int>(order.size()) &&
           order[pos_[r] - 1].overlap_next;
  }
  // Phases (optimus): forwards fill gaps only before the rank's first text backward,
  // backwards only after its last text forward.
  bool ForwardPhase(int r) const { return !rules_.phases || pos_[r] <= first_b_[Stage(r)]; }
  bool BackwardPhase(int r) const { return !rules_.phases || pos_[r] > last_f_[Stage(r)]; }
  int Pieces(int task) const {
    return in_.bounds.empty() ? 1 : static_cast<int>(in_.bounds[task].size()) - 1;
  }
  // Share of the task's layers in pieces [from, to).
  double Share(int task, int from, int to) const {
    if (in_.bounds.empty()) return to > from ? 1 : 0;
    const auto& b = in_.bounds[task];
    return double(b[to] - b[from]) / (b.back() - b.front());
  }
  double NextForward(int task) const {
    const int k = jobs_[task].f_next;
    return in_.vf_s[task] * Share(task, k, k + 1);
  }
  double NextBackward(int task) const {
    const int k = Pieces(task) - 1 - jobs_[task].b_next;
    return in_.vb_s[task] * Share(task, k, k + 1);
  }
  bool ForwardDone(int task) const { return jobs_[task].f_next == Pieces(task); }
  bool BackwardDone(int task) const { return jobs_[task].b_next == Pieces(task); }
  double Deadline(int task) const {
    const VisionTask& v = w_.vision[task];
    return deadline_[static_cast<size_t>(v.d) * s_.m + v.mb];
  }
  double LatestStart(int task) const {
    const Job& j = jobs_[task];
    return Deadline(task) - in_.vf_s[task] * Share(task, j.f_next, Pieces(task)) - in_.out_s[task];
  }
  bool WindowOpen(int task, double t) const;
  // Window: the backward of micro-batch m is overdue once its consumer has started the
  // text forward of m + backward_window (bounds the encoder activations alive).
  double PieceBytes(int task, int piece) const {
    return in_.bytes.empty() ? 0 : in_.bytes[task] * Share(task, piece, piece + 1);
  }
  bool OverBudget(int r, double extra) const {
    const bool room =
        !rules_.memory_room_bytes.empty() && alive_[r] + extra > rules_.memory_room_bytes[r];
    return (rules_.memory_budget_bytes > 0 && alive_[r] + extra > rules_.memory_budget_bytes) ||
           room;
  }
  bool BackwardOverdue(int task, double t) const {
    if (jobs_[task].gang == kNone && OverBudget(jobs_[task].rank, 0)) return true;
    const VisionTask& v = w_.vision[task];
    const int w = rules_.backward_window;
    if (w <= 0 || v.mb + w >= s_.m) return false;
    const double st = Start(s_.rank(v.d, 0), PosOf(0, OpKind::kB, 0, v.mb + w));
    const bool due = st != kUnknown && st <= t;
    window_bound_ |= due;
    return due;
  }

  const ListInput& in_;
  const ModalityWork& w_;
  const ListRules& rules_;
  const PipelineShape s_;
  const std::vector<double>& deadline_;
  const std::vector<int>* moved_to_;
  std::vector<std::vector<int>> pos_of_;  // per stage: (chunk, mb, kind) -> position
  std::vector<std::vector<int>> w_pos_;   // per stage: positions of its W passes
  std::vector<int> pos_;
  // Per rank, per text position: a W already run in a gap before its place; and the W
  // moved, each with the position it ran before.
  std::vector<std::vector<uint8_t>> pulled_;
  std::vector<std::vector<std::pair<int, int>>> moved_;  // (W position, ran before)
  bool PullWeight(int r, double t, double gap);
  void Advance(int r) {
    const int n = static_cast<int>(in_.orders[Stage(r)].size());
    while (pos_[r] < n && pulled_[r][pos_[r]]) ++pos_[r];
  }
  std::vector<double> free_;
  // Start and end of rank r's text op i at base_[r] + i (one array: a rank's reads of its
  // producers' ends stay in few cache lines).
  std::vector<double> start_, end_;
  std::vector<size_t> base_;
  double& Start(int r, int i) { return start_[base_[r] + i]; }
  double& End(int r, int i) { return end_[base_[r] + i]; }
  double Start(int r, int i) const { return start_[base_[r] + i]; }
  double End(int r, int i) const { return end_[base_[r] + i]; }
  std::vector<uint8_t> parked_;
  std::vector<int> posted_;  // gang a rank waits in, or kNone
  std::vector<Job> jobs_;
  std::vector<Gang> gangs_;
  int gangs_initiated_ = 0;
  std::vector<std::vector<int>> forwards_;  // per rank: tasks by deadline
  std::vector<size_t> first_open_;          // per rank: index of the first forward not placed
  // Per rank: gangs initiated elsewhere that it has not posted, with the text position
  // the initiator had (the rank posts when it reaches that position: the same gap, since
  // a gang's ranks are one stage of different replicas).
  std::vector<std::vector<std::pair<int, int>>> follow_;
  using Released = std::pair<double, int>;  // (release time, task)
  // Earliest release first; its items can be read in any order (GangBackfill).
  struct ReleasedQueue : std::priority_queue<Released, std::vector<Released>, std::greater<>> {
    const std::vector<Released>& items() const { return c; }
  };
  std::vector<ReleasedQueue> released_;
  std::vector<int> outstanding_;     // per (d, mb): vision forwards not yet placed
  std::vector<double> arrival_;      // per (d, mb): last vision output's arrival
  std::vector<int> consumer_tasks_;  // CSR per (d, mb): tasks
  std::vector<int> consumer_begin_;
  std::set<std::pair<double, int>> stealable_;  // (forward seconds, task)
  DecisionQueue queue_;
  double makespan_ = 0;
  mutable bool window_bound_ = false;
  // Sharded generator, per (d * m + mb): its gang, start and end, and (rank, text position)
  // of each shard.
  std::vector<int> gen_gang_;
  std::vector<double> gen_start_, gen_end_;
  std::vector<std::vector<std::pair<int, int>>> gen_slots_;
  // Parked ranks holding work: (earliest forward deadline or +inf, free time, rank).
  std::priority_queue<std::tuple<double, double, int>, std::vector<std::tuple<double, double, int>>,
                      std::greater<>>
      fallback_;
  std::set<int> followers_;                   // ranks with gangs to follow (follow_ not empty)
  std::vector<int> first_b_, last_f_;         // per stage: text positions
  std::vector<double> alive_;                 // per rank: encoder activation bytes held
  std::vector<double> peak_alive_;            // ... and their peak so far
  std::vector<int> stage_, replica_;          // per rank
  std::vector<std::vector<TextLink>> links_;  // per stage, per text position
};

void Pass::BuildLinks() {
  const int S = s_.stages();
  links_.assign(s_.pp, {});
  for (int s = 0; s < s_.pp; ++s) {
    const StageOrder& order = in_.orders[s];
    auto& links = links_[s];
    links.resize(order.size());
    for (size_t i = 0; i < order.size(); ++i) {
      const Step& st = order[i];
      TextLink& l = links[i];
      const int g = s_.global(st.chunk, s);
      l.mb = st.mb;
      l.overlap_next = st.overlap_next;
      l.overlap_prev = i > 0 && order[i - 1].overlap_next;
      const double paired = in_.pair_s.empty() ? -1 : in_.pair_s[s][i];
      if (paired >= 0 && st.kind != OpKind::kF)
        l.dur = paired;
      else if (st.kind == OpKind::kB)
        l.dur = in_.b_s[g];
      else if (st.kind == OpKind::kI)
        l.dur = in_.i_s[g];
      else if (st.kind == OpKind::kW)
        l.dur = in_.w_s[g];
      else
        l.dur = paired >= 0 ? paired : in_.f_s[g];
      l.after_last_f = st.kind == OpKind::kF && g == S - 1 && !in_.after_last_f_s.empty();
      // The op whose output it waits for: a rank's own op, or the op of another whose
      // output leaves after its overlapped pair's second op.
      auto wait_for = [&](int q_stage, int p) {
        l.wait = TextLink::kText;
        l.dep_stage = q_stage;
        l.dep_pos = p + (q_stage != s && in_.orders[q_stage][p].overlap_next ? 1 : 0);
      };
      if (st.kind == OpKind::kF) {
        if (g > 0) {
          const int q = s_.home(g - 1).pp_rank;
          wait_for(q, PosOf(q, OpKind::kF, s_.home(g - 1).chunk, st.mb));
        } else if (vision()) {
          l.wait = TextLink::kVision;
        }
        if (g < S - 1) l.wake_stage = s_.home(g + 1).pp_rank;
        l.release_generator = g == S - 1 && Sharded();
        l.first_f = g == 0;
      } else if (Backward(st.kind)) {
        if (g < S - 1) {
          const int q = s_.home(g + 1).pp_rank;
          wait_for(q, PosOf(q, OpKind::kB, s_.home(g + 1).chunk, st.mb));
        } else {
          wait_for(s, PosOf(s, OpKind::kF, st.chunk, st.mb));
          l.generator_grad = Sharded();
        }
        if (g > 0) l.wake_stage = s_.home(g - 1).pp_rank;
        l.release_vision = vision() && g == 0;
      }
    }
  }
}

double Pass::Duration(int r, int i) const {
  const TextLink& l = links_[Stage(r)][i];
  if (!l.after_last_f) return l.dur;
  return l.dur + in_.after_last_f_s[static_cast<size_t>(Replica(r)) * s_.m + l.mb];
}

double Pass::Transfer(int a, int b) const {
  if (a == b) return 0;
  return in_.next_p2p_s[std::min(a, b)];
}

// When rank r's next text op may start: kUnknown while an op it waits for is not placed.
// An overlapped pair starts once the inputs of both its ops are in (the lowering receives
// both before the pair).
double Pass::ReadyTime(int r) const {
  const int i = pos_[r];
  const double ready = ReadyAt(r, i);
  if (ready == kUnknown || !in_.orders[Stage(r)][i].overlap_next) return ready;
  const double second = ReadyAt(r, i + 1);
  return second == kUnknown ? kUnknown : std::max(ready, second);
}

// When text op i of rank r has its input: kUnknown while its producer is not placed (the
// output of an overlapped pair's op leaves after the pair's second op).
double Pass::ReadyAt(int r, int i) const {
  const int s = Stage(r);
  const TextLink& l = links_[s][i];
  if (l.wait == TextLink::kNothing) return 0;  // W: after its own I, earlier on the rank
  const size_t k = static_cast<size_t>(Replica(r)) * s_.m + l.mb;
  if (l.wait == TextLink::kVision) return outstanding_[k] > 0 ? kUnknown : arrival_[k];
  const int q = r - s + l.dep_stage;
  const double e = End(q, l.dep_pos);
  if (e == kUnknown) return kUnknown;
  double ready = e + Transfer(q, r);
  if (l.generator_grad && gen_gang_[k] != kNone) {  // the generator's gradient
    const double gen = gen_end_[k];
    if (gen == kUnknown) return kUnknown;
    ready = std::max(ready, gen + in_.gen_in_s[r]);
  }
  return ready;
}

bool Pass::WindowOpen(int task, double t) const {
  if (rules_.window <= 0) return true;
  const VisionTask& v = w_.vision[task];
  const int m = v.mb - rules_.window;
  if (m < 0) return true;
  const int c = s_.rank(v.d, 0);
  const double st = Start(c, PosOf(0, OpKind::kF, 0, m));
  const bool open = st != kUnknown && st <= t;
  window_bound_ |= !open;
  return open;
}

// The unplaced forward on r with the earliest deadline whose window is open at t and that
// fits `gap` (gangs: all of their ranks are free to post). Under a memory budget, forwards
// are admitted in deadline order: when the earliest open one that fits the gap does not fit
// the memory, no later one takes the room it waits for (a later forward would hold its
// bytes until its own backward, long after the earlier one's consumer has stalled the
// pipeline). Bubble-fill's moves of forwards to ranks in a gap (Steal) check the room only.
// `solo`: forwards of gangs are passed over (they still count towards the scan).
int Pass::PickForward(int r, double t, double gap, bool any_window, bool solo) {
  auto& list = forwards_[r];
  size_t& first = first_open_[r];
  while (first < list.size() && ForwardDone(list[first])) ++first;
  for (size_t k = first, seen = 0; k < list.size() && seen < kScan; ++k) {
    const int task = list[k];
    if (ForwardDone(task) || jobs_[task].rank != r) continue;
    ++seen;
    if (solo && jobs_[task].gang != kNone) continue;
    if (NextForward(task) > gap || (!any_window && !WindowOpen(task, t))) continue;
    if (!any_window && OverBudget(r, PieceBytes(task, jobs_[task].f_next))) return kNone;
    return task;
  }
  return kNone;
}

int Pass::PickBackward(int r, double t, double gap) {
  auto& q = released_[r];
  while (!q.empty() && BackwardDone(q.top().second)) q.pop();
  if (q.empty() || q.top().first > t) return kNone;
  const int task = q.top().second;
  return NextBackward(task) <= gap ? task : kNone;
}

// Once r's text is done: a released gang backward of r whose other members are all free
// at t (not waiting in another gang), the earliest released (then the lowest task); kNone
// if none. It runs before r's own backwards, which would otherwise go first when released
// earlier: the members then idle until each of r's own pieces ends (the last micro-batch's
// backward, cut into pieces, is the step's tail).
int Pass::WaitedGang(int r, double t) const {
  int best = kNone;
  double best_release = 0;
  for (const auto& [release, task] : released_[r].items()) {
    const int g = jobs_[task].gang;
    if (release > t || g == kNone || BackwardDone(task)) continue;
    bool free = true;
    for (int other : gangs_[g + 1].tasks) {
      const int q = jobs_[other].rank;
      free = free && free_[q] <= t && posted_[q] == kNone;
    }
    if (free && (best == kNone || std::pair{release, task} < std::pair{best_release, best}))
      best = task, best_release = release;
  }
  return best;
}

int Pass::Steal(int r, double t, double gap) {
  auto it = stealable_.upper_bound({gap, std::numeric_limits<int>::max()});
  for (int tries = 0; tries < kScan && it != stealable_.begin(); ++tries) {
    --it;
    const int task = it->second;
    if (LatestStart(task) >= t && !OverBudget(r, PieceBytes(task, jobs_[task].f_next))) return task;
  }
  return kNone;
}

// The output of rank r's text op i has left r (at r's free time): the ranks that wait for
// it are woken, a generator gang is released, the encoder's gradients go back.
void Pass::Deliver(int r, int i) {
  const int s = Stage(r);
  const TextLink& l = links_[s][i];
  if (l.wake_stage >= 0) Wake(r - s + l.wake_stage);
  if (l.release_generator) ReleaseGenerator(r, l.mb);
  if (l.release_vision) {
    // Gradients of micro-batch l.mb's visual tokens go back to the tasks' ranks.
    const size_t k = static_cast<size_t>(Replica(r)) * s_.m + l.mb;
    for (int j = consumer_begin_[k]; j < consumer_begin_[k + 1]; ++j) {
      const int task = consumer_tasks_[j];
      Job& job = jobs_[task];
      job.release = free_[r] + in_.out_s[task];
      released_[job.rank].push({job.release, task});
      if (parked_[job.rank]) fallback_.push({kInf, free_[job.rank], job.rank});
      if (pos_[job.rank] >= static_cast<int>(in_.orders[Stage(job.rank)].size())) Wake(job.rank);
    }
  }
}

void Pass::RunText(int r, double start) {
  const int s = Stage(r), i = pos_[r];
  const TextLink& l = links_[s][i];
  const double dur = Duration(r, i);
  Start(r, i) = start;
  End(r, i) = start + dur;
  free_[r] = start + dur;
  ++pos_[r];
  Advance(r);
  // The outputs of an overlapped pair leave after its second op.
  if (!l.overlap_next) {
    if (l.overlap_prev) Deliver(r, i - 1);
    Deliver(r, i);
  }
  if (vision() && l.first_f) {
    // A window may have opened for forwards of later micro-batches.
    const size_t k = static_cast<size_t>(Replica(r)) * s_.m + l.mb + rules_.window;
    if (rules_.window > 0 && l.mb + rules_.window < s_.m)
      for (int j = consumer_begin_[k]; j < consumer_begin_[k + 1]; ++j) {
        const int q = jobs_[consumer_tasks_[j]].rank;
        window_bound_ |= parked_[q] != 0;  // without the window it would sleep on
        Wake(q);
      }
  }
  Push(r);
}

double Pass::RunForward(int task, int r, double start) {
  Job& job = jobs_[task];
  const VisionTask& v = w_.vision[task];
  if (job.rank != r) {  // stolen: its later pieces and its backward follow it
    job.rank = r;
    auto& list = forwards_[r];
    auto at = std::upper_bound(list.begin() + first_open_[r], list.end(), task,
                               [&](int a, int b) { return Deadline(a) < Deadline(b); });
    list.insert(at, task);
  }
  if (job.f_next == 0) stealable_.erase({NextForward(task), task});
  const double dur = NextForward(task);
  alive_[r] += PieceBytes(task, job.f_next);
  peak_alive_[r] = std::max(peak_alive_[r], alive_[r]);
  job.slots[job.f_next++].f = {start, pos_[r]};
  if (ForwardDone(task)) {
    const size_t k = static_cast<size_t>(v.d) * s_.m + v.mb;
    arrival_[k] = std::max(arrival_[k], start + dur + (r == s_.rank(v.d, 0) ? 0 : in_.out_s[task]));
    if (--outstanding_[k] == 0) Wake(s_.rank(v.d, 0));
  }
  return dur;
}

double Pass::RunBackward(int task, double start) {
  Job& job = jobs_[task];
  const double dur = NextBackward(task);
  alive_[job.rank] -= PieceBytes(task, Pieces(task) - 1 - job.b_next);
  job.slots[Pieces(task) - 1 - job.b_next++].b = {start, pos_[job.rank]};
  return dur;
}

// Whether r may start gang `g` now: every member is free of other gangs; with
// ListRules::fill_gangs, unless it is urgent, every member is also free now and its next
// text op (where known) is not ready before the gang's next piece would end.
bool Pass::TryGang(int r, int g, bool urgent) {
  if (!follow_[r].empty()) return false;  // it posts the gangs it follows first
  const Gang& gang = gangs_[g];
  const double t = free_[r];
  double dur = 0;
  for (int task : gang.tasks) {
    const int q = jobs_[task].rank;
    if (q != r && posted_[q] != kNone) return false;
    if (gang.backward && jobs_[task].release == kUnknown) return false;
    dur = std::max(dur, gang.backward ? NextBackward(task) : NextForward(task));
  }
  if (!urgent && rules_.fill_gangs)
    for (int task : gang.tasks) {
      const int q = jobs_[task].rank;
      if (q == r) continue;
      if (free_[q] > t) return false;
      if (pos_[q] < static_cast<int>(in_.orders[Stage(q)].size())) {
        const double ready = ReadyTime(q);
        if (ready != kUnknown && ready < t + dur) return false;
      }
    }
  gangs_[g].number = gangs_initiated_++;
  for (int task : gangs_[g].tasks) {
    const int q = jobs_[task].rank;
    if (q == r) continue;
    follow_[q].push_back({g, pos_[r]});
    followers_.insert(q);
    Wake(q);
  }
  Post(r, g);
  return true;
}

bool Pass::TextFirst(int r, int g, double t, bool initiate) const {
  const auto& order = in_.orders[Stage(r)];
  const int n = static_cast<int>(order.size()), p = pos_[r];
  // Not the first op of an overlapped pair (the second would follow it at once).
  if (p >= n || InsidePair(r) || order[p].overlap_next) return false;
  const double ready = ReadyTime(r);
  if (ready == kUnknown || ready > t) return false;
  int next = p + 1;  // r's position after the op (W passes run earlier skipped)
  while (next < n && pulled_[r][next]) ++next;
  const Gang& gang = gangs_[g];
  double start = gang.posted > 0 ? gang.ready : 0;  // the gang starts no earlier
  for (int task : gang.tasks) {
    const int q = jobs_[task].rank;
    if (q == r || posted_[q] == g) continue;
    // Initiated after the op, the gang has its followers post at r's next position: only
    // those already there are not held back by that.
    if (initiate && pos_[q] < next) return false;
    start = std::max(start, free_[q]);
  }
  return t + Duration(r, p) <= start;
}

// The last stage's text forward of `mb` ended: the generator gang of (its replica, mb)
// starts once every rank of the replica has posted it (its input sent to each).
void Pass::ReleaseGenerator(int r, int mb) {
  const int d = Replica(r);
  const size_t k = static_cast<size_t>(d) * s_.m + mb;
  const int g = gen_gang_[k];
  if (g == kNone) return;  // no generation target in this micro-batch
  Gang& gang = gangs_[g];
  gang.number = gangs_initiated_++;
  gang.ready = free_[r];
  for (int q : gang.ranks) {
    gang.ready = std::max(gang.ready, free_[r] + in_.gen_in_s[q]);
    follow_[q].push_back({g, -1});
    followers_.insert(q);
    Wake(q);
  }
}

void Pass::Post(int r, int g) {
  Gang& gang = gangs_[g];
  posted_[r] = g;
  gang.ready = std::max(gang.ready, free_[r]);
  if (gang.generator != kNone) {
    gen_slots_[gang.generator].push_back({r, pos_[r]});
    if (++gang.posted < static_cast<int>(gang.ranks.size())) return;
    const double start = gang.ready, end = start + in_.gen_shard_s[gang.generator];
    gen_start_[gang.generator] = start;
    gen_end_[gang.generator] = end;
    for (int q : gang.ranks) {
      posted_[q] = kNone;
      free_[q] = end;
      Push(q);
    }
    return;
  }
  if (gang.backward)
    for (int task : gang.tasks)
      if (jobs_[task].rank == r) gang.ready = std::max(gang.ready, jobs_[task].release);
  if (++gang.posted < static_cast<int>(gang.tasks.size())) return;
  double dur = 0;
  for (int task : gang.tasks)
    dur = std::max(dur, gang.backward ? NextBackward(task) : NextForward(task));
  const double start = gang.ready;
  gang.posted = 0, gang.ready = 0;  // the next piece posts anew
  for (int task : gang.tasks) {
    const int q = jobs_[task].rank;
    if (gang.backward)
      RunBackward(task, start);
    else
      RunForward(task, q, start);
    posted_[q] = kNone;
    free_[q] = start + dur;
    Push(q);
  }
}

// Before it posts a forward gang it follows, r runs a piece of a forward of its own (not
// a gang's) whose deadline is earlier: the gang waits for r at most that long, where
// posting first would make r's own forward wait for the whole gang.
bool Pass::OwnFirst(int r, double t) {
  if (follow_[r].empty()) return false;
  const auto next = std::min_element(follow_[r].begin(), follow_[r].end(), [&](auto& a, auto& b) {
    return gangs_[a.first].number < gangs_[b.first].number;
  });
  const Gang& gang = gangs_[next->first];
  if (gang.backward || gang.tasks.empty()) return false;
  const int own = PickForward(r, t, kInf);
  if (own == kNone || jobs_[own].gang != kNone || Deadline(own) >= Deadline(gang.tasks[0]))
    return false;
  free_[r] = t + RunForward(own, r, t);
  Push(r);
  return true;
}

// Posts the earliest-initiated gang r follows, when r has reached its position (or
// always, with `now`); without `now`, not while TextFirst holds (r then decides as if it
// followed no gang). Gangs are posted in initiation order on every rank, so no two ranks
// wait for each other.
bool Pass::FollowDue(int r, bool now) {
  if (follow_[r].empty()) return false;
  auto it = std::min_element(follow_[r].begin(), follow_[r].end(), [&](auto& a, auto& b) {
    return gangs_[a.first].number < gangs_[b.first].number;
  });
  if (!now && it->second > pos_[r]) return false;
  const int g = it->first;
  if (!now && TextFirst(r, g, free_[r], false)) return false;
  follow_[r].erase(it);
  if (follow_[r].empty()) followers_.erase(r);
  Post(r, g);
  return true;
}

// One decision of rank r at its free time; false when it parks.
bool Pass::Decide(int r) {
  const double t = free_[r];
  if (posted_[r] != kNone) return true;  // waits in a gang; the gang's start pushes it
  if (InsidePair(r)) {  // the pair's second op follows its first, nothing between them
    const double ready = ReadyTime(r);
    if (ready == kUnknown) {
      Park(r);
      return false;
    }
    RunText(r, std::max(t, ready));
    return true;
  }
  if (vision() && OwnFirst(r, t)) return true;
  if (FollowDue(r, false)) return true;
  const int n = static_cast<int>(in_.orders[Stage(r)].size());
  const bool text_left = pos_[r] < n;
  const double ready = text_left ? ReadyTime(r) : kInf;
  // A forward that must start now to meet its deadline.
  auto run = [&](int task, bool backward, bool urgent) {
    const int g = jobs_[task].gang;
    if (g != kNone) {
      const int gang = backward ? g + 1 : g;
      // Not while r follows gangs started elsewhere: it posts those first (TryGang).
      // r's next text op unknown (it waits for its input): no room before it.
      const double until = !text_left ? kInf : ready == kUnknown ? t : ready;
      if (const auto [solo, solo_backward] =
              follow_[r].empty() ? GangBackfill(r, gang, t, until) : std::pair{kNone, false};
          solo != kNone) {
        free_[r] = t + (solo_backward ? RunBackward(solo, t) : RunForward(solo, r, t));
        Push(r);
        return true;
      }
      return !TextFirst(r, gang, t, true) && TryGang(r, gang, urgent);
    }
    free_[r] = t + (backward ? RunBackward(task, t) : RunForward(task, r, t));
    Push(r);
    return true;
  };
  auto try_run = [&](int task, bool backward, bool urgent = false) {
    return task != kNone && run(task, backward, urgent);
  };
  if (vision()) {
    const int urgent = PickForward(r, t, kInf);
    if (urgent != kNone && LatestStart(urgent) <= t && try_run(urgent, false, true)) return true;
    const int late = PickBackward(r, t, kInf);
    if (late != kNone && BackwardOverdue(late, t) && try_run(late, true, true)) return true;
  }
  if (text_left && ready != kUnknown && ready <= t) {
    RunText(r, t);
    return true;
  }
  // The rank would wait for its text: gangs it follows start now.
  if (FollowDue(r, true)) return true;
  if (text_left && ready == kUnknown) {
    Park(r);  // woken when the op it waits for is placed
    return false;
  }
  // A gap before the next text op (or the text is done): fill it.
  const double gap = text_left ? ready - t : kInf;
  if (!text_left && BackwardPhase(r) && try_run(WaitedGang(r, t), true)) return true;
  if (BackwardPhase(r) && try_run(PickBackward(r, t, gap), true)) return true;
  if (ForwardPhase(r) && try_run(PickForward(r, t, gap), false)) return true;
  if (rules_.steal && text_left && try_run(Steal(r, t, gap), false)) return true;
  if (text_left && vision() && PullWeight(r, t, gap)) return true;
  if (text_left) {
    RunText(r, ready);
    return true;
  }
  // Text done: backwards as they are released.
  if (!released_[r].empty()) {
    const Released next = released_[r].top();
    if (next.first > t) {
      free_[r] = next.first;
      Push(r);
      return true;
    }
    return try_run(next.second, true) || (Park(r), false);
  }
  Park(r);
  return false;
}

// With gang `g` next on r at t (r would start it): work of r's own (no gang) that ends
// before g could start (its other members are busy until then) and by `until` (r's next
// text op): running it first costs the gang nothing. The longest released backward, else the
// forward with the earliest deadline whose window is open (as the phases allow, within the memory
// budget); (task, backward), or kNone.
std::pair<int, bool> Pass::GangBackfill(int r, int g, double t, double until) {
  double latest = 0;
  for (int task : gangs_[g].tasks) {
    const int q = jobs_[task].rank;
    if (q != r) latest = std::max(latest, free_[q]);
  }
  const double room = std::min(until, latest) - t;
  if (room <= 0) return {kNone, false};
  int best = kNone;
  double longest = 0, best_release = 0;
  if (BackwardPhase(r))
    for (const auto& [release, task] : released_[r].items()) {
      if (release > t || jobs_[task].gang != kNone || BackwardDone(task)) continue;
      const double dur = NextBackward(task);
      if (dur > room) continue;
      // The longest; among equals the earliest released, then the lowest task (the heap's
      // storage order is not a rule).
      if (best == kNone || dur > longest ||
          (dur == longest && std::pair{release, task} < std::pair{best_release, best})) {
        best = task, longest = dur, best_release = release;
      }
    }
  if (best != kNone || !ForwardPhase(r)) return {best, true};
  return {PickForward(r, t, room, false, true), false};
}

// Parks r; remembers it for the fallback if it holds work it could run.
void Pass::Park(int r) {
  parked_[r] = 1;
  const int f = PickForward(r, free_[r], kInf, true);
  if (f != kNone)
    fallback_.push({Deadline(f), free_[r], r});
  else if (PickBackward(r, kInf, kInf) != kNone)
    fallback_.push({kInf, free_[r], r});
}

Status Pass::Run(double cutoff) {
  const int R = s_.dp * s_.pp;
  pos_of_.assign(s_.pp, std::vector<int>(static_cast<size_t>(s_.vp) * s_.m * 2, -1));
  w_pos_.assign(s_.pp, {});
  for (int s = 0; s < s_.pp; ++s)
    for (size_t i = 0; i < in_.orders[s].size(); ++i) {
      const Step& st = in_.orders[s][i];
      if (st.kind == OpKind::kW) {
        w_pos_[s].push_back(static_cast<int>(i));
        continue;
      }
      pos_of_[s][(static_cast<size_t>(st.chunk) * s_.m + st.mb) * 2 + Backward(st.kind)] =
          static_cast<int>(i);
    }
  stage_.resize(R), replica_.resize(R);
  for (int r = 0; r < R; ++r) stage_[r] = r % s_.pp, replica_[r] = r / s_.pp;
  BuildLinks();
  pos_.assign(R, 0);
  free_.assign(R, 0.0);
  parked_.assign(R, 0);
  posted_.assign(R, kNone);
  pulled_.resize(R);
  moved_.assign(R, {});
  base_.assign(R + 1, 0);
  for (int r = 0; r < R; ++r) {
    const size_t n = in_.orders[Stage(r)].size();
    base_[r + 1] = base_[r] + n;
    pulled_[r].assign(n, 0);
  }
  start_.assign(base_[R], kUnknown), end_.assign(base_[R], kUnknown);
  follow_.assign(R, {});
  released_.assign(R, {});
  forwards_.assign(R, {});
  first_open_.assign(R, 0);
  const size_t T = vision() ? w_.vision.size() : 0;
  const size_t DM = static_cast<size_t>(s_.dp) * s_.m;
  jobs_.assign(T, Job{});
  outstanding_.assign(DM, 0);
  arrival_.assign(DM, 0.0);
  consumer_begin_.assign(DM + 1, 0);
  consumer_tasks_.assign(T, 0);
  for (size_t i = 0; i < T; ++i) ++consumer_begin_[w_.vision[i].d * s_.m + w_.vision[i].mb + 1];
  for (size_t k = 0; k < DM; ++k) consumer_begin_[k + 1] += consumer_begin_[k];
  {
    std::vector<int> fill(consumer_begin_.begin(), consumer_begin_.end() - 1);
    for (size_t i = 0; i < T; ++i) {
      const VisionTask& v = w_.vision[i];
      const size_t k = static_cast<size_t>(v.d) * s_.m + v.mb;
      consumer_tasks_[fill[k]++] = static_cast<int>(i);
      ++outstanding_[k];
      jobs_[i].rank = moved_to_ && (*moved_to_)[i] != kNone ? (*moved_to_)[i] : v.rank;
      jobs_[i].slots.resize(Pieces(static_cast<int>(i)));
      forwards_[jobs_[i].rank].push_back(static_cast<int>(i));
      if (v.shard < 0 && rules_.steal)
        stealable_.insert({NextForward(static_cast<int>(i)), static_cast<int>(i)});
    }
  }
  // Gangs: forward gang 2k, backward gang 2k + 1, over the shards of one image.
  for (size_t i = 0; i < T;) {
    const VisionTask& v = w_.vision[i];
    if (v.shard < 0) {
      ++i;
      continue;
    }
    Gang f, b;
    size_t j = i;
    for (;
         j < T && w_.vision[j].shard >= 0 && w_.vision[j].mb == v.mb && w_.vision[j].task == v.task;
         ++j) {
      f.tasks.push_back(static_cast<int>(j));
      jobs_[j].gang = static_cast<int>(gangs_.size());
    }
    b = f;
    b.backward = true;
    gangs_.push_back(std::move(f));
    gangs_.push_back(std::move(b));
    i = j;
  }
  if (Sharded()) {
    gen_gang_.assign(DM, kNone), gen_start_.assign(DM, kUnknown), gen_end_.assign(DM, kUnknown);
    gen_slots_.assign(DM, {});
    for (size_t k = 0; k < DM; ++k) {
      if (in_.gen_shard_s[k] < 0) continue;
      Gang gang;
      gang.generator = static_cast<int>(k);
      for (int st = 0; st < s_.pp; ++st)
        gang.ranks.push_back(s_.rank(static_cast<int>(k) / s_.m, st));
      gen_gang_[k] = static_cast<int>(gangs_.size());
      gangs_.push_back(std::move(gang));
    }
  }
  for (int r = 0; r < R; ++r)
    std::stable_sort(forwards_[r].begin(), forwards_[r].end(),
                     [&](int a, int b) { return Deadline(a) < Deadline(b); });
  alive_.assign(R, 0.0);
  peak_alive_.assign(R, 0.0);
  first_b_.assign(s_.pp, 0), last_f_.assign(s_.pp, 0);
  for (int st = 0; st < s_.pp; ++st) {
    const auto& order = in_.orders[st];
    for (int i = static_cast<int>(order.size()) - 1; i >= 0; --i) {
      if (Backward(order[i].kind)) first_b_[st] = i;
      if (order[i].kind == OpKind::kF) last_f_[st] = std::max(last_f_[st], i);
    }
  }
  queue_.Reset(R);
  for (int r = 0; r < R; ++r) Push(r);
  size_t budget = 64 * (T + 16) + 64 * static_cast<size_t>(R) * (in_.orders[0].size() + 4);
  for (;;) {
    while (!queue_.Empty()) {
      if (budget-- == 0) return Internal("modality list scheduler: no progress");
      auto [time, r] = queue_.Pop();
      if (time != free_[r] || parked_[r]) continue;
      if (time > cutoff) {  // free times only grow: the makespan is past the cutoff
        makespan_ = kInf;
        return Status::Ok();
      }
      Decide(r);
    }
    // Everyone waits: gangs are posted by their followers first.
    bool posted = false;
    for (auto it = followers_.begin(); it != followers_.end() && !posted;) {
      const int r = *it++;  // FollowDue may erase r
      if (posted_[r] != kNone) continue;
      parked_[r] = 0;
      posted = FollowDue(r, true);
    }
    if (posted) continue;
    // Everyone parked: of the forwards that parked ranks hold, the one with the earliest
    // deadline runs (a consumer waits for it), windows ignored; else a released backward.
    int best = kNone, task = kNone;
    bool backward = false;
    while (!fallback_.empty() && best == kNone) {
      auto [key, free, r] = fallback_.top();
      fallback_.pop();
      if (!parked_[r] || posted_[r] != kNone || free != free_[r]) continue;
      const int f = PickForward(r, free_[r], kInf, true);
      if (f != kNone && Deadline(f) > key) {  // stale: its earliest forward has changed
        fallback_.push({Deadline(f), free, r});
        continue;
      }
      if (f != kNone) {
        best = r, task = f;
      } else if (const int b = PickBackward(r, kInf, kInf); b != kNone) {
        best = r, task = b, backward = true;
      }
    }
    if (best == kNone) {
      for (int r = 0; r < R; ++r)
        if (parked_[r] && pos_[r] < static_cast<int>(in_.orders[Stage(r)].size()))
          return Internal(fmt::format("modality list scheduler: rank {} cannot progress", r));
      break;
    }
    parked_[best] = 0;
    const int g = jobs_[task].gang;
    if (g != kNone) {
      if (!TryGang(best, backward ? g + 1 : g, true))
        return Internal("modality list scheduler: a gang cannot start");
      continue;
    }
    const double t = backward ? std::max(free_[best], jobs_[task].release) : free_[best];
    free_[best] = t + (backward ? RunBackward(task, t) : RunForward(task, best, t));
    Push(best);
  }
  for (size_t k = 0; k < gen_end_.size(); ++k)
    if (gen_gang_[k] != kNone && gen_end_[k] == kUnknown)
      return Internal(fmt::format("the generator of micro-batch {} was not placed", k));
  for (size_t i = 0; i < T; ++i)
    if (!BackwardDone(static_cast<int>(i)))
      return Internal(fmt::format("vision task {} was not placed", i));
  makespan_ = *std::max_element(free_.begin(), free_.end());
  return Status::Ok();
}

// Weight-gradient passes are fill material too: in a gap no encoder work fits, the rank
// runs the first W of its order whose I has run, when it ends before the next text op is
// ready (it then no longer runs at its own place).
bool Pass::PullWeight(int r, double t, double gap) {
  const auto& order = in_.orders[Stage(r)];
  if (InsidePair(r)) return false;
  const auto& ws = w_pos_[Stage(r)];
  auto first = std::upper_bound(ws.begin(), ws.end(), pos_[r]);
  for (int seen = 0; first != ws.end() && seen < kScan; ++first) {
    const int j = *first;
    const Step& st = order[j];
    if (pulled_[r][j]) continue;
    ++seen;
    const int i = PosOf(Stage(r), OpKind::kI, st.chunk, st.mb);
    if (i >= pos_[r] || End(r, i) == kUnknown) continue;  // its I has not run
    const double dur = Duration(r, j);
    if (dur > gap) continue;
    Start(r, j) = t, End(r, j) = t + dur;
    pulled_[r][j] = 1;
    moved_[r].push_back({j, pos_[r]});
    free_[r] = t + dur;
    Push(r);
    return true;
  }
  return false;
}

std::vector<StageOrder> Pass::RankOrders() const {
  bool any = false;
  for (const auto& m : moved_) any = any || !m.empty();
  if (!any) return {};
  std::vector<StageOrder> out(pos_.size());
  for (size_t r = 0; r < pos_.size(); ++r) {
    const auto& order = in_.orders[Stage(static_cast<int>(r))];
    std::vector<std::vector<int>> before(order.size() + 1);  // position -> W moved there
    for (auto [w, at] : moved_[r]) before[at].push_back(w);
    for (size_t j = 0; j <= order.size(); ++j) {
      for (int w : before[j]) out[r].push_back(order[w]);
      if (j < order.size() && !pulled_[r][j]) out[r].push_back(order[j]);
    }
  }
  return out;
}

std::vector<double> Pass::ConsumerStarts() const {
  std::vector<double> out(static_cast<size_t>(s_.dp) * s_.m, 0.0);
  for (int d = 0; d < s_.dp; ++d)
    for (int m = 0; m < s_.m; ++m)
      out[static_cast<size_t>(d) * s_.m + m] = Start(s_.rank(d, 0), PosOf(0, OpKind::kF, 0, m));
  return out;
}

std::vector<VisionPlacement> Pass::Placements() const {
  auto anchor = [&](int r, const Slot& at) {
    const auto& order = in_.orders[Stage(r)];
    if (at.pos >= static_cast<int>(order.size())) return Anchor{OpKind::kF, 0, -1, false};
    return Anchor{order[at.pos].kind, order[at.pos].chunk, order[at.pos].mb, false};
  };
  std::vector<VisionPlacement> out;
  out.reserve(jobs_.size());
  for (const Job& j : jobs_) {
    VisionPlacement p;
    p.rank = j.rank;
    for (const PieceSlot& slot : j.slots)
      p.pieces.push_back({anchor(j.rank, slot.f), anchor(j.rank, slot.b), slot.f.at, slot.b.at});
    p.f = p.pieces.front().f, p.b = p.pieces.back().b;  // the whole task's extent
    p.f_at = p.pieces.front().f_at, p.b_at = p.pieces.back().b_at;
    if (p.pieces.size() == 1) p.pieces.clear();
    out.push_back(std::move(p));
  }
  return out;
}

std::pair<int, int> Pass::TailMove() const {
  int tail = kNone;
  double end = -kInf;
  for (size_t i = 0; i < jobs_.size(); ++i) {
    const Job& j = jobs_[i];
    if (j.gang != kNone || j.slots.empty() || !BackwardDone(static_cast<int>(i))) continue;
    const int task = static_cast<int>(i);
    const double e = j.slots[0].b.at + in_.vb_s[task] * Share(task, 0, 1);
    if (e > end) tail = task, end = e;
  }
  if (tail == kNone || end < makespan_) return {kNone, kNone};
  const Job& j = jobs_[tail];
  const double work = in_.vb_s[tail];
  int to = kNone;
  double best = end;
  const double bytes = in_.bytes.empty() ? 0 : in_.bytes[tail];
  for (int r = 0; r < static_cast<int>(free_.size()); ++r) {
    const double at = std::max(j.release, free_[r]) + work;
    // The image's activations on top of the rank's peak stay within its budget and room.
    const double held = peak_alive_[r] + bytes;
    const bool fits = (rules_.memory_budget_bytes <= 0 || held <= rules_.memory_budget_bytes) &&
                      (rules_.memory_room_bytes.empty() || held <= rules_.memory_room_bytes[r]);
    if (r != j.rank && at < best && fits) to = r, best = at;
  }
  return {to == kNone ? kNone : tail, to};
}

TextTimeline Pass::Timeline() const {
  TextTimeline tl;
  tl.busy.resize(pos_.size());
  for (size_t r = 0; r < pos_.size(); ++r)
    for (size_t i = base_[r]; i < base_[r + 1]; ++i) tl.busy[r].push_back({start_[i], end_[i]});
  for (size_t k = 0; k < gen_slots_.size(); ++k)
    for (auto [r, pos] : gen_slots_[k]) tl.busy[r].push_back({gen_start_[k], gen_end_[k]});
  for (auto& b : tl.busy) {
    std::sort(b.begin(), b.end());
    if (!b.empty()) tl.end = std::max(tl.end, b.back().second);
  }
  tl.due = ConsumerStarts();
  tl.release.assign(tl.due.size(), 0.0);
  for (int d = 0; d < s_.dp; ++d)
    for (int m = 0; m < s_.m; ++m)
      tl.release[static_cast<size_t>(d) * s_.m + m] =
          End(s_.rank(d, 0), PosOf(0, OpKind::kB, 0, m));
  return tl;
}

std::vector<std::vector<GeneratorPlacement>> Pass::GeneratorPlacements() const {
  std::vector<std::vector<GeneratorPlacement>> out(gen_slots_.size());
  for (size_t k = 0; k < gen_slots_.size(); ++k)
    for (auto [r, pos] : gen_slots_[k]) {
      const auto& order = in_.orders[Stage(r)];
      GeneratorPlacement p;
      p.rank = r, p.shard = Stage(r), p.at = gen_start_[k];
      p.f = pos >= static_cast<int>(order.size())
                ? Anchor{OpKind::kF, 0, -1, false}
                : Anchor{order[pos].kind, order[pos].chunk, order[pos].mb, false};
      p.b = p.f;
      out[k].push_back(p);
    }
  return out;
}

}  // namespace

namespace {

// `w` null: the text part of `in` only.
// `text` (where given): the text-only pass the placement starts from.
Status CheckInput(const ListInput& in, const ModalityWork* w, const TextTimeline* text = nullptr) {
  if (text && text->due.size() != static_cast<size_t>(in.shape.dp) * in.shape.m)
    return Internal("modality list scheduler: a text timeline of another pipeline");
  const PipelineShape& sh = in.shape;
  const size_t T = w ? w->vision.size() : in.vf_s.size(), R = static_cast<size_t>(sh.dp) * sh.pp;
  const size_t DM = static_cast<size_t>(sh.dp) * sh.m;
  auto sized = [](const auto& v, size_t n, bool may_be_empty) {
    return v.size() == n || (may_be_empty && v.empty());
  };
  if (!sized(in.orders, sh.pp, false) || !sized(in.f_s, sh.stages(), false) ||
      !sized(in.b_s, sh.stages(), false) || !sized(in.next_p2p_s, R, false) ||
      !sized(in.i_s, sh.stages(), true) || !sized(in.w_s, sh.stages(), true) ||
      !sized(in.vf_s, T, false) || !sized(in.vb_s, T, false) || !sized(in.out_s, T, false) ||
      !sized(in.bounds, T, true) || !sized(in.bytes, T, true) ||
      !sized(in.after_last_f_s, DM, true) || !sized(in.gen_shard_s, DM, true) ||
      (!in.gen_shard_s.empty() && !sized(in.gen_in_s, R, false)) || !sized(in.pair_s, sh.pp, true))
    return Internal("modality list scheduler: inputs of inconsistent sizes");
  for (size_t st = 0; st < in.pair_s.size(); ++st)
    if (in.pair_s[st].size() != in.orders[st].size())
      return Internal("modality list scheduler: inputs of inconsistent sizes");
  for (const StageOrder& o : in.orders)
    for (const Step& st : o)
      if ((st.kind == OpKind::kI || st.kind == OpKind::kW) && in.i_s.empty())
        return Internal("modality list scheduler: a split backward without I and W times");
  if (w)
    for (const VisionTask& v : w->vision)
      if (v.rank < 0 || static_cast<size_t>(v.rank) >= R || v.d < 0 || v.d >= sh.dp || v.mb < 0 ||
          v.mb >= sh.m)
        return Internal("modality list scheduler: a vision task outside the pipeline");
  return Status::Ok();
}

// Index of the alternative before `b` that differs from it only by its windows (b has
// none), or -1; with `same`, only among those for which it holds. Passes of the two are the
// same decisions until a window binds.
int WindowTwin(const std::vector<ListRules>& alternatives, size_t b,
               const std::function<bool(size_t)>& same = {}) {
  const ListRules& rb = alternatives[b];
  if (rb.window != 0 || rb.backward_window != 0) return -1;
  for (size_t a = 0; a < b; ++a) {
    ListRules ra = alternatives[a];
    if ((ra.window == 0 && ra.backward_window == 0) || (same && !same(a))) continue;
    ra.window = ra.backward_window = 0;
    if (ra == rb) return static_cast<int>(a);
  }
  return -1;
}

constexpr int kRepeat = -2;  // RunTwins: an item that repeats an earlier one

// Runs items 0..n-1 of a list of rule sets (`run(i)`), on the machine's cores: first those
// without a window twin (`twin[i]` -1), then each item whose twin (`twin[i]`, an earlier
// item) met a window in its run (`acted(twin[i])`): where it met none, the item would make
// its twin's decisions (WindowTwin) and does not run. Items marked kRepeat do not run. With
// `eager`, items with a twin run beside the others (the machine has cores to spare; a run
// that could have been skipped repeats its twin's result). Returns, per item, whether it ran.
StatusOr<std::vector<uint8_t>> RunTwins(const std::vector<int>& twin,
                                        const std::function<Status(size_t)>& run,
                                        const std::function<bool(size_t)>& acted, bool eager) {
  std::vector<uint8_t> ran(twin.size(), 0);
  std::vector<Status> status(twin.size(), Status::Ok());
  auto round = [&](const std::vector<size_t>& items) -> Status {
    RunParallel(items.size(), [&](size_t k) { status[items[k]] = run(items[k]); });
    for (size_t i : items) {
      RETURN_IF_ERROR(status[i]);
      ran[i] = 1;
    }
    return Status::Ok();
  };
  std::vector<size_t> first, second;
  for (size_t i = 0; i < twin.size(); ++i)
    if (twin[i] != kRepeat) (twin[i] < 0 || eager ? first : second).push_back(i);
  RETURN_IF_ERROR(round(first));
  std::erase_if(second, [&](size_t i) { return !acted(static_cast<size_t>(twin[i])); });
  RETURN_IF_ERROR(round(second));
  return ran;
}

}  // namespace

StatusOr<TextTimeline> ScheduleText(const ListInput& in) {
  const ModalityWork none_work;
  RETURN_IF_ERROR(CheckInput(in, nullptr));
  // Rules do not act without modality work; a Pass keeps references to its arguments.
  const ListRules rules;
  const std::vector<double> none;
  Pass text(in, none_work, rules, none);
  RETURN_IF_ERROR(text.Run());
  return text.Timeline();
}

StatusOr<ListResult> ScheduleModality(const ListInput& in, const ModalityWork& w,
                                      const std::vector<ListRules>& alternatives,
                                      const TextTimeline& text) {
  RETURN_IF_ERROR(CheckInput(in, &w, &text));
  // Each alternative repeats passes while its makespan improves and keeps its best pass.
  // Alternatives are independent: they run on the machine's cores. The winner is the
  // shortest makespan, the first alternative among equals (as one after the other would
  // pick); only the winner so far keeps its placements. An alternative without windows
  // whose twin with windows never met one would repeat the twin's passes exactly and lose
  // the tie: it runs (in a second round) only when a window bound the twin. A repeat of an
  // earlier alternative does not run.
  ListResult best;
  best.makespan_s = kInf;
  best.alternative_s.assign(alternatives.size(), kInf);
  best.first_pass_s.assign(alternatives.size(), kInf);
  size_t best_index = alternatives.size();
  std::vector<uint8_t> window_bound(alternatives.size(), 0);
  // The winner's best pass: its deadlines and the move of its tail (Pass::TailMove).
  std::vector<double> best_deadline;
  std::pair<int, int> best_tail{kNone, kNone};
  std::mutex mu;
  auto run = [&](size_t a) -> Status {
    const ListRules& rules = alternatives[a];
    ListResult mine;
    mine.makespan_s = kInf;
    std::vector<double> deadline = text.due, mine_deadline, mine_next;
    std::pair<int, int> mine_tail{kNone, kNone};
    double last = kInf;
    for (int k = 0; k < std::max(1, rules.passes); ++k) {
      Pass p(in, w, rules, deadline);
      RETURN_IF_ERROR(p.Run());
      ++mine.passes;
      window_bound[a] |= p.window_bound();
      if (k == 0) best.first_pass_s[a] = p.makespan();  // each alternative its own slot
      if (p.makespan() >= last) break;
      last = p.makespan();
      if (last < mine.makespan_s) {
        mine.makespan_s = last;
        mine.vision = p.Placements();
        mine.generator = p.GeneratorPlacements();
        mine.rank_orders = p.RankOrders();
        if (rules.move_tail) mine_deadline = deadline, mine_tail = p.TailMove();
      }
      deadline = p.ConsumerStarts();
      if (k + 1 == std::max(1, rules.passes)) mine_next = std::move(deadline);
    }
    std::lock_guard<std::mutex> lock(mu);
    best.passes += mine.passes;
    best.alternative_s[a] = mine.makespan_s;
    if (mine.makespan_s < best.makespan_s ||
        (mine.makespan_s == best.makespan_s && a < best_index)) {
      best_index = a;
      best.makespan_s = mine.makespan_s;
      best.vision = std::move(mine.vision);
      best.generator = std::move(mine.generator);
      best.rank_orders = std::move(mine.rank_orders);
      best_deadline = std::move(mine_deadline), best_tail = mine_tail;
      best.next_deadline = std::move(mine_next);
    }
    return Status::Ok();
  };
  std::vector<int> twin(alternatives.size());
  for (size_t a = 0; a < alternatives.size(); ++a) {
    const auto begin = alternatives.begin();
    const bool repeat = std::find(begin, begin + a, alternatives[a]) != begin + a;
    twin[a] = repeat ? kRepeat : WindowTwin(alternatives, a);
  }
  const auto acted = [&](size_t a) { return window_bound[a] != 0; };
  RETURN_IF_ERROR(RunTwins(twin, run, acted, false).status());
  best.text_makespan_s = text.end;
  best.alternative = static_cast<int>(best_index);
  best.tail_deadline = std::move(best_deadline);
  std::tie(best.tail_task, best.tail_rank) = best_tail;
  best.unmoved_s = best.makespan_s;
  if (best_index < alternatives.size() && alternatives[best_index].move_tail)
    RETURN_IF_ERROR(MoveTail(in, w, alternatives[best_index], &best));
  return best;
}

StatusOr<bool> NextPassFaster(const ListInput& in, const ModalityWork& w, const ListRules& rules,
                              const std::vector<double>& deadline, double makespan_s) {
  Pass p(in, w, rules, deadline);
  RETURN_IF_ERROR(p.Run(makespan_s));  // past it the pass cannot be faster
  return p.makespan() < makespan_s;
}

Status MoveTail(const ListInput& in, const ModalityWork& w, const ListRules& rules,
                ListResult* placed) {
  // Moves go on while the makespan does not grow (images of several replicas can end
  // together: each move takes one off the tail). They stop at a move already made (the
  // image stolen back by another rank in the pass: the same pass again).
  std::vector<int> moved(w.vision.size(), kNone);
  std::pair<int, int> tail{placed->tail_task, placed->tail_rank};
  double now = placed->makespan_s;
  for (int k = 0; k < kTailMoves && tail.first != kNone; ++k) {
    if (moved[tail.first] == tail.second) break;
    moved[tail.first] = tail.second;
    Pass p(in, w, rules, placed->tail_deadline, &moved);
    RETURN_IF_ERROR(p.Run());
    ++placed->passes;
    if (p.makespan() > now) break;
    now = p.makespan();
    tail = p.TailMove();
    if (!(now < placed->makespan_s)) continue;
    placed->tail_moves = k + 1;
    placed->makespan_s = now;
    placed->vision = p.Placements();
    placed->generator = p.GeneratorPlacements();
    placed->rank_orders = p.RankOrders();
  }
  return Status::Ok();
}

StatusOr<std::vector<double>> Probe(const std::vector<ListProbe>& probes,
                                    const TextTimeline& text) {
  std::vector<double> makespan(probes.size(), kInf);
  std::vector<uint8_t> window_bound(probes.size(), 0);
  for (size_t i = 0; i < probes.size(); ++i) {
    RETURN_IF_ERROR(CheckInput(*probes[i].in, probes[i].work, &text));
  }
  auto run = [&](size_t i) -> Status {
    const ListProbe& x = probes[i];
    Pass p(*x.in, *x.work, x.rules, text.due);
    RETURN_IF_ERROR(p.Run(x.bound));
    makespan[i] = p.makespan();
    window_bound[i] = p.window_bound();
    return Status::Ok();
  };
  // A probe's window twin: the same images and bound, its rules with windows (a pass
  // stopped at the bound before a window met it would stop there without windows too).
  std::vector<ListRules> rules;
  for (const ListProbe& x : probes) rules.push_back(x.rules);
  std::vector<int> twin(probes.size());
  for (size_t i = 0; i < probes.size(); ++i)
    twin[i] = WindowTwin(rules, i, [&](size_t a) {
      return probes[a].in == probes[i].in && probes[a].work == probes[i].work &&
             probes[a].bound == probes[i].bound;
    });
  const bool eager = probes.size() <= std::max(1u, std::thread::hardware_concurrency());
  const auto acted = [&](size_t i) { return window_bound[i] != 0; };
  ASSIGN_OR_RETURN(const std::vector<uint8_t> ran, RunTwins(twin, run, acted, eager));
  for (size_t i = 0; i < probes.size(); ++i)
    if (!ran[i]) makespan[i] = makespan[twin[i]];
  return makespan;
}

StatusOr<ListResult> ScheduleModality(const ListInput& in, const ModalityWork& w,
                                      const ListRules& rules) {
  ASSIGN_OR_RETURN(TextTimeline text, ScheduleText(in));
  return ScheduleModality(in, w, std::vector<ListRules>{rules}, text);
}

}  // namespace pipeplan
