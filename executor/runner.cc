#include "executor/runner.h"

#include <fmt/format.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <mutex>
#include <thread>

namespace pipeplan {
namespace {

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// One op of a rank's sequence, timed; the error names the rank and the op.
Status RunTimed(const Table& t, int32_t rank, OpId i, const std::function<Status(OpId)>& run_op,
                const RunOptions& o, std::chrono::steady_clock::time_point t0, Timeline* measured) {
  measured->start[i] = Seconds(t0);
  const bool fault = rank == o.fault_rank && IsSend(t.kind(i));
  if (fault && o.fault_kill) std::raise(SIGKILL);  // a crash: no error, no trace, no exit code
  Status s = fault ? Internal("injected fault (--fault)") : run_op(i);
  measured->end[i] = Seconds(t0);
  if (!s.ok()) return Status(s.code(), fmt::format("rank {}: {}: {}", rank, t.str(i), s.message()));
  return Status::Ok();
}

// An op through a Backend (its calls one at a time: `mu`) and a Transport (waits outside
// the lock, so that the rank's other streams go on).
Status RunOp(const Table& t, OpId i, Backend& b, std::mutex& mu, Transport& tr,
             const RunOptions& o) {
  const OpKind k = t.kind(i);
  std::unique_lock<std::mutex> lock(mu);
  if (IsSend(k)) {
    ASSIGN_OR_RETURN(Tensor data, b.Outgoing(i));
    lock.unlock();
    return tr.Send(t.peer(i), t.tag(i), std::move(data));
  }
  if (IsRecv(k)) {
    lock.unlock();
    Tensor data;
    RETURN_IF_ERROR(tr.Recv(t.peer(i), t.tag(i), o.op_timeout_s, &data));
    lock.lock();
    return b.Incoming(i, std::move(data));
  }
  if (IsCollective(k)) {
    ASSIGN_OR_RETURN(Tensor data, b.Contribution(i));
    lock.unlock();
    RETURN_IF_ERROR(
        tr.AllReduce(t.peer(i), t.tag(i), t.group(t.peer(i)).size(), o.op_timeout_s, &data));
    lock.lock();
    return b.Reduced(i, std::move(data));
  }
  return b.Compute(i);
}

// What the streams of one rank share: which of its ops have ended, and its first failure.
class RankStreams {
 public:
  RankStreams(const Table& t, int32_t rank)
      : t_(t), rank_(rank), begin_(t.rank_begin(rank)), done_(t.rank_end(rank) - begin_, 0) {}

  // Waits until every dependency of op i on this rank has ended (a RECV's SEND is the
  // transport's to wait for); false when a stream of the rank failed. Not bounded by a
  // timeout of its own: a dependency is an earlier op (RunRank checks), so the ops waited for
  // end, or fail at a transport's timeout, which wakes this wait.
  bool WaitForDeps(OpId i) {
    std::unique_lock<std::mutex> lock(mu_);
    for (OpId d : t_.deps(i))
      if (t_.rank(d) == rank_) cv_.wait(lock, [&] { return failed_ || done_[d - begin_]; });
    return !failed_;
  }
  void Done(OpId i) {
    std::lock_guard<std::mutex> lock(mu_);
    done_[i - begin_] = 1;
    cv_.notify_all();
  }
  // Records a stream's failure at op i; true for the rank's first.
  bool Fail(OpId i, Status s) {
    std::lock_guard<std::mutex> lock(mu_);
    cv_.notify_all();
    if (failed_) return false;
    failed_ = true, first_ = std::move(s), failed_op_ = i;
    return true;
  }
  const Status& status() const { return first_; }
  OpId failed_op() const { return failed_op_; }

