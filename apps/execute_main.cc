// pipeplan-execute: `pipeplan execute`, linked with the executor's backends (CPU, and CUDA,
// NCCL and MPI where they were built). `pipeplan execute ARGS` runs this binary with ARGS.
#include <CLI/CLI.hpp>

#include "apps/common.h"
#include "core/version.h"

int main(int argc, char** argv) {
  using namespace pipeplan;
  CLI::App app{kExecuteHelp, "pipeplan execute"};
  app.set_version_flag("--version", kVersion);
  std::vector<CommandEntry> table = {{"", kExecuteHelp, MakeExecuteCommand()}};
  return RunCommandLine(app, table, argc, argv);
}
