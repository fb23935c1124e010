// Test helpers: configs from inline YAML, tables written op by op, running the CLI.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/table.h"
#include "planner/config.h"

namespace pipeplan::test {

// A small text-only config: `pp` stages, `vp` chunks, `m` micro-batches, dp replicas,
// tp = 1, one GPU per rank, 2 layers per chunk. `sets` are applied like --set.
Config SmallConfig(PipelineKind kind, int pp, int vp, int m, int dp = 1,
                   std::vector<std::string> sets = {});
// The small multimodal config of the executor tests: pp = 4, 8 micro-batches, images of
// 224^2 and 2048^2 (the large ones split by dynamic CP), `policy` placing the encoder.
Config MultimodalConfig(const std::string& policy, std::vector<std::string> sets = {});
Config ParseYaml(const std::string& yaml, std::vector<std::string> sets = {});
Table Plan(const Config& c);
// Rank r's ops that `keep` selects, in sequence order.
std::vector<OpId> RankOps(const Table& t, int32_t rank, const std::function<bool(OpId)>& keep);

// Builds a table from per-rank op strings. SEND/RECV are paired in order of appearance by
// (sender, receiver, direction, micro-batch); collectives get CollectiveTag(kind, chunk).
// F/B ops get 1 unit of work; groups are given as member lists.
Table TableFromOps(const std::vector<std::vector<std::string>>& ranks, int pp, int vp, int m,
                   std::vector<std::vector<int32_t>> groups = {});
// Returns the table with an extra dependency op -> on.
Table WithDep(const Table& t, OpId op, OpId on);
OpId Find(const Table& t, const std::string& op);

// The rules Perfetto's JSON importer applies (an empty string when all hold, else the
// first broken one): times in whole nanoseconds; slices of one thread never overlap or
// nest; each flow start lies in a slice of its thread (and each flow end, bound "e", in
// one of its thread) that the file has written before it.
std::string TraceRuleBroken(const std::string& trace_json);
// The same for a trace file (gunzipped first when it ends in .gz).
std::string TraceFileRuleBroken(const std::string& path);

// The same rules for a Perfetto protobuf trace (.pftrace), read packet by packet: every
// event on a track described before it, in non-decreasing time; on each track a slice
// opens only when none is open and ends before the next opens (so slices never overlap or
// nest), and all are closed at the end; interned iids defined by the sequence's first
// packet; each flow starts once and terminates once, after its start, on slice begins.
struct PftraceCounts {
  size_t slices = 0, flows = 0, counter_values = 0;
  std::vector<std::string> names;  // slice names, in file order
};
std::string PftraceRuleBroken(const std::string& path, PftraceCounts* counts);

struct RunResult {
  int exit_code;
  std::string out;  // stdout + stderr
};
RunResult RunCli(const std::string& args);  // the pipeplan binary with these arguments
RunResult RunShell(const std::string& command);
std::string TempDir();
std::string Slurp(const std::string& path);
bool Exists(const std::string& path);

}  // namespace pipeplan::test
