#include "simulator/engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <unordered_map>

namespace pipeplan {
namespace {

enum State : uint8_t { kIdle = 0, kPosted = 1, kDone = 2 };

class Engine {
 public:
  Engine(const Table& t, const std::vector<double>& dur) : t_(t), dur_(dur) {}

  StatusOr<Timeline> Run() {
    const size_t n = t_.size();
    const int32_t R = t_.num_ranks();
    tl_.start.assign(n, 0.0);
    tl_.end.assign(n, 0.0);
    state_.assign(n, kIdle);
    partner_.assign(n, UINT32_MAX);
    for (OpId i = 0; i < n; ++i) {
      if (!IsRecv(t_.kind(i))) continue;
      const OpId s = t_.send_of(i);
      if (s == UINT32_MAX) return InvalidPlan(fmt::format("{}: has no matching SEND", t_.str(i)));
      partner_[s] = i, partner_[i] = s;
    }
    RETURN_IF_ERROR(IndexCollectives());
    cursor_.resize(R);
    stream_end_.assign(R, {0.0, 0.0});
    queued_.assign(R, 1);
    for (int32_t r = 0; r < R; ++r) {
      cursor_[r] = {t_.rank_begin(r), t_.rank_begin(r)};
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
  Status IndexCollectives() {
    std::unordered_map<uint64_t, uint32_t> index;
    for (OpId i = 0; i < t_.size(); ++i) {
      if (!t_.grouped(i)) continue;
      uint64_t key = static_cast<uint64_t>(t_.peer(i)) << 32 | t_.tag(i);
      auto [it, inserted] = index.emplace(key, static_cast<uint32_t>(coll_.size()));
      if (inserted)
        coll_.push_back({static_cast<uint32_t>(t_.group(t_.peer(i)).size()), 0, 0.0, {}});
      coll_[it->second].members.push_back(i);
      coll_of_[i] = it->second;
    }
    for (auto& c : coll_)
      if (c.members.size() != c.size)
        return InvalidPlan(fmt::format("{}: {} of the group's {} ranks take part",
                                       t_.str(c.members[0]), c.members.size(), c.size));
    return Status::Ok();
  }

  void Enqueue(int32_t r) {
    if (!queued_[r]) queued_[r] = 1, queue_.push_back(r);
  }

  // Latest end of i's dependencies, or -1 if one has not ended.
  double DepsEnd(OpId i) {
    double e = 0;
    for (OpId d : t_.deps(i)) {
      if (state_[d] != kDone) {
        if (t_.rank(d) != t_.rank(i)) waiters_[d].push_back(t_.rank(i));
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
    if (!waiters_.empty()) {
      auto it = waiters_.find(i);
      if (it != waiters_.end()) {
        for (int32_t r : it->second) Enqueue(r);
        waiters_.erase(it);
      }
    }
  }

  void Advance(int32_t r) {
    bool progress = true;
    while (progress) progress = AdvanceCompute(r) | AdvanceCollective(r);
  }

  bool AdvanceCompute(int32_t r) {
    const OpId end = t_.rank_end(r);
    OpId& i = cursor_[r][0];
    double& stream_end = stream_end_[r][0];
    bool progress = false;
    for (;;) {
      while (i < end && IsCollective(t_.kind(i))) ++i;
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
        double deps = DepsEnd(i);
        if (deps < 0) return progress;
        if (t_.grouped(i))
          Post(i, std::max(stream_end, deps), r);  // a gang: all members at once
        else
          Finish(i, std::max(stream_end, deps), dur_[i]);
      }
      if (state_[i] != kDone) return progress;
      stream_end = tl_.end[i];
      ++i;
      progress = true;
    }
  }

  // Posts a collective or gang op ready at `at`; the last member to post starts them all.
  void Post(OpId i, double at, int32_t r) {
    state_[i] = kPosted;
    tl_.start[i] = at;
    Coll& c = coll_[coll_of_[i]];
    c.ready = std::max(c.ready, at);
    if (++c.posted < c.size) return;
    double d = 0;
    for (OpId m : c.members) d = std::max(d, dur_[m]);
    for (OpId m : c.members) {
      Finish(m, c.ready, d);
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
      OpId partner = partner_[j];
      if (partner == UINT32_MAX || state_[partner] != kPosted) continue;
      double start = std::max(at, tl_.start[partner]);
      double d = std::max(dur_[j], dur_[partner]);
      Finish(j, start, d);
      Finish(partner, start, d);
      Enqueue(t_.rank(partner));
    }
  }

  bool AdvanceCollective(int32_t r) {
    const OpId end = t_.rank_end(r);
    OpId& i = cursor_[r][1];
    double& stream_end = stream_end_[r][1];
    bool progress = false;
    for (;;) {
      while (i < end && !IsCollective(t_.kind(i))) ++i;
      if (i >= end) return progress;
      if (state_[i] == kIdle) {
        double deps = DepsEnd(i);
        if (deps < 0) return progress;
        Post(i, std::max(stream_end, deps), r);
      }
      if (state_[i] != kDone) return progress;
      stream_end = tl_.end[i];
      ++i;
      progress = true;
    }
  }

  Status Deadlock() const {
    std::string msg = fmt::format("deadlock: {} of {} ops can never start; blocked ranks wait on:",
                                  t_.size() - done_, t_.size());
    int shown = 0;
    for (int32_t r = 0; r < t_.num_ranks() && shown < 16; ++r) {
      for (int s = 0; s < 2; ++s) {
        OpId i = cursor_[r][s];
        while (i < t_.rank_end(r) && (IsCollective(t_.kind(i)) != (s == 1))) ++i;
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

  struct Coll {
    uint32_t size;
    uint32_t posted;
    double ready;
    std::vector<OpId> members;
  };

  const Table& t_;
  const std::vector<double>& dur_;
  Timeline tl_;
  std::vector<uint8_t> state_;
  std::vector<OpId> partner_;  // SEND <-> RECV
  std::vector<std::array<OpId, 2>> cursor_;
  std::vector<std::array<double, 2>> stream_end_;
  std::vector<uint8_t> queued_;
  std::vector<int32_t> queue_;
  std::vector<Coll> coll_;
  std::unordered_map<OpId, uint32_t> coll_of_;
  std::unordered_map<OpId, std::vector<int32_t>> waiters_;
  size_t done_ = 0;
};

}  // namespace

StatusOr<Timeline> Simulate(const Table& t, const std::vector<double>& durations) {
  if (durations.size() != t.size()) return Internal("durations do not match the table");
  return Engine(t, durations).Run();
}

std::vector<OpId> CriticalPath(const Table& t, const Timeline& tl) {
  std::vector<OpId> path;
  if (t.size() == 0) return path;
  std::vector<OpId> send_to_recv(t.size(), UINT32_MAX);
  std::map<std::pair<int32_t, uint32_t>, std::vector<OpId>> instances;  // collective members
  for (OpId i = 0; i < t.size(); ++i) {
    if (IsRecv(t.kind(i)) && t.send_of(i) != UINT32_MAX) send_to_recv[t.send_of(i)] = i;
    if (t.grouped(i)) instances[{t.peer(i), t.tag(i)}].push_back(i);
  }
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
      OpId partner = IsSend(t.kind(cur)) ? send_to_recv[cur] : t.send_of(cur);
      candidates = {prev(cur), partner == UINT32_MAX ? UINT32_MAX : prev(partner)};
    } else if (t.grouped(cur)) {
      // Started when the last member was ready: any member's stream or dependencies.
      for (OpId m : instances[{t.peer(cur), t.tag(cur)}]) {
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
