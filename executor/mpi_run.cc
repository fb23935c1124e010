#include "executor/mpi_run.h"

#include <fmt/format.h>
#include <mpi.h>

#include <chrono>
#include <map>
#include <mutex>
#include <thread>

#include "executor/cpu_backend.h"
#include "executor/deadline.h"

namespace pipeplan {
namespace {

using Clock = std::chrono::steady_clock;

// Messages carry their plan tag as the first element (MPI tags are too small for ours).
// A rank's streams call it from their threads: every MPI call is made under mu_ (MPI's
// THREAD_SERIALIZED), waits poll with the lock released.
class MpiTransport : public Transport {
 public:
  explicit MpiTransport(const Table& t) {
    int me;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    for (int32_t g = 0; g < t.num_groups(); ++g) {
      auto members = t.group(g);
      const bool in = std::find(members.begin(), members.end(), me) != members.end();
      MPI_Comm comm;
      MPI_Comm_split(MPI_COMM_WORLD, in ? 0 : MPI_UNDEFINED, me, &comm);
      comms_.push_back(comm);
    }
  }
  ~MpiTransport() override {
    // After a failure the process ends with MPI_Abort: a send may never be received, a
    // collective left behind may still write into its buffers (kept, not freed).
    if (!aborted_.empty() || !abandoned_.empty()) return;
    for (auto& [req, buf] : pending_) MPI_Wait(&req, MPI_STATUS_IGNORE);
    for (MPI_Comm& c : comms_)
      if (c != MPI_COMM_NULL) MPI_Comm_free(&c);
  }
  Status Send(int32_t peer, uint32_t tag, Tensor data) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_.empty()) return Internal(aborted_);
    data.insert(data.begin(), static_cast<double>(tag));
    pending_.push_back({MPI_REQUEST_NULL, std::move(data)});
    auto& [req, buf] = pending_.back();
    MPI_Isend(buf.data(), static_cast<int>(buf.size()), MPI_DOUBLE, peer, 0, MPI_COMM_WORLD, &req);
    return Status::Ok();
  }
  Status Recv(int32_t peer, uint32_t tag, double timeout_s, Tensor* out) override {
    const auto deadline = Deadline(timeout_s);
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (!aborted_.empty()) return Internal(aborted_);
      auto it = stash_.find(tag);
      if (it != stash_.end()) {
        *out = std::move(it->second);
        stash_.erase(it);
        return Status::Ok();
      }
      int ready = 0;
      MPI_Status st;
      MPI_Iprobe(peer, 0, MPI_COMM_WORLD, &ready, &st);
      if (!ready) {
        if (Clock::now() > deadline)
          return Internal(
              fmt::format("timed out after {} s: the matching SEND never came", timeout_s));
        Pause(lock);
        continue;
      }
      int n;
      MPI_Get_count(&st, MPI_DOUBLE, &n);
      Tensor buf(n);
      MPI_Recv(buf.data(), n, MPI_DOUBLE, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      const uint32_t got = static_cast<uint32_t>(buf[0]);
      buf.erase(buf.begin());
      stash_[got] = std::move(buf);
    }
  }
  Status AllReduce(int32_t group, uint32_t, size_t, double timeout_s, Tensor* data) override {
    const auto deadline = Deadline(timeout_s);
    std::unique_lock<std::mutex> lock(mu_);
    MPI_Comm comm = comms_[group];
    if (comm == MPI_COMM_NULL) return Internal("this rank is not in the group");
    Tensor in = std::move(*data), out(in.size());
    MPI_Request req;
    MPI_Iallreduce(in.data(), out.data(), static_cast<int>(in.size()), MPI_DOUBLE, MPI_SUM, comm,
                   &req);
    for (;;) {
      int done = 0;
      MPI_Test(&req, &done, MPI_STATUS_IGNORE);
      if (done) break;
      std::string why = aborted_;
      if (why.empty() && Clock::now() > deadline)
        why = fmt::format("timed out after {} s waiting for the other group members", timeout_s);
      if (!why.empty()) {  // MPI may still write into the buffers: they stay with the transport
        abandoned_.push_back(std::move(in)), abandoned_.push_back(std::move(out));
        return Internal(why);
      }
      Pause(lock);
    }
    *data = std::move(out);
    return Status::Ok();
  }
  // Wakes this process's waits (another of its streams failed).
  void Abort(const std::string& why) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_.empty()) aborted_ = why;
  }

 private:
  // Polls again shortly, letting the process's other streams call MPI meanwhile.
  static void Pause(std::unique_lock<std::mutex>& lock) {
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::microseconds(20));
    lock.lock();
  }
  std::mutex mu_;
  std::string aborted_;
  std::vector<Tensor> abandoned_;  // buffers of collectives left behind by a failure
  std::vector<MPI_Comm> comms_;
  std::vector<std::pair<MPI_Request, Tensor>> pending_;
  std::map<uint32_t, Tensor> stash_;
};

