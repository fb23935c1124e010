// Recompute per pipeline rank (training.recompute as a list) and the search of
// `training.memory: auto`.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <map>

#include "executor/check.h"
#include "helpers.h"
#include "planner/data.h"
#include "planner/modality.h"
#include "planner/plan.h"
#include "planner/validate.h"
#include "planner/workload.h"
#include "simulator/cost_model.h"
#include "simulator/metrics.h"

using namespace pipeplan;
using namespace pipeplan::test;

namespace {

// SmallConfig's model: hidden 256, seq 128, micro-batch 1, 2 layers per chunk.
constexpr double kH = 256, kT = 128;

std::string ParseError(const Config& base_yaml_of, std::vector<std::string> sets) {
  auto doc = YamlDoc::FromString("cfg.yaml", base_yaml_of.resolved_yaml.str());
  REQUIRE(doc.ok());
  for (const std::string& s : sets)
    if (Status st = doc->ApplySet(s); !st.ok()) return st.message();
  auto c = ParseConfig(std::move(*doc));
  REQUIRE(!c.ok());
  return c.status().message();
}

std::string ModeList(const std::vector<Recompute>& modes) {
  std::string s;
  for (size_t i = 0; i < modes.size(); ++i)
    s += fmt::format("{}{}", i ? ", " : "", RecomputeName(modes[i]));
  return "[" + s + "]";
}

Metrics Simulated(const Config& c, const Table& t) {
  SimOptions o = SimOptionsFor(c);
  auto r = RunSimulation(t, o);
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  return r->metrics;
}

}  // namespace

TEST_CASE("training.recompute as a list: one mode per pipeline rank, errors name the key") {
  const Config c =
      SmallConfig(PipelineKind::k1F1B, 2, 1, 4, 1, {"training.recompute=[full, none]"});
  CHECK(c.training.RecomputeOf(0, 0) == Recompute::kFull);
  CHECK(c.training.RecomputeOf(1, 1) == Recompute::kNone);
  const Config plain = SmallConfig(PipelineKind::k1F1B, 2, 1, 4);
  CHECK(ParseError(plain, {"training.recompute=[full, none, none]"}) ==
        "--set training.recompute=[full, none, none]: 'training.recompute' has 3 entries; one per "
        "pipeline rank (pp = 2) is needed");
  CHECK(ParseError(plain, {"training.recompute=[full, sometimes]"}) ==
        "--set training.recompute=[full, sometimes]: bad value 'sometimes' in the list "
        "'training.recompute' (expected one of: none, selective, full)");
  CHECK(ParseError(plain, {"training.saved_activations=[fp8]"}) ==
        "--set training.saved_activations=[fp8]: 'training.saved_activations' has 1 entry; one per "
        "pipeline rank "
        "(pp = 2) is needed");
  CHECK(ParseError(plain, {"training.memory_policies=[fp8]"}) ==
        "--set training.memory_policies=[fp8]: 'training.memory_policies' applies only with "
        "'training.memory: auto'");
  CHECK(ParseError(plain, {"training.memory=[auto]"}) ==
        "--set training.memory=[auto]: 'training.memory' takes one value, not a list or "
        "mapping");
  CHECK(ParseError(plain, {"training.memory=always"}) ==
        "--set training.memory=always: bad value 'always' for 'training.memory' (expected one "
        "of: manual, auto)");
}

TEST_CASE("recompute per pipeline rank changes only the chunks that rank holds") {
  // pp 2, vp 2 (interleaved): rank 0 holds global stages 0 and 2, rank 1 stages 1 and 3.
  auto make = [](const char* rc) {
    return BuildTextWorkload(SmallConfig(PipelineKind::kInterleaved1F1B, 2, 2, 4, 1,
                                         {std::string("training.recompute=") + rc}));
  };
  const TextWorkload mixed = make("[full, none]"), full = make("full"), none = make("none");
  for (int g = 0; g < 4; ++g) {
    CAPTURE(g);
    const TextWorkload& same = g % 2 == 0 ? full : none;
    CHECK(mixed.f[g].mem_delta_bytes == same.f[g].mem_delta_bytes);
    CHECK(mixed.b[g].flops == same.b[g].flops);
  }
  // Full recompute keeps each layer's bf16 input, 2*T*h bytes (Korthikanti et al.), for the
  // 2 layers of a chunk; its backward runs the layers' forward again.
  CHECK(mixed.f[0].mem_delta_bytes == doctest::Approx(2 * 2 * kT * kH));
  CHECK(mixed.f[2].mem_delta_bytes == doctest::Approx(2 * 2 * kT * kH));
  CHECK(mixed.b[0].flops - none.b[0].flops == doctest::Approx(mixed.f[0].flops));
  // Interleaved chunks: stage 1 is rank 1's first chunk, without recompute.
  CHECK(mixed.f[1].mem_delta_bytes > 4 * 2 * kT * kH);
  // V placement (zbv): rank 0 holds stages 0 and 3, rank 1 stages 1 and 2.
  const TextWorkload v = BuildTextWorkload(
      SmallConfig(PipelineKind::kZbv, 2, 2, 4, 1, {"training.recompute=[full, none]"}));
  for (int g : {0, 3}) CHECK(v.f[g].mem_delta_bytes == full.f[g].mem_delta_bytes);
  for (int g : {1, 2}) CHECK(v.f[g].mem_delta_bytes == none.f[g].mem_delta_bytes);
}

