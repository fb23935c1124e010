#include "executor/nccl_backend.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <thread>

#include "executor/cuda_backend.h"
#include "executor/cuda_device.h"
#include "executor/process_map.h"

namespace pipeplan {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxPayload = size_t{1} << 30;  // larger transfers are cut (both sides alike)
constexpr size_t kSendSlots = 8;                 // send buffers in flight per process
constexpr size_t kScratch = size_t{256} << 20;   // memory-bound passes write this at a time

Clock::time_point Deadline(double s) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

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
    ncclCommGetAsyncError(comm, &r);
  }
  return r == ncclSuccess ? Status::Ok() : NcclError(r, comm, what);
}

// A byte (1..251) that identifies a SEND, or a group member's contribution, on the wire.
uint8_t Stamp(uint64_t x) {
  return static_cast<uint8_t>(x * 2654435761u % 251 + 1);
}

size_t Bytes(const Work& w) {
  return static_cast<size_t>(std::clamp(w.payload_bytes, 0.0, static_cast<double>(kMaxPayload)));
}

struct Probe {
  size_t slot;   // byte in the pinned probe buffer
  uint8_t want;  // what must have arrived
  OpId op;       // the transfer (its SEND) or collective it checks
};

class Executor {
 public:
  Executor(const Table& t, const RunOptions& o, bool check)
      : t_(t), o_(o), check_(check), order_(t) {}
  ~Executor() { Release(); }

  Status Init(const NcclLaunch& l);
  Status Barrier();
  void SetReference(Clock::time_point t0);
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
  Status Wait(OpId i, const std::string& waiting_for);
  Status Finish(OpId i);  // waits for an asynchronous op
  Status RunCompute(OpId i);
  Status RunSend(OpId i);
  Status RunRecv(OpId i);
  Status RunCollective(OpId i);
  Status Alloc(void** p, size_t bytes) { return Cuda(cudaMalloc(p, std::max<size_t>(bytes, 1)), "cudaMalloc"); }
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

  ncclComm_t world_ = nullptr;
  std::vector<ncclComm_t> comms_;
  std::unique_ptr<cudadev::Pool> pool_;  // GEMMs and memory-bound passes, compute stream
  cudaStream_t compute_ = nullptr, collective_ = nullptr, recv_ = nullptr;
  std::map<int32_t, cudaStream_t> send_streams_;  // per send communicator
  std::vector<void*> slots_;                       // send buffers
  std::vector<OpId> slot_op_;                      // the SEND using each slot
  size_t next_slot_ = 0;
  void *recv_buf_ = nullptr, *coll_in_ = nullptr, *coll_out_ = nullptr, *fold_ = nullptr;
  std::map<OpId, void*> held_;  // transfers that arrived before their RECV ran
  std::vector<cudaEvent_t> start_, end_;
  std::vector<char> ran_, pending_;
  cudaEvent_t ref_ = nullptr;
  double ref_s_ = 0;
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
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  RETURN_IF_ERROR(Taken(ncclCommInitRankConfig(&world_, l.world, id, me_, &config), world_,
                        fmt::format("joining the NCCL world of {} processes", l.world),
                        o_.op_timeout_s));
  if (me_ == 0 && l.joined) l.joined();
  comms_.assign(cp_.members.size(), nullptr);
  const std::vector<int32_t> colors = cp_.Colors(me_);
  for (int32_t k = 0; k < cp_.rounds; ++k) {
    ncclComm_t c = nullptr;
    ncclResult_t r =
        ncclCommSplit(world_, colors[k] < 0 ? NCCL_SPLIT_NOCOLOR : colors[k], me_, &c, &config);
    RETURN_IF_ERROR(Taken(r, c ? c : world_,
                          fmt::format("creating communicators (round {} of {})", k + 1, cp_.rounds),
                          o_.op_timeout_s));
    if (colors[k] >= 0) comms_[colors[k]] = c;
  }

