#include "apps/common.h"

#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <new>
#include <system_error>

#include "core/files.h"
#include "core/perfetto_trace.h"
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
    MemoryChoice choice;
    ASSIGN_OR_RETURN(Table t, BuildPlan(c, &choice));
    std::optional<MemoryChoice> memory;
    if (c.training.memory_auto) c = WithChoice(std::move(c), choice), memory = std::move(choice);
    return Input{std::move(t), std::move(c), std::move(memory)};
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

std::function<void(size_t, size_t)> PointProgress(const char* what) {
  if (!StderrIsTerminal()) return nullptr;
  const auto start = std::chrono::steady_clock::now();
  return [start, what](size_t done, size_t total) {
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double left = done > 0 ? elapsed / done * (total - done) : 0;
    const int width = 30, filled = total > 0 ? static_cast<int>(width * done / total) : width;
    fmt::print(stderr, "\r[{}{}] {}/{} {}, {:.0f} s elapsed, about {:.0f} s left   ",
               std::string(filled, '#'), std::string(width - filled, '.'), done, total, what,
               elapsed, left);
    if (done == total) fmt::print(stderr, "\n");
  };
}

Status WriteTrace(const std::string& path, const Table& t, const Timeline& tl,
                  const std::vector<CounterTrack>& counters, const TraceOptions& o) {
  const std::string_view name(path);
  const bool perfetto = name.ends_with(".pftrace") || name.ends_with(".pftrace.gz");
  ASSIGN_OR_RETURN(size_t bytes, perfetto ? WritePerfettoTrace(path, t, tl, counters, o)
                                          : WriteChromeTrace(path, t, tl, counters, o));
  if (bytes > kTraceWarnBytes)
    fmt::print(stderr,
               "warning: the trace is {:.0f} MiB; --trace-ranks / --trace-dp keep fewer ranks, "
               "{}\n",
               bytes / 1048576.0,
               perfetto ? "a .pftrace.gz name compresses it"
                        : "a .pftrace name (Perfetto's protobuf format) is about a third the size, "
                          "a .json.gz name compresses it");
  return Status::Ok();
}

int RunCommandLine(CLI::App& app, std::vector<CommandEntry>& table, int argc, char** argv) {
  std::vector<CLI::App*> subs;
  double max_memory_gib = 0;
  for (CommandEntry& e : table) {
    CLI::App* sub = *e.name ? app.add_subcommand(e.name, e.help) : &app;
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

}  // namespace pipeplan
