// Multimodal planning: data model, dynamic CP, the four placement policies, and the
// validator's modality rules (proved by breaking them).
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

#include "core/files.h"
#include "core/table_io.h"
#include "helpers.h"
#include "planner/data.h"
#include "planner/modality.h"
#include "planner/plan.h"
#include "planner/validate.h"
#include "simulator/metrics.h"

using namespace pipeplan;
using namespace pipeplan::test;

namespace {

// A small multimodal config: pp stages x dp replicas of one GPU each, 1B-class LLM, a
// ViT-L-sized encoder, a mixture with a few large images.
Config Multimodal(const std::string& policy, int m, std::vector<std::string> sets = {}) {
  std::string yaml = fmt::format(R"(
cluster: {{gpu: H100, nodes: 1, gpus_per_node: 8}}
model:
  llm: {{layers: 8, hidden: 1024, ffn: 4096, heads: 8, vocab: 32000}}
  vision: {{layers: 12, hidden: 1024, mlp: 4096, heads: 16, recompute: full, cp_threshold_patches: 4096}}
parallelism: {{pp: 4}}
training: {{seq_length: 8192, microbatches: {}}}
data:
  seed: 5
  text_tokens: 512
  images_per_sample: 2
  images:
    - {{height: 224, width: 224, weight: 0.6}}
    - {{height: 1344, width: 1344, weight: 0.3}}
    - {{height: 2048, width: 2048, weight: 0.1}}
schedule: {{pipeline: 1f1b, modality: {}}}
)",
                                 m, policy);
  return ParseYaml(yaml, std::move(sets));
}

Metrics Simulated(const Config& c) {
  auto r = RunSimulation(Plan(c), SimOptionsFor(c));
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  return r->metrics;
}

double PeakVisionActivation(const Metrics& m) {
  double peak = 0;
  for (const RankMetrics& r : m.ranks) peak = std::max(peak, r.peak_by_module[1]);
  return peak;
}

// Understanding pipeline written by hand: pp = 2, one micro-batch, its image encoded on
// r1 and sent to r0; the gradient comes back.
std::vector<std::vector<std::string>> VisionOnOtherRank() {
  return {
      {"r0 vision.RECV_F m0 t0 <-r1", "r0 F c0 m0", "r0 SEND_F c0 m0 ->r1", "r0 RECV_B c0 m0 <-r1",
       "r0 B c0 m0", "r0 vision.SEND_B m0 t0 ->r1"},
      {"r1 vision.F m0 t0", "r1 vision.SEND_F m0 t0 ->r0", "r1 RECV_F c0 m0 <-r0", "r1 F c0 m0",
       "r1 B c0 m0", "r1 SEND_B c0 m0 ->r0", "r1 vision.RECV_B m0 t0 <-r0", "r1 vision.B m0 t0"}};
}

std::string Why(const std::vector<std::vector<std::string>>& ops) {
  Status s = ValidatePlan(TableFromOps(ops, 2, 1, 1));
  REQUIRE(!s.ok());
  return s.message();
}

}  // namespace

TEST_CASE("patches and visual tokens follow the patch and merge sizes") {
  CHECK(Patches({224, 224, 1}, 14) == 256);
  CHECK(Patches({3584, 3584, 1}, 14) == 65536);
  CHECK(Patches({225, 224, 1}, 14) == 17 * 16);  // ceil
  CHECK(Patches({448, 448, 8}, 14) == 32 * 32 * 8);
}

TEST_CASE(
    "every policy's plan validates, for 1F1B and interleaved 1F1B, with and without a generator") {
  for (std::string policy : {"inline", "decoupled", "nested", "bubble-fill", "optimus"}) {
    for (bool interleaved : {false, true}) {
      CAPTURE(policy);
      CAPTURE(interleaved);
      std::vector<std::string> sets;
      if (interleaved) sets = {"schedule.pipeline=interleaved-1f1b", "parallelism.vp=2"};
      Config c = Multimodal(policy, 8, sets);
      Status s = ValidatePlan(Plan(c));
      CHECK_MESSAGE(s.ok(), s.message());
    }
    Config g = Multimodal(policy, 8,
                          {"model.generator={layers: 4, hidden: 1024, mlp: 4096, heads: 8}",
                           "data.generate={height: 512, width: 512}"});
    Status s = ValidatePlan(Plan(g));
    CHECK_MESSAGE(s.ok(), s.message());
  }
}

TEST_CASE("the hand-written multimodal table is valid") {
  CHECK(ValidatePlan(TableFromOps(VisionOnOtherRank(), 2, 1, 1)).ok());
}

TEST_CASE("broken: a text forward runs before its vision output arrived") {
  auto ops = VisionOnOtherRank();
  std::swap(ops[0][0], ops[0][1]);
  CHECK(Why(ops) == "r0 F c0 m0: runs before its vision input r1 vision.F m0 t0 arrives");
}

TEST_CASE("broken: a vision backward before its gradient exists") {
  auto ops = VisionOnOtherRank();
  ops[0].pop_back();
  ops[0].insert(ops[0].begin() + 3, "r0 vision.SEND_B m0 t0 ->r1");  // before r0 B c0 m0
  CHECK(Why(ops) ==
        "r1 vision.RECV_B m0 t0 <-r0: sent before the gradient from r0 B c0 m0 produced it");
}

