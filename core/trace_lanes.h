// Where a trace draws each op, shared by the Chrome JSON and Perfetto protobuf writers: a
// rank has one track per kind of work (compute, vision, generator, pp send, pp recv,
// collectives, host copies), split into lanes so that no two slices of one lane overlap or nest (an
// op goes to the first lane of its track free at its start, in whole nanoseconds).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/chrome_trace.h"
#include "core/table.h"
#include "core/timeline.h"

namespace pipeplan::trace {

enum Track { kCompute = 0, kVision, kGenerator, kSend, kRecv, kColl, kCopy, kNumTracks };
inline constexpr const char* kTrackNames[kNumTracks] = {
    "compute", "vision", "generator", "pp send", "pp recv", "collectives", "host copies"};
inline constexpr int32_t kMaxLanes = 10000;  // per track; ops beyond share the last lane

Track TrackOf(const Table& t, OpId i);

// Times in traces are whole nanoseconds: Perfetto rounds to nanoseconds on import, and
// slices that touch would otherwise overlap by one.
int64_t Ns(double seconds);

// `v` as printf's %.6g writes it (six significant digits, trailing zeros dropped; fmt's
// {:.6g} is the same), into `out` (32 bytes); returns the end of the text.
char* General6(double v, char* out);

// The name of lane `lane` of track `tr`: "compute", then "compute #2", ...
std::string LaneName(int tr, int32_t lane);

// A rank's process name: "rank R [dp D pp P; G GPUs from GPU F]".
std::string RankLabel(const Table& t, int32_t rank);

// The ranks a trace shows (TraceOptions::ranks and dp_replicas; empty = all).
std::vector<uint8_t> IncludedRanks(const Table& t, const TraceOptions& o);

struct Lanes {
  std::vector<int32_t> lane;                           // per op; -1 = not drawn
  std::vector<std::array<int32_t, kNumTracks>> count;  // per rank: lanes of each track
};
// Lanes of the ops that ran (start >= 0) on the included ranks.
Lanes AssignLanes(const Table& t, const Timeline& tl, const std::vector<uint8_t>& include);

}  // namespace pipeplan::trace
