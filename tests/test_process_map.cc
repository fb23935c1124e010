// One process per GPU (the NCCL mode), checked without a GPU: which process runs which
// rank, which communicators exist and the rounds that create them, and the transfer order
// NCCL needs.
#include <doctest/doctest.h>

#include <chrono>
#include <set>
#include <thread>

#include "executor/process_map.h"
#include "executor/rendezvous.h"
#include "helpers.h"

using namespace pipeplan;
using namespace pipeplan::test;

namespace {

Config Multimodal(const std::string& policy, std::vector<std::string> sets = {}) {
  sets.push_back("model.vision.cp_threshold_patches=2048");  // more gangs
  return MultimodalConfig(policy, std::move(sets));
}

// Every communicator an op of process p will use exists, contains p (and the peer), and
// p's colors put it in exactly the communicators that contain it.
void ExpectComplete(const Table& t, const ProcessMap& pm, const CommPlan& cp) {
  // Rounds: members of one round are disjoint.
  std::map<std::pair<int32_t, int32_t>, int32_t> owner;  // (round, process) -> comm
  for (size_t c = 0; c < cp.members.size(); ++c)
    for (int32_t p : cp.members[c])
      CHECK(owner.emplace(std::pair{cp.round[c], p}, static_cast<int32_t>(c)).second);
  for (int32_t p = 0; p < pm.world; ++p) {
    auto colors = cp.Colors(p);
    REQUIRE(static_cast<int32_t>(colors.size()) == cp.rounds);
    for (int32_t k = 0; k < cp.rounds; ++k) {
      auto it = owner.find({k, p});
      CHECK(colors[k] == (it == owner.end() ? -1 : it->second));
    }
    const int32_t r = pm.rank[p], s = pm.shard[p];
    for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i) {
      int32_t c = -1, other = -1;
      if (IsSend(t.kind(i))) c = cp.p2p.at({r, t.peer(i), s}), other = pm.process(t.peer(i), s);
      if (IsRecv(t.kind(i))) c = cp.p2p.at({t.peer(i), r, s}), other = pm.process(t.peer(i), s);
      if (t.grouped(i)) c = cp.group.at({t.peer(i), s});
      if (c < 0) continue;
      CHECK(cp.RankIn(c, p) >= 0);
      if (other >= 0) {
        CHECK(cp.members[c].size() == 2);
        CHECK(cp.RankIn(c, other) >= 0);
      }
      if (t.grouped(i)) CHECK(cp.members[c].size() == t.group(t.peer(i)).size());
    }
  }
}

}  // namespace

TEST_CASE("one process per GPU: ranks holding several GPUs map to consecutive processes") {
  // tp = 2, pp = 2, dp = 2: 4 ranks of 2 GPUs; Megatron order tp-dp-pp.
  Table t = Plan(SmallConfig(PipelineKind::k1F1B, 2, 1, 4, 2,
                             {"parallelism.tp=2", "cluster.gpus_per_node=8"}));
  REQUIRE(t.num_ranks() == 4);
  auto pm = MapProcesses(t, 8);
  REQUIRE_MESSAGE(pm.ok(), pm.status().message());
  for (int32_t p = 0; p < 8; ++p) {
    const RankInfo& r = t.ranks()[pm->rank[p]];
    CHECK(p == r.first_gpu + pm->shard[p]);
    CHECK(pm->process(pm->rank[p], pm->shard[p]) == p);
    CHECK(r.pp == p / 4);  // stage-major: 4 GPUs (2 replicas x tp 2) per stage
  }
  auto wrong = MapProcesses(t, 4);
  REQUIRE(!wrong.ok());
  CHECK(wrong.status().message() ==
        "4 processes for a plan of 4 ranks holding 8 GPUs: start one process per GPU");

  CommPlan cp = PlanCommunicators(t, *pm);
  // Each rank's two GPUs share a communicator; transfers and gradient groups go per shard.
  for (int32_t r = 0; r < 4; ++r) {
    REQUIRE(cp.rank_comm[r] >= 0);
    CHECK(cp.members[cp.rank_comm[r]] ==
          std::vector<int32_t>{pm->process(r, 0), pm->process(r, 1)});
  }
  ExpectComplete(t, *pm, cp);
  // The two directions of a pair are different communicators.
  for (auto& [key, c] : cp.p2p) {
    auto [from, to, s] = key;
    CHECK(cp.p2p.at({to, from, s}) != c);
  }
}