// The same with the encoder task in two layer-group pieces on r1.
std::vector<std::vector<std::string>> PiecesOnOtherRank() {
  auto ops = VisionOnOtherRank();
  ops[1] = {"r1 vision.F m0 t0 p0",
            "r1 vision.F m0 t0 p1",
            "r1 vision.SEND_F m0 t0 ->r0",
            "r1 RECV_F c0 m0 <-r0",
            "r1 F c0 m0",
            "r1 B c0 m0",
            "r1 SEND_B c0 m0 ->r0",
            "r1 vision.RECV_B m0 t0 <-r0",
            "r1 vision.B m0 t0 p1",
            "r1 vision.B m0 t0 p0"};
  return ops;
}

TEST_CASE("pieces: in layer order forward and reverse order backward, else a located error") {
  CHECK(ValidatePlan(TableFromOps(PiecesOnOtherRank(), 2, 1, 1)).ok());
  auto f = PiecesOnOtherRank();
  std::swap(f[1][0], f[1][1]);
  CHECK(Why(f) == "r1 vision.F m0 t0 p0: runs after r1 vision.F m0 t0 p1");
  auto b = PiecesOnOtherRank();
  std::swap(b[1][8], b[1][9]);
  CHECK(Why(b) == "r1 vision.B m0 t0 p0: runs before r1 vision.B m0 t0 p1");
  auto g = PiecesOnOtherRank();
  g[1].erase(g[1].begin());                         // piece 0's forward moves
  g[1].insert(g[1].end(), "r1 vision.F m0 t0 p0");  // after its backward
  CHECK(Why(g) == "r1 vision.B m0 t0 p0: runs before its forward piece");
}

TEST_CASE("broken: a vision backward before its forward") {
  auto ops = VisionOnOtherRank();
  ops[1] = {"r1 vision.RECV_B m0 t0 <-r0",
            "r1 vision.B m0 t0",
            "r1 vision.F m0 t0",
            "r1 vision.SEND_F m0 t0 ->r0",
            "r1 RECV_F c0 m0 <-r0",
            "r1 F c0 m0",
            "r1 B c0 m0",
            "r1 SEND_B c0 m0 ->r0"};
  CHECK(!ValidatePlan(TableFromOps(ops, 2, 1, 1)).ok());
}

TEST_CASE("broken: generator ops out of order") {
  std::vector<std::vector<std::string>> ok = {
      {"r0 F c0 m0", "r0 SEND_F c0 m0 ->r1", "r0 RECV_B c0 m0 <-r1", "r0 B c0 m0"},
      {"r1 RECV_F c0 m0 <-r0", "r1 F c0 m0", "r1 generator.F m0", "r1 generator.B m0", "r1 B c0 m0",
       "r1 SEND_B c0 m0 ->r0"}};
  CHECK(ValidatePlan(TableFromOps(ok, 2, 1, 1)).ok());
  auto b = ok;
  std::swap(b[1][2], b[1][3]);  // generator backward before its forward
  CHECK(Why(b) == "r1 generator.F m0: has no generator backward after it");
  auto c = ok;
  std::swap(c[1][3], c[1][4]);  // text backward before the generator's gradient
  CHECK(Why(c) == "r1 B c0 m0: runs before the generator gradient r1 generator.B m0");
  auto d = ok;
  std::swap(d[1][1], d[1][2]);  // generator forward before its input
  CHECK(Why(d) == "r1 generator.F m0: runs before its input from r1 F c0 m0");
}

TEST_CASE("dynamic CP: a 3584x3584 image is split over a sub-group with gather-KV") {
  Config c = Multimodal("nested", 8,
                        {"model.vision.cp_threshold_patches=16384", "model.vision.cp_max_group=8"});
  CpPlan p = PlanVisionCp(c, {Patches({3584, 3584, 1}, 14), 256, 256, 256}, 8);
  REQUIRE(p.items.size() == 4);
  CHECK(p.items[0].k > 1);
  CHECK(p.items[0].first_gpu % p.items[0].k == 0);  // aligned sub-group
  CHECK(p.items[0].gather_bytes_per_gpu > 0);
  CHECK(p.items[1].k == 1);  // thumbnails are never split
  MESSAGE("3584^2 image: k = " << p.items[0].k
                               << ", per-GPU load max/mean = " << p.max_flops() / p.mean_flops());
}

TEST_CASE("dynamic CP: several large images spread over sub-groups with balanced load") {
  Config c = Multimodal("nested", 8,
                        {"model.vision.cp_threshold_patches=16384", "model.vision.cp_max_group=4"});
  std::vector<int64_t> images(8, Patches({3584, 3584, 1}, 14));
  for (int i = 0; i < 40; ++i) images.push_back(Patches({448, 448, 1}, 14));
  CpPlan p = PlanVisionCp(c, images, 16);
  // Each large image is split to about the per-GPU target (here k = 2 of 16 GPUs), and
  // no two share a sub-group.
  std::set<int> groups;
  for (int i = 0; i < 8; ++i) {
    CHECK(p.items[i].k == 2);
    groups.insert(p.items[i].first_gpu);
  }
  CHECK(groups.size() == 8);
  CHECK(p.max_flops() / p.mean_flops() < 1.1);
  MESSAGE("8 large + 40 small images on 16 GPUs: max/mean load = " << p.max_flops() /
                                                                          p.mean_flops());
}