TEST_CASE("recompute, storage and offload per virtual stage: each chunk its own policy") {
  // pp 2, vp 2: a list of 4 entries is per global stage (layers 0-1, 2-3, 4-5, 6-7); rank 0
  // holds stages 0 and 2. Each stage's works equal those of the one mode everywhere.
  auto config = [](std::vector<std::string> sets) {
    return SmallConfig(PipelineKind::kInterleaved1F1B, 2, 2, 4, 2, sets);
  };
  const Config mixed = config({"training.recompute=[full, none, selective, none]",
                               "training.saved_activations=[bf16, bf16, fp8, bf16]"});
  const TextWorkload w = BuildTextWorkload(mixed);
  auto one = [&](const char* rc, const char* st) {
    return BuildTextWorkload(config({std::string("training.recompute=") + rc,
                                     std::string("training.saved_activations=") + st}));
  };
  const TextWorkload full = one("full", "bf16"), none = one("none", "bf16"),
                     selective_fp8 = one("selective", "fp8");
  const std::array<const TextWorkload*, 4> same = {&full, &none, &selective_fp8, &none};
  for (int g = 0; g < 4; ++g) {
    CAPTURE(g);
    CHECK(w.f[g].mem_delta_bytes == same[g]->f[g].mem_delta_bytes);
    CHECK(w.f[g].hbm_bytes == same[g]->f[g].hbm_bytes);
    CHECK(w.f[g].saved_fp8 == (g == 2));
    CHECK(w.b[g].flops == same[g]->b[g].flops);
  }
  // Offload of stage 2 only: rank 0 copies its second chunk's forwards, not its first's.
  const Config off =
      config({"training.offload=[none, none, host, none]", "cluster.hardware.host_link_bw=1e15"});
  const Table t = Plan(off);
  REQUIRE(ValidatePlan(t).ok());
  int copied = 0;
  for (OpId i = t.rank_begin(0); i < t.rank_end(0); ++i) {
    if (t.kind(i) != OpKind::kOffload) continue;
    CHECK(t.chunk(i) == 1);
    ++copied;
  }
  CHECK(copied == 4);  // its 4 micro-batches
  for (int r = 1; r < t.num_ranks(); ++r)
    for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i)
      CHECK((t.kind(i) != OpKind::kOffload || t.ranks()[r].pp == 0));
  // The CPU replay: the offloaded chunk's activations leave and come back, FP8 storage of
  // one chunk quantises and dequantises its layers only.
  for (const Config& c : {off, mixed}) {
    Timeline tl;
    auto run = RunCpuLocal(Plan(c), RunOptions{}, true, &tl);
    REQUIRE_MESSAGE(run.ok(), run.status().message());
    CHECK(run->passed());
  }
  // Errors: neither per rank nor per stage; per stage under memory: auto (it chooses per
  // rank).
  CHECK(ParseError(mixed, {"training.offload=[none, host, none]"}) ==
        "--set training.offload=[none, host, none]: 'training.offload' has 3 entries; one per "
        "pipeline rank (pp = 2) or one per virtual stage (4) is needed");
  CHECK(ParseError(mixed, {"training.memory=auto"}).find("one entry per virtual stage") !=
        std::string::npos);
}

TEST_CASE("full recompute by Megatron's method: uniform groups and block layers") {
  // pp 2, 2 layers per stage; stage 0 (no loss) holds two identical dense layers.
  auto stage0 = [](std::vector<std::string> sets) {
    return BuildTextWorkload(SmallConfig(PipelineKind::k1F1B, 2, 1, 4, 1, std::move(sets)));
  };
  const TextWorkload full = stage0({"training.recompute=full"});
  const TextWorkload none = stage0({"training.recompute=none"});
  // uniform, 2 layers a group: one kept input (2*T*h) for the two layers, both recomputed.
  const TextWorkload groups =
      stage0({"training.recompute=full", "training.recompute_num_layers=2"});
  CHECK(groups.f[0].mem_delta_bytes == doctest::Approx(2 * kT * kH));
  CHECK(full.f[0].mem_delta_bytes == doctest::Approx(2 * 2 * kT * kH));
  CHECK(groups.b[0].flops == full.b[0].flops);
  // block, 1 layer: the first layer recomputed (its input kept), the second keeps all.
  const TextWorkload block = stage0({"training.recompute=full", "training.recompute_method=block",
                                     "training.recompute_num_layers=1"});
  CHECK(block.f[0].mem_delta_bytes ==
        doctest::Approx((full.f[0].mem_delta_bytes + none.f[0].mem_delta_bytes) / 2));
  CHECK(block.b[0].flops - none.b[0].flops == doctest::Approx(none.f[0].flops / 2));
  CHECK(block.b[0].tp_calls == none.b[0].tp_calls + none.f[0].tp_calls / 2);
  // block with at least the chunk's layers is full recompute.
  const TextWorkload all = stage0({"training.recompute=full", "training.recompute_method=block",
                                   "training.recompute_num_layers=4"});
  CHECK(all.f[0].mem_delta_bytes == full.f[0].mem_delta_bytes);
  CHECK(all.b[0].flops == full.b[0].flops);
  // Without full recompute on any rank the keys would be ignored: an error.
  const Config plain = SmallConfig(PipelineKind::k1F1B, 2, 1, 4);
  CHECK(ParseError(plain, {"training.recompute_method=block"}) ==
        "--set training.recompute_method=block: 'training.recompute_method' applies to full "
        "recompute; no pipeline rank has 'training.recompute: full'");
}

