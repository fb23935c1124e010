// pipeplan validate PLAN
#include <fmt/format.h>

#include <memory>

#include "apps/common.h"
#include "core/table_io.h"
#include "planner/validate.h"

namespace pipeplan {

Command MakeValidateCommand() {
  auto path = std::make_shared<std::string>();
  Command c;
  c.setup = [path](CLI::App* app) {
    app->add_option("plan", *path, "plan file (.pb or .json)")->required();
  };
  c.run = [path]() -> int {
    auto t = LoadPlan(*path);
    if (!t.ok()) return Report(t.status());
    if (Status s = ValidatePlan(*t); !s.ok())
      return Report(Status(s.code(), fmt::format("{}: {}", *path, s.message())));
    fmt::print("{}: valid ({} ops, {} ranks)\n", *path, t->size(), t->num_ranks());
    return 0;
  };
  return c;
}

}  // namespace pipeplan
