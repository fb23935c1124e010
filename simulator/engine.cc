#include "simulator/engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <unordered_map>

#include "core/memory.h"

namespace pipeplan {
namespace {

enum State : uint8_t { kIdle = 0, kPosted = 1, kDone = 2 };
constexpr uint32_t kNone = UINT32_MAX;

class Engine {
 public:
  Engine(const Table& t, const std::vector<double>& dur, const EngineIndex& index, Timeline reuse,
         const Module* without)
      : t_(t), dur_(dur), ix_(index), tl_(std::move(reuse)), without_(without) {}

  StatusOr<Timeline> Run() {
    const size_t n = t_.size();
    const int32_t R = t_.num_ranks();
    // Every op's start and end are written before it counts as done (a deadlock discards
    // the timeline), so reused buffers need no clearing.
    ResizeHuge(tl_.start, n);
    ResizeHuge(tl_.end, n);
    ResizeHuge(state_, n);
    std::fill(state_.begin(), state_.end(), kIdle);
    if (without_ != nullptr)  // absent: done at time 0, nothing waits for them
      for (OpId i = 0; i < n; ++i)
        if (t_.module(i) == *without_) Finish(i, 0, 0);
    const size_t C = ix_.inst_begin.size() - 1;
    posted_.assign(C, 0);
    ready_.assign(C, 0.0);
    cursor_.resize(R);
    stream_end_.assign(R, {});
    queued_.assign(R, 1);
    blocked_.assign(kNumStreams * static_cast<size_t>(R), kNone);
    streams_ = 2;  // the host copy streams are walked only in plans that have copies
    for (OpId i = 0; i < n && streams_ == 2; ++i)
      if (IsCopy(t_.kind(i))) streams_ = kNumStreams;
    waiters_.assign(R, {});
    for (int32_t r = 0; r < R; ++r) {
      cursor_[r].fill(t_.rank_begin(r));
      queue_.push_back(r);
    }
    while (!queue_.empty()) {
      int32_t r = queue_.back();
      queue_.pop_back();
      queued_[r] = 0;
      Advance(r);
    }
    if (done_ != n) return Deadlock();
    return std::move(tl_);
  }

 private:
  void Enqueue(int32_t r) {
    if (!queued_[r]) queued_[r] = 1, queue_.push_back(r);
  }

  // Latest end of i's dependencies, or -1 if one has not ended (a stream waiting on another
  // rank's op is woken when that rank next advances and the op has ended).
  double DepsEnd(OpId i, int stream) {
    double e = 0;
    for (OpId d : t_.deps(i)) {
      if (state_[d] != kDone) {
        const int32_t r = t_.rank(i), q = t_.rank(d);
        OpId& blocked = blocked_[kNumStreams * r + stream];
        if (q != r && blocked != d) waiters_[q].push_back({r, d});
        blocked = d;
        return -1;
      }
      e = std::max(e, tl_.end[d]);
    }
    return e;
  }

  void Finish(OpId i, double start, double duration) {
    tl_.start[i] = start;
    tl_.end[i] = start + duration;
    state_[i] = kDone;
    ++done_;
  }

  // Every op of rank r that ends is followed by a call of Advance(r) (here, or through the
  // queue): ranks waiting on one of its ops are woken at its end.
  void Advance(int32_t r) {
    bool progress = true;
    while (progress) {
      progress = AdvanceCompute(r);
      for (int s = 1; s < streams_; ++s) progress |= AdvanceSide(r, static_cast<Stream>(s));
    }
    auto& w = waiters_[r];
    for (size_t k = 0; k < w.size();) {
      if (state_[w[k].second] == kDone) {
        Enqueue(w[k].first);
        w[k] = w.back();
        w.pop_back();
      } else {
        ++k;
      }
    }
  }

  bool AdvanceCompute(int32_t r) {
    const OpId end = t_.rank_end(r);
    OpId& i = cursor_[r][0];
    double& stream_end = stream_end_[r][0];
    bool progress = false;
    for (;;) {
      while (i < end && StreamOf(t_.kind(i)) != Stream::kCompute) ++i;
      if (i >= end) return progress;
      const OpKind k = t_.kind(i);
      if (IsP2P(k)) {
        if (state_[i] == kIdle) PostRun(r, i, stream_end);
        // Sends are eager: the stream moves on. The op after a run waits for its receives.
        if (IsRecv(k)) {
          if (state_[i] != kDone) return progress;
          stream_end = std::max(stream_end, tl_.end[i]);
        }
        ++i;
        progress = true;
        continue;
      }
      if (state_[i] == kIdle) {
        double deps = DepsEnd(i, 0);
        if (deps < 0) return progress;
        if (ix_.instance[i] != kNone)
          Post(i, std::max(stream_end, deps), r);  // a gang: all members at once
        else
          Finish(i, std::max(stream_end, deps), dur_[i]);
      }
      if (state_[i] != kDone) return progress;
      stream_end = std::max(stream_end, tl_.end[i]);  // an absent op ended at 0
      ++i;
      progress = true;
    }
  }