TEST_CASE("memory: auto raises recompute where ranks run out of memory, and no further") {
  // The executor tests' multimodal config (pp 4, 8 micro-batches, 2048^2 images); HBM is
  // set so that some modes must rise but not all.
  const std::vector<std::string> tight = {"training.memory=auto",
                                          "cluster.hardware.hbm_bytes=2.6e9"};
  const Config c = MultimodalConfig("nested", tight);
  CHECK(c.training.RecomputeOf(0, 0) == Recompute::kNone);  // the start: none where not given
  CHECK(c.model.vision.recompute == Recompute::kNone);
  MemoryChoice choice;
  auto t = BuildPlan(c, &choice);
  REQUIRE_MESSAGE(t.ok(), t.status().message());
  REQUIRE(choice.fits);
  REQUIRE(choice.text.size() == 4);
  const Metrics m = Simulated(c, *t);
  CHECK(!m.oom);
  CHECK(m.peak_memory_bytes == choice.peak_bytes);
  CHECK(m.peak_memory_bytes <= 2.6e9);
  CHECK(choice.start_peak_bytes > 2.6e9);
  CHECK(choice.step_s >= choice.start_step_s);  // recompute only adds work

  // Only recompute (the default policy); selective never, the attention being fused; some
  // module rose, not every one: the search stops where the plan fits.
  std::vector<MemoryMode> modes = choice.text;
  modes.push_back(choice.vision);
  int raised = 0;
  for (MemoryMode mode : modes) {
    CHECK(mode.storage == ActStorage::kBf16);
    CHECK(mode.recompute != Recompute::kSelective);
    raised += mode.recompute == Recompute::kFull;
  }
  CHECK(raised > 0);
  CHECK(raised < 5);

  // Minimal: each raised module one step lower (back to none: the recompute ladder under
  // fused attention is none, full), set by hand, runs out of memory or is slower.
  auto manual = [&](const std::vector<MemoryMode>& ms) {
    std::vector<Recompute> text;
    for (size_t r = 0; r + 1 < ms.size(); ++r) text.push_back(ms[r].recompute);
    return MultimodalConfig(
        "nested", {"cluster.hardware.hbm_bytes=2.6e9", "training.recompute=" + ModeList(text),
                   fmt::format("model.vision.recompute={}", RecomputeName(ms.back().recompute))});
  };
  const Config chosen = manual(modes);
  CHECK(Simulated(chosen, Plan(chosen)).step_time_s == m.step_time_s);
  for (size_t r = 0; r < modes.size(); ++r) {
    CAPTURE(r);
    if (modes[r].recompute == Recompute::kNone) continue;
    std::vector<MemoryMode> lower = modes;
    lower[r].recompute = Recompute::kNone;
    const Config k = manual(lower);
    const Metrics lm = Simulated(k, Plan(k));
    CHECK((lm.oom || lm.step_time_s > m.step_time_s));
  }

  // The plan stores the choice: its config, parsed again, is manual with the chosen modes.
  auto stored = ConfigOfPlan(*t, "plan.pb");
  REQUIRE_MESSAGE(stored.ok(), stored.status().message());
  CHECK(!stored->training.memory_auto);
  for (int r = 0; r < 4; ++r) CHECK(stored->training.RecomputeOf(r, r) == choice.text[r].recompute);
  CHECK(stored->model.vision.recompute == choice.vision.recompute);
}

TEST_CASE("memory: auto with fp8 storage: a faster fit than recompute alone, and fp8 alone") {
  // configs/default.yaml on a 12 GB part: recompute alone must fully recompute rank 0
  // (its configured selective saves almost nothing under FlashAttention); FP8 storage
  // fits it without recomputing, so the step is faster. The encoder runs decoupled, so
  // that rank 0's text is on the critical path (nested hides its recompute in the slack
  // its encoder placement leaves it: the same step either way).
  auto search = [](std::vector<std::string> sets, MemoryChoice* choice) {
    sets.push_back("schedule.modality=decoupled");
    sets.push_back("training.memory=auto");
    sets.push_back("cluster.hardware.hbm_bytes=12e9");
    auto c = LoadConfig(std::string(PIPEPLAN_SOURCE_DIR) + "/configs/default.yaml", sets);
    REQUIRE_MESSAGE(c.ok(), c.status().message());
    auto t = BuildPlan(*c, choice);
    REQUIRE_MESSAGE(t.ok(), t.status().message());
    return std::move(t).value();
  };
  MemoryChoice recompute, both;
  search({}, &recompute);
  const Table plan = search({"training.memory_policies=[recompute, fp8]"}, &both);
  REQUIRE(recompute.fits);
  REQUIRE(both.fits);
  CHECK(recompute.text[0] == MemoryMode{Recompute::kFull, ActStorage::kBf16});
  CHECK(both.text[0].storage == ActStorage::kFp8);
  CHECK(both.step_s < recompute.step_s);
  // The plan's stored config (memory: manual, the chosen modes) parses and re-plans to the
  // same step: memory_policies, a key of memory: auto only, is not left in it.
  auto stored = ConfigOfPlan(plan, "plan.pb");
  REQUIRE_MESSAGE(stored.ok(), stored.status().message());
  CHECK(stored->training.StorageOf(0, 0) == ActStorage::kFp8);
  CHECK(Simulated(*stored, Plan(*stored)).step_time_s == both.step_s);

  // FP8 alone never recomputes more than configured; it costs only (de)quantisation
  // traffic, far less than recompute's extra work.
  MemoryChoice fp8;
  auto t = BuildPlan(
      MultimodalConfig("nested", {"training.memory=auto", "cluster.hardware.hbm_bytes=6e9",
                                  "training.memory_policies=fp8"}),
      &fp8);
  REQUIRE(t.ok());
  REQUIRE(fp8.fits);
  CHECK(fp8.peak_bytes <= 6e9);
  CHECK(fp8.vision.storage == ActStorage::kFp8);
  for (MemoryMode mode : fp8.text) CHECK(mode.recompute == Recompute::kNone);
  CHECK(fp8.vision.recompute == Recompute::kNone);
  CHECK(fp8.step_s - fp8.start_step_s < 0.1 * fp8.start_step_s);
}

