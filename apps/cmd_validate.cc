// pipeplan validate PLAN
#include <fmt/format.h>

#include <memory>
#include <nlohmann/json.hpp>

#include "apps/common.h"
#include "core/files.h"
#include "core/table_io.h"
#include "planner/validate.h"

namespace pipeplan {

Command MakeValidateCommand() {
  struct Options {
    std::string path;
    bool json = false;
  };
  auto o = std::make_shared<Options>();
  Command c;
  c.setup = [o](CLI::App* app) {
    app->add_option("plan", o->path, "plan file (.pb or .json)")->required();
    app->add_flag("--json", o->json, "print the verdict as JSON (also when invalid)");
  };
  c.run = [o]() -> int {
    auto t = LoadPlan(o->path);
    if (!t.ok()) return Report(t.status());
    Status s = ValidatePlan(*t);
    if (o->json) {
      nlohmann::json j = {{"plan", o->path},
                          {"valid", s.ok()},
                          {"ops", t->size()},
                          {"ranks", t->num_ranks()},
                          {"error", s.ok() ? "" : s.message()}};
      fmt::print("{}\n", DumpJson(j));
      return static_cast<int>(s.code());
    }
    if (!s.ok()) return Report(Status(s.code(), fmt::format("{}: {}", o->path, s.message())));
    fmt::print("{}: valid ({} ops, {} ranks)\n", o->path, t->size(), t->num_ranks());
    return 0;
  };
  return c;
}

}  // namespace pipeplan