 private:
  const Table& t_;
  const int32_t rank_;
  const OpId begin_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint8_t> done_;
  bool failed_ = false;
  Status first_;
  OpId failed_op_ = 0;
};

}  // namespace

Status RunSequence(const Table& t, int32_t rank, const std::function<Status(OpId)>& run_op,
                   const RunOptions& o, std::chrono::steady_clock::time_point t0,
                   Timeline* measured, OpId* failed) {
  for (OpId i = t.rank_begin(rank); i < t.rank_end(rank); ++i) {
    if (Status s = RunTimed(t, rank, i, run_op, o, t0, measured); !s.ok()) {
      if (failed) *failed = i;
      return s;
    }
    if (o.on_op_done) o.on_op_done(i, measured->start[i], measured->end[i]);
  }
  return Status::Ok();
}

Status RunRank(const Table& t, int32_t rank, Backend& backend, Transport& transport,
               const RunOptions& o, std::chrono::steady_clock::time_point t0, Timeline* measured,
               OpId* failed) {
  std::array<std::vector<OpId>, kNumStreams> streams;
  for (OpId i = t.rank_begin(rank); i < t.rank_end(rank); ++i) {
    for (OpId d : t.deps(i))
      if (t.rank(d) == rank && d >= i) {  // would wait for itself
        if (failed) *failed = i;
        return InvalidPlan(fmt::format("rank {}: {}: depends on {}, which is not before it", rank,
                                       t.str(i), t.str(d)));
      }
    streams[static_cast<int>(StreamOf(t.kind(i)))].push_back(i);
  }
  RankStreams state(t, rank);
  std::mutex backend_mu, done_mu;
  auto run_op = [&](OpId i) { return RunOp(t, i, backend, backend_mu, transport, o); };
  auto fail = [&](OpId i, Status s) {
    // The rank's other streams may wait on peers: wake them (and the other ranks) now.
    const std::string why = fmt::format("aborted: {}", s.message());
    if (state.Fail(i, std::move(s))) transport.Abort(why);
  };
  // With the compute stream alone, its order is all there is to wait for.
  const bool beside =
      streams[0].size() < static_cast<size_t>(t.rank_end(rank) - t.rank_begin(rank));
  auto walk = [&](const std::vector<OpId>& ops) {
    for (OpId i : ops) {
      if (beside && !state.WaitForDeps(i)) return;  // another stream failed
      if (Status s = RunTimed(t, rank, i, run_op, o, t0, measured); !s.ok())
        return fail(i, std::move(s));
      if (beside) state.Done(i);
      if (o.on_op_done) {
        std::lock_guard<std::mutex> lock(done_mu);
        o.on_op_done(i, measured->start[i], measured->end[i]);
      }
    }
  };
  // The simulator's streams: collectives and each direction of host copies beside the
  // compute stream, ordered against it only by the plan's dependencies.
  std::vector<std::thread> threads;
  try {
    for (size_t k = 1; k < streams.size(); ++k)
      if (!streams[k].empty()) threads.emplace_back(walk, std::cref(streams[k]));
  } catch (const std::system_error& e) {
    fail(t.rank_begin(rank),
         Internal(fmt::format("rank {}: cannot start a stream's thread: {}", rank, e.what())));
  }
  walk(streams[0]);
  for (auto& th : threads) th.join();
  if (!state.status().ok() && failed) *failed = state.failed_op();
  return state.status();
}

Status RunLocal(const Table& t, std::vector<std::unique_ptr<Backend>>& backends,
                const RunOptions& o, Timeline* measured) {
  if (static_cast<int32_t>(backends.size()) != t.num_ranks())
    return InvalidInput(
        fmt::format("{} local ranks for a plan of {} ranks", backends.size(), t.num_ranks()));
  measured->start.assign(t.size(), -1.0);  // -1: the op never ran (a failed run's partial trace)
  measured->end.assign(t.size(), -1.0);
  InProcessTransport transport;
  std::vector<Status> status(t.num_ranks());
  std::vector<OpId> failed(t.num_ranks(), 0);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  threads.reserve(t.num_ranks());
  try {
    for (int32_t r = 0; r < t.num_ranks(); ++r)
      threads.emplace_back([&, r] {
        status[r] = RunRank(t, r, *backends[r], transport, o, t0, measured, &failed[r]);
        if (!status[r].ok()) transport.Abort(fmt::format("aborted: {}", status[r].message()));
      });
  } catch (const std::system_error& e) {  // the machine refused a thread: stop the others
    transport.Abort("aborted: a rank could not start");
    for (auto& th : threads) th.join();
    return Internal(fmt::format("cannot start the thread of rank {} of {}: {}", threads.size(),
                                t.num_ranks(), e.what()));
  }
  for (auto& th : threads) th.join();
  // The root cause: of the errors that are not another rank's abort, the one whose op
  // began first (a rank stuck waiting makes its peers time out a little later).
  int32_t root = -1;
  for (int32_t r = 0; r < t.num_ranks(); ++r) {
    if (status[r].ok() || status[r].message().find("aborted: ") != std::string::npos) continue;
    if (root < 0 || measured->start[failed[r]] < measured->start[failed[root]]) root = r;
  }
  if (root >= 0) return status[root];
  for (const Status& s : status)
    if (!s.ok()) return s;
  return Status::Ok();
}

}  // namespace pipeplan
