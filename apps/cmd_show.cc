// pipeplan show PLAN|CONFIG [--rank R]
#include <fmt/format.h>

#include <memory>
#include <nlohmann/json.hpp>

#include "apps/common.h"
#include "core/files.h"

namespace pipeplan {

Command MakeShowCommand() {
  struct Options {
    std::string input;
    int rank = -1;
    std::vector<std::string> sets;
    bool json = false;
  };
  auto o = std::make_shared<Options>();
  Command c;
  c.setup = [o](CLI::App* app) {
    app->add_option("input", o->input, "plan file or YAML config")->required();
    app->add_option("--rank", o->rank, "only this rank");
    app->add_option("--set", o->sets, "override a config key (configs only)");
    app->add_flag("--json", o->json, "print the ranks and their op strings as JSON");
  };
  c.run = [o]() -> int {
    auto in = LoadInput(o->input, o->sets);
    if (!in.ok()) return Report(in.status());
    const Table& t = in->table;
    if (o->rank < -1 || o->rank >= t.num_ranks())
      return Report(
          InvalidInput(fmt::format("--rank {}: the plan has {} ranks", o->rank, t.num_ranks())));
    if (o->json) {
      nlohmann::json ranks = nlohmann::json::array();
      for (int32_t r = 0; r < t.num_ranks(); ++r) {
        if (o->rank >= 0 && r != o->rank) continue;
        nlohmann::json ops = nlohmann::json::array();
        for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i) ops.push_back(t.str(i));
        ranks.push_back({{"rank", r},
                         {"dp", t.ranks()[r].dp},
                         {"pp", t.ranks()[r].pp},
                         {"ops", std::move(ops)}});
      }
      fmt::print("{}\n", DumpJson(nlohmann::json{{"ranks", std::move(ranks)}}));
      return 0;
    }
    std::string out;
    for (int32_t r = 0; r < t.num_ranks(); ++r) {
      if (o->rank >= 0 && r != o->rank) continue;
      const RankInfo& ri = t.ranks()[r];
      out += fmt::format("rank {} (dp {}, pp {}): {} ops\n", r, ri.dp, ri.pp,
                         t.rank_end(r) - t.rank_begin(r));
      for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i) out += fmt::format("  {}\n", t.str(i));
    }
    fmt::print("{}", out);
    return 0;
  };
  return c;
}

}  // namespace pipeplan