TEST_CASE("dynamic CP: the gather-KV share stays bounded when the job grows 8x") {
  Config c = Multimodal("nested", 8,
                        {"model.vision.cp_threshold_patches=16384", "model.vision.cp_max_group=8"});
  auto batch = [](int scale) {
    std::vector<int64_t> v;
    for (int s = 0; s < scale; ++s) {
      for (int i = 0; i < 2; ++i) v.push_back(Patches({3584, 3584, 1}, 14));
      for (int i = 0; i < 6; ++i) v.push_back(Patches({2048, 2048, 1}, 14));
      for (int i = 0; i < 40; ++i) v.push_back(Patches({224, 224, 1}, 14));
    }
    return v;
  };
  CpPlan small = PlanVisionCp(c, batch(1), 64), large = PlanVisionCp(c, batch(8), 512);
  double fs = CpCommFraction(c, small), fl = CpCommFraction(c, large);
  MESSAGE("gather-KV share of the busiest GPU: " << fs << " on 64 GPUs, " << fl << " on 512 GPUs");
  MESSAGE("max/mean load: " << small.max_flops() / small.mean_flops() << " on 64 GPUs, "
                            << large.max_flops() / large.mean_flops() << " on 512 GPUs");
  CHECK(fs > 0);
  CHECK(fl <= fs * 1.25);
  CHECK(fl < 0.5);
  CHECK(large.max_flops() / large.mean_flops() <= 1.1 * small.max_flops() / small.mean_flops());
}

TEST_CASE("decoupled vision memory grows with micro-batches, nested stays flat") {
  // Nested keeps about 2 pp + 1 rounds of encoder activations: flat once m exceeds that.
  double d16 = PeakVisionActivation(Simulated(Multimodal("decoupled", 16)));
  double d64 = PeakVisionActivation(Simulated(Multimodal("decoupled", 64)));
  double n16 = PeakVisionActivation(Simulated(Multimodal("nested", 16)));
  double n64 = PeakVisionActivation(Simulated(Multimodal("nested", 64)));
  MESSAGE("peak vision activations, GiB: decoupled " << d16 / (1 << 30) << " -> " << d64 / (1 << 30)
                                                     << ", nested " << n16 / (1 << 30) << " -> "
                                                     << n64 / (1 << 30));
  CHECK(d64 > 3 * d16);
  CHECK(n64 < 1.25 * n16);
}

TEST_CASE("nested and bubble-fill are faster than inline, which large images slow down") {
  double inl = Simulated(Multimodal("inline", 16)).step_time_s;
  double nes = Simulated(Multimodal("nested", 16)).step_time_s;
  double bub = Simulated(Multimodal("bubble-fill", 16)).step_time_s;
  CHECK(nes < inl);
  CHECK(bub < inl);
  Metrics m = Simulated(Multimodal("inline", 16));
  CHECK(m.vision_load_after[2] ==
        doctest::Approx(m.vision_load_before[2]));  // inline does not rebalance
  Metrics n = Simulated(Multimodal("nested", 16));
  CHECK(n.vision_load_after[2] < n.vision_load_before[2]);
  CHECK(n.vision_hidden_fraction >= 0);
  CHECK(n.vision_hidden_fraction <= 1);
}

TEST_CASE("bubble-fill is never slower than nested where nested fits in memory") {
  // Bubble-fill's search may keep nested's rules on one sizing of the images while nested's
  // own search keeps another it predicts faster; nested's plan is then simulated too and
  // the faster kept. Before, these four of the grid's pairs had bubble-fill slower (by
  // 0.8 %, 0.8 %, 0.8 % and 1.4 %).
  int pairs = 0;
  for (const char* pipeline : {"1f1b", "zb-h1"})
    for (int pp : {2, 4})
      for (int m : {4, 16})
        for (int seed : {1, 2, 5}) {
          CAPTURE(pipeline);
          CAPTURE(pp);
          CAPTURE(m);
          CAPTURE(seed);
          const std::vector<std::string> sets = {
              fmt::format("schedule.pipeline={}", pipeline), fmt::format("parallelism.pp={}", pp),
              fmt::format("training.microbatches={}", m), fmt::format("data.seed={}", seed)};
          const Metrics nested = Simulated(MultimodalConfig("nested", sets));
          if (nested.oom) continue;
          ++pairs;
          CHECK(Simulated(MultimodalConfig("bubble-fill", sets)).step_time_s <= nested.step_time_s);
        }
  CHECK(pairs >= 20);
}

TEST_CASE("manifest: samples are read, bad lines name the file and line") {
  std::string dir = TempDir();
  REQUIRE(WriteFileAtomic(dir + "/ok.jsonl",
                          "{\"id\": \"a\", \"text_tokens\": 100, \"images\": [[224, 224]]}\n"
                          "{\"id\": \"b\", \"text_tokens\": 50, \"videos\": [[4, 448, 448]]}\n")
              .ok());
  Config c = Multimodal("inline", 1,
                        {"data.manifest=" + dir + "/ok.jsonl", "parallelism.pp=1",
                         "cluster.gpus_per_node=1", "model.llm.layers=2"});
  auto b = MakeStepBatch(c);
  REQUIRE_MESSAGE(b.ok(), b.status().message());
  REQUIRE(b->replicas[0][0].samples.size() == 2);
  CHECK(b->replicas[0][0].visual_tokens == 64 + 4 * 256);
  REQUIRE(
      WriteFileAtomic(dir + "/bad.jsonl",
                      "{\"id\": \"a\", \"images\": [[224, 224]]}\n{\"id\": 2, \"pictures\": []}\n")
          .ok());
  c.data.manifest = dir + "/bad.jsonl";
  CHECK(MakeStepBatch(c).status().message() == dir +
                                                   "/bad.jsonl:2: unknown key 'pictures' (expected "
                                                   "id, text_tokens, images, videos, generate)");
  REQUIRE(WriteFileAtomic(dir + "/big.jsonl",
                          "{\"id\": \"huge\", \"text_tokens\": 8000, \"images\": [[2048, 2048]]}\n")
              .ok());
  c.data.manifest = dir + "/big.jsonl";
  CHECK(MakeStepBatch(c).status().message() ==
        "huge: 8000 text + 5403 visual tokens do not fit in a micro-batch of 8192 tokens "
        "(seq_length x micro_batch_size)");
}