TEST_CASE("fp8 storage of saved activations: bytes and (de)quantisation traffic by hand") {
  // DeepSeek-V3's 1x128 tiles: 1 byte per element + a 4-byte scale per 128 elements, i.e.
  // k = (1 + 4/128) / 2 of the bf16 bytes. pp 2: stage 0 holds 2 layers, no loss.
  const double k = (1 + 4.0 / 128) / 2;
  auto stage0 = [](const char* rc, const char* st) {
    return BuildTextWorkload(SmallConfig(PipelineKind::k1F1B, 2, 1, 4, 1,
                                         {std::string("training.recompute=") + rc,
                                          std::string("training.saved_activations=") + st}));
  };
  // Full recompute keeps the layer input, 2*T*h bf16 bytes per layer: all of it quantised.
  const TextWorkload full = stage0("full", "bf16"), full8 = stage0("full", "fp8");
  const double inputs = 2 * 2 * kT * kH;
  CHECK(full8.f[0].mem_delta_bytes == doctest::Approx(k * inputs));
  CHECK(full8.b[0].mem_delta_bytes == doctest::Approx(-k * inputs));
  // Quantise: read 2 bytes, write the stored ones; dequantise: the reverse.
  CHECK(full8.f[0].hbm_bytes - full.f[0].hbm_bytes == doctest::Approx((1 + k) * inputs));
  CHECK(full8.b[0].hbm_bytes - full.b[0].hbm_bytes == doctest::Approx((1 + k) * inputs));
  CHECK(full8.b[0].flops == full.b[0].flops);
  // Without recompute the bf16 tensors are the selective set minus the 2*T*h of 1-byte
  // dropout masks (Korthikanti et al.'s 34*s*b*h: 32 bf16 + 2 masks); masks and the fp32
  // log-sum-exp stay: saved = (selective - full recompute's 2*T*h) * (1 - k).
  const TextWorkload none = stage0("none", "bf16"), none8 = stage0("none", "fp8");
  const TextWorkload sel = stage0("selective", "bf16");
  const double bf16 = sel.f[0].mem_delta_bytes - full.f[0].mem_delta_bytes;
  CHECK(none.f[0].mem_delta_bytes - none8.f[0].mem_delta_bytes == doctest::Approx(bf16 * (1 - k)));

  // The encoder: per task, full recompute's stored input shrinks by k and the traffic added
  // each way is the bf16 bytes times (1 + k).
  auto tasks = [](const char* st) {
    const Config c = MultimodalConfig(
        "nested",
        {"model.vision.recompute=full", std::string("model.vision.saved_activations=") + st});
    auto batch = MakeStepBatch(c);
    REQUIRE(batch.ok());
    return BuildModalityWork(c, *batch, VisionPool{}, false).vision;
  };
  const auto v16 = tasks("bf16"), v8 = tasks("fp8");
  REQUIRE(v16.size() == v8.size());
  for (size_t i = 0; i < v16.size(); ++i) {
    CAPTURE(i);
    CHECK(v8[i].act_bytes == doctest::Approx(k * v16[i].act_bytes));
    CHECK(v8[i].f.hbm_bytes - v16[i].f.hbm_bytes == doctest::Approx((1 + k) * v16[i].act_bytes));
    CHECK(v8[i].b.hbm_bytes - v16[i].b.hbm_bytes == doctest::Approx((1 + k) * v16[i].act_bytes));
  }
}

TEST_CASE("memory: auto keeps the configured modes when they fit, says so when nothing fits") {
  MemoryChoice ample;
  const Config roomy = MultimodalConfig(
      "nested", {"training.memory=auto", "training.recompute=none", "model.vision.recompute=full"});
  REQUIRE(BuildPlan(roomy, &ample).ok());
  CHECK(ample.fits);
  CHECK(ample.plans == 1);
  CHECK(ample.step_s == ample.start_step_s);
  for (MemoryMode r : ample.text) CHECK(r.recompute == Recompute::kNone);
  CHECK(ample.vision.recompute == Recompute::kFull);

  MemoryChoice none;
  const Config tiny =
      MultimodalConfig("nested", {"training.memory=auto", "cluster.hardware.hbm_bytes=1e9"});
  REQUIRE(BuildPlan(tiny, &none).ok());
  CHECK(!none.fits);
  for (MemoryMode r : none.text) CHECK(r.recompute == Recompute::kFull);
  CHECK(none.vision.recompute == Recompute::kFull);
  CHECK(MemoryChoiceText(none).rfind("does not fit", 0) == 0);
}

TEST_CASE("the encoder's fused attention keeps no P^2 scores without recompute") {
  // Per layer and patch (Korthikanti et al.): selective keeps 18d + 4 mlp bytes, none adds
  // the fp32 log-sum-exp per head (4 heads bytes), full keeps only the input (2d). With
  // d = 1024, mlp = 4096, 16 heads: (none - selective) / (selective - full) = 64 / 32768
  // for every task, small images and CP gang shards of 2048^2 ones alike.
  auto tasks = [](const char* rc) {
    const Config c = MultimodalConfig("nested", {std::string("model.vision.recompute=") + rc});
    auto batch = MakeStepBatch(c);
    REQUIRE(batch.ok());
    return BuildModalityWork(c, *batch, VisionPool{}, false).vision;
  };
  const auto none = tasks("none"), sel = tasks("selective"), full = tasks("full");
  REQUIRE(none.size() == sel.size());
  REQUIRE(full.size() == sel.size());
  REQUIRE(!none.empty());
  for (size_t i = 0; i < none.size(); ++i) {
    CAPTURE(i);
    CHECK((none[i].act_bytes - sel[i].act_bytes) / (sel[i].act_bytes - full[i].act_bytes) ==
          doctest::Approx(64.0 / 32768));
  }
}

TEST_CASE("encoder and generator backward recompute: selective runs the core attention again") {
  // Backward FLOPs per task: none 2 F; selective 2 F + the core attention's forward (it
  // keeps no attention output or log-sum-exp: the fused kernel runs again before its
  // backward); full 3 F (the whole forward again). The same for the attention part.
  auto work = [](const char* rc) {
    const std::string r(rc);
    Config c =
        MultimodalConfig("nested", {"model.vision.recompute=" + r, "model.generator.layers=2",
                                    "model.generator.hidden=512", "model.generator.mlp=2048",
                                    "model.generator.heads=8", "model.generator.recompute=" + r,
                                    "data.generate.height=256", "data.generate.width=256"});
    auto batch = MakeStepBatch(c);
    REQUIRE(batch.ok());
    return BuildModalityWork(c, *batch, VisionPool{}, false);
  };
  const ModalityWork none = work("none"), sel = work("selective"), full = work("full");
  REQUIRE(!none.vision.empty());
  REQUIRE(!none.generator.empty());
  auto check = [](const Work& f_none, const Work& b_none, const Work& f_sel, const Work& b_sel,
                  const Work& f_full, const Work& b_full) {
    REQUIRE(f_none.attn_flops > 0);
    CHECK(f_sel.flops == doctest::Approx(f_none.flops));
    CHECK(b_none.flops == doctest::Approx(2 * f_none.flops));
    CHECK(b_sel.flops == doctest::Approx(2 * f_sel.flops + f_sel.attn_flops));
    CHECK(b_sel.attn_flops == doctest::Approx(3 * f_sel.attn_flops));
    CHECK(b_full.flops == doctest::Approx(3 * f_full.flops));
    CHECK(b_full.attn_flops == doctest::Approx(3 * f_full.attn_flops));
  };
  for (size_t i = 0; i < none.vision.size(); ++i) {
    CAPTURE(i);
    check(none.vision[i].f, none.vision[i].b, sel.vision[i].f, sel.vision[i].b, full.vision[i].f,
          full.vision[i].b);
  }
  for (size_t i = 0; i < none.generator.size(); ++i) {
    CAPTURE(i);
    check(none.generator[i].f, none.generator[i].b, sel.generator[i].f, sel.generator[i].b,
          full.generator[i].f, full.generator[i].b);
  }
}