  // Streams, buffers and events for this rank's ops.
  const OpId b = t_.rank_begin(rank_), e = t_.rank_end(rank_);
  size_t dim = 0, hbm = 1, send = 0, recv = 0, coll = 0, fold = 0, probes = 0;
  for (OpId i = b; i < e; ++i) {
    const Work& w = t_.work(i);
    const OpKind k = t_.kind(i);
    if (IsCompute(k)) {
      dim = std::max(dim, GemmDim(w, t_.ranks()[rank_].gpus));
      hbm = std::max(hbm, static_cast<size_t>(std::min<double>(w.hbm_bytes, kScratch)));
      if (w.tp_calls > 0)
        fold = std::max(fold, static_cast<size_t>(std::min<double>(w.tp_bytes, kMaxPayload)));
    }
    if (IsSend(k)) send = std::max(send, Bytes(w));
    if (IsRecv(k)) recv = std::max(recv, Bytes(w)), probes += 2;
    if (IsCollective(k))
      coll = std::max(coll, Bytes(w)), probes += std::max<size_t>(2, t_.group(t_.peer(i)).size());
  }
  std::string err = cudadev::Pool::Create(1, dim, hbm, &pool_);
  if (!err.empty()) return Internal(err);
  compute_ = static_cast<cudaStream_t>(pool_->stream(0));
  RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&collective_, cudaStreamNonBlocking), "stream"));
  RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&recv_, cudaStreamNonBlocking), "stream"));
  for (OpId i = b; i < e; ++i)
    if (IsSend(t_.kind(i)) && !send_streams_.count(CommOf(i)))
      RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&send_streams_[CommOf(i)],
                                                     cudaStreamNonBlocking),
                           "stream"));
  if (send > 0) {
    slots_.assign(kSendSlots, nullptr);
    slot_op_.assign(kSendSlots, UINT32_MAX);
    for (void*& s : slots_) RETURN_IF_ERROR(Alloc(&s, send));
  }
  RETURN_IF_ERROR(Alloc(&recv_buf_, recv));
  RETURN_IF_ERROR(Alloc(&coll_in_, coll));
  RETURN_IF_ERROR(Alloc(&coll_out_, coll));
  RETURN_IF_ERROR(Alloc(&fold_, fold));
  if (check_) {
    RETURN_IF_ERROR(Cuda(cudaMallocHost(&probe_host_, std::max<size_t>(probes, 1)), "cudaMallocHost"));
    std::memset(probe_host_, 0, std::max<size_t>(probes, 1));
  }
  start_.assign(e - b, nullptr), end_.assign(e - b, nullptr);
  ran_.assign(e - b, 0), pending_.assign(e - b, 0);
  for (size_t k = 0; k < start_.size(); ++k) {
    RETURN_IF_ERROR(Cuda(cudaEventCreate(&start_[k]), "cudaEventCreate"));
    RETURN_IF_ERROR(Cuda(cudaEventCreate(&end_[k]), "cudaEventCreate"));
  }
  return Cuda(cudaEventCreate(&ref_), "cudaEventCreate");
}

