#include "executor/nccl_backend.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <thread>

#include "executor/cuda_backend.h"
#include "executor/cuda_device.h"
#include "executor/deadline.h"
#include "executor/process_map.h"

namespace pipeplan {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxPayload = size_t{1} << 30;  // larger transfers are cut (both sides alike)
constexpr size_t kScratch = size_t{256} << 20;   // memory-bound passes write this at a time

Status Cuda(cudaError_t e, const char* what) {
  return e == cudaSuccess ? Status::Ok()
                          : Internal(fmt::format("{}: {}", what, cudaGetErrorString(e)));
}

Status NcclError(ncclResult_t r, ncclComm_t comm, const std::string& what) {
  const char* last = ncclGetLastError(comm);
  return Internal(fmt::format("{}: NCCL: {}{}{}", what, ncclGetErrorString(r),
                              last && *last ? ": " : "", last ? last : ""));
}

// Communicators are non-blocking, so that every wait has a deadline: a call may answer
// ncclInProgress, and is taken once ncclCommGetAsyncError stops saying so.
Status Taken(ncclResult_t r, ncclComm_t comm, const std::string& what, double timeout_s) {
  const auto deadline = Deadline(timeout_s);
  while (r == ncclInProgress) {
    if (Clock::now() > deadline)
      return Internal(fmt::format("{}: timed out after {} s", what, timeout_s));
    std::this_thread::sleep_for(std::chrono::microseconds(20));
    if (ncclResult_t q = ncclCommGetAsyncError(comm, &r); q != ncclSuccess) r = q;
  }
  return r == ncclSuccess ? Status::Ok() : NcclError(r, comm, what);
}

// Waits for `ev` until the deadline, watching NCCL's asynchronous errors on `comm`.
Status WaitEvent(cudaEvent_t ev, ncclComm_t comm, double timeout_s, const std::string& what) {
  const auto deadline = Deadline(timeout_s);
  for (;;) {
    cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) return Status::Ok();
    if (e != cudaErrorNotReady) return Cuda(e, what.c_str());
    if (comm != nullptr) {
      ncclResult_t r = ncclSuccess;
      if (ncclResult_t q = ncclCommGetAsyncError(comm, &r); q != ncclSuccess) r = q;
      if (r != ncclSuccess && r != ncclInProgress) return NcclError(r, comm, what);
    }
    if (Clock::now() > deadline)
      return Internal(fmt::format("timed out after {} s: {}", timeout_s, what));
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// A byte (1..251) that identifies a SEND, or a group member's contribution, on the wire.
uint8_t Stamp(uint64_t x) {
  return static_cast<uint8_t>(x * 2654435761u % 251 + 1);
}

size_t Bytes(const Work& w) {
  return static_cast<size_t>(std::clamp(w.payload_bytes, 0.0, static_cast<double>(kMaxPayload)));
}

// Folded TP/CP collectives (a gang's gather-KV) as all-reduces over n GPUs: bf16 elements
// per call such that the calls move the op's tp_bytes per GPU over the ring (2 (n-1)/n of
// each call's size). 0: none.
size_t FoldCount(const Work& w, size_t n) {
  if (n < 2 || w.tp_calls <= 0) return 0;
  const double ring = 2.0 * static_cast<double>(n - 1) / static_cast<double>(n);
  return static_cast<size_t>(std::min<double>(w.tp_bytes, kMaxPayload) / w.tp_calls / ring / 2);
}

struct Probe {
  size_t slot;   // byte in the pinned probe buffer
  uint8_t want;  // what must have arrived
  OpId op;       // the transfer (its SEND) or collective it checks
};

// What a communicator is used for by this process, to connect it before the run.
// NCCL connects what the algorithm it picks for a call needs, and the pick depends on the
// size: every distinct (kind, size) is used once.
struct Usage {
  size_t send = 0, recv = 0;                  // largest transfer sent / received on it
  std::set<std::pair<OpKind, size_t>> colls;  // collectives: kind, bytes per member
  std::set<size_t> folds;                     // all-reduces of bf16 elements (1: a gang's barrier)
};

class Executor {
 public:
  Executor(const Table& t, const RunOptions& o, bool check)
      : t_(t), o_(o), check_(check), order_(t) {}
  ~Executor() { Release(); }

  Status Init(const NcclLaunch& l);
  Status Barrier();
  Status Run(OpId i);
  Status Drain();
  void EventTimes(Timeline* own) const;
  StatusOr<NcclResult> Gather(const Timeline& own);
  void MarkFailed() { failed_ = true; }
  int32_t rank() const { return rank_; }

 private:
  size_t K(OpId i) const { return i - t_.rank_begin(rank_); }
  ncclComm_t Comm(int32_t c) const { return comms_[c]; }
  int32_t CommOf(OpId i) const;
  Status Split(int32_t round, int32_t color);
  Status Connect();
  Status Wait(OpId i, const std::string& waiting_for);
  Status Finish(OpId i);  // waits for an asynchronous op
  Status RunCompute(OpId i);
  Status RunSend(OpId i);
  Status RunRecv(OpId i);
  Status RunCollective(OpId i);
  Status RunCopy(OpId i);
  Status Collective(OpKind kind, int32_t c, size_t bytes, cudaStream_t s, OpId probe_op);
  Status Fold(int32_t c, size_t count, int32_t calls, cudaStream_t s);
  Status Alloc(void** p, size_t bytes) {
    return Cuda(cudaMalloc(p, std::max<size_t>(bytes, 1)), "cudaMalloc");
  }
  void AddProbe(cudaStream_t s, const void* dev, size_t offset, uint8_t want, OpId op);
  void Release();

  const Table& t_;
  RunOptions o_;
  bool check_;
  ReceiveOrder order_;
  ProcessMap pm_;
  CommPlan cp_;
  int32_t me_ = 0, rank_ = 0, shard_ = 0;
  std::string device_;
  bool failed_ = false;

  ncclConfig_t config_ = NCCL_CONFIG_INITIALIZER;  // non-blocking; NCCL may read it later
  ncclComm_t world_ = nullptr;
  std::vector<ncclComm_t> comms_;
  ncclComm_t no_comm_ = nullptr;  // NCCL writes a split's "no communicator" here, later
  std::map<int32_t, Usage> usage_;
  std::unique_ptr<cudadev::Pool> pool_;  // GEMMs and memory-bound passes, compute stream
  cudaStream_t compute_ = nullptr, collective_ = nullptr, recv_ = nullptr;
  cudaStream_t to_host_ = nullptr, from_host_ = nullptr;  // host copies, one per direction
  std::map<int32_t, cudaStream_t> send_streams_;          // per send communicator
  void *send_buf_ = nullptr, *recv_buf_ = nullptr, *coll_in_ = nullptr, *coll_out_ = nullptr,
       *fold_ = nullptr, *gather_in_ = nullptr, *gather_out_ = nullptr;
  size_t row_ = 0;              // doubles per process in the final gather
  std::map<OpId, void*> held_;  // transfers that arrived before their RECV ran
  std::vector<cudaEvent_t> start_, end_;
  std::vector<char> ran_, pending_;
  cudaEvent_t ref_ = nullptr, mark_ = nullptr;  // ref_: the start barrier's end, time 0
  uint8_t* probe_host_ = nullptr;
  size_t probe_slots_ = 0;
  std::vector<Probe> probes_;
};

Status Executor::Init(const NcclLaunch& l) {
  ASSIGN_OR_RETURN(pm_, MapProcesses(t_, l.world));
  if (l.process < 0 || l.process >= l.world)
    return InvalidInput(fmt::format("process {} of a world of {}", l.process, l.world));
  me_ = l.process, rank_ = pm_.rank[me_], shard_ = pm_.shard[me_];
  cp_ = PlanCommunicators(t_, pm_);

  int n = 0;
  if (cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess || n == 0)
    return Internal(fmt::format("no CUDA device: {}",
                                e != cudaSuccess ? cudaGetErrorString(e) : "none visible"));
  const int dev = l.local_rank % n;
  RETURN_IF_ERROR(Cuda(cudaSetDevice(dev), "cudaSetDevice"));
  cudaDeviceProp prop;
  RETURN_IF_ERROR(Cuda(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties"));
  device_ = fmt::format("GPU {} ({})", dev, prop.name);

  // What this rank's ops need: GEMM sizes, buffers, probes, and per communicator.
  const OpId b = t_.rank_begin(rank_), e = t_.rank_end(rank_);
  std::set<size_t> dims;
  size_t dim = 0, hbm = 1, send = 0, recv = 0, coll = 0, fold = 0, probes = 0;
  bool copies = false;
  for (OpId i = b; i < e; ++i) {
    const Work& w = t_.work(i);
    const OpKind k = t_.kind(i);
    const size_t bytes = Bytes(w);
    if (IsCompute(k)) {
      const size_t g = GemmDim(w, t_.ranks()[rank_].gpus);
      if (g > 0) dims.insert(g), dim = std::max(dim, g);
      hbm = std::max(hbm, static_cast<size_t>(std::min<double>(w.hbm_bytes, kScratch)));
      if (const int32_t c = CommOf(i); c >= 0) {
        Usage& u = usage_[c];
        if (t_.grouped(i) && cp_.members[c].size() > 1) u.folds.insert(1);
        if (const size_t count = FoldCount(w, cp_.members[c].size()); count > 0)
          u.folds.insert(count), fold = std::max(fold, 2 * count);
      }
    }
    if (IsCopy(k) && t_.peer(i) >= 0)
      return InvalidInput(
          fmt::format("{}: offload to another rank's memory is not replayed by "
                      "the NCCL backend (offload to host is)",
                      t_.str(i)));
    if (IsCopy(k)) hbm = std::max(hbm, std::min(bytes, kScratch)), copies = true;  // chunks
    if (IsSend(k)) {
      send = std::max(send, bytes);
      usage_[CommOf(i)].send = std::max(usage_[CommOf(i)].send, bytes);
    }
    if (IsRecv(k)) {
      recv = std::max(recv, bytes), probes += 2;
      usage_[CommOf(i)].recv = std::max(usage_[CommOf(i)].recv, bytes);
    }
    if (IsCollective(k)) {
      coll = std::max(coll, bytes), probes += std::max<size_t>(2, t_.group(t_.peer(i)).size());
      usage_[CommOf(i)].colls.insert({k, bytes});
    }
  }
  std::string err = cudadev::Pool::Create(1, dim, hbm, &pool_);
  if (err.empty()) err = pool_->Warmup({dims.begin(), dims.end()});
  if (err.empty() && copies) err = pool_->PinHost();  // before the clock starts
  if (!err.empty()) return Internal(err);
  compute_ = static_cast<cudaStream_t>(pool_->stream(0));
  RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&collective_, cudaStreamNonBlocking), "stream"));
  RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&recv_, cudaStreamNonBlocking), "stream"));
  RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&to_host_, cudaStreamNonBlocking), "stream"));
  RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&from_host_, cudaStreamNonBlocking), "stream"));
  for (OpId i = b; i < e; ++i)
    if (IsSend(t_.kind(i)) && !send_streams_.count(CommOf(i)))
      RETURN_IF_ERROR(Cuda(
          cudaStreamCreateWithFlags(&send_streams_[CommOf(i)], cudaStreamNonBlocking), "stream"));
  RETURN_IF_ERROR(Alloc(&send_buf_, send));
  RETURN_IF_ERROR(Alloc(&recv_buf_, recv));
  RETURN_IF_ERROR(Alloc(&coll_in_, coll));
  RETURN_IF_ERROR(Alloc(&coll_out_, coll));
  RETURN_IF_ERROR(Alloc(&fold_, std::max<size_t>(fold, 16)));  // also a gang's barrier
  if (check_) {
    RETURN_IF_ERROR(
        Cuda(cudaMallocHost(&probe_host_, std::max<size_t>(probes, 1)), "cudaMallocHost"));
    std::memset(probe_host_, 0, std::max<size_t>(probes, 1));
  }
  start_.assign(e - b, nullptr), end_.assign(e - b, nullptr);
  ran_.assign(e - b, 0), pending_.assign(e - b, 0);
  for (size_t k = 0; k < start_.size(); ++k) {
    RETURN_IF_ERROR(Cuda(cudaEventCreate(&start_[k]), "cudaEventCreate"));
    RETURN_IF_ERROR(Cuda(cudaEventCreate(&end_[k]), "cudaEventCreate"));
  }
  RETURN_IF_ERROR(Cuda(cudaEventCreate(&ref_), "cudaEventCreate"));
  RETURN_IF_ERROR(Cuda(cudaEventCreate(&mark_), "cudaEventCreate"));
  // The final gather: (start, end) per op of the longest sequence, + [checked, bad].
  size_t longest = 0;
  for (int32_t r = 0; r < t_.num_ranks(); ++r)
    longest = std::max<size_t>(longest, t_.rank_end(r) - t_.rank_begin(r));
  row_ = 2 * longest + 2;
  RETURN_IF_ERROR(Alloc(&gather_in_, row_ * sizeof(double)));
  RETURN_IF_ERROR(Alloc(&gather_out_, row_ * pm_.world * sizeof(double)));

  // The world communicator, then every communicator this plan needs, one split per round.
  ncclUniqueId id;
  std::string bytes;
  if (me_ == 0) {
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess)
      return NcclError(r, nullptr, "ncclGetUniqueId");
    bytes.assign(reinterpret_cast<const char*>(&id), sizeof id);
  }
  RETURN_IF_ERROR(l.share_id(&bytes));
  if (bytes.size() != sizeof id) return Internal("the shared NCCL id has the wrong size");
  std::memcpy(&id, bytes.data(), sizeof id);
  config_.blocking = 0;
  // world_ is set by the call: read it only after (argument order is unspecified).
  const ncclResult_t joined = ncclCommInitRankConfig(&world_, l.world, id, me_, &config_);
  RETURN_IF_ERROR(Taken(joined, world_,
                        fmt::format("joining the NCCL world of {} processes", l.world),
                        o_.op_timeout_s));
  if (me_ == 0 && l.joined) l.joined();
  comms_.assign(cp_.members.size(), nullptr);
  const std::vector<int32_t> colors = cp_.Colors(me_);
  for (int32_t k = 0; k < cp_.rounds; ++k) RETURN_IF_ERROR(Split(k, colors[k]));
  return Connect();
}

