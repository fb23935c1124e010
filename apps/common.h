// Shared pieces of the subcommands: the command table entry, error reporting, input
// loading. Exit codes: 0 ok, 1 other failure, 2 bad input, 3 invalid plan.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/chrome_trace.h"
#include "core/status.h"
#include "core/table.h"
#include "planner/config.h"
#include "planner/plan.h"

namespace pipeplan {

struct Command {
  std::function<void(CLI::App*)> setup;  // adds options to the subcommand
  std::function<int()> run;              // runs it after parsing; returns the exit code
};

// Prints "pipeplan: error: ..." to stderr and returns the status's exit code.
int Report(const Status& s);
// Writes a trace: Perfetto's protobuf format when the name ends in .pftrace, else Chrome's
// JSON (streamed; gzipped when the name ends in .gz); a warning on stderr
// when it is larger than kTraceWarnBytes (with how to make it smaller).
inline constexpr size_t kTraceWarnBytes = size_t{256} << 20;
Status WriteTrace(const std::string& path, const Table& t, const Timeline& tl,
                  const std::vector<CounterTrack>& counters, const TraceOptions& o);

// A YAML config (planned now) or a plan file (.pb/.json); `config` is the one used.
struct Input {
  Table table;
  Config config;
  std::optional<MemoryChoice> memory;  // what `training.memory: auto` chose, if it ran
};
StatusOr<Input> LoadInput(const std::string& path, const std::vector<std::string>& sets);
bool IsConfigPath(const std::string& path);

bool StderrIsTerminal();

// A progress bar on stderr ("[###...] done/total points, elapsed, about ... left"), drawn
// only when stderr is a terminal; call it after each point (`what`: what is counted).
std::function<void(size_t, size_t)> PointProgress(const char* what = "points");

// One entry of a command-line tool: a subcommand, or (with an empty name) the tool's only
// command.
struct CommandEntry {
  const char* name;
  const char* help;
  Command cmd;
};
// Parses the command line and runs the chosen entry; every entry takes --max-memory.
// Running out of memory or threads ends in an error naming the cause, not an abort.
int RunCommandLine(CLI::App& app, std::vector<CommandEntry>& table, int argc, char** argv);

Command MakePlanCommand();
Command MakeImportMegatronCommand();
Command MakeValidateCommand();
Command MakeShowCommand();
Command MakeSimulateCommand();
Command MakeSweepCommand();
Command MakeTuneCommand();
Command MakeReportCommand();
Command MakeExecuteCommand();  // in pipeplan-execute only
inline constexpr const char* kExecuteHelp =
    "Run a plan: every rank's sequence, on the CPU (a tiny model, real numerics, --check "
    "against a sequential run) or on GPUs (CUDA, NCCL between processes)";
Command MakeCompareCommand();

}  // namespace pipeplan