TEST_CASE("pieces: each takes its share of the task's layers, FLOPs and activations") {
  // A task over 12 layers cut at {0, 3, 12}: the first piece has 3/12 of the work and
  // activations, the second 9/12 plus the output, which only the last piece holds.
  VisionTask t;
  t.f.flops = 1200, t.f.attn_flops = 120, t.f.hbm_bytes = 12, t.f.kernels = 144;
  t.f.layer_begin = 0, t.f.layer_end = 12;
  t.b = t.f;
  t.b.flops = 3600;
  t.act_bytes = 1200, t.out_bytes = 7;
  auto p = SplitTask(t, {0, 3, 12});
  REQUIRE(p.size() == 2);
  CHECK(p[0].f.flops == doctest::Approx(300));
  CHECK(p[0].f.attn_flops == doctest::Approx(30));
  CHECK(p[0].b.flops == doctest::Approx(900));
  CHECK(p[0].f.kernels == 36);
  CHECK(p[0].f.layer_begin == 0);
  CHECK(p[0].f.layer_end == 3);
  CHECK(p[1].f.layer_begin == 3);
  CHECK(p[0].f.mem_delta_bytes == doctest::Approx(300));
  CHECK(p[1].f.mem_delta_bytes == doctest::Approx(900 + 7));
  CHECK(p[1].b.mem_delta_bytes == doctest::Approx(-(900 + 7)));
}

TEST_CASE("dynamic CP: a latency budget keeps an image whole, ring gather-KV hides") {
  Config c = Multimodal("nested", 8,
                        {"model.vision.cp_threshold_patches=16384", "model.vision.cp_max_group=8"});
  const int64_t big = Patches({3584, 3584, 1}, 14);
  CpPlan split = PlanVisionCp(c, {big, 256, 256, 256}, 8);
  CpPlan whole = PlanVisionCp(c, {big, 256, 256, 256}, 8, {}, 1e9);
  CHECK(split.items[0].k > 1);
  CHECK(whole.items[0].k == 1);
  CHECK(whole.items[0].gather_bytes_per_gpu == 0);
  // 65,536 patches over k = 2 on NVLink: a hop moves 32,768 x 2 x 1024 x 2 B = 134 MB
  // (about 0.37 ms at 360 GB/s); the block it overlaps is 4 x 32768^2 x 1024 FLOPs = 4.4
  // TFLOP (about 8.9 ms at 989 TFLOP/s x 0.5): the gather is hidden.
  CpPlan two = PlanVisionCp(c, {big}, 2);
  REQUIRE(two.items[0].k == 2);
  CHECK(two.items[0].gather_bytes_per_gpu > 0);
  CHECK(two.items[0].exposed_gather_bytes_per_gpu == 0);
  // Attention FLOPs per GPU: 12 layers x 4 x (P / 2) x P x 1024.
  const double P = static_cast<double>(big);
  CHECK(two.items[0].attn_flops_per_gpu == doctest::Approx(12 * 4 * (P / 2) * P * 1024));
}

namespace {

// A text-only timeline of the small multimodal config (pp 4 x dp 2, one GPU per rank):
// ranks of the stages in `busy_stages` busy for [0, 1000 s], the others idle; every
// micro-batch due at `due` and its gradient released at 0.
TextTimeline IdleStages(const Config& c, std::vector<int> busy_stages, double due) {
  TextTimeline tl;
  const int ranks = c.parallel.pp * c.parallel.dp, m = c.training.microbatches;
  tl.busy.assign(ranks, {});
  for (int r = 0; r < ranks; ++r)
    for (int s : busy_stages)
      if (r % c.parallel.pp == s) tl.busy[r] = {{0, 1000}};
  tl.due.assign(static_cast<size_t>(c.parallel.dp) * m, due);
  tl.release.assign(tl.due.size(), 0);
  tl.end = 1000;
  tl.Index(0);
  return tl;
}

}  // namespace

TEST_CASE("timed placement: images go to the stage that is idle before they are due") {
  // Stages 0-2 busy for the whole step, stage 3 idle: an image is on time only on stage
  // 3 (elsewhere its forward ends after 1000 s), gangs too (a stage holds 2 GPUs).
  Config c = MultimodalConfig("bubble-fill", {"model.vision.cp_max_group=2"});
  auto batch = MakeStepBatch(c);
  REQUIRE_MESSAGE(batch.ok(), batch.status().message());
  const TextTimeline tl = IdleStages(c, {0, 1, 2}, 1000);
  VisionPool pool;
  pool.timeline = &tl;
  ModalityWork w = BuildModalityWork(c, *batch, pool, false);
  REQUIRE(!w.vision.empty());
  for (const VisionTask& t : w.vision) {
    CHECK(t.rank % 4 == 3);
    for (int r : t.gang_ranks) CHECK(r % 4 == 3);
  }
}

