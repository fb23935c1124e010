// The CPU test double of the CUDA runtime, NCCL and the cuBLAS pool (see cuda_runtime.h
// and nccl.h here). Every process of a job is a thread of the test.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cuda_runtime.h"
#include "executor/cuda_device.h"
#include "nccl.h"

using Clock = std::chrono::steady_clock;

struct EmuStream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> tasks;
  size_t unfinished = 0;
  bool stop = false;
  std::thread worker;

  EmuStream() : worker([this] { Loop(); }) {}
  ~EmuStream() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_all();
    worker.join();
  }
  void Push(std::function<void()> f) {
    std::lock_guard<std::mutex> lock(mu);
    tasks.push_back(std::move(f));
    ++unfinished;
    cv.notify_all();
  }
  void Sync() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return unfinished == 0; });
  }
  void Loop() {
    for (;;) {
      std::function<void()> f;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || !tasks.empty(); });
        if (tasks.empty()) return;
        f = std::move(tasks.front());
        tasks.pop_front();
      }
      f();
      std::lock_guard<std::mutex> lock(mu);
      --unfinished;
      cv.notify_all();
    }
  }
};

struct EmuEvent {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0, done = 0;
  Clock::time_point at;
};

namespace {

std::atomic<int> g_devices{1};
std::atomic<int> g_corrupt{-1};
std::atomic<int> g_delivered{0};
thread_local std::set<EmuStream*> t_streams;  // this "process's" streams

}  // namespace

namespace emu {
void Enqueue(cudaStream_t s, void (*fn)(void*), void* arg) {
  s->Push([fn, arg] { fn(arg); });
}
void SetDeviceCount(int n) {
  g_devices = n;
}
void CorruptTransfer(int n) {
  g_corrupt = n;
  g_delivered = 0;
}
}  // namespace emu

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorNotReady:
      return "device not ready";
    default:
      return "no CUDA-capable device is detected";
  }
}
cudaError_t cudaGetDeviceCount(int* n) {
  *n = g_devices;
  return *n > 0 ? cudaSuccess : cudaErrorInvalidValue;
}
cudaError_t cudaSetDevice(int d) {
  return d >= 0 && d < g_devices ? cudaSuccess : cudaErrorInvalidValue;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int) {
  std::snprintf(p->name, sizeof p->name, "emulated GPU");
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  for (EmuStream* s : t_streams) s->Sync();
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** p, size_t bytes) {
  *p = std::calloc(std::max<size_t>(bytes, 1), 1);
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** p, size_t bytes) {
  return cudaMalloc(p, bytes);
}
cudaError_t cudaFreeHost(void* p) {
  return cudaFree(p);
}
cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t) {
  return cudaMalloc(p, bytes);
}
cudaError_t cudaFreeAsync(void* p, cudaStream_t s) {
  s->Push([p] { std::free(p); });
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t s) {
  s->Push([=] { std::memset(p, value, bytes); });
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
  std::memcpy(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind k,
                            cudaStream_t s) {
  if (k == cudaMemcpyHostToDevice) {  // pageable host memory is staged at the call
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                      static_cast<const char*>(src) + bytes);
    s->Push([=] { std::memcpy(dst, staged->data(), bytes); });
  } else {
    s->Push([=] { std::memcpy(dst, src, bytes); });
  }
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  *s = new EmuStream();
  t_streams.insert(*s);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  t_streams.erase(s);
  delete s;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  s->Sync();
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* e) {
  *e = new EmuEvent();
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  uint64_t gen;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    gen = ++e->recorded;
  }
  s->Push([e, gen] {
    std::lock_guard<std::mutex> lock(e->mu);
    e->done = gen, e->at = Clock::now();
    e->cv.notify_all();
  });
  return cudaSuccess;
}
// Waits a little before answering "not ready": the backend polls, and on a loaded test
// machine a tight poll of many threads starves the stream workers it waits for.
cudaError_t cudaEventQuery(cudaEvent_t e) {
  std::unique_lock<std::mutex> lock(e->mu);
  e->cv.wait_for(lock, std::chrono::microseconds(500), [&] { return e->done == e->recorded; });
  return e->done == e->recorded ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  std::unique_lock<std::mutex> lock(e->mu);
  e->cv.wait(lock, [&] { return e->done == e->recorded; });
  return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
  if (cudaEventQuery(a) != cudaSuccess || cudaEventQuery(b) != cudaSuccess)
    return cudaErrorNotReady;
  *ms = std::chrono::duration<float, std::milli>(b->at - a->at).count();
  return cudaSuccess;
}