// NCCL fills the new communicator in from a background job, possibly after the call
// returns: the handle it writes to lives as long as the executor. The split is done when
// the parent is no longer in progress.
Status Executor::Split(int32_t round, int32_t color) {
  ncclComm_t* out = color >= 0 ? &comms_[color] : &no_comm_;
  const std::string what =
      fmt::format("creating communicators (round {} of {})", round + 1, cp_.rounds);
  RETURN_IF_ERROR(
      Taken(ncclCommSplit(world_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, me_, out, &config_),
            world_, what, o_.op_timeout_s));
  if (color >= 0 && *out == nullptr) return Internal(what + ": no communicator");
  return color >= 0 ? Taken(ncclInProgress, *out, what, o_.op_timeout_s) : Status::Ok();
}

// NCCL connects peers on a communicator's first use of each kind, and a non-blocking call
// then waits on the CPU for them: the first eager SEND or asynchronous collective would
// wait for its peers. So every communicator is used here once per kind and size it will
// carry (transfers: the largest), in the same global order on every process
// (which cannot deadlock: the lowest unfinished communicator always has all its members).
Status Executor::Connect() {
  for (auto& [c, u] : usage_) {
    const std::string what =
        fmt::format("connecting communicator {} of {}", c + 1, cp_.members.size());
    ncclComm_t comm = Comm(c);
    if (u.send > 0 || u.recv > 0) {
      const int32_t other = cp_.members[c][cp_.members[c][0] == me_ ? 1 : 0];
      const int32_t peer = cp_.RankIn(c, other);
      ncclGroupStart();
      if (u.send > 0) ncclSend(send_buf_, u.send, ncclInt8, peer, comm, collective_);
      if (u.recv > 0) ncclRecv(recv_buf_, u.recv, ncclInt8, peer, comm, collective_);
      RETURN_IF_ERROR(Taken(ncclGroupEnd(), comm, what, o_.op_timeout_s));
    }
    for (auto [kind, bytes] : u.colls)
      RETURN_IF_ERROR(Collective(kind, c, bytes, collective_, UINT32_MAX));
    for (size_t count : u.folds) RETURN_IF_ERROR(Fold(c, count, 1, collective_));
    RETURN_IF_ERROR(Cuda(cudaEventRecord(mark_, collective_), "cudaEventRecord"));
    RETURN_IF_ERROR(WaitEvent(mark_, comm, o_.op_timeout_s, what));
  }
  // The world communicator carries the final gather.
  RETURN_IF_ERROR(
      Taken(ncclAllGather(gather_in_, gather_out_, row_, ncclFloat64, world_, collective_), world_,
            "connecting the world communicator", o_.op_timeout_s));
  RETURN_IF_ERROR(Cuda(cudaEventRecord(mark_, collective_), "cudaEventRecord"));
  return WaitEvent(mark_, world_, o_.op_timeout_s, "connecting the world communicator");
}