TEST_CASE("timed placement: an image that is late everywhere is split as far as it may be") {
  // A latency budget without bound keeps every image whole under FLOP balancing; when every
  // stage is busy past the due time, each image above the patch threshold (2048^2:
  // 21,316 patches > 4,096) is split over the 2 GPUs cp_max_group allows: a gang of 2.
  Config c = MultimodalConfig("bubble-fill", {"model.vision.cp_max_group=2"});
  auto batch = MakeStepBatch(c);
  REQUIRE_MESSAGE(batch.ok(), batch.status().message());
  int large = 0;
  for (const auto& replica : batch->replicas)
    for (const MicroBatch& mb : replica)
      for (const Sample& s : mb.samples)
        for (const Image& img : s.images)
          large += Patches(img, c.model.vision.patch) > c.model.vision.cp_threshold_patches;
  REQUIRE(large > 0);
  auto shards = [](const ModalityWork& w) {
    int n = 0;
    for (const VisionTask& t : w.vision) n += t.shard >= 0;
    return n;
  };
  VisionPool pool;
  pool.latency_budget_s = 1e9, pool.window_rounds = 1 << 20;
  CHECK(shards(BuildModalityWork(c, *batch, pool, false)) == 0);
  const TextTimeline tl = IdleStages(c, {0, 1, 2, 3}, 0);
  pool.timeline = &tl;
  CHECK(shards(BuildModalityWork(c, *batch, pool, false)) == 2 * large);
}

TEST_CASE("timed placement: an image released too late to be hidden is split below the threshold") {
  // Ranks of 2 GPUs (cp 2), every image 2048^2 (21,316 patches), below a threshold of 10^6:
  // dynamic CP never splits one for load. Every image's task is one image (the images are
  // equal, so a rank's images of one replica run side by side, two to a task, only when
  // each keeps one GPU). When every stage is busy past the due time (late for the load
  // around it) no image is split: a task's time is its longest image's on one GPU, so its
  // FLOPs (the busiest GPU's, times the rank's GPUs) are twice its images' mean. When the
  // gradients are released only as the text ends, no text can hide a backward, only its
  // latency counts, and each image is split over its rank's 2 GPUs: a task of one image,
  // its FLOPs its own. (cp_max_group 2 allows no wider split here; below, one that does.)
  Config c =
      MultimodalConfig("bubble-fill", {"parallelism.cp=2", "model.vision.cp_max_group=2",
                                       "model.vision.cp_threshold_patches=1000000",
                                       "data.images=[{height: 2048, width: 2048, weight: 1}]"});
  auto batch = MakeStepBatch(c);
  REQUIRE_MESSAGE(batch.ok(), batch.status().message());
  const double image = VisionImageFlops(c, Patches({2048, 2048, 1}, c.model.vision.patch));
  VisionPool pool;
  pool.latency_budget_s = 1e9, pool.window_rounds = 1 << 20;
  const TextTimeline busy = IdleStages(c, {0, 1, 2, 3}, 0);
  pool.timeline = &busy;
  for (const VisionTask& t : BuildModalityWork(c, *batch, pool, false).vision) {
    CHECK(t.shard < 0);
    const double images = std::round(t.f.model_flops / image);
    CHECK(t.f.flops == doctest::Approx(2 * t.f.model_flops / images).epsilon(0.01));
  }
  TextTimeline late = IdleStages(c, {}, 1000);
  std::fill(late.release.begin(), late.release.end(), late.end);
  pool.timeline = &late;
  for (const VisionTask& t : BuildModalityWork(c, *batch, pool, false).vision) {
    CHECK(t.shard < 0);
    CHECK(t.f.model_flops == doctest::Approx(image));
    CHECK(t.f.flops == doctest::Approx(t.f.model_flops).epsilon(0.01));
  }
  // On 2 nodes (a stage holds 2 ranks, 4 GPUs) with sub-groups of up to 4 GPUs, splitting
  // over 4 would be faster still, but a gang over 2 ranks would hold them together through
  // its forward: the image stays on its rank's 2 GPUs.
  c = MultimodalConfig("bubble-fill",
                       {"parallelism.cp=2", "cluster.nodes=2", "model.vision.cp_max_group=4",
                        "model.vision.cp_threshold_patches=1000000",
                        "data.images=[{height: 2048, width: 2048, weight: 1}]"});
  batch = MakeStepBatch(c);
  REQUIRE_MESSAGE(batch.ok(), batch.status().message());
  REQUIRE(TimedPlacementFits(c));
  late = IdleStages(c, {}, 1000);
  std::fill(late.release.begin(), late.release.end(), late.end);
  pool.timeline = &late;
  for (const VisionTask& t : BuildModalityWork(c, *batch, pool, false).vision) {
    CHECK(t.shard < 0);
    CHECK(t.f.flops == doctest::Approx(t.f.model_flops).epsilon(0.01));
  }
}

