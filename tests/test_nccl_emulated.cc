// The NCCL backend's logic, run without a GPU: every process of a job is a thread, CUDA
// and NCCL are the CPU test double in tests/emulated (streams as worker threads, NCCL's
// matching rules, sends that complete when received). What this proves: every process
// issues matching NCCL calls (communicator creation, connection, transfers in the
// sender's order, collectives), nothing deadlocks, every transfer arrives where its SEND
// meant it to, the merged timeline is complete and causal, failures end every process.
// What it cannot: NCCL's and the GPU's own behaviour and timing.
#include <doctest/doctest.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "emulated/cuda_runtime.h"
#include "executor/nccl_backend.h"
#include "executor/process_map.h"
#include "helpers.h"

using namespace pipeplan;
using namespace pipeplan::test;

namespace {

// A wait limit of the emulated runs, times PIPEPLAN_TEST_TIMEOUT_SCALE when set (the
// ThreadSanitizer run of scripts/test_sanitizers.sh: every emulated reduction there is many
// times slower).
double Limit(double seconds) {
  const char* scale = std::getenv("PIPEPLAN_TEST_TIMEOUT_SCALE");
  return scale != nullptr ? seconds * std::max(1.0, std::atof(scale)) : seconds;
}

struct Job {
  std::vector<StatusOr<NcclResult>> results;
  std::vector<Timeline> own;
};

// Runs every process of `t` (one per GPU) as a thread; NCCL's id passes through memory.
Job RunJob(const Table& t, RunOptions o, bool check) {
  int world = 0;
  for (const RankInfo& r : t.ranks()) world += r.gpus;
  std::mutex mu;
  std::condition_variable cv;
  std::string shared;
  Job job;
  job.results.assign(world, Status(Internal("not run")));
  job.own.resize(world);
  std::vector<std::thread> threads;
  for (int p = 0; p < world; ++p)
    threads.emplace_back([&, p] {
      NcclLaunch l;
      l.process = p, l.world = world, l.local_rank = p;
      l.share_id = [&, p](std::string* id) {
        std::unique_lock<std::mutex> lock(mu);
        if (p == 0) shared = *id, cv.notify_all();
        cv.wait(lock, [&] { return !shared.empty(); });
        *id = shared;
        return Status::Ok();
      };
      job.results[p] = RunNccl(t, l, o, check, &job.own[p]);
    });
  for (auto& th : threads) th.join();
  return job;
}

// Every process succeeded and checked its transfers. In each process's own timeline no op
// starts before the compute op or RECV before it ended (the host waits for those); the
// merged timeline has every op. (Across processes the clocks agree up to the start
// barrier's spread, which here is thread wake-ups on a loaded machine: not checked.)
void ExpectClean(const Table& t, const Job& job) {
  for (const auto& r : job.results) REQUIRE_MESSAGE(r.ok(), r.status().message());
  const NcclResult& r0 = *job.results[0];
  CHECK(r0.checked > 0);
  CHECK_MESSAGE(r0.bad == 0, r0.mismatch);
  for (const auto& r : job.results) CHECK(r->mismatch.empty());
  const Timeline& m = r0.merged;
  REQUIRE(m.start.size() == t.size());
  for (const Timeline& own : job.own) {
    OpId waited = UINT32_MAX;
    for (OpId i = 0; i < t.size(); ++i) {
      if (own.start[i] < 0) continue;  // another rank's op
      CAPTURE(t.str(i));
      if (waited != UINT32_MAX) CHECK(own.start[i] >= own.end[waited]);
      if (IsCompute(t.kind(i)) || IsRecv(t.kind(i))) waited = i;
      // The gathered op spans what each of its rank's processes measured.
      CHECK(m.start[i] <= own.start[i]);
      CHECK(m.end[i] >= own.end[i]);
    }
  }
  for (OpId i = 0; i < t.size(); ++i) {
    CAPTURE(t.str(i));
    REQUIRE(m.start[i] >= 0);
    CHECK(m.end[i] >= m.start[i]);
  }
}

// The emulation moves and sums every byte on the CPU: the tests' models are narrow, and
// the micro-batches short (1,024 tokens: the large images are 616^2, 484 visual tokens).
std::vector<std::string> Narrow(std::vector<std::string> sets) {
  for (const char* s : {"model.llm.hidden=128", "model.llm.ffn=512", "model.vision.hidden=128",
                        "model.vision.mlp=512", "training.seq_length=1024",
                        "data.images=[{height: 224, width: 224, weight: 0.6}, "
                        "{height: 616, width: 616, weight: 0.4}]"})
    sets.push_back(s);
  return sets;
}

}  // namespace