TEST_CASE("training.recompute_modules: what selective recompute drops and runs again, by hand") {
  // pp 2: stage 0 holds 2 layers (and the embedding, the same in every mode).
  auto stage0 = [](std::vector<std::string> sets) {
    return BuildTextWorkload(SmallConfig(PipelineKind::k1F1B, 2, 1, 4, 2, std::move(sets)));
  };
  const double L = 2, T = kT, h = kH, f = 1024;
  SUBCASE("dense layers: layernorm and mlp") {
    const TextWorkload attn = stage0({}),
                       attn2 = stage0({"training.recompute_modules=[core_attn]"});
    CHECK(attn.f[0] == attn2.f[0]);  // the default is Megatron's: the core attention
    CHECK(attn.b[0] == attn2.b[0]);
    // layernorm: the two norms' outputs (2*h bytes each per token) are not kept; the
    // backward runs both norms again (read 2*h, write 2*h bytes each).
    const TextWorkload ln = stage0({"training.recompute_modules=[core_attn, layernorm]"});
    CHECK(attn.f[0].mem_delta_bytes - ln.f[0].mem_delta_bytes == doctest::Approx(L * 4 * h * T));
    CHECK(ln.b[0].hbm_bytes - attn.b[0].hbm_bytes == doctest::Approx(L * 8 * h * T));
    CHECK(ln.b[0].flops == attn.b[0].flops);
    // mlp (SwiGLU, the default FFN): the gate and up outputs and SwiGLU's output (3 x 2
    // bytes per FFN element) are not kept; the backward runs the gate, up and down GEMMs
    // again (3 x 2*T*h*f FLOPs) and SwiGLU (read gate and up, write one: 6 bytes).
    const TextWorkload mlp = stage0({"training.recompute_modules=[core_attn, mlp]"});
    CHECK(attn.f[0].mem_delta_bytes - mlp.f[0].mem_delta_bytes == doctest::Approx(L * 6 * f * T));
    CHECK(mlp.b[0].flops - attn.b[0].flops == doctest::Approx(L * 3 * 2 * T * h * f));
    CHECK(mlp.b[0].hbm_bytes - attn.b[0].hbm_bytes == doctest::Approx(L * 6 * f * T));
    // moe_act and moe touch no dense layer.
    const TextWorkload moe = stage0({"training.recompute_modules=[core_attn, moe_act, moe]"});
    CHECK(moe.f[0] == attn.f[0]);
    CHECK(moe.b[0] == attn.b[0]);
  }
  SUBCASE("MoE layers: the dispatched tokens, moe_act and moe") {
    // 8 experts, top-2, SwiGLU experts of 512, over ep 2 (the 2 replicas).
    const double k = 2, fe = 512, E = 8, heads = 4;
    const std::vector<std::string> moe = {"model.llm.moe={experts: 8, top_k: 2, expert_ffn: 512}",
                                          "model.llm.gated_ffn=true", "parallelism.ep=2"};
    auto with = [&](std::vector<std::string> more) {
      std::vector<std::string> sets = moe;
      sets.insert(sets.end(), more.begin(), more.end());
      return stage0(sets);
    };
    // Without recompute, per token and layer: Korthikanti's 16*h bf16 + 2*h of masks, the
    // fp32 log-sum-exp per head, each routed copy's gate, up and SwiGLU outputs (3 x 2 bytes
    // per expert FFN element) and its FC1 input (the dispatched token, 2*h).
    const TextWorkload none = with({"training.recompute=none"});
    CHECK(none.f[0].mem_delta_bytes ==
          doctest::Approx(L * T * (16 * h + 2 * h + 4 * heads + k * (6 * fe + 2 * h))));
    const TextWorkload attn = with({});
    CHECK(none.f[0].mem_delta_bytes - attn.f[0].mem_delta_bytes ==
          doctest::Approx(L * T * 4 * heads));
    // moe_act: the SwiGLU output is not kept (2 bytes per element per routed copy); the
    // backward runs SwiGLU again (read gate and up, write one: 6 bytes).
    const TextWorkload act = with({"training.recompute_modules=[core_attn, moe_act]"});
    CHECK(attn.f[0].mem_delta_bytes - act.f[0].mem_delta_bytes ==
          doctest::Approx(L * T * k * 2 * fe));
    CHECK(act.b[0].hbm_bytes - attn.b[0].hbm_bytes == doctest::Approx(L * T * k * 6 * fe));
    CHECK(act.b[0].flops == attn.b[0].flops);
    CHECK(act.b[0].ep_bytes == attn.b[0].ep_bytes);
    // moe: the block keeps only its input. The backward runs the router (2*T*h*E), the
    // experts (3 GEMMs of 2*T*h*fe per routed copy), SwiGLU, the permutation to and from the
    // experts (2 x 2 x 2*h bytes per routed copy) and both all-to-alls again: each moves
    // T*k*h bf16 of which (ep-1)/ep leaves the GPU.
    const TextWorkload all = with({"training.recompute_modules=[core_attn, moe_act, moe]"});
    CHECK(attn.f[0].mem_delta_bytes - all.f[0].mem_delta_bytes ==
          doctest::Approx(L * T * k * (6 * fe + 2 * h)));
    CHECK(all.b[0].flops - attn.b[0].flops ==
          doctest::Approx(L * (2 * T * h * E + k * 3 * 2 * T * h * fe)));
    CHECK(all.b[0].hbm_bytes - attn.b[0].hbm_bytes ==
          doctest::Approx(L * T * k * (6 * fe + 8 * h)));
    CHECK(all.b[0].ep_bytes - attn.b[0].ep_bytes == doctest::Approx(L * 2 * T * k * h * 2 * 0.5));
    CHECK(all.b[0].ep_calls - attn.b[0].ep_calls == L * 2);
  }
  SUBCASE("errors name the key") {
    const Config plain = SmallConfig(PipelineKind::k1F1B, 2, 1, 4);
    CHECK(
        ParseError(plain, {"training.recompute=full", "training.recompute_modules=[layernorm]"}) ==
        "--set training.recompute_modules=[layernorm]: 'training.recompute_modules' applies to "
        "selective recompute; no pipeline rank has 'training.recompute: selective'");
    CHECK(
        ParseError(plain, {"training.recompute_modules=[attention]"})
            .find(
                "bad value 'attention' in the list 'training.recompute_modules' (expected one of: "
                "core_attn, layernorm, moe_act, mlp, moe)") != std::string::npos);
  }
}