// An all-reduce over every process, waited for: a common start for the clocks.
Status Executor::Barrier() {
  RETURN_IF_ERROR(Cuda(cudaMemsetAsync(coll_in_, 0, 1, collective_), "cudaMemsetAsync"));
  RETURN_IF_ERROR(Taken(ncclAllReduce(coll_in_, coll_in_, 1, ncclInt8, ncclSum, world_, collective_),
                        world_, "barrier", o_.op_timeout_s));
  RETURN_IF_ERROR(Cuda(cudaEventRecord(ref_, collective_), "cudaEventRecord"));
  const auto deadline = Deadline(o_.op_timeout_s);
  for (;;) {
    cudaError_t e = cudaEventQuery(ref_);
    if (e == cudaSuccess) return Status::Ok();
    if (e != cudaErrorNotReady) return Cuda(e, "barrier");
    if (Clock::now() > deadline)
      return Internal(fmt::format("timed out after {} s waiting for every process to start",
                                  o_.op_timeout_s));
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void Executor::SetReference(Clock::time_point t0) {
  cudaEventRecord(ref_, compute_);
  cudaEventSynchronize(ref_);
  ref_s_ = std::chrono::duration<double>(Clock::now() - t0).count();
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
  const auto deadline = Deadline(o_.op_timeout_s);
  for (;;) {
    cudaError_t e = cudaEventQuery(end_[K(i)]);
    if (e == cudaSuccess) return Status::Ok();
    if (e != cudaErrorNotReady) return Cuda(e, "waiting for the GPU");
    if (c >= 0) {
      ncclResult_t r = ncclSuccess;
      ncclCommGetAsyncError(Comm(c), &r);
      if (r != ncclSuccess && r != ncclInProgress) return NcclError(r, Comm(c), waiting_for);
    }
    if (Clock::now() > deadline)
      return Internal(fmt::format("timed out after {} s: {}", o_.op_timeout_s, waiting_for));
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

Status Executor::Finish(OpId i) {
  if (!pending_[K(i)]) return Status::Ok();
  Status s = IsSend(t_.kind(i)) ? Wait(i, fmt::format("{}: the receiver never took it", t_.str(i)))
                                : Wait(i, fmt::format("{}: waiting for the other group members",
                                                      t_.str(i)));
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
                               : RunCompute(i);
  if (s.ok()) ran_[K(i)] = 1;
  return s;
}

Status Executor::RunCompute(OpId i) {
  const Work& w = t_.work(i);
  RETURN_IF_ERROR(Cuda(cudaEventRecord(start_[K(i)], compute_), "cudaEventRecord"));
  std::string err = pool_->EnqueueGemm(0, GemmDim(w, t_.ranks()[rank_].gpus),
                                       std::max(1, w.layer_end - w.layer_begin));
  if (err.empty()) err = pool_->EnqueueWrite(0, static_cast<size_t>(std::max(0.0, w.hbm_bytes)));
  if (!err.empty()) return Internal(err);
  // Folded TP/CP collectives (a gang's gather-KV): all-reduces moving tp_bytes per GPU
  // over the ring (2 (n-1)/n of each call's size).
  const int32_t c = CommOf(i);
  const size_t n = c >= 0 ? cp_.members[c].size() : 1;
  if (n > 1 && w.tp_calls > 0) {
    const double ring = 2.0 * static_cast<double>(n - 1) / static_cast<double>(n);
    const size_t count = static_cast<size_t>(
        std::min<double>(w.tp_bytes, kMaxPayload) / w.tp_calls / ring / 2);  // bf16 elements
    for (int32_t call = 0; call < w.tp_calls && count > 0; ++call)
      RETURN_IF_ERROR(Taken(ncclAllReduce(fold_, fold_, count, ncclBfloat16, ncclSum, Comm(c),
                                          compute_),
                            Comm(c), "folded all-reduce", o_.op_timeout_s));
  }
  RETURN_IF_ERROR(Cuda(cudaEventRecord(end_[K(i)], compute_), "cudaEventRecord"));
  return Wait(i, t_.grouped(i) ? "waiting for the gang's other members" : "the GPU never finished");
}

void Executor::AddProbe(cudaStream_t s, const void* dev, size_t offset, uint8_t want, OpId op) {
  if (!check_) return;
  const size_t slot = probe_slots_++;
  cudaMemcpyAsync(probe_host_ + slot, static_cast<const uint8_t*>(dev) + offset, 1,
                  cudaMemcpyDeviceToHost, s);
  probes_.push_back({slot, want, op});
}

Status Executor::RunSend(OpId i) {
  const int32_t c = CommOf(i);
  cudaStream_t s = send_streams_.at(c);
  const size_t bytes = Bytes(t_.work(i));
  const size_t slot = next_slot_++ % kSendSlots;
  if (slot_op_[slot] != UINT32_MAX) RETURN_IF_ERROR(Finish(slot_op_[slot]));  // slot reuse
  slot_op_[slot] = i;
  RETURN_IF_ERROR(Cuda(cudaEventRecord(start_[K(i)], s), "cudaEventRecord"));
  if (bytes > 0) {
    if (check_)
      RETURN_IF_ERROR(Cuda(cudaMemsetAsync(slots_[slot], Stamp(i), bytes, s), "cudaMemsetAsync"));
    const int32_t to = cp_.RankIn(c, pm_.process(t_.peer(i), shard_));
    RETURN_IF_ERROR(Taken(ncclSend(slots_[slot], bytes, ncclInt8, to, Comm(c), s), Comm(c),
                          "ncclSend", o_.op_timeout_s));
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

Status Executor::RunCollective(OpId i) {
  const int32_t c = CommOf(i);
  ncclComm_t comm = Comm(c);
  const size_t n = cp_.members[c].size(), me = cp_.RankIn(c, me_);
  const size_t bytes = Bytes(t_.work(i)), per = bytes / n;
  auto* in = static_cast<uint8_t*>(coll_in_);
  auto* out = static_cast<uint8_t*>(coll_out_);
  cudaStream_t s = collective_;
  RETURN_IF_ERROR(Cuda(cudaEventRecord(start_[K(i)], s), "cudaEventRecord"));
  // Contributions whose result is known: ones that sum to n, or member stamps that land
  // in the member's segment.
  auto fill = [&](void* p, int value, size_t count) {
    return check_ && count > 0 ? Cuda(cudaMemsetAsync(p, value, count, s), "cudaMemsetAsync")
                               : Status::Ok();
  };
  ncclResult_t r = ncclSuccess;
  switch (t_.kind(i)) {
    case OpKind::kAllReduce:
      RETURN_IF_ERROR(fill(in, 1, bytes));
      if (bytes > 0) r = ncclAllReduce(in, out, bytes, ncclInt8, ncclSum, comm, s);
      if (bytes > 0) AddProbe(s, out, bytes - 1, static_cast<uint8_t>(n), i);
      break;
    case OpKind::kReduceScatter:
      RETURN_IF_ERROR(fill(in, 1, per * n));
      if (per > 0) r = ncclReduceScatter(in, out, per, ncclInt8, ncclSum, comm, s);
      if (per > 0) AddProbe(s, out, per - 1, static_cast<uint8_t>(n), i);
      break;
    case OpKind::kAllGather:
      RETURN_IF_ERROR(fill(in, Stamp(me + 1000), per));
      if (per > 0) r = ncclAllGather(in, out, per, ncclInt8, comm, s);
      for (size_t j = 0; j < n && per > 0; ++j) AddProbe(s, out, j * per, Stamp(j + 1000), i);
      break;
    default:  // all-to-all: segment j goes to member j
      for (size_t j = 0; j < n; ++j) RETURN_IF_ERROR(fill(in + j * per, Stamp(me * n + j + 1), per));
      if (per > 0) {
        ncclGroupStart();
        for (size_t j = 0; j < n; ++j) {
          ncclSend(in + j * per, per, ncclInt8, static_cast<int>(j), comm, s);
          ncclRecv(out + j * per, per, ncclInt8, static_cast<int>(j), comm, s);
        }
        r = ncclGroupEnd();
      }
      for (size_t j = 0; j < n && per > 0; ++j) AddProbe(s, out, j * per, Stamp(j * n + me + 1), i);
      break;
  }
  RETURN_IF_ERROR(Taken(r, comm, fmt::format("{} collective", KindName(t_.kind(i))), o_.op_timeout_s));
  RETURN_IF_ERROR(Cuda(cudaEventRecord(end_[K(i)], s), "cudaEventRecord"));
  pending_[K(i)] = 1;  // waited for by the ops that depend on it
  return Status::Ok();
}

Status Executor::Drain() {
  for (OpId i = t_.rank_begin(rank_); i < t_.rank_end(rank_); ++i)
    if (Status s = Finish(i); !s.ok())
      return Status(s.code(), fmt::format("rank {}: {}: {}", rank_, t_.str(i), s.message()));
  return Cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

// Device times of the ops that completed: the reference event's host time plus the
// elapsed GPU time.
void Executor::EventTimes(Timeline* own) const {
  for (OpId i = t_.rank_begin(rank_); i < t_.rank_end(rank_); ++i) {
    const size_t k = K(i);
    if (!ran_[k] || cudaEventQuery(end_[k]) != cudaSuccess) continue;
    float a = 0, b = 0;
    if (cudaEventElapsedTime(&a, ref_, start_[k]) != cudaSuccess ||
        cudaEventElapsedTime(&b, ref_, end_[k]) != cudaSuccess)
      continue;
    own->start[i] = ref_s_ + a / 1e3;
    own->end[i] = ref_s_ + b / 1e3;
  }
}

StatusOr<NcclResult> Executor::Gather(const Timeline& own) {
  NcclResult res;
  res.device = device_;
  // Every process's (start, end) per op of its rank, padded to the longest sequence.
  size_t longest = 0;
  for (int32_t r = 0; r < t_.num_ranks(); ++r)
    longest = std::max<size_t>(longest, t_.rank_end(r) - t_.rank_begin(r));
  const size_t row = 2 * longest + 2;  // + [checked, bad]
  std::vector<double> mine(row, -1.0), all(row * pm_.world);
  for (OpId i = t_.rank_begin(rank_), k = 0; i < t_.rank_end(rank_); ++i, ++k)
    mine[2 * k] = own.start[i], mine[2 * k + 1] = own.end[i];
  int64_t bad = 0;
  for (const Probe& p : probes_)
    if (probe_host_[p.slot] != p.want && bad++ == 0)
      res.mismatch = fmt::format("rank {}: {}: byte {} arrived where {} was sent", rank_,
                                 t_.str(p.op), probe_host_[p.slot], p.want);
  int64_t checked = 0;
  for (size_t k = 0; k < probes_.size(); ++k)
    checked += k == 0 || probes_[k].op != probes_[k - 1].op;
  mine[row - 2] = static_cast<double>(checked), mine[row - 1] = static_cast<double>(bad);
  void *dev_in = nullptr, *dev_out = nullptr;
  RETURN_IF_ERROR(Alloc(&dev_in, row * sizeof(double)));
  RETURN_IF_ERROR(Alloc(&dev_out, all.size() * sizeof(double)));
  Status s = Cuda(cudaMemcpy(dev_in, mine.data(), row * sizeof(double), cudaMemcpyHostToDevice),
                  "cudaMemcpy");
  if (s.ok())
    s = Taken(ncclAllGather(dev_in, dev_out, row, ncclFloat64, world_, collective_), world_,
              "gathering the timelines", o_.op_timeout_s);
  if (s.ok()) s = Cuda(cudaStreamSynchronize(collective_), "gathering the timelines");
  if (s.ok())
    s = Cuda(cudaMemcpy(all.data(), dev_out, all.size() * sizeof(double), cudaMemcpyDeviceToHost),
             "cudaMemcpy");
  cudaFree(dev_in), cudaFree(dev_out);
  RETURN_IF_ERROR(s);
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
    if (clean) {
      ncclResult_t r = ncclCommFinalize(c);
      clean = Taken(r, c, "finalize", o_.op_timeout_s).ok();
    }
    if (clean)
      ncclCommDestroy(c);
    else
      ncclCommAbort(c);
  }
  comms_.clear(), world_ = nullptr;
  for (auto& [op, buf] : held_) cudaFree(buf);
  for (void* p : slots_) cudaFree(p);
  for (void* p : {recv_buf_, coll_in_, coll_out_, fold_}) cudaFree(p);
  for (auto& [c, s] : send_streams_) cudaStreamDestroy(s);
  if (collective_) cudaStreamDestroy(collective_);
  if (recv_) cudaStreamDestroy(recv_);
  for (auto* v : {&start_, &end_})
    for (cudaEvent_t e : *v)
      if (e) cudaEventDestroy(e);
  if (ref_) cudaEventDestroy(ref_);
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
  const auto t0 = Clock::now();
  ex.SetReference(t0);
  s = RunSequence(
      t, ex.rank(), [&](OpId i) { return ex.Run(i); }, o, t0, own);
  if (s.ok()) s = ex.Drain();
  ex.EventTimes(own);
  if (!s.ok()) {
    ex.MarkFailed();
    return s;
  }
  return ex.Gather(*own);
}

}  // namespace pipeplan
