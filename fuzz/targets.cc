#include "fuzz/targets.h"

#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "core/files.h"
#include "core/table_io.h"
#include "planner/config.h"
#include "planner/data.h"
#include "planner/megatron_import.h"
#include "planner/plan.h"
#include "planner/schedules.h"
#include "planner/validate.h"
#include "planner/yaml_doc.h"
#include "report/html_report.h"
#include "simulator/compare.h"
#include "simulator/metrics.h"

namespace pipeplan::fuzz {
namespace {

// Plans built from fuzzed configs stay small: the config check refuses any whose estimate
// is above this (kBytesPerOp per op), so one input costs milliseconds.
constexpr double kPlanBudgetBytes = 4 << 20;
// Plans read from fuzzed files are simulated only up to this many ops.
constexpr size_t kSimulateOps = 20000;

// A small multimodal config (1 node, pp 2, dp 2, 2 micro-batches) the manifest and
// calibration targets override.
constexpr const char* kBase = R"(cluster: {gpu: H100, nodes: 1, gpus_per_node: 4}
model:
  llm: {layers: 4, hidden: 256, ffn: 512, heads: 4, vocab: 1000}
  vision: {layers: 2, hidden: 128, mlp: 256, heads: 2, patch: 14, merge: 2}
parallelism: {tp: 1, pp: 2}
training: {seq_length: 2048, micro_batch_size: 1, microbatches: 2}
data:
  seed: 1
  text_tokens: 256
  images_per_sample: 1
  images: [{height: 224, width: 224, weight: 1}]
schedule: {pipeline: 1f1b, modality: nested}
)";

std::string Text(const uint8_t* data, size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

// A file with the input's bytes, for readers that take a path; removed when done.
class TempInput {
 public:
  TempInput(const uint8_t* data, size_t size, const char* ext)
      : path_("/tmp/pipeplan_fuzz_" + std::to_string(getpid()) + ext) {
    if (std::FILE* f = std::fopen(path_.c_str(), "wb")) {
      if (size > 0) std::fwrite(data, 1, size, f);
      std::fclose(f);
    }
  }
  ~TempInput() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Validates, then simulates a plan that passed (as `simulate` would after `validate`).
bool CheckAndSimulate(const Table& t) {
  if (!ValidatePlan(t).ok()) return false;
  if (t.size() > kSimulateOps) return true;
  SimOptions o;  // unit costs
  return RunSimulation(t, o).ok();
}

// The plan budget set for one input, the caller's restored after it.
class Budget {
 public:
  explicit Budget(double bytes) : saved_(MemoryBudgetBytes()) { SetMemoryBudgetBytes(bytes); }
  ~Budget() { SetMemoryBudgetBytes(saved_); }

 private:
  double saved_;
};

// Parses `doc` after `sets`; plans, validates and simulates what parses.
bool ParseAndPlan(YamlDoc doc, const std::vector<std::string>& sets) {
  for (const std::string& s : sets)
    if (!doc.ApplySet(s).ok()) return false;
  Budget small(kPlanBudgetBytes);
  auto c = ParseConfig(std::move(doc));
  if (!c.ok()) return false;
  auto t = BuildPlan(*c);
  return t.ok() && CheckAndSimulate(*t);
}

}  // namespace

bool YamlConfig(const uint8_t* data, size_t size) {
  std::string yaml;
  std::vector<std::string> sets;
  const std::string text = Text(data, size);
  size_t at = 0;
  while (at <= text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(at, end - at);
    if (line.rfind("%set ", 0) == 0)
      sets.push_back(line.substr(5));
    else
      yaml += line + "\n";
    at = end + 1;
  }
  auto doc = YamlDoc::FromString("fuzz.yaml", yaml);
  return doc.ok() && ParseAndPlan(std::move(doc).value(), sets);
}

bool ManifestJsonl(const uint8_t* data, size_t size) {
  TempInput in(data, size, ".jsonl");
  auto doc = YamlDoc::FromString("base.yaml", kBase);
  return doc.ok() && ParseAndPlan(std::move(doc).value(), {"data.manifest=" + in.path()});
}

bool CalibrationYaml(const uint8_t* data, size_t size) {
  auto cal = YamlDoc::FromString("calibration.yaml", Text(data, size));
  if (!cal.ok()) return false;
  auto leaves = cal->LeafAssignments();
  if (!leaves.ok()) return false;
  auto doc = YamlDoc::FromString("base.yaml", kBase);
  return doc.ok() && ParseAndPlan(std::move(doc).value(), *leaves);
}

bool PlanPb(const uint8_t* data, size_t size) {
  auto t = ParsePb(Text(data, size));
  return t.ok() && CheckAndSimulate(*t);
}

bool PlanJson(const uint8_t* data, size_t size) {
  auto t = FromJson(Text(data, size));
  return t.ok() && CheckAndSimulate(*t);
}

bool ChromeTrace(const uint8_t* data, size_t size) {
  return ReadTraceOps(Text(data, size)).ok();
}

bool TorchCsv(const uint8_t* data, size_t size) {
  const std::string text = Text(data, size);
  bool any = false;
  for (int pp = 2; pp <= 4; ++pp)
    for (int vp = 1; vp <= 2; ++vp)
      any = ParseTorchCsvSchedule(text, "fuzz.csv", pp, vp, 4).ok() || any;
  return any;
}

bool SweepCsv(const uint8_t* data, size_t size) {
  return SweepReportHtml("fuzz.csv", Text(data, size)).ok();
}

bool MegatronArgs(const uint8_t* data, size_t size) {
  auto imported = ImportMegatron(Text(data, size), "fuzz.sh", MegatronImportOptions{});
  if (!imported.ok()) return false;
  auto doc = YamlDoc::FromString("imported.yaml", imported->yaml);
  if (!doc.ok()) return false;
  // Accepted: a config as `import-megatron` checks it (the caller's plan budget); planned
  // when it also fits the small one (a real job's config seldom does).
  if (!ParseConfig(doc->Clone()).ok()) return false;
  ParseAndPlan(std::move(doc).value(), {});
  return true;
}

}  // namespace pipeplan::fuzz