TEST_CASE("offload_modules and fp8_modules: the named tensor classes only, bytes by hand") {
  // pp 2: stage 0 holds 2 layers. MoE: 8 experts, top-2, SwiGLU experts of 512, ep 2.
  const double L = 2, T = kT, h = kH, k = 2, fe = 512;
  auto stage0 = [](std::vector<std::string> sets) {
    sets.insert(sets.end(), {"model.llm.moe={experts: 8, top_k: 2, expert_ffn: 512}",
                             "model.llm.gated_ffn=true", "parallelism.ep=2"});
    return BuildTextWorkload(SmallConfig(PipelineKind::k1F1B, 2, 1, 4, 2, std::move(sets)));
  };
  auto offloaded = [&](std::string modules, std::vector<std::string> more = {}) {
    more.insert(more.end(), {"training.offload=host", "training.offload_modules=" + modules});
    return stage0(std::move(more)).offload_bytes[0];
  };
  SUBCASE("offload: each class is its module's input") {
    // Without recompute: core_attn Q, K, V (6*h bf16 per token), attn_proj its input (2*h);
    // expert_fc1 the dispatched tokens (2*h per routed copy), moe_act FC1's output (gate and
    // up: 2 x 2 bytes per expert FFN element per routed copy).
    CHECK(offloaded("[core_attn, attn_proj]", {"training.recompute=none"}) ==
          doctest::Approx(L * T * 8 * h));
    CHECK(offloaded("[expert_fc1, moe_act]", {"training.recompute=none"}) ==
          doctest::Approx(L * T * k * (2 * h + 4 * fe)));
    CHECK(offloaded("[attn_norm, qkv_linear, mlp_norm]", {"training.recompute=none"}) ==
          doctest::Approx(L * T * 6 * h));
    // What recompute does not keep is not offloaded: the norms' outputs (qkv_linear) under
    // layernorm recompute, the whole MoE block's tensors under moe.
    CHECK(offloaded("qkv_linear", {"training.recompute_modules=[core_attn, layernorm]"}) == 0);
    CHECK(offloaded("[expert_fc1, moe_act]", {"training.recompute_modules=[core_attn, moe]"}) == 0);
    // Full recompute keeps each layer's input: attn_norm's; nothing else.
    CHECK(offloaded("attn_norm", {"training.recompute=full"}) == doctest::Approx(L * T * 2 * h));
    CHECK(offloaded("[core_attn, expert_fc1]", {"training.recompute=full"}) == 0);
    // Unnamed: the whole forward's activations go (offload_bytes unused).
    CHECK(stage0({"training.offload=host"}).offload_bytes[0] == 0);
  }
  SUBCASE("offload without sequence parallelism: the norm tensors are whole on each TP GPU") {
    // tp 2: the layer input is 2*h*T/2 sharded plus 2*h*T*(1 - 1/2) replicated = 2*h*T.
    const TextWorkload w = BuildTextWorkload(
        SmallConfig(PipelineKind::k1F1B, 2, 1, 4, 1,
                    {"cluster.gpus_per_node=4", "parallelism.tp=2",
                     "training.sequence_parallel=false", "training.recompute=none",
                     "training.offload=host", "training.offload_modules=attn_norm"}));
    CHECK(w.offload_bytes[0] == doctest::Approx(L * T * 2 * h));
  }
  SUBCASE("fp8: only the named classes are quantised") {
    // FP8 storage keeps (1 + 4/128) / 2 bytes per bf16 byte (E4M3 plus an fp32 scale per
    // 128 elements); quantising reads the bf16 bytes and writes the stored ones.
    const double per = (1 + 4.0 / 128) / 2, dispatched = L * T * k * 2 * h;
    const TextWorkload bf16 = stage0({"training.recompute=none"});
    const TextWorkload fp8 = stage0({"training.recompute=none", "training.saved_activations=fp8",
                                     "training.fp8_modules=expert_fc1"});
    CHECK(bf16.f[0].mem_delta_bytes - fp8.f[0].mem_delta_bytes ==
          doctest::Approx(dispatched * (1 - per)));
    CHECK(fp8.f[0].hbm_bytes - bf16.f[0].hbm_bytes == doctest::Approx(dispatched * (1 + per)));
    CHECK(fp8.b[0].hbm_bytes - bf16.b[0].hbm_bytes == doctest::Approx(dispatched * (1 + per)));
    // Offloading a class that is stored in FP8 moves its FP8 bytes.
    CHECK(offloaded("expert_fc1", {"training.recompute=none", "training.saved_activations=fp8",
                                   "training.fp8_modules=expert_fc1"}) ==
          doctest::Approx(dispatched * per));
  }
  SUBCASE("errors name the key") {
    const Config plain = SmallConfig(PipelineKind::k1F1B, 2, 1, 4);
    CHECK(ParseError(plain, {"training.offload_modules=core_attn"}) ==
          "--set training.offload_modules=core_attn: 'training.offload_modules' applies to the "
          "LLM's saved activations, but no pipeline rank offloads ('training.offload')");
    CHECK(ParseError(plain, {"training.fp8_modules=core_attn"}) ==
          "--set training.fp8_modules=core_attn: 'training.fp8_modules' applies to the LLM's "
          "saved activations, but no pipeline rank stores in FP8 ('training.saved_activations')");
    CHECK(ParseError(plain, {"training.offload=host", "training.offload_modules=[moe_act]"}) ==
          "--set training.offload_modules=[moe_act]: 'training.offload_modules' names expert_fc1 "
          "or moe_act, but the LLM has no MoE layers");
    CHECK(ParseError(plain, {"training.offload=host", "training.offload_modules=[mlp]"})
              .find("bad value 'mlp' in the list 'training.offload_modules'") != std::string::npos);
  }
}