// An all-reduce over every process, waited for. Its end on each GPU is time 0 of that
// process's device times: the same instant everywhere, up to the all-reduce's last step
// (host clocks would differ by how soon each host noticed).
Status Executor::Barrier() {
  RETURN_IF_ERROR(Cuda(cudaMemsetAsync(coll_in_, 0, 1, collective_), "cudaMemsetAsync"));
  RETURN_IF_ERROR(
      Taken(ncclAllReduce(coll_in_, coll_in_, 1, ncclInt8, ncclSum, world_, collective_), world_,
            "barrier", o_.op_timeout_s));
  RETURN_IF_ERROR(Cuda(cudaEventRecord(ref_, collective_), "cudaEventRecord"));
  return WaitEvent(ref_, world_, o_.op_timeout_s, "waiting for every process to start");
}

int32_t Executor::CommOf(OpId i) const {
  const OpKind k = t_.kind(i);
  if (IsSend(k)) return cp_.p2p.at({rank_, t_.peer(i), shard_});
  if (IsRecv(k)) return cp_.p2p.at({t_.peer(i), rank_, shard_});
  if (t_.grouped(i)) return cp_.group.at({t_.peer(i), shard_});
  return cp_.rank_comm[rank_];
}

Status Executor::Wait(OpId i, const std::string& waiting_for) {
  const int32_t c = CommOf(i);
  return WaitEvent(end_[K(i)], c >= 0 ? Comm(c) : nullptr, o_.op_timeout_s, waiting_for);
}