TEST_CASE("placement: a rank's images of one replica run side by side, not in turn") {
  // A rank runs one task per replica, that replica's whole images side by side on its
  // GPUs, and the tasks of one round one after another. Placing by each GPU's load alone
  // puts images of two replicas on one rank's GPUs, whose tasks then run in turn.
  // Both placements: by load over the job, and timed with only stage 3 idle.
  auto placed = [](const Config& c, const StepBatch& batch, bool timed) {
    const TextTimeline tl = IdleStages(c, {0, 1, 2}, 1000);
    VisionPool pool;
    if (timed) pool.timeline = &tl;
    return BuildModalityWork(c, batch, pool, false);
  };
  SUBCASE("ranks of 2 GPUs: each replica's 2 images on one rank, the replicas on two") {
    // tp 2, 2 replicas, 2 images per sample kept whole (cp_max_group 1), one sample per
    // micro-batch: per round 2 tasks on 2 ranks.
    Config c = MultimodalConfig(
        "bubble-fill", {"cluster.nodes=2", "parallelism.tp=2", "model.vision.cp_max_group=1"});
    REQUIRE(c.parallel.dp == 2);
    auto batch = MakeStepBatch(c);
    REQUIRE_MESSAGE(batch.ok(), batch.status().message());
    for (const bool timed : {false, true}) {
      CAPTURE(timed);
      const ModalityWork w = placed(c, *batch, timed);
      for (int m = 0; m < c.training.microbatches; ++m) {
        std::set<int> ranks, replicas;
        int tasks = 0;
        for (const VisionTask& t : w.vision) {
          if (t.mb != m) continue;
          ++tasks;
          ranks.insert(t.rank), replicas.insert(t.d);
          if (timed) CHECK(t.rank % 4 == 3);
        }
        CAPTURE(m);
        CHECK(tasks == 2);
        CHECK(ranks.size() == 2);
        CHECK(replicas.size() == 2);
      }
    }
  }
  SUBCASE("ranks of 3 GPUs (not a power of two): up to 3 images of a replica, one task") {
    // The largest image opens the task and each other one fits on an idle GPU beside it.
    Config c = MultimodalConfig(
        "bubble-fill", {"cluster.nodes=3", "parallelism.tp=3", "model.vision.cp_max_group=1",
                        "data.images_per_sample=3", "model.llm.hidden=1536", "model.llm.heads=24",
                        "training.seq_length=12288"});
    REQUIRE(c.parallel.dp == 2);
    auto batch = MakeStepBatch(c);
    REQUIRE_MESSAGE(batch.ok(), batch.status().message());
    int checked = 0;
    for (const bool timed : {false, true}) {
      CAPTURE(timed);
      const ModalityWork w = placed(c, *batch, timed);
      for (int d = 0; d < 2; ++d)
        for (int m = 0; m < c.training.microbatches; ++m) {
          int images = 0, tasks = 0;
          for (const Sample& s : batch->replicas[d][m].samples)
            images += static_cast<int>(s.images.size());
          for (const VisionTask& t : w.vision) tasks += t.d == d && t.mb == m;
          CAPTURE(d);
          CAPTURE(m);
          CAPTURE(images);
          if (images >= 2 && images <= 3) {
            CHECK(tasks == 1);
            ++checked;
          }
        }
    }
    CHECK(checked >= 4);  // not vacuous: rounds of a replica with 2 or 3 images
    // With the images split where they may be (cp_max_group 8), no image is split over
    // more GPUs than a rank has: a sub-group of 4 or 8 would not fall on whole ranks of 3
    // (its shards, one per rank, would hold 4 or 8 GPUs' share on 3).
    c.model.vision.cp_max_group = 8;
    for (const bool timed : {false, true}) {
      CAPTURE(timed);
      for (const VisionTask& t : placed(c, *batch, timed).vision) CHECK(t.gang_ranks.empty());
    }
  }
}

TEST_CASE("micro-batch order light_ends: lightest at both ends, heaviest in the middle") {
  Config drawn = MultimodalConfig("nested");
  Config light = MultimodalConfig("nested", {"data.microbatch_order=light_ends"});
  auto a = MakeStepBatch(drawn), b = MakeStepBatch(light);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE(a->replicas.size() == b->replicas.size());
  for (size_t d = 0; d < a->replicas.size(); ++d) {
    std::vector<double> x, y;
    for (const MicroBatch& mb : a->replicas[d]) x.push_back(mb.vision_flops);
    for (const MicroBatch& mb : b->replicas[d]) y.push_back(mb.vision_flops);
    std::vector<double> sorted = y;
    std::sort(x.begin(), x.end());
    std::sort(sorted.begin(), sorted.end());
    CHECK(x == sorted);  // the same micro-batches
    REQUIRE(y.size() >= 2);
    CHECK(y.front() == sorted[0]);
    CHECK(y.back() == sorted[1]);
    const size_t peak = std::max_element(y.begin(), y.end()) - y.begin();
    for (size_t i = 0; i + 1 < y.size(); ++i)
      CHECK((i < peak ? y[i] <= y[i + 1] : y[i] >= y[i + 1]));
  }
}

TEST_CASE("micro-batch order auto: the faster of both orders, named in the plan's config") {
  // Each policy and count planned with each order; auto must keep the faster one (the
  // data's order on a tie) and be that plan, byte for byte, and its config must name it.
  auto step = [](const Table& t) {
    auto c = ConfigOfPlan(t, "plan.pb");
    REQUIRE(c.ok());
    SimOptions o = SimOptionsFor(*c);
    o.exposure = false;
    auto r = RunSimulation(t, o);
    REQUIRE(r.ok());
    return r->metrics.step_time_s;
  };
  std::set<std::string> kept;
  for (const char* policy : {"decoupled", "nested", "optimus"})
    for (const char* m : {"8", "16"}) {
      const std::string count = std::string("training.microbatches=") + m;
      const Table drawn = Plan(MultimodalConfig(policy, {count}));
      const Table light =
          Plan(MultimodalConfig(policy, {count, "data.microbatch_order=light_ends"}));
      const Table automatic = Plan(MultimodalConfig(policy, {count, "data.microbatch_order=auto"}));
      const bool light_faster = step(light) < step(drawn);
      CAPTURE(policy);
      CAPTURE(m);
      auto stored = ConfigOfPlan(automatic, "plan.pb");
      REQUIRE(stored.ok());
      CHECK(stored->data.order ==
            (light_faster ? MicrobatchOrder::kLightEnds : MicrobatchOrder::kDrawn));
      // The same ops and times as the plan of the order it kept; re-planned from its own
      // config, the same plan again.
      const Table& same = light_faster ? light : drawn;
      CHECK(step(automatic) == step(same));
      CHECK(automatic.size() == same.size());
      CHECK(SerializePb(Plan(*stored)) == SerializePb(automatic));
      kept.insert(light_faster ? "light_ends" : "drawn");
    }
  CHECK(kept.size() == 2);  // this workload has cases of both
  // Text only: nothing to order, the data's order.
  const Table text =
      Plan(SmallConfig(PipelineKind::k1F1B, 4, 1, 8, 1, {"data.microbatch_order=auto"}));
  auto stored = ConfigOfPlan(text, "plan.pb");
  REQUIRE(stored.ok());
  CHECK(stored->data.order == MicrobatchOrder::kDrawn);
}

