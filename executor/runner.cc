#include "executor/runner.h"

#include <fmt/format.h>

#include <chrono>
#include <csignal>
#include <thread>

namespace pipeplan {
namespace {

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Status RunOp(const Table& t, OpId i, Backend& b, Transport& tr, const RunOptions& o) {
  const OpKind k = t.kind(i);
  if (IsSend(k)) {
    ASSIGN_OR_RETURN(Tensor data, b.Outgoing(i));
    return tr.Send(t.peer(i), t.tag(i), std::move(data));
  }
  if (IsRecv(k)) {
    Tensor data;
    RETURN_IF_ERROR(tr.Recv(t.peer(i), t.tag(i), o.op_timeout_s, &data));
    return b.Incoming(i, std::move(data));
  }
  if (IsCollective(k)) {
    ASSIGN_OR_RETURN(Tensor data, b.Contribution(i));
    RETURN_IF_ERROR(
        tr.AllReduce(t.peer(i), t.tag(i), t.group(t.peer(i)).size(), o.op_timeout_s, &data));
    return b.Reduced(i, std::move(data));
  }
  return b.Compute(i);
}

}  // namespace

Status RunSequence(const Table& t, int32_t rank, const std::function<Status(OpId)>& run_op,
                   const RunOptions& o, std::chrono::steady_clock::time_point t0,
                   Timeline* measured, OpId* failed) {
  for (OpId i = t.rank_begin(rank); i < t.rank_end(rank); ++i) {
    measured->start[i] = Seconds(t0);
    const bool fault = rank == o.fault_rank && IsSend(t.kind(i));
    if (fault && o.fault_kill) std::raise(SIGKILL);  // a crash: no error, no trace, no exit code
    Status s = fault ? Internal("injected fault (--fault)") : run_op(i);
    measured->end[i] = Seconds(t0);
    if (!s.ok()) {
      if (failed) *failed = i;
      return Status(s.code(), fmt::format("rank {}: {}: {}", rank, t.str(i), s.message()));
    }
    if (o.on_op_done) o.on_op_done(i, measured->start[i], measured->end[i]);
  }
  return Status::Ok();
}

Status RunRank(const Table& t, int32_t rank, Backend& backend, Transport& transport,
               const RunOptions& o, std::chrono::steady_clock::time_point t0, Timeline* measured,
               OpId* failed) {
  return RunSequence(
      t, rank, [&](OpId i) { return RunOp(t, i, backend, transport, o); }, o, t0, measured, failed);
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