Status Executor::Finish(OpId i) {
  if (!pending_[K(i)]) return Status::Ok();
  Status s = IsSend(t_.kind(i)) ? Wait(i, fmt::format("{}: the receiver never took it", t_.str(i)))
             : IsCopy(t_.kind(i))
                 ? Wait(i, fmt::format("{}: the host copy never ended", t_.str(i)))
                 : Wait(i, fmt::format("{}: waiting for the other group members", t_.str(i)));
  if (s.ok()) pending_[K(i)] = 0;
  return s;
}

Status Executor::Run(OpId i) {
  // Asynchronous ops (sends, collectives) this op depends on must be complete.
  for (OpId d : t_.deps(i))
    if (t_.rank(d) == rank_) RETURN_IF_ERROR(Finish(d));
  const OpKind k = t_.kind(i);
  Status s = IsSend(k)         ? RunSend(i)
             : IsRecv(k)       ? RunRecv(i)
             : IsCollective(k) ? RunCollective(i)
             : IsCopy(k)       ? RunCopy(i)
                               : RunCompute(i);
  if (s.ok()) ran_[K(i)] = 1;
  return s;
}

// `calls` all-reduces of `count` bf16 elements on communicator c, as one NCCL group.
Status Executor::Fold(int32_t c, size_t count, int32_t calls, cudaStream_t s) {
  ncclGroupStart();
  for (int32_t call = 0; call < calls; ++call)
    ncclAllReduce(fold_, fold_, count, ncclBfloat16, ncclSum, Comm(c), s);
  return Taken(ncclGroupEnd(), Comm(c), "folded all-reduce", o_.op_timeout_s);
}