TEST_CASE("overlap_moe_recompute: the recomputed dispatch hides behind the experts' dgrad GEMMs") {
  // pp 2 x dp 2 on one node of 4 GPUs, ep 2: stage 0 holds 2 MoE layers (8 experts, top-2,
  // SwiGLU experts of 512), the whole MoE block recomputed.
  const double L = 2, T = kT, h = kH, k = 2, fe = 512;
  auto config = [](std::vector<std::string> more) {
    std::vector<std::string> sets = {"model.llm.moe={experts: 8, top_k: 2, expert_ffn: 512}",
                                     "model.llm.gated_ffn=true", "parallelism.ep=2",
                                     "training.recompute_modules=[core_attn, moe]"};
    sets.insert(sets.end(), more.begin(), more.end());
    return SmallConfig(PipelineKind::k1F1B, 2, 1, 4, 2, sets);
  };
  const Config serial = config({}), overlapped = config({"training.overlap_moe_recompute=true"});
  const Work b = BuildTextWorkload(serial).b[0], bo = BuildTextWorkload(overlapped).b[0];
  // Per layer: the dispatch moves T*k*h bf16 per GPU, half of it to the other EP rank; the
  // experts' data-gradient GEMMs are 3 matrices x 2*T*h*fe FLOPs per routed copy. Layer 0's
  // dispatch runs beside layer 1's GEMMs; layer 1, the first in the backward, has nothing
  // before it: of L = 2 layers one dispatch is hidden.
  const double dispatch = T * k * h * 2 * 0.5, gemm = 3 * 2 * T * h * fe * k;
  CHECK(bo.ep_overlap_bytes == doctest::Approx((L - 1) * dispatch));
  CHECK(bo.ep_overlap_calls == L - 1);
  CHECK(bo.ep_overlap_flops == doctest::Approx((L - 1) * gemm));
  CHECK(b.ep_overlap_calls == 0);
  CHECK(bo.ep_bytes == b.ep_bytes);  // charged again all the same, only hidden
  // Seconds: the 4 EP GPUs of the node talk over NVLink (alpha + bytes / NVLink bus bw);
  // the GEMMs run at the bf16 rate. The backward is shorter by what of the hidden dispatch
  // the GEMMs cover.
  const GpuSpec& s = serial.cluster.spec;
  const CostModel cost = CostModel::Real(s);
  const double a2a = s.intra_latency_s + dispatch / (s.nvlink_bw * s.nvlink_efficiency);
  const double covers = gemm / (s.bf16_flops * s.compute_efficiency);
  CHECK(cost.ComputeSeconds(b, 1, 1, 2, 4, false) - cost.ComputeSeconds(bo, 1, 1, 2, 4, false) ==
        doctest::Approx((L - 1) * std::min(a2a, covers)).epsilon(1e-9));
  // That GEMM time hides nothing else (DualPipeV's overlapped F/B pairs).
  CHECK(cost.ComputeParts(bo, 1, 1, 2, 4).covering ==
        doctest::Approx((L - 1) * std::min(a2a, covers)).epsilon(1e-9));
  CHECK(cost.ComputeParts(b, 1, 1, 2, 4).covering == 0);
  // The forward and a dense or serial plan are unchanged; the key needs `moe` recompute.
  CHECK(BuildTextWorkload(overlapped).f[0] == BuildTextWorkload(serial).f[0]);
  CHECK(ParseError(serial, {"training.recompute_modules=[core_attn]",
                            "training.overlap_moe_recompute=true"}) ==
        "--set training.overlap_moe_recompute=true: 'training.overlap_moe_recompute' needs MoE "
        "layers over ep > 1 and selective recompute of 'moe' (training.recompute_modules)");
}

TEST_CASE("memory: auto stores a config that loads when the search leaves a refining key idle") {
  // The small model fits as configured (no recompute, bf16, on the device): the class and
  // module keys refine modes no rank was given, so the stored manual config drops them.
  const Config c =
      SmallConfig(PipelineKind::k1F1B, 2, 1, 4, 1,
                  {"training.memory=auto", "training.memory_policies=[recompute, fp8, offload]",
                   "training.offload_modules=[core_attn]", "training.fp8_modules=[core_attn]",
                   "training.recompute_modules=[core_attn, layernorm]"});
  MemoryChoice choice;
  auto t = BuildPlan(c, &choice);
  REQUIRE_MESSAGE(t.ok(), t.status().message());
  for (int r = 0; r < 2; ++r) CHECK(choice.text[r].recompute == Recompute::kNone);
  auto stored = ConfigOfPlan(*t, "plan.pb");
  REQUIRE_MESSAGE(stored.ok(), stored.status().message());
  CHECK(!stored->training.memory_auto);
  CHECK(stored->training.offload_modules == 0);
  CHECK(stored->training.fp8_modules == 0);
}

