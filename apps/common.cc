#include "apps/common.h"

#include <fmt/format.h>
#include <unistd.h>

#include "core/files.h"
#include "core/table_io.h"
#include "planner/plan.h"

namespace pipeplan {

int Report(const Status& s) {
  fmt::print(stderr, "pipeplan: error: {}\n", s.message());
  return static_cast<int>(s.code());
}

bool IsConfigPath(const std::string& path) {
  auto ends = [&](std::string_view e) {
    return path.size() >= e.size() && path.compare(path.size() - e.size(), e.size(), e) == 0;
  };
  return ends(".yaml") || ends(".yml");
}

StatusOr<Input> LoadInput(const std::string& path, const std::vector<std::string>& sets) {
  if (IsConfigPath(path)) {
    ASSIGN_OR_RETURN(Config c, LoadConfig(path, sets));
    ASSIGN_OR_RETURN(Table t, BuildPlan(c));
    return Input{std::move(t), std::move(c)};
  }
  // A plan's structure is fixed; only the hardware it is simulated on may change.
  for (const std::string& s : sets)
    if (s.rfind("cluster.hardware.", 0) != 0)
      return InvalidInput(
          fmt::format("--set {}: a plan file only takes cluster.hardware.* overrides", s));
  ASSIGN_OR_RETURN(Table t, LoadPlan(path));
  ASSIGN_OR_RETURN(Config c, ConfigOfPlan(t, path, sets));
  return Input{std::move(t), std::move(c)};
}

bool StderrIsTerminal() {
  return isatty(STDERR_FILENO) == 1;
}

Status WriteTrace(const std::string& path, const std::string& json) {
  if (json.size() > kTraceWarnBytes)
    fmt::print(stderr,
               "warning: the trace is {:.0f} MiB; --trace-ranks / --trace-dp keep fewer ranks, a "
               ".json.gz name compresses it\n",
               json.size() / 1048576.0);
  const bool gz = path.size() > 3 && path.compare(path.size() - 3, 3, ".gz") == 0;
  if (!gz) return WriteFileAtomic(path, json);
  ASSIGN_OR_RETURN(std::string packed, Gzip(json));
  return WriteFileAtomic(path, packed);
}

}  // namespace pipeplan