// Rank 0 receives a vector of doubles from every rank.
std::vector<Tensor> Gather(const Tensor& mine, int world) {
  int n = static_cast<int>(mine.size());
  std::vector<int> counts(world), displs(world);
  MPI_Gather(&n, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  int total = 0;
  for (int r = 0; r < world; ++r) displs[r] = total, total += counts[r];
  Tensor all(total);
  MPI_Gatherv(mine.data(), n, MPI_DOUBLE, all.data(), counts.data(), displs.data(), MPI_DOUBLE, 0,
              MPI_COMM_WORLD);
  std::vector<Tensor> out(world);
  for (int r = 0; r < world; ++r)
    out[r].assign(all.begin() + displs[r], all.begin() + displs[r] + counts[r]);
  return out;
}

}  // namespace

bool MpiAvailable() {
  int init = 0;
  MPI_Initialized(&init);
  int provided = MPI_THREAD_SINGLE;  // checked by RunCpuMpi
  if (!init) MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
  return true;
}

int MpiRank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

void MpiFinalize() {
  int fin = 0;
  MPI_Finalized(&fin);
  if (!fin) MPI_Finalize();
}

Status MpiBroadcast(std::string* bytes) {
  int n = static_cast<int>(bytes->size());
  if (MPI_Bcast(&n, 1, MPI_INT, 0, MPI_COMM_WORLD) != MPI_SUCCESS)
    return Internal("MPI_Bcast failed");
  bytes->resize(n);
  if (MPI_Bcast(bytes->data(), n, MPI_BYTE, 0, MPI_COMM_WORLD) != MPI_SUCCESS)
    return Internal("MPI_Bcast failed");
  return Status::Ok();
}

void MpiAbort(int code) {
  MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

StatusOr<MpiResult> RunCpuMpi(const Table& t, const RunOptions& o, bool check, Timeline* own) {
  MpiResult res;
  MPI_Comm_rank(MPI_COMM_WORLD, &res.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &res.world);
  if (res.world != t.num_ranks())
    return InvalidInput(
        fmt::format("{} processes for a plan of {} ranks", res.world, t.num_ranks()));
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  if (level < MPI_THREAD_SERIALIZED)  // a rank's streams are threads (RunRank)
    return Internal("this MPI library does not give MPI_THREAD_SERIALIZED");
  auto model = std::make_shared<const TinyModel>(t, TinyDims{});
  CpuBackend backend(t, res.rank, model);
  Timeline& tl = *own;
  tl.start.assign(t.size(), -1.0), tl.end.assign(t.size(), -1.0);
  Status status;
  {
    MpiTransport transport(t);
    MPI_Barrier(MPI_COMM_WORLD);
    status = RunRank(t, res.rank, backend, transport, o, Clock::now(), &tl);
    if (!status.ok()) return status;
  }
  // One merged timeline and, for the check, every rank's gradients on rank 0.
  const OpId b = t.rank_begin(res.rank), e = t.rank_end(res.rank);
  Tensor mine;
  for (OpId i = b; i < e; ++i) mine.push_back(tl.start[i]), mine.push_back(tl.end[i]);
  auto times = Gather(mine, res.world);
  const ParamSet& g = backend.grads();
  Tensor flat = g.text;
  flat.insert(flat.end(), g.vision.begin(), g.vision.end());
  flat.insert(flat.end(), g.generator.begin(), g.generator.end());
  flat.push_back(backend.loss());
  auto grads = Gather(flat, res.world);
  if (res.rank != 0) return res;
  res.merged.start.assign(t.size(), -1.0), res.merged.end.assign(t.size(), -1.0);
  std::vector<ParamSet> per_rank;
  double loss = 0;
  for (int r = 0; r < res.world; ++r) {
    for (OpId i = t.rank_begin(r), k = 0; i < t.rank_end(r); ++i, k += 2)
      res.merged.start[i] = times[r][k], res.merged.end[i] = times[r][k + 1];
    ParamSet p = model->ZeroGrads();
    size_t k = 0;
    for (Tensor* part : {&p.text, &p.vision, &p.generator})
      for (double& x : *part) x = grads[r][k++];
    loss += grads[r][k];
    per_rank.push_back(std::move(p));
  }
  res.check.loss = loss;
  if (check) res.check = CompareWithReference(t, *model, per_rank, loss);
  return res;
}

}  // namespace pipeplan