TEST_CASE("decoupled runs a CP gang's forward shards first and its backward shards last") {
  // The README's default workload at 64 micro-batches: dynamic CP splits the 2048x2048
  // scans over two ranks. A gang waits for both ranks; in the order the tasks were made
  // (each round's rank tasks, then its gangs) a rank reached a gang only after its own
  // tasks of that round, a different amount of work on each of the two ranks, and the
  // step was 7.24 s: slower than the same images without gangs (`cp_max_group: 1`,
  // 6.16 s). With every rank's gang forwards first and gang backwards last (in the
  // job's order of gangs) the gangs cost less than they save.
  const std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/default.yaml";
  auto load = [&](std::vector<std::string> sets) {
    sets.push_back("training.microbatches=64");
    sets.push_back("schedule.modality=decoupled");
    auto c = LoadConfig(cfg, sets);
    REQUIRE_MESSAGE(c.ok(), c.status().message());
    return *c;
  };
  const Config gangs = load({}), whole = load({"model.vision.cp_max_group=1"});
  const Table t = Plan(gangs);
  REQUIRE(ValidatePlan(t).ok());
  int gang_ops = 0;
  for (int32_t r = 0; r < t.num_ranks(); ++r) {
    CAPTURE(r);
    // Per kind, whether a rank's own task came before (forward) or a gang shard
    // before an own task (backward).
    bool own_forward_seen = false, gang_backward_seen = false;
    for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i) {
      if (t.module(i) != Module::kVision) continue;
      if (t.kind(i) == OpKind::kF) {
        if (t.grouped(i)) {
          ++gang_ops;
          CHECK(!own_forward_seen);
        }
        own_forward_seen |= !t.grouped(i);
      } else if (t.kind(i) == OpKind::kB) {
        if (!t.grouped(i)) CHECK(!gang_backward_seen);
        gang_backward_seen |= t.grouped(i);
      }
    }
  }
  CHECK(gang_ops > 0);
  auto step = [](const Table& plan, const Config& c) {
    auto r = RunSimulation(plan, SimOptionsFor(c));
    REQUIRE_MESSAGE(r.ok(), r.status().message());
    return r->metrics.step_time_s;
  };
  CHECK(step(t, gangs) < step(Plan(whole), whole));
}

TEST_CASE("balanced against the text: ranks of a stage with more text take less encoder work") {
  // pp 4 x dp 2 on 8 GPUs (tp 1), gangs of at most 2 GPUs (GPUs are laid out stage by
  // stage, so a gang stays in one stage). The same images placed by FLOPs alone, with every
  // stage's text round equal (no change), and with the last stage's round longer than the
  // whole step's encoder work (its ranks start every round behind every other rank by more
  // than any rank ever takes, so none of its ranks gets an image).
  const Config c = MultimodalConfig("nested", {"parallelism.dp=2", "model.vision.cp_max_group=2"});
  auto batch = MakeStepBatch(c);
  REQUIRE(batch.ok());
  const VisionPool plain;
  const ModalityWork base = BuildModalityWork(c, *batch, plain, false);
  auto flops_by_stage = [&](const ModalityWork& w) {
    std::vector<double> by(4, 0);
    for (const VisionTask& t : w.vision) by[t.rank % 4] += t.f.flops;
    return by;
  };
  const std::vector<double> before = flops_by_stage(base);
  REQUIRE(before[3] > 0);
  VisionPool even = plain;
  even.text_round_s = {0.25, 0.25, 0.25, 0.25};
  CHECK(flops_by_stage(BuildModalityWork(c, *batch, even, false)) == before);
  double total = 0;
  for (double f : before) total += f;
  VisionPool heavy_last = plain;
  heavy_last.text_round_s = {0, 0, 0, 1e6};  // seconds: more than any encoder work
  const std::vector<double> after = flops_by_stage(BuildModalityWork(c, *batch, heavy_last, false));
  CHECK(after[3] == 0);
  CHECK(after[0] + after[1] + after[2] == doctest::Approx(total));
}