  // Posts a collective or gang op ready at `at`; the last member to post starts them all.
  void Post(OpId i, double at, int32_t r) {
    state_[i] = kPosted;
    tl_.start[i] = at;
    const uint32_t c = ix_.instance[i];
    ready_[c] = std::max(ready_[c], at);
    const uint32_t b = ix_.inst_begin[c], e = ix_.inst_begin[c + 1];
    if (++posted_[c] < e - b) return;
    double d = 0;
    for (uint32_t k = b; k < e; ++k) d = std::max(d, dur_[ix_.inst_members[k]]);
    for (uint32_t k = b; k < e; ++k) {
      const OpId m = ix_.inst_members[k];
      Finish(m, ready_[c], d);
      if (t_.rank(m) != r) Enqueue(t_.rank(m));
    }
  }

  void PostRun(int32_t r, OpId from, double at) {
    for (OpId j = from; j < t_.rank_end(r); ++j) {
      const OpKind k = t_.kind(j);
      if (IsCollective(k)) continue;
      if (!IsP2P(k)) break;
      if (state_[j] != kIdle) continue;
      state_[j] = kPosted;
      tl_.start[j] = at;  // post time until matched
      OpId partner = ix_.partner[j];
      if (partner == kNone || state_[partner] != kPosted) continue;
      double start = std::max(at, tl_.start[partner]);
      double d = std::max(dur_[j], dur_[partner]);
      Finish(j, start, d);
      Finish(partner, start, d);
      Enqueue(t_.peer(j));  // the partner's rank (IndexForEngine checks it)
    }
  }

  // The collective stream (members post, the last one starts the instance) or a host copy
  // stream (an op starts when its stream and dependencies allow).
  bool AdvanceSide(int32_t r, Stream stream) {
    const int s = static_cast<int>(stream);
    const OpId end = t_.rank_end(r);
    OpId& i = cursor_[r][s];
    double& stream_end = stream_end_[r][s];
    bool progress = false;
    for (;;) {
      while (i < end && StreamOf(t_.kind(i)) != stream) ++i;
      if (i >= end) return progress;
      if (state_[i] == kIdle) {
        double deps = DepsEnd(i, s);
        if (deps < 0) return progress;
        if (stream == Stream::kCollective)
          Post(i, std::max(stream_end, deps), r);
        else
          Finish(i, std::max(stream_end, deps), dur_[i]);
      }
      if (state_[i] != kDone) return progress;
      stream_end = std::max(stream_end, tl_.end[i]);  // an absent op ended at 0
      ++i;
      progress = true;
    }
  }

  Status Deadlock() const {
    std::string msg = fmt::format("deadlock: {} of {} ops can never start; blocked ranks wait on:",
                                  t_.size() - done_, t_.size());
    int shown = 0;
    for (int32_t r = 0; r < t_.num_ranks() && shown < 16; ++r) {
      for (int s = 0; s < kNumStreams; ++s) {
        OpId i = cursor_[r][s];
        while (i < t_.rank_end(r) && static_cast<int>(StreamOf(t_.kind(i))) != s) ++i;
        if (i >= t_.rank_end(r) || state_[i] == kDone) continue;
        std::string why;
        if (IsP2P(t_.kind(i)))
          why = "a SEND that is never posted";
        else if (IsCollective(t_.kind(i)))
          why = state_[i] == kPosted ? "other group members" : "a dependency";
        else
          why = "a dependency";
        msg += fmt::format("\n  {} (waits for {})", t_.str(i), why);
        ++shown;
      }
    }
    for (OpId i = 0; i < t_.size() && shown < 16; ++i)
      if (state_[i] != kDone && IsSend(t_.kind(i)))
        msg += fmt::format("\n  {} (its receiver never posts)", t_.str(i)), ++shown;
    return InvalidPlan(msg);
  }