Status Executor::RunCompute(OpId i) {
  const Work& w = t_.work(i);
  const int32_t c = CommOf(i);
  const size_t n = c >= 0 ? cp_.members[c].size() : 1;
  // A gang's members start together (a one-element all-reduce), as the simulator has them:
  // the op starts when the last member is ready.
  if (t_.grouped(i) && n > 1) RETURN_IF_ERROR(Fold(c, 1, 1, compute_));
  RETURN_IF_ERROR(Cuda(cudaEventRecord(start_[K(i)], compute_), "cudaEventRecord"));
  std::string err = pool_->EnqueueGemm(0, GemmDim(w, t_.ranks()[rank_].gpus),
                                       std::max(1, w.layer_end - w.layer_begin));
  if (err.empty()) err = pool_->EnqueueWrite(0, static_cast<size_t>(std::max(0.0, w.hbm_bytes)));
  if (!err.empty()) return Internal(err);
  if (const size_t count = FoldCount(w, n); count > 0)
    RETURN_IF_ERROR(Fold(c, count, w.tp_calls, compute_));
  RETURN_IF_ERROR(Cuda(cudaEventRecord(end_[K(i)], compute_), "cudaEventRecord"));
  return Wait(i, t_.grouped(i) ? "waiting for the gang's other members" : "the GPU never finished");
}

void Executor::AddProbe(cudaStream_t s, const void* dev, size_t offset, uint8_t want, OpId op) {
  if (!check_ || op == UINT32_MAX) return;
  const size_t slot = probe_slots_++;
  cudaMemcpyAsync(probe_host_ + slot, static_cast<const uint8_t*>(dev) + offset, 1,
                  cudaMemcpyDeviceToHost, s);
  probes_.push_back({slot, want, op});
}