TEST_CASE("communicator rounds: disjoint, complete, and few for every policy") {
  size_t gangs = 0;
  for (std::string policy : {"inline", "decoupled", "nested", "bubble-fill", "optimus"}) {
    CAPTURE(policy);
    Table t = Plan(Multimodal(policy, {"parallelism.dp=2", "cluster.gpus_per_node=4",
                                       "cluster.nodes=2", "model.vision.cp_max_group=4"}));
    auto pm = MapProcesses(t, 8);
    REQUIRE_MESSAGE(pm.ok(), pm.status().message());
    CommPlan cp = PlanCommunicators(t, *pm);
    ExpectComplete(t, *pm, cp);
    for (OpId i = 0; i < t.size(); ++i) gangs += t.grouped(i) && IsCompute(t.kind(i));
    // A process joins at most one communicator per round, so the rounds are at least the
    // most communicators one process is in; greedy colouring stays near that bound.
    size_t most = 0;
    for (int32_t p = 0; p < pm->world; ++p) {
      size_t in = 0;
      for (auto c : cp.Colors(p)) in += c >= 0;
      most = std::max(most, in);
    }
    CHECK(static_cast<size_t>(cp.rounds) >= most);
    CHECK(static_cast<size_t>(cp.rounds) <= 2 * most);
  }
  CHECK(gangs > 0);  // multi-rank vision CP: gangs have communicators too
}

namespace {

// Walks every rank's RECVs in program order; returns how many transfers arrived early.
// Each pair's transfers must be posted exactly once, in the sender's order, and a RECV's
// own transfer must be posted by the time it completes.
size_t ExpectSenderOrder(const Table& t) {
  ReceiveOrder order(t);
  std::map<std::pair<int32_t, int32_t>, std::vector<OpId>> posted, sent;
  std::set<OpId> arrived;
  size_t early = 0;
  for (OpId i = 0; i < t.size(); ++i) {
    if (IsSend(t.kind(i))) sent[{t.rank(i), t.peer(i)}].push_back(i);
    if (!IsRecv(t.kind(i))) continue;
    auto now = order.Post(i);
    if (now.empty()) {
      CHECK(arrived.count(t.send_of(i)));  // held since an earlier RECV
    } else {
      CHECK(now.back() == t.send_of(i));
      early += now.size() - 1;
    }
    for (OpId s : now) {
      CHECK(arrived.insert(s).second);
      posted[{t.peer(i), t.rank(i)}].push_back(s);
    }
  }
  CHECK(posted == sent);
  return early;
}

}  // namespace

TEST_CASE("receives are posted in the sender's order, early transfers are held") {
  for (auto k : {PipelineKind::kGpipe, PipelineKind::k1F1B})
    CHECK(ExpectSenderOrder(Plan(SmallConfig(k, 4, 1, 8, 2))) == 0);
  for (int pp : {2, 4})
    for (int vp : {2, 3})
      CHECK(ExpectSenderOrder(Plan(SmallConfig(PipelineKind::kInterleaved1F1B, pp, vp, 2 * pp))) ==
            0);
  // Vision embeddings from a pool rank overtake text transfers between the same two ranks.
  size_t early = 0;
  for (std::string policy : {"inline", "decoupled", "nested", "bubble-fill", "optimus"}) {
    CAPTURE(policy);
    early += ExpectSenderOrder(Plan(Multimodal(policy)));
    early += ExpectSenderOrder(
        Plan(Multimodal(policy, {"schedule.pipeline=interleaved-1f1b", "parallelism.vp=2"})));
  }
  CHECK(early > 0);
}

TEST_CASE("a transfer received out of its send order is held until its RECV runs") {
  // Rank 1 receives m1 before m0.
  std::vector<std::vector<std::string>> ops = {
      {"r0 F c0 m0", "r0 SEND_F c0 m0 ->r1", "r0 F c0 m1", "r0 SEND_F c0 m1 ->r1"},
      {"r1 RECV_F c0 m1 <-r0", "r1 RECV_F c0 m0 <-r0", "r1 F c0 m0", "r1 F c0 m1"}};
  Table t = TableFromOps(ops, 2, 1, 2);
  ReceiveOrder order(t);
  CHECK(order.Post(Find(t, "r1 RECV_F c0 m1 <-r0")) ==
        std::vector<OpId>{Find(t, "r0 SEND_F c0 m0 ->r1"), Find(t, "r0 SEND_F c0 m1 ->r1")});
  CHECK(order.Post(Find(t, "r1 RECV_F c0 m0 <-r0")).empty());
}