  const Table& t_;
  const std::vector<double>& dur_;
  const EngineIndex& ix_;
  Timeline tl_;
  const Module* without_;
  std::vector<uint8_t> state_;
  std::vector<uint32_t> posted_;  // per instance: members posted
  std::vector<double> ready_;     // per instance: latest post time
  std::vector<std::array<OpId, kNumStreams>> cursor_;
  std::vector<std::array<double, kNumStreams>> stream_end_;
  int streams_ = 2;  // streams walked: compute and collective, and the copy streams if any
  std::vector<uint8_t> queued_;
  std::vector<int32_t> queue_;
  std::vector<OpId> blocked_;  // per rank and stream: the dependency it last waited on
  // Per rank: (rank, op of this rank it waits on).
  std::vector<std::vector<std::pair<int32_t, OpId>>> waiters_;
  size_t done_ = 0;
};

}  // namespace

StatusOr<EngineIndex> IndexForEngine(const Table& t) {
  const size_t n = t.size();
  EngineIndex ix;
  ResizeHuge(ix.partner, n);
  ResizeHuge(ix.instance, n);
  std::fill(ix.partner.begin(), ix.partner.end(), kNone);
  std::fill(ix.instance.begin(), ix.instance.end(), kNone);
  for (OpId i = 0; i < n; ++i) {
    if (!IsRecv(t.kind(i))) continue;
    const OpId s = t.send_of(i);
    if (s == kNone) return InvalidPlan(fmt::format("{}: has no matching SEND", t.str(i)));
    if (t.peer(i) != t.rank(s) || t.peer(s) != t.rank(i))
      return InvalidPlan(fmt::format("{}: its SEND {} names another rank", t.str(i), t.str(s)));
    ix.partner[s] = i, ix.partner[i] = s;
  }
  // Instances by (group, tag), numbered in order of their first op; members in op order.
  std::unordered_map<uint64_t, uint32_t> index;
  std::vector<uint32_t> count;
  for (OpId i = 0; i < n; ++i) {
    if (!t.grouped(i)) continue;
    const uint64_t key = static_cast<uint64_t>(t.peer(i)) << 32 | t.tag(i);
    auto [it, inserted] = index.emplace(key, static_cast<uint32_t>(count.size()));
    if (inserted) count.push_back(0);
    ++count[it->second];
    ix.instance[i] = it->second;
  }
  ix.inst_begin.assign(count.size() + 1, 0);
  for (size_t c = 0; c < count.size(); ++c) ix.inst_begin[c + 1] = ix.inst_begin[c] + count[c];
  ix.inst_members.resize(ix.inst_begin.back());
  std::vector<uint32_t> fill(ix.inst_begin.begin(), ix.inst_begin.end() - 1);
  for (OpId i = 0; i < n; ++i)
    if (ix.instance[i] != kNone) ix.inst_members[fill[ix.instance[i]]++] = i;
  for (size_t c = 0; c < count.size(); ++c) {
    const OpId first = ix.inst_members[ix.inst_begin[c]];
    const size_t size = t.group(t.peer(first)).size();
    if (count[c] != size)
      return InvalidPlan(
          fmt::format("{}: {} of the group's {} ranks take part", t.str(first), count[c], size));
  }
  return ix;
}

StatusOr<Timeline> Simulate(const Table& t, const std::vector<double>& durations,
                            const EngineIndex& index, Timeline reuse) {
  if (durations.size() != t.size() || index.partner.size() != t.size())
    return Internal("durations or index do not match the table");
  return Engine(t, durations, index, std::move(reuse), nullptr).Run();
}

StatusOr<Timeline> SimulateWithout(const Table& t, const std::vector<double>& durations,
                                   const EngineIndex& index, Module without, Timeline reuse) {
  if (durations.size() != t.size() || index.partner.size() != t.size())
    return Internal("durations or index do not match the table");
  return Engine(t, durations, index, std::move(reuse), &without).Run();
}

StatusOr<Timeline> Simulate(const Table& t, const std::vector<double>& durations) {
  if (durations.size() != t.size()) return Internal("durations do not match the table");
  ASSIGN_OR_RETURN(EngineIndex index, IndexForEngine(t));
  return Simulate(t, durations, index);
}

std::vector<OpId> CriticalPath(const Table& t, const Timeline& tl, const EngineIndex& ix) {
  std::vector<OpId> path;
  if (t.size() == 0) return path;
  auto close = [](double a, double b) {
    return std::abs(a - b) <= 1e-9 * std::max(1.0, std::abs(b));
  };
  // Previous op of i on its stream; for p2p ops, the op that posted i's run.
  auto prev = [&](OpId i) -> OpId {
    const Stream s = StreamOf(t.kind(i));
    for (OpId j = i; j > t.rank_begin(t.rank(i));) {
      --j;
      // Sends are eager (they never hold the stream); a run's ops were posted together.
      if (StreamOf(t.kind(j)) != s || IsSend(t.kind(j)) || (IsP2P(t.kind(i)) && IsP2P(t.kind(j))))
        continue;
      return j;
    }
    return UINT32_MAX;
  };
  OpId cur = static_cast<OpId>(std::max_element(tl.end.begin(), tl.end.end()) - tl.end.begin());
  for (size_t steps = 0; steps < t.size(); ++steps) {
    path.push_back(cur);
    const double s = tl.start[cur];
    if (s <= 0) break;
    std::vector<OpId> candidates;
    if (IsP2P(t.kind(cur))) {
      const OpId partner = ix.partner[cur];
      candidates = {prev(cur), partner == kNone ? kNone : prev(partner)};
    } else if (t.grouped(cur)) {
      // Started when the last member was ready: any member's stream or dependencies.
      const uint32_t c = ix.instance[cur];
      for (uint32_t k = ix.inst_begin[c]; k < ix.inst_begin[c + 1]; ++k) {
        const OpId m = ix.inst_members[k];
        candidates.insert(candidates.end(), t.deps(m).begin(), t.deps(m).end());
        candidates.push_back(prev(m));
      }
    } else {
      candidates.assign(t.deps(cur).begin(), t.deps(cur).end());
      candidates.push_back(prev(cur));
    }
    OpId next = UINT32_MAX;
    for (OpId c : candidates)
      if (c != UINT32_MAX && close(tl.end[c], s)) next = c;
    if (next == UINT32_MAX) break;
    cur = next;
  }
  std::reverse(path.begin(), path.end());
  return path;
}

}  // namespace pipeplan