// ---- NCCL ----

namespace {

std::mutex g_mu;  // all communicator state
std::condition_variable g_cv;

size_t Size(ncclDataType_t t) {
  return t == ncclFloat64 ? 8 : t == ncclBfloat16 ? 2 : 1;
}

struct Msg {
  const void* buf;
  size_t bytes;
  bool taken = false;
};

struct Coll {
  int kind = 0;  // 0 all-reduce, 1 reduce-scatter, 2 all-gather
  ncclDataType_t type = ncclInt8;
  size_t count = 0;
  std::vector<const void*> in;
  std::vector<void*> out;
  int arrived = 0, left = 0;
  bool done = false;
};

struct SplitCall {
  std::vector<int> color, key;
  std::vector<ncclComm_t*> out;
  int arrived = 0;
  bool done = false;
};

// The members of one communicator.
struct Clique {
  int n = 0, joined = 0;
  std::vector<char> aborted;  // per member: its own abort (NCCL does not abort peers)
  std::string error;          // a mismatch between members
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<Msg>>> fifo;  // (from, to)
  std::map<uint64_t, Coll> colls;
  std::map<uint64_t, SplitCall> splits;
};

std::map<std::string, std::shared_ptr<Clique>> g_worlds;
std::atomic<int> g_ids{0};

}  // namespace

struct EmuComm {
  std::shared_ptr<Clique> clique;
  int rank = 0;
  // Calls answered ncclInProgress reach their stream only when the caller next asks
  // ncclCommGetAsyncError, as NCCL's background thread enqueues them "later".
  std::vector<std::pair<cudaStream_t, std::function<void()>>> deferred;
  uint64_t next_coll = 0, next_split = 0;
  int64_t pending_split = -1;
  int finalizing = 0;
};