// Sends read their buffer only: one shared buffer, unless the check stamps each transfer
// (then each gets its own, allocated and freed in stream order: no CPU wait).
Status Executor::RunSend(OpId i) {
  const int32_t c = CommOf(i);
  cudaStream_t s = send_streams_.at(c);
  const size_t bytes = Bytes(t_.work(i));
  RETURN_IF_ERROR(Cuda(cudaEventRecord(start_[K(i)], s), "cudaEventRecord"));
  if (bytes > 0) {
    void* buf = send_buf_;
    if (check_) {
      RETURN_IF_ERROR(Cuda(cudaMallocAsync(&buf, bytes, s), "cudaMallocAsync"));
      RETURN_IF_ERROR(Cuda(cudaMemsetAsync(buf, Stamp(i), bytes, s), "cudaMemsetAsync"));
    }
    const int32_t to = cp_.RankIn(c, pm_.process(t_.peer(i), shard_));
    Status sent =
        Taken(ncclSend(buf, bytes, ncclInt8, to, Comm(c), s), Comm(c), "ncclSend", o_.op_timeout_s);
    if (check_) cudaFreeAsync(buf, s);
    RETURN_IF_ERROR(sent);
  }
  RETURN_IF_ERROR(Cuda(cudaEventRecord(end_[K(i)], s), "cudaEventRecord"));
  pending_[K(i)] = 1;  // eager: the next op does not wait for the receiver
  return Status::Ok();
}

Status Executor::RunRecv(OpId i) {
  const int32_t c = CommOf(i);
  const OpId mine = t_.send_of(i);
  RETURN_IF_ERROR(Cuda(cudaEventRecord(start_[K(i)], recv_), "cudaEventRecord"));
  const std::vector<OpId> now = order_.Post(i);
  if (now.empty()) {  // arrived earlier and was held
    auto it = held_.find(mine);
    if (it != held_.end()) {
      RETURN_IF_ERROR(Cuda(cudaFreeAsync(it->second, recv_), "cudaFreeAsync"));
      held_.erase(it);
    }
  } else {
    const int32_t from = cp_.RankIn(c, pm_.process(t_.peer(i), shard_));
    std::vector<std::pair<void*, size_t>> bufs;
    for (OpId s : now) {
      const size_t bytes = Bytes(t_.work(s));
      void* buf = recv_buf_;
      if (s != mine) {  // an earlier transfer: held until its own RECV
        RETURN_IF_ERROR(
            Cuda(cudaMallocAsync(&buf, std::max<size_t>(bytes, 1), recv_), "cudaMallocAsync"));
        held_[s] = buf;
      }
      bufs.push_back({buf, bytes});
    }
    ncclGroupStart();
    for (auto [buf, bytes] : bufs)
      if (bytes > 0) ncclRecv(buf, bytes, ncclInt8, from, Comm(c), recv_);
    RETURN_IF_ERROR(Taken(ncclGroupEnd(), Comm(c), "ncclRecv", o_.op_timeout_s));
    for (size_t k = 0; k < now.size(); ++k)
      if (bufs[k].second > 0) {
        AddProbe(recv_, bufs[k].first, 0, Stamp(now[k]), now[k]);
        AddProbe(recv_, bufs[k].first, bufs[k].second - 1, Stamp(now[k]), now[k]);
      }
  }
  RETURN_IF_ERROR(Cuda(cudaEventRecord(end_[K(i)], recv_), "cudaEventRecord"));
  return Wait(i, "the matching SEND never came");
}

// Enqueues a collective of `bytes` per member on communicator c. With the check, the
// inputs make the result known: ones that sum to n, or member stamps that land in the
// member's segment; probes read the result (probe_op = UINT32_MAX: no probes).
Status Executor::Collective(OpKind kind, int32_t c, size_t bytes, cudaStream_t s, OpId probe_op) {
  ncclComm_t comm = Comm(c);
  const size_t n = cp_.members[c].size(), me = cp_.RankIn(c, me_), per = bytes / n;
  auto* in = static_cast<uint8_t*>(coll_in_);
  auto* out = static_cast<uint8_t*>(coll_out_);
  auto fill = [&](void* p, int value, size_t count) {
    return check_ && count > 0 ? Cuda(cudaMemsetAsync(p, value, count, s), "cudaMemsetAsync")
                               : Status::Ok();
  };
  std::vector<std::pair<size_t, uint8_t>> expect;  // (offset in out, byte) once it ran
  ncclResult_t r = ncclSuccess;
  switch (kind) {
    case OpKind::kAllReduce:
      RETURN_IF_ERROR(fill(in, 1, bytes));
      if (bytes > 0) r = ncclAllReduce(in, out, bytes, ncclInt8, ncclSum, comm, s);
      if (bytes > 0) expect.push_back({bytes - 1, static_cast<uint8_t>(n)});
      break;
    case OpKind::kReduceScatter:
      RETURN_IF_ERROR(fill(in, 1, per * n));
      if (per > 0) r = ncclReduceScatter(in, out, per, ncclInt8, ncclSum, comm, s);
      if (per > 0) expect.push_back({per - 1, static_cast<uint8_t>(n)});
      break;
    case OpKind::kAllGather:
      RETURN_IF_ERROR(fill(in, Stamp(me + 1000), per));
      if (per > 0) r = ncclAllGather(in, out, per, ncclInt8, comm, s);
      for (size_t j = 0; j < n && per > 0; ++j) expect.push_back({j * per, Stamp(j + 1000)});
      break;
    default:  // all-to-all: segment j goes to member j
      for (size_t j = 0; j < n; ++j)
        RETURN_IF_ERROR(fill(in + j * per, Stamp(me * n + j + 1), per));
      if (per > 0) {
        ncclGroupStart();
        for (size_t j = 0; j < n; ++j) {
          ncclSend(in + j * per, per, ncclInt8, static_cast<int>(j), comm, s);
          ncclRecv(out + j * per, per, ncclInt8, static_cast<int>(j), comm, s);
        }
        r = ncclGroupEnd();
      }
      for (size_t j = 0; j < n && per > 0; ++j) expect.push_back({j * per, Stamp(j * n + me + 1)});
      break;
  }
  // A non-blocking call puts its kernel on the stream only once taken: probes go after.
  RETURN_IF_ERROR(Taken(r, comm, fmt::format("{} collective", KindName(kind)), o_.op_timeout_s));
  for (auto [offset, want] : expect) AddProbe(s, out, offset, want, probe_op);
  return Status::Ok();
}