TEST_CASE("memory: auto with gradients: ZeRO-2 where the fp32 gradients are what does not fit") {
  // configs/small_text.yaml with tp 1 (pp 4 x dp 2, vp 2). Rank 0 holds layers 0-1 and 8-9
  // and the embedding: 4 x (4 h^2 + 3 h ffn + 2 h) + vocab x h = 271,073,280 parameters.
  // Its fp32 gradients: 4 bytes each under ZeRO-1 (1.084 GB); under ZeRO-2 a 1/dp shard
  // plus two buckets of 40e6 parameters (the default grad_bucket_size; a chunk holds
  // more): 542,146,560 + 320,000,000 = 862,146,560 bytes. With the HBM between the full
  // recompute plans' peaks under ZeRO-1 and ZeRO-2, recompute alone cannot fit it.
  const double params = 4 * (4 * 2048.0 * 2048 + 3 * 2048.0 * 5632 + 2 * 2048) + 32000 * 2048.0;
  const double zero2_grads = 4 * params / 2 + 2 * 40e6 * 4;
  const std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/small_text.yaml";
  auto peak = [&](std::vector<std::string> sets) {
    sets.push_back("parallelism.tp=1");
    auto c = LoadConfig(cfg, sets);
    REQUIRE_MESSAGE(c.ok(), c.status().message());
    return Simulated(*c, Plan(*c)).peak_memory_bytes;
  };
  const double zero1 = peak({"training.recompute=full"});
  const double zero2 = peak({"training.recompute=full", "training.zero_stage=2"});
  REQUIRE(zero2 < zero1);
  const std::string hbm = fmt::format("cluster.hardware.hbm_bytes={}", (zero1 + zero2) / 2);

  auto search = [&](const std::string& policies, MemoryChoice* choice) {
    auto c = LoadConfig(cfg, {"parallelism.tp=1", hbm, "training.memory=auto",
                              "training.memory_policies=" + policies});
    REQUIRE_MESSAGE(c.ok(), c.status().message());
    auto t = BuildPlan(*c, choice);
    REQUIRE_MESSAGE(t.ok(), t.status().message());
    auto r = RunSimulation(*t, SimOptionsFor(WithChoice(*c, *choice)));
    REQUIRE_MESSAGE(r.ok(), r.status().message());
    return std::pair{std::move(*t), std::move(*r)};
  };
  // Without data parallelism there is nothing to shard: an error naming the key.
  auto dp1 = LoadConfig(cfg, {"training.memory=auto", "training.memory_policies=gradients"});
  REQUIRE(!dp1.ok());
  CHECK(dp1.status().message().find("training.memory_policies") != std::string::npos);
  CHECK(dp1.status().message().find("needs data parallelism (dp > 1)") != std::string::npos);

  MemoryChoice alone;
  search("recompute", &alone);
  CHECK(!alone.fits);
  CHECK(!alone.gradients_searched);

  MemoryChoice choice;
  auto [table, sim] = search("[recompute, gradients]", &choice);
  REQUIRE(choice.fits);
  CHECK(choice.gradients_searched);
  CHECK(choice.gradients == GradMode{2, false});
  CHECK(!sim.metrics.oom);
  CHECK(sim.metrics.peak_memory_bytes == doctest::Approx(choice.peak_bytes));
  CHECK(sim.memory[0].peak_by_cat[kGrads] == doctest::Approx(zero2_grads));
  CHECK(MemoryChoiceText(choice).find("gradients ZeRO-2:") != std::string::npos);
  CHECK(MemoryChoiceJson(choice)["gradients"] == "ZeRO-2");

  // The plan's config says so; the same activation modes under ZeRO-1 do not fit.
  auto stored = ConfigOfPlan(table, "plan.pb");
  REQUIRE_MESSAGE(stored.ok(), stored.status().message());
  CHECK(stored->training.zero_stage == 2);
  CHECK(!stored->training.grad_offload);
  CHECK(Simulated(*stored, Plan(*stored)).peak_memory_bytes == doctest::Approx(choice.peak_bytes));
  auto doc = YamlDoc::FromString("stored.yaml", table.meta().config_yaml);
  REQUIRE(doc.ok());
  REQUIRE(doc->ApplySet("training.zero_stage=1").ok());
  auto one = ParseConfig(std::move(*doc));
  REQUIRE_MESSAGE(one.ok(), one.status().message());
  CHECK(Simulated(*one, Plan(*one)).oom);
}

TEST_CASE("memory: auto under bubble-fill is no slower than under nested") {
  // The generation workload from no recompute (the README's memory table): the two
  // policies' greedy searches take different paths (bubble-fill's alone ended at 24.82 s,
  // nested's at 23.08 s); bubble-fill may use every placement nested may, so it keeps
  // nested's search's plan where that one is faster, as its own.
  const std::string cfg =
      std::string(PIPEPLAN_SOURCE_DIR) + "/configs/qwen3_30b_a3b_vit_mmdit20b.yaml";
  std::map<std::string, MemoryChoice> by;
  for (std::string policy : {"nested", "bubble-fill"}) {
    auto c =
        LoadConfig(cfg, {"schedule.modality=" + policy, "training.memory=auto",
                         "training.memory_policies=[recompute, fp8]", "training.recompute=none",
                         "model.vision.recompute=none", "model.generator.recompute=none"});
    REQUIRE_MESSAGE(c.ok(), c.status().message());
    MemoryChoice& choice = by[policy];
    auto t = BuildPlan(*c, &choice);
    REQUIRE_MESSAGE(t.ok(), t.status().message());
    CHECK(t->meta().modality == policy);
    CHECK(choice.fits);
    CHECK(Simulated(WithChoice(*c, choice), *t).step_time_s == doctest::Approx(choice.step_s));
    auto stored = ConfigOfPlan(*t, "plan.pb");
    REQUIRE_MESSAGE(stored.ok(), stored.status().message());
    CHECK(stored->schedule.modality == c->schedule.modality);
  }
  CHECK(by["bubble-fill"].step_s <= by["nested"].step_s);
}