namespace {

ncclComm_t NewComm(std::shared_ptr<Clique> c, int rank) {
  auto* comm = new EmuComm();
  comm->clique = std::move(c);
  comm->rank = rank;
  return comm;
}

bool Aborted(const EmuComm& c) {
  return c.clique->aborted[c.rank] != 0;
}

struct P2P {
  bool send;
  void* buf;
  size_t bytes;
  int peer;
  ncclComm_t comm;
  cudaStream_t stream;
};
thread_local int t_group = 0, t_group_calls = 0;
thread_local std::vector<P2P> t_ops;

// Runs on the stream: posts the sends, takes the receives in order, waits for the sends.
void RunP2P(std::vector<P2P> ops) {
  std::unique_lock<std::mutex> lock(g_mu);
  std::vector<std::shared_ptr<Msg>> posted;
  for (const P2P& op : ops)
    if (op.send) {
      auto m = std::make_shared<Msg>(Msg{op.buf, op.bytes});
      op.comm->clique->fifo[{op.comm->rank, op.peer}].push_back(m);
      posted.push_back(m);
    }
  g_cv.notify_all();
  for (const P2P& op : ops) {
    if (op.send) continue;
    auto& q = op.comm->clique->fifo[{op.peer, op.comm->rank}];
    g_cv.wait(lock, [&] { return Aborted(*op.comm) || !q.empty(); });
    if (Aborted(*op.comm)) return;
    auto m = q.front();
    q.pop_front();
    if (m->bytes != op.bytes)
      op.comm->clique->error = "send and receive sizes differ: " + std::to_string(m->bytes) +
                               " vs " + std::to_string(op.bytes);
    // A sender that aborted has left, its stream runs on: its buffer is not read.
    if (!op.comm->clique->aborted[op.peer])
      std::memcpy(op.buf, m->buf, std::min(m->bytes, op.bytes));
    if (g_delivered++ == g_corrupt && op.bytes > 0) {
      static_cast<char*>(op.buf)[0] ^= 0x5a;
      static_cast<char*>(op.buf)[op.bytes - 1] ^= 0x5a;
    }
    m->taken = true;
    g_cv.notify_all();
  }
  for (auto& m : posted) g_cv.wait(lock, [&] { return m->taken || Aborted(*ops[0].comm); });
}

ncclResult_t AddP2P(P2P op) {
  if (op.comm == nullptr || op.peer < 0 || op.peer >= op.comm->clique->n)
    return ncclInvalidArgument;
  if (t_group > 0) {
    t_ops.push_back(op);
    return ncclSuccess;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  op.comm->deferred.push_back({op.stream, [op] { RunP2P({op}); }});
  return ncclInProgress;
}

// Runs on the stream: the k-th collective of the communicator meets its members there.
void RunColl(ncclComm_t comm, uint64_t k, int kind, const void* in, void* out, size_t count,
             ncclDataType_t type) {
  std::unique_lock<std::mutex> lock(g_mu);
  Clique& c = *comm->clique;
  Coll& co = c.colls[k];
  if (co.arrived == 0) {
    co.kind = kind, co.type = type, co.count = count, co.left = c.n;
    co.in.assign(c.n, nullptr), co.out.assign(c.n, nullptr);
  }
  if (co.kind != kind || co.type != type || co.count != count)
    c.error = "collective " + std::to_string(k) + " differs between members";
  co.in[comm->rank] = in, co.out[comm->rank] = out;
  if (++co.arrived == c.n) {
    const size_t es = Size(type), bytes = count * es;
    // Results first (in place is allowed), then written to every member. A member that
    // aborted has left the collective and its stream runs on: its buffers are no longer the
    // collective's (read as zeros, not written).
    std::vector<std::vector<char>> result(c.n);
    for (int r = 0; r < c.n; ++r) {
      if (kind == 2) {  // all-gather
        result[r].assign(bytes * c.n, 0);
        for (int m = 0; m < c.n; ++m)
          if (!c.aborted[m]) std::memcpy(result[r].data() + m * bytes, co.in[m], bytes);
        continue;
      }
      const size_t offset = kind == 1 ? r * bytes : 0;  // reduce-scatter: member r's block
      result[r].assign(bytes, 0);
      for (int m = 0; m < c.n; ++m) {
        if (c.aborted[m]) continue;
        const char* src = static_cast<const char*>(co.in[m]) + offset;
        for (size_t i = 0; i < count; ++i) {
          if (type == ncclInt8) result[r][i] = static_cast<char>(result[r][i] + src[i]);
          if (type == ncclFloat64) {
            double a, b;
            std::memcpy(&a, result[r].data() + 8 * i, 8), std::memcpy(&b, src + 8 * i, 8);
            a += b;
            std::memcpy(result[r].data() + 8 * i, &a, 8);
          }
        }
      }
    }
    for (int r = 0; r < c.n; ++r)
      if (!c.aborted[r]) std::memcpy(co.out[r], result[r].data(), result[r].size());
    co.done = true;
    g_cv.notify_all();
  }
  g_cv.wait(lock, [&] { return co.done || Aborted(*comm); });
  if (--co.left == 0) c.colls.erase(k);
}

ncclResult_t AddColl(int kind, const void* in, void* out, size_t count, ncclDataType_t type,
                     ncclComm_t comm, cudaStream_t s) {
  if (comm == nullptr) return ncclInvalidArgument;
  std::lock_guard<std::mutex> lock(g_mu);
  const uint64_t k = comm->next_coll++;  // issue order, as NCCL matches collectives
  comm->deferred.push_back({s, [=] { RunColl(comm, k, kind, in, out, count, type); }});
  t_group_calls += t_group > 0;
  return t_group > 0 ? ncclSuccess : ncclInProgress;
}

}  // namespace

const char* ncclGetErrorString(ncclResult_t r) {
  static const char* names[] = {"no error",
                                "unhandled cuda error",
                                "unhandled system error",
                                "internal error",
                                "invalid argument",
                                "invalid usage",
                                "remote process exited or there was a network error",
                                "operation in progress"};
  return r >= 0 && r <= ncclInProgress ? names[r] : "unknown";
}
const char* ncclGetLastError(ncclComm_t comm) {
  static thread_local std::string last;
  std::lock_guard<std::mutex> lock(g_mu);
  last = comm ? comm->clique->error : "";
  return last.c_str();
}
ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id->internal, 0, sizeof id->internal);
  std::snprintf(id->internal, sizeof id->internal, "emulated-%d", ++g_ids);
  return ncclSuccess;
}
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t*) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto& c = g_worlds[std::string(id.internal, strnlen(id.internal, sizeof id.internal))];
  if (!c) c = std::make_shared<Clique>(), c->n = nranks, c->aborted.assign(nranks, 0);
  if (c->n != nranks || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  *comm = NewComm(c, rank);
  ++c->joined;
  g_cv.notify_all();
  return ncclInProgress;
}
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                           ncclConfig_t*) {
  if (comm == nullptr) return ncclInvalidArgument;
  std::lock_guard<std::mutex> lock(g_mu);
  *newcomm = nullptr;
  Clique& c = *comm->clique;
  const uint64_t k = comm->next_split++;
  SplitCall& sc = c.splits[k];
  if (sc.arrived == 0) sc.color.assign(c.n, -1), sc.key.assign(c.n, 0), sc.out.assign(c.n, nullptr);
  sc.color[comm->rank] = color, sc.key[comm->rank] = key, sc.out[comm->rank] = newcomm;
  comm->pending_split = static_cast<int64_t>(k);
  if (++sc.arrived == c.n) {  // the last member fills every member's handle in
    std::map<int, std::vector<int>> by_color;
    for (int r = 0; r < c.n; ++r)
      if (sc.color[r] >= 0) by_color[sc.color[r]].push_back(r);
    for (auto& [col, members] : by_color) {
      std::stable_sort(members.begin(), members.end(),
                       [&](int a, int b) { return sc.key[a] < sc.key[b]; });
      auto child = std::make_shared<Clique>();
      child->n = child->joined = static_cast<int>(members.size());
      child->aborted.assign(members.size(), 0);
      for (size_t i = 0; i < members.size(); ++i)
        *sc.out[members[i]] = NewComm(child, static_cast<int>(i));
    }
    sc.done = true;
  }
  return ncclInProgress;
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  if (comm == nullptr) return ncclInvalidArgument;
  std::unique_lock<std::mutex> lock(g_mu);
  const Clique& c = *comm->clique;
  auto waiting = [&] {
    return c.joined < c.n || (comm->pending_split >= 0 && !c.splits.at(comm->pending_split).done);
  };
  g_cv.wait_for(lock, std::chrono::microseconds(500), [&] { return !waiting(); });  // as above
  for (auto& [s, task] : comm->deferred) s->Push(std::move(task));
  comm->deferred.clear();
  if (!c.error.empty())
    *state = ncclInvalidUsage;
  else if (waiting())
    *state = ncclInProgress;
  else if (comm->finalizing == 1)
    *state = ncclInProgress, comm->finalizing = 2;
  else
    *state = ncclSuccess;
  return ncclSuccess;
}
ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  if (comm == nullptr) return ncclInvalidArgument;
  std::lock_guard<std::mutex> lock(g_mu);
  comm->finalizing = 1;
  return ncclInProgress;
}
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  std::lock_guard<std::mutex> lock(g_mu);
  comm->clique->aborted[comm->rank] = 1;  // the handle stays: aborted tasks still read it
  g_cv.notify_all();
  return ncclSuccess;
}
ncclResult_t ncclGroupStart() {
  ++t_group;
  return ncclSuccess;
}
ncclResult_t ncclGroupEnd() {
  if (--t_group > 0) return ncclSuccess;
  std::vector<P2P> ops;
  ops.swap(t_ops);
  const bool collectives = t_group_calls > 0;
  t_group_calls = 0;
  if (ops.empty()) return collectives ? ncclInProgress : ncclSuccess;
  for (const P2P& op : ops)
    if (op.stream != ops[0].stream) return ncclInvalidUsage;  // one stream per group here
  std::lock_guard<std::mutex> lock(g_mu);
  ops[0].comm->deferred.push_back({ops[0].stream, [ops] { RunP2P(ops); }});
  return ncclInProgress;
}
ncclResult_t ncclSend(const void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t s) {
  return AddP2P({true, const_cast<void*>(buf), count * Size(type), peer, comm, s});
}
ncclResult_t ncclRecv(void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t s) {
  return AddP2P({false, buf, count * Size(type), peer, comm, s});
}
ncclResult_t ncclAllReduce(const void* in, void* out, size_t count, ncclDataType_t type,
                           ncclRedOp_t, ncclComm_t comm, cudaStream_t s) {
  return AddColl(0, in, out, count, type, comm, s);
}
ncclResult_t ncclReduceScatter(const void* in, void* out, size_t count, ncclDataType_t type,
                               ncclRedOp_t, ncclComm_t comm, cudaStream_t s) {
  return AddColl(1, in, out, count, type, comm, s);
}
ncclResult_t ncclAllGather(const void* in, void* out, size_t count, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t s) {
  return AddColl(2, in, out, count, type, comm, s);
}

