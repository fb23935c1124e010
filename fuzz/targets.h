// Fuzz targets: one per input format. Each takes arbitrary bytes and must return without
// crashing, hanging, leaking a library exception or tripping a sanitizer; a rejected input
// is fine. Each returns whether the input was accepted (read without error; for configs and
// plans, also planned or validated). libFuzzer drivers (fuzz/driver.cc, scripts/fuzz.sh) and the
// suite's replay of past crash inputs (tests/test_fuzz_inputs.cc) call the same functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace pipeplan::fuzz {

using Target = bool (*)(const uint8_t* data, size_t size);

// YAML config (lines "%set KEY=VALUE" are --set overrides): parse, and plan + validate +
// simulate what fits a small budget.
bool YamlConfig(const uint8_t* data, size_t size);
// Manifest JSONL of a small multimodal config: read, pack, place.
bool ManifestJsonl(const uint8_t* data, size_t size);
// Calibration YAML: its leaves as overrides of a small config (an empty file changes nothing).
bool CalibrationYaml(const uint8_t* data, size_t size);
// Plan files, protobuf and JSON: load, validate, and simulate what passes (small plans).
bool PlanPb(const uint8_t* data, size_t size);
bool PlanJson(const uint8_t* data, size_t size);
// Chrome trace JSON as `compare` reads it.
bool ChromeTrace(const uint8_t* data, size_t size);
// PyTorch pipelining CSV schedule (schedule.pipeline: csv) for pp 2..4.
bool TorchCsv(const uint8_t* data, size_t size);
// Megatron-LM launch script or argument list (import-megatron); accepted = imported into a
// valid config (planned too when it fits the small budget).
bool MegatronArgs(const uint8_t* data, size_t size);

// A sweep's CSV as `report` reads it; accepted = its page was written.
bool SweepCsv(const uint8_t* data, size_t size);

struct Named {
  std::string_view name;
  Target target;
};
inline constexpr Named kTargets[] = {
    {"config", YamlConfig},  {"manifest", ManifestJsonl}, {"calibration", CalibrationYaml},
    {"plan_pb", PlanPb},     {"plan_json", PlanJson},     {"trace", ChromeTrace},
    {"torch_csv", TorchCsv}, {"megatron", MegatronArgs},  {"sweep_csv", SweepCsv},
};

}  // namespace pipeplan::fuzz
