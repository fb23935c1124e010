// Plan files: binary protobuf (.pb), JSON (.json) and PyTorch-pipelining CSV (.csv,
// write-only: compute actions per rank, `<stage><F|B|I|W><mb>`, stage = chunk*pp + pp rank).
#pragma once

#include <string>

#include "core/status.h"
#include "core/table.h"

namespace pipeplan {

enum class PlanFormat { kPb, kJson, kTorchCsv };

StatusOr<PlanFormat> ParsePlanFormat(const std::string& name);
// By extension (.pb, .json, .csv); "-" is JSON; a device or FIFO protobuf; an error
// for any other name (say --format).
StatusOr<PlanFormat> FormatFromPath(const std::string& path);

std::string SerializePb(const Table& t);
StatusOr<Table> ParsePb(const std::string& bytes);
std::string ToJson(const Table& t);
StatusOr<Table> FromJson(const std::string& text);
std::string ToTorchCsv(const Table& t);

Status SavePlan(const Table& t, const std::string& path, PlanFormat format);
// Reads .pb or .json (detected from content); `path` names errors.
StatusOr<Table> LoadPlan(const std::string& path);

}  // namespace pipeplan