TEST_CASE("file rendezvous: process 0's id reaches the others, stale or missing files fail") {
  FileRendezvous fr{TempDir(), "job7.0", 5};
  std::string sent = std::string("\x00\x01\xfe\xff id", 7), got;
  std::thread root([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the others wait for it
    std::string id = sent;
    CHECK(ShareThroughFile(fr, 0, 3, &id).ok());
  });
  Status s = ShareThroughFile(fr, 2, 3, &got);
  root.join();
  REQUIRE_MESSAGE(s.ok(), s.message());
  CHECK(got == sent);
  // A file left by a job of another size is refused, not joined.
  s = ShareThroughFile(fr, 1, 4, &got);
  REQUIRE(!s.ok());
  CHECK(s.message().find("written for 3 processes, this job has 4") != std::string::npos);
  RemoveRendezvousFile(fr);
  CHECK(!Exists(fr.path()));
  fr.timeout_s = 0.05;
  s = ShareThroughFile(fr, 1, 3, &got);
  REQUIRE(!s.ok());
  CHECK(s.message() ==
        "process 1: timed out after 0.05 s waiting for process 0 to write " + fr.path());
}

TEST_CASE("execute --backend cuda, one process per GPU: errors are clear and nothing hangs") {
  std::string dir = TempDir();
  std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/default.yaml";
  REQUIRE(RunCli("plan " + cfg + " --set parallelism.pp=4 --set cluster.gpus_per_node=4 -o " + dir +
                 "/p.pb")
              .exit_code == 0);
  // The world must be the plan's GPU count; said before any GPU or network is touched.
  RunResult r = RunCli("execute " + dir + "/p.pb --backend cuda --rank 0 --world 3 --rendezvous " +
                       dir + " --rendezvous-key t1 --timeout 5");
  CHECK(r.exit_code != 0);
  CHECK_MESSAGE(
      (r.out.find("3 processes for a plan of 4 ranks holding 4 GPUs") != std::string::npos ||
       r.out.find("built without") != std::string::npos),
      r.out);
  CHECK(RunCli("execute " + dir + "/p.pb --nccl").exit_code == 2);  // needs --backend cuda
  r = RunCli("execute " + dir + "/p.pb --backend cuda --rank 2 --world 2");
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("--rank 2 --world 2: expected 0 <= rank < world") != std::string::npos);
  CHECK(RunCli("execute " + dir + "/p.pb --backend cuda --rank 1").exit_code == 2);
  // Outside Slurm a file rendezvous needs a key of this run's own (no stale file is read).
  r = RunShell("env -u SLURM_JOB_ID " + std::string(PIPEPLAN_BIN) + " execute " + dir +
               "/p.pb --backend cuda --rank 1 --world 4 --rendezvous " + dir);
  CHECK_MESSAGE(
      (r.out.find("--rendezvous outside Slurm needs --rendezvous-key") != std::string::npos ||
       r.out.find("built without") != std::string::npos),
      r.out);
  CHECK(r.exit_code != 0);
  // Rank 1 of 4 on a machine without a GPU (or without NCCL): a clear error, no trace.
  r = RunCli("execute " + dir + "/p.pb --backend cuda --rank 1 --world 4 --rendezvous " + dir +
             " --rendezvous-key t2 --timeout 5 --trace " + dir + "/m.json");
  if (r.exit_code == 0 || r.out.find("no CUDA device") == std::string::npos) {
    // A GPU is here: the run waits for the three other processes and times out instead.
    CHECK(r.exit_code != 0);
    CHECK_MESSAGE((r.out.find("timed out") != std::string::npos ||
                   r.out.find("built without") != std::string::npos),
                  r.out);
  } else {
    CHECK(r.out.find("process 1: no CUDA device") != std::string::npos);
  }
  CHECK(!Exists(dir + "/m.json"));
}