TEST_CASE("replanning: later steps keep the first step's sizing and rule set") {
  // For each list-scheduled policy, steps with other seeds: where the full search of that
  // step's images keeps the first step's choice, the replanned step is that plan, byte for
  // byte; everywhere it is a valid plan of that step's images, its config naming its seed.
  int same_choice = 0, steps = 0;
  for (const char* policy : {"nested", "bubble-fill", "optimus"}) {
    CAPTURE(policy);
    const Config c = MultimodalConfig(policy, {"data.seed=3"});
    auto r = Replanner::Start(c);
    REQUIRE_MESSAGE(r.ok(), r.status().message());
    CHECK(SerializePb(r->first()) == SerializePb(Plan(c)));
    REQUIRE(r->choice().sizing >= 0);
    auto again = r->Plan(3);  // the first step's seed: the first step's plan
    REQUIRE(again.ok());
    CHECK(SerializePb(*again) == SerializePb(r->first()));
    for (uint64_t seed : {4, 5, 6, 7}) {
      CAPTURE(seed);
      auto step = r->Plan(seed);
      REQUIRE_MESSAGE(step.ok(), step.status().message());
      REQUIRE(r->last().has_value());
      CHECK_FALSE(r->last()->searched);  // the first step's choices fit every step here
      CHECK(ValidatePlan(*step).ok());
      auto stored = ConfigOfPlan(*step, "plan.pb");
      REQUIRE(stored.ok());
      CHECK(stored->data.seed == seed);
      CHECK(stored->schedule.modality == c.schedule.modality);
      const Config own = MultimodalConfig(policy, {fmt::format("data.seed={}", seed)});
      auto searched = Replanner::Start(own);
      REQUIRE(searched.ok());
      ++steps;
      if (searched->choice() == r->choice()) {
        ++same_choice;
        CHECK(SerializePb(*step) == SerializePb(searched->first()));
      }
    }
  }
  // Both cases occur on this workload: steps whose own search keeps the first step's
  // choice, and steps whose search would choose otherwise.
  CHECK(same_choice > 0);
  CHECK(same_choice < steps);
  MESSAGE(
      fmt::format("{} of {} steps: the search kept the first step's choice", same_choice, steps));
  // Under memory: auto and micro-batch order auto, the steps keep the searched modes and
  // order: the first step's plan re-planned from its own config is the same plan.
  const Config automatic = MultimodalConfig(
      "nested", {"data.microbatch_order=auto", "training.memory=auto", "data.seed=3"});
  auto a = Replanner::Start(automatic);
  REQUIRE(a.ok());
  auto stored = ConfigOfPlan(a->first(), "plan.pb");
  REQUIRE(stored.ok());
  CHECK(stored->data.order != MicrobatchOrder::kAuto);
  CHECK(!stored->training.memory_auto);
  CHECK(SerializePb(Plan(*stored)) == SerializePb(a->first()));
  // Text only: nothing to choose; a step is the config's plan with its seed.
  const Config text = SmallConfig(PipelineKind::k1F1B, 4, 1, 8, 1, {"data.seed=5"});
  auto t = Replanner::Start(text);
  REQUIRE(t.ok());
  CHECK(t->choice().sizing == -1);
  auto step = t->Plan(5);
  REQUIRE(step.ok());
  CHECK(SerializePb(*step) == SerializePb(Plan(text)));
}

TEST_CASE("plan --steps: one plan per step, each with its own manifest, later steps warm-started") {
  const std::string dir = TempDir();
  const Config c = MultimodalConfig("nested");
  REQUIRE(WriteFileAtomic(dir + "/mm.yaml", c.resolved_yaml.str()).ok());
  // 16 micro-batches (dp 2 x 8), one sample each (two do not fit in 8192 tokens): step k's
  // images all 224^2 (k odd, 64 visual tokens) or all 2048^2 (k even, 5329).
  for (int k = 0; k < 3; ++k) {
    std::string lines;
    const int side = k % 2 ? 224 : 2048, text = k % 2 ? 6000 : 2000;
    for (int i = 0; i < 16; ++i)
      lines += fmt::format(R"({{"id": "s{}", "text_tokens": {}, "images": [[{}, {}]]}})", i, text,
                           side, side) +
               "\n";
    REQUIRE(WriteFileAtomic(fmt::format("{}/m{}.jsonl", dir, k), lines).ok());
  }
  const std::string args = "plan " + dir + "/mm.yaml --steps 3 --manifests " + dir +
                           "/m{step}.jsonl -o " + dir + "/plan{step}.pb";
  const RunResult run = RunCli(args);
  REQUIRE_MESSAGE(run.exit_code == 0, run.out);
  CHECK(run.out.find("step 0 (manifest " + dir + "/m0.jsonl)") != std::string::npos);
  CHECK(run.out.find("searched, predicted") != std::string::npos);
  CHECK(run.out.find("step 2 (manifest " + dir + "/m2.jsonl)") != std::string::npos);
  CHECK(run.out.find("placed with step 0's choices") != std::string::npos);
  // The library's steps, byte for byte; each plan's config names its own manifest, and the
  // steps' images differ.
  Config first = MultimodalConfig("nested", {"data.manifest=" + dir + "/m0.jsonl"});
  auto r = Replanner::Start(first);
  REQUIRE(r.ok());
  std::vector<size_t> vision_ops;
  for (int k = 0; k < 3; ++k) {
    CAPTURE(k);
    auto plan = LoadPlan(fmt::format("{}/plan{}.pb", dir, k));
    REQUIRE(plan.ok());
    CHECK(ValidatePlan(*plan).ok());
    auto stored = ConfigOfPlan(*plan, "plan.pb");
    REQUIRE(stored.ok());
    CHECK(stored->data.manifest == fmt::format("{}/m{}.jsonl", dir, k));
    auto mine = k == 0 ? StatusOr<Table>(r->first())
                       : r->Plan(first.data.seed + k, fmt::format("{}/m{}.jsonl", dir, k));
    REQUIRE(mine.ok());
    CHECK(SerializePb(*plan) == SerializePb(*mine));
    size_t n = 0;
    for (OpId i = 0; i < plan->size(); ++i) n += plan->module(i) == Module::kVision;
    vision_ops.push_back(n);
  }
  CHECK(vision_ops[0] != vision_ops[1]);  // 2048^2 images are split (dynamic CP), 224^2 not
  CHECK(vision_ops[0] == vision_ops[2]);
  // Errors: a pattern without {step}; a step's manifest that is not there.
  CHECK(RunCli("plan " + dir + "/mm.yaml --steps 2 -o " + dir + "/one.pb")
            .out.find("has no {step}") != std::string::npos);
  const RunResult missing =
      RunCli("plan " + dir + "/mm.yaml --steps 4 --manifests " + dir + "/m{step}.jsonl");
  CHECK(missing.exit_code != 0);
  CHECK(missing.out.find(dir + "/m3.jsonl") != std::string::npos);
}
