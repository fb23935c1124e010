// Plan files: binary protobuf (.pb) and JSON (.json). PyTorch pipelining's CSV (.csv) is
// core/torch_csv.h; its format names live here so that the CLI picks a writer by name.
#pragma once

#include <string>

#include "core/status.h"
#include "core/table.h"

namespace pipeplan {

// kTorchCsv: compute actions only; kTorchCsvComms: with SEND/RECV actions; kChakra: one
// Chakra execution trace per rank (core/chakra.h), the output name a prefix.
enum class PlanFormat { kPb, kJson, kTorchCsv, kTorchCsvComms, kChakra };

StatusOr<PlanFormat> ParsePlanFormat(const std::string& name);
// By extension (.pb, .json, .csv, .et: Chakra); "-" is JSON; a device or FIFO protobuf; an error
// for any other name (say --format).
StatusOr<PlanFormat> FormatFromPath(const std::string& path);

std::string SerializePb(const Table& t);
StatusOr<Table> ParsePb(const std::string& bytes);
std::string ToJson(const Table& t);
StatusOr<Table> FromJson(const std::string& text);

// Writes .pb or .json (CSV and Chakra are an error: see core/torch_csv.h, core/chakra.h).
Status SavePlan(const Table& t, const std::string& path, PlanFormat format);
// Reads .pb or .json (detected from content); `path` names errors.
StatusOr<Table> LoadPlan(const std::string& path);

}  // namespace pipeplan