// ---- the cuBLAS pool: streams only, GEMMs take no time ----

namespace pipeplan::cudadev {

struct Pool::Impl {
  std::vector<cudaStream_t> streams;
  ~Impl() {
    for (cudaStream_t s : streams) cudaStreamDestroy(s);
  }
};

std::string DeviceCount(int* n) {
  return cudaGetDeviceCount(n) == cudaSuccess ? "" : "no CUDA device";
}
std::string DeviceName(std::string* name) {
  *name = "emulated GPU";
  return "";
}
std::string Pool::Create(int ranks, size_t, size_t payload_bytes, std::unique_ptr<Pool>* out) {
  auto pool = std::unique_ptr<Pool>(new Pool());
  pool->impl_ = std::make_unique<Impl>();
  pool->payload_bytes_ = std::max<size_t>(payload_bytes, 1);
  for (int r = 0; r < ranks; ++r) {
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    pool->impl_->streams.push_back(s);
  }
  *out = std::move(pool);
  return "";
}
Pool::~Pool() = default;
std::string Pool::Gemm(int rank, size_t, int) {
  impl_->streams[rank]->Sync();
  return "";
}
std::string Pool::EnqueueGemm(int, size_t, int) {
  return "";
}
std::string Pool::EnqueueWrite(int, size_t) {
  return "";
}
std::string Pool::Warmup(const std::vector<size_t>&) {
  return "";
}
std::string Pool::Copy(int, int, size_t) {
  return "";
}
std::string Pool::Touch(int, size_t) {
  return "";
}
std::string Pool::EnqueueHostCopy(int, size_t, bool, void*) {
  return "";
}
std::string Pool::PinHost() {
  return "";
}
std::string Pool::HostCopy(int rank, size_t, bool) {
  impl_->streams[rank]->Sync();
  return "";
}
void* Pool::stream(int rank) const {
  return impl_->streams[rank];
}

}  // namespace pipeplan::cudadev
