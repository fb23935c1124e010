// pipeplan: plan, validate, show, simulate and sweep pipeline-parallel schedules.
#include <fmt/format.h>

#include <CLI/CLI.hpp>

#include "apps/common.h"
#include "core/version.h"
#include "planner/config.h"

int main(int argc, char** argv) {
  using namespace pipeplan;
  CLI::App app{"pipeplan: plan, simulate and execute pipeline-parallel training schedules"};
  app.set_version_flag("--version", kVersion);
  app.require_subcommand(1);
  struct Entry {
    const char* name;
    const char* help;
    Command cmd;
  };
  std::vector<Entry> table = {
      {"plan", "Build the operator table of a config", MakePlanCommand()},
      {"validate", "Check a plan: dependencies, SEND/RECV pairs, data flow, no deadlock",
       MakeValidateCommand()},
      {"show", "Print per-rank op sequences of a config or plan", MakeShowCommand()},
      {"simulate", "Simulate a config or plan: step time, bubbles, memory, MFU, trace",
       MakeSimulateCommand()},
      {"sweep", "Plan and simulate a grid of config variations", MakeSweepCommand()},
      {"execute",
       "Run a plan: every rank's sequence, on the CPU (a tiny model, real numerics, --check "
       "against a sequential run) or on GPUs (CUDA, NCCL between processes)",
       MakeExecuteCommand()},
      {"compare", "Line up a simulated and a measured trace; fit a calibration",
       MakeCompareCommand()},
      {"import-megatron", "Write a pipeplan config from a Megatron-LM launch script or arguments",
       MakeImportMegatronCommand()},
  };
  std::vector<CLI::App*> subs;
  double max_memory_gib = 0;
  for (Entry& e : table) {
    CLI::App* sub = app.add_subcommand(e.name, e.help);
    sub->option_defaults()->always_capture_default();  // --help shows every default
    e.cmd.setup(sub);
    sub->add_option("--max-memory", max_memory_gib,
                    "GiB a plan may take (estimated before it is built; default: half the "
                    "machine's memory)")
        ->check(CLI::Range(1e-6, 1e9));
    subs.push_back(sub);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  }
  if (max_memory_gib > 0) SetMemoryBudgetBytes(max_memory_gib * (1 << 30));
  // Running out of memory or threads ends in an error naming the cause, not an abort.
  try {
    for (size_t i = 0; i < table.size(); ++i)
      if (subs[i]->parsed()) return table[i].cmd.run();
  } catch (const std::bad_alloc&) {
    fmt::print(stderr,
               "pipeplan: error: out of memory (make the plan smaller, or see "
               "--max-memory)\n");
    return 1;
  } catch (const std::system_error& e) {
    fmt::print(stderr, "pipeplan: error: the system refused a resource: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "pipeplan: error: internal error: {}\n", e.what());
    return 1;
  }
  return 2;
}