Status Executor::RunCollective(OpId i) {
  RETURN_IF_ERROR(Cuda(cudaEventRecord(start_[K(i)], collective_), "cudaEventRecord"));
  RETURN_IF_ERROR(Collective(t_.kind(i), CommOf(i), Bytes(t_.work(i)), collective_, i));
  RETURN_IF_ERROR(Cuda(cudaEventRecord(end_[K(i)], collective_), "cudaEventRecord"));
  pending_[K(i)] = 1;  // waited for by the ops that depend on it
  return Status::Ok();
}

// A host copy runs on its direction's stream while compute goes on; the ops that depend on
// it wait for it (Run).
Status Executor::RunCopy(OpId i) {
  cudaStream_t s = t_.kind(i) == OpKind::kOffload ? to_host_ : from_host_;
  RETURN_IF_ERROR(Cuda(cudaEventRecord(start_[K(i)], s), "cudaEventRecord"));
  if (std::string e =
          pool_->EnqueueHostCopy(0, Bytes(t_.work(i)), t_.kind(i) == OpKind::kOffload, s);
      !e.empty())
    return Internal(e);
  RETURN_IF_ERROR(Cuda(cudaEventRecord(end_[K(i)], s), "cudaEventRecord"));
  pending_[K(i)] = 1;
  return Status::Ok();
}

Status Executor::Drain() {
  for (OpId i = t_.rank_begin(rank_); i < t_.rank_end(rank_); ++i)
    if (Status s = Finish(i); !s.ok())
      return Status(s.code(), fmt::format("rank {}: {}: {}", rank_, t_.str(i), s.message()));
  return Status::Ok();
}

// Device times of the ops that completed: the GPU time from the start barrier to the op's
// start, plus the op's own elapsed time. (Ops that did not complete keep host times.)
void Executor::EventTimes(Timeline* own) const {
  for (OpId i = t_.rank_begin(rank_); i < t_.rank_end(rank_); ++i) {
    const size_t k = K(i);
    if (!ran_[k] || cudaEventQuery(end_[k]) != cudaSuccess) continue;
    float to_start = 0, length = 0;
    if (cudaEventElapsedTime(&to_start, ref_, start_[k]) != cudaSuccess ||
        cudaEventElapsedTime(&length, start_[k], end_[k]) != cudaSuccess)
      continue;
    own->start[i] = to_start / 1e3;
    own->end[i] = own->start[i] + length / 1e3;
  }
}