TEST_CASE("NCCL backend, emulated: every policy runs, every transfer arrives where it was sent") {
  RunOptions o;
  o.op_timeout_s = Limit(30);
  for (std::string policy : {"inline", "decoupled", "nested", "bubble-fill", "optimus"}) {
    CAPTURE(policy);
    // pp = 4 over 8 GPUs (dp = 2): vision embeddings overtaking text transfers, gangs of
    // multi-rank CP, gradient collectives.
    Table t = Plan(MultimodalConfig(
        policy, Narrow({"parallelism.dp=2", "cluster.gpus_per_node=4", "cluster.nodes=2",
                        "model.vision.cp_max_group=4", "model.vision.cp_threshold_patches=1024"})));
    size_t gang_ops = 0;
    for (OpId i = 0; i < t.size(); ++i) gang_ops += t.module(i) == Module::kVision && t.grouped(i);
    CHECK(gang_ops > 0);
    ExpectClean(t, RunJob(t, o, true));
  }
  Table inter = Plan(MultimodalConfig(
      "nested", Narrow({"schedule.pipeline=interleaved-1f1b", "parallelism.vp=2"})));
  ExpectClean(inter, RunJob(inter, o, true));
  // A generator split over each replica's ranks: its gangs and its input/gradient transfers.
  Table gen = Plan(MultimodalConfig(
      "nested", Narrow({"model.generator={layers: 2, hidden: 512, mlp: 2048, heads: 8}",
                        "data.generate={height: 256, width: 256}"})));
  ExpectClean(gen, RunJob(gen, o, true));
}

TEST_CASE("NCCL backend, emulated: ranks of two GPUs (tp = 2) run as two processes each") {
  Table t =
      Plan(SmallConfig(PipelineKind::k1F1B, 2, 1, 4, 2,
                       {"parallelism.tp=2", "cluster.gpus_per_node=8", "training.zero_stage=1"}));
  REQUIRE(t.ranks()[0].gpus == 2);
  RunOptions o;
  o.op_timeout_s = Limit(30);
  Job job = RunJob(t, o, true);
  ExpectClean(t, job);
  CHECK(job.results.size() == 8);
}

TEST_CASE("NCCL backend, emulated: a corrupted transfer is caught by the check") {
  Table t = Plan(MultimodalConfig("nested", Narrow({})));
  RunOptions o;
  o.op_timeout_s = Limit(30);
  // The first transfers connect the point-to-point communicators, one each: corrupt one of
  // the run's own.
  auto pm = MapProcesses(t, t.num_ranks());
  REQUIRE(pm.ok());
  emu::CorruptTransfer(static_cast<int>(PlanCommunicators(t, *pm).p2p.size()) + 3);
  Job job = RunJob(t, o, true);
  emu::CorruptTransfer(-1);
  for (const auto& r : job.results) REQUIRE_MESSAGE(r.ok(), r.status().message());
  CHECK(job.results[0]->bad == 1);
  std::string mismatch;
  for (const auto& r : job.results) mismatch += r->mismatch;
  CHECK(mismatch.find("SEND") != std::string::npos);
  CHECK(mismatch.find("arrived where") != std::string::npos);
}

TEST_CASE("NCCL backend, emulated: a failed rank ends every process with its rank and op") {
  Table t = Plan(SmallConfig(PipelineKind::k1F1B, 4, 1, 8));
  RunOptions o;
  o.op_timeout_s = 0.5;
  o.fault_rank = 1;
  Job job = RunJob(t, o, false);
  REQUIRE(!job.results[1].ok());
  CHECK(job.results[1].status().message().find("rank 1: r1 SEND_F c0 m0 ->r2: injected fault") ==
        0);
  for (int p : {0, 2, 3}) {
    CAPTURE(p);
    REQUIRE(!job.results[p].ok());
    CHECK(job.results[p].status().message().find("timed out after 0.5 s") != std::string::npos);
  }
  // Partial timelines: what ran before the failure.
  CHECK(job.own[1].start[t.rank_begin(1)] >= 0);
  CHECK(job.own[1].start[t.rank_end(1) - 1] < 0);
}

TEST_CASE("NCCL backend, emulated: no GPU, and a world that does not match, are clear errors") {
  Table t = Plan(SmallConfig(PipelineKind::k1F1B, 2, 1, 2));
  emu::SetDeviceCount(0);
  Job job = RunJob(t, RunOptions{}, false);
  emu::SetDeviceCount(1);
  for (const auto& r : job.results) {
    REQUIRE(!r.ok());
    CHECK(r.status().message().find("no CUDA device") != std::string::npos);
  }
  NcclLaunch l;
  l.process = 0, l.world = 3;
  Timeline own;
  auto r = RunNccl(t, l, RunOptions{}, false, &own);
  REQUIRE(!r.ok());
  CHECK(r.status().message() ==
        "process 0: 3 processes for a plan of 2 ranks holding 2 GPUs: start one process per GPU");
}
