// pipeplan: plan, validate, show, simulate and sweep pipeline-parallel schedules.
// `pipeplan execute` runs pipeplan-execute (beside this binary), the only part linked with
// the GPU backends and MPI: the other commands start without loading them.
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string_view>

#include "apps/common.h"
#include "core/version.h"

namespace {

// Replaces this process with pipeplan-execute (same arguments after "execute"); returns
// only on failure.
int RunExecute(int argc, char** argv) {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  const std::string path =
      (ec ? std::filesystem::path(argv[0]) : self).parent_path() / "pipeplan-execute";
  std::vector<char*> args{const_cast<char*>(path.c_str())};
  for (int i = 2; i < argc; ++i) args.push_back(argv[i]);
  args.push_back(nullptr);
  execv(path.c_str(), args.data());
  fmt::print(stderr, "pipeplan: error: execute runs {}, which cannot be started: {}\n", path,
             std::strerror(errno));
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace pipeplan;
  if (argc >= 2 && std::string_view(argv[1]) == "execute") return RunExecute(argc, argv);
  CLI::App app{"pipeplan: plan, simulate and execute pipeline-parallel training schedules"};
  app.set_version_flag("--version", kVersion);
  app.require_subcommand(1);
  std::vector<CommandEntry> table = {
      {"plan", "Build the operator table of a config", MakePlanCommand()},
      {"validate", "Check a plan: dependencies, SEND/RECV pairs, data flow, no deadlock",
       MakeValidateCommand()},
      {"show", "Print per-rank op sequences of a config or plan", MakeShowCommand()},
      {"simulate", "Simulate a config or plan: step time, bubbles, memory, MFU, trace",
       MakeSimulateCommand()},
      {"sweep", "Plan and simulate a grid of config variations", MakeSweepCommand()},
      {"tune",
       "Search parallelism, micro-batch size, recompute, schedule and policy for the best step",
       MakeTuneCommand()},
      {"report", "Write an HTML report of a simulated step or of a sweep's CSV",
       MakeReportCommand()},
      // Handled above; listed here for --help (pipeplan execute --help shows its options).
      {"execute", kExecuteHelp, {[](CLI::App* sub) { sub->allow_extras(); }, [] { return 2; }}},
      {"compare", "Line up a simulated and a measured trace; fit a calibration",
       MakeCompareCommand()},
      {"import-megatron", "Write a pipeplan config from a Megatron-LM launch script or arguments",
       MakeImportMegatronCommand()},
  };
  return RunCommandLine(app, table, argc, argv);
}