StatusOr<NcclResult> Executor::Gather(const Timeline& own) {
  NcclResult res;
  res.device = device_;
  // Every process's (start, end) per op of its rank, padded to the longest sequence.
  const size_t row = row_;
  std::vector<double> mine(row, -1.0), all(row * pm_.world);
  for (OpId i = t_.rank_begin(rank_), k = 0; i < t_.rank_end(rank_); ++i, ++k)
    mine[2 * k] = own.start[i], mine[2 * k + 1] = own.end[i];
  // Transfers and collectives checked, and how many of them went wrong.
  std::set<OpId> checked, bad;
  for (const Probe& p : probes_) {
    checked.insert(p.op);
    if (probe_host_[p.slot] != p.want && bad.insert(p.op).second && res.mismatch.empty())
      res.mismatch = fmt::format("rank {}: {}: byte {} arrived where {} was sent", rank_,
                                 t_.str(p.op), probe_host_[p.slot], p.want);
  }
  mine[row - 2] = static_cast<double>(checked.size());
  mine[row - 1] = static_cast<double>(bad.size());
  // On the gather's own stream: a plain cudaMemcpy from pageable memory may return before
  // the data lands, and the non-blocking stream would not wait for it.
  Status s = Cuda(cudaMemcpyAsync(gather_in_, mine.data(), row * sizeof(double),
                                  cudaMemcpyHostToDevice, collective_),
                  "cudaMemcpyAsync");
  if (s.ok())
    s = Taken(ncclAllGather(gather_in_, gather_out_, row, ncclFloat64, world_, collective_), world_,
              "gathering the timelines", o_.op_timeout_s);
  if (s.ok()) s = Cuda(cudaEventRecord(mark_, collective_), "cudaEventRecord");
  if (s.ok())
    s = WaitEvent(mark_, world_, o_.op_timeout_s,
                  "gathering the timelines: another process did not finish");
  if (s.ok())
    s = Cuda(
        cudaMemcpy(all.data(), gather_out_, all.size() * sizeof(double), cudaMemcpyDeviceToHost),
        "cudaMemcpy");
  if (!s.ok()) return Status(s.code(), fmt::format("process {}: {}", me_, s.message()));
  // An op of a rank with several GPUs spans its first start to its last end.
  res.merged.start.assign(t_.size(), -1.0), res.merged.end.assign(t_.size(), -1.0);
  for (int32_t p = 0; p < pm_.world; ++p) {
    const double* got = all.data() + row * p;
    const int32_t r = pm_.rank[p];
    for (OpId i = t_.rank_begin(r), k = 0; i < t_.rank_end(r); ++i, ++k) {
      double& st = res.merged.start[i];
      double& en = res.merged.end[i];
      st = st < 0 ? got[2 * k] : std::min(st, got[2 * k]);
      en = std::max(en, got[2 * k + 1]);
    }
    res.checked += static_cast<int64_t>(got[row - 2]);
    res.bad += static_cast<int64_t>(got[row - 1]);
  }
  return res;
}

void Executor::Release() {
  // A failed run may leave kernels waiting on peers: abort instead of finalising.
  std::vector<ncclComm_t> all = comms_;
  all.push_back(world_);
  for (ncclComm_t c : all) {
    if (c == nullptr) continue;
    bool clean = !failed_;
    if (clean) clean = Taken(ncclCommFinalize(c), c, "finalize", o_.op_timeout_s).ok();
    if (clean)
      ncclCommDestroy(c);
    else
      ncclCommAbort(c);
  }
  comms_.clear(), world_ = nullptr;
  if (device_.empty()) return;  // no device was set: nothing else was made
  cudaDeviceSynchronize();      // nothing of ours is still reading a buffer freed below
  for (auto& [op, buf] : held_) cudaFree(buf);
  for (void* p : {send_buf_, recv_buf_, coll_in_, coll_out_, fold_, gather_in_, gather_out_})
    cudaFree(p);
  for (auto& [c, s] : send_streams_)
    if (s) cudaStreamDestroy(s);
  if (collective_) cudaStreamDestroy(collective_);
  if (recv_) cudaStreamDestroy(recv_);
  if (to_host_) cudaStreamDestroy(to_host_);
  if (from_host_) cudaStreamDestroy(from_host_);
  for (auto* v : {&start_, &end_})
    for (cudaEvent_t e : *v)
      if (e) cudaEventDestroy(e);
  for (cudaEvent_t e : {ref_, mark_})
    if (e) cudaEventDestroy(e);
  if (probe_host_) cudaFreeHost(probe_host_);
  pool_.reset();
}

}  // namespace

StatusOr<NcclResult> RunNccl(const Table& t, const NcclLaunch& launch, const RunOptions& o,
                             bool check, Timeline* own) {
  own->start.assign(t.size(), -1.0), own->end.assign(t.size(), -1.0);
  Executor ex(t, o, check);
  Status s = ex.Init(launch);
  if (s.ok()) s = ex.Barrier();
  if (!s.ok()) {
    ex.MarkFailed();
    return Status(s.code(), fmt::format("process {}: {}", launch.process, s.message()));
  }
  const auto t0 = Clock::now();  // host times (partial traces): the barrier as seen here
  s = RunSequence(
      t, ex.rank(), [&](OpId i) { return ex.Run(i); }, o, t0, own);
  if (s.ok()) s = ex.Drain();
  ex.EventTimes(own);
  if (!s.ok()) {
    ex.MarkFailed();
    return s;
  }
  auto res = ex.Gather(*own);
  if (!res.ok()) ex.MarkFailed();
  return res;
}

}  // namespace pipeplan
