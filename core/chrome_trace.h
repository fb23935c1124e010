// Chrome trace (JSON object format, as Perfetto and chrome://tracing read it).
// One process per rank, one thread per stream (compute, vision, generator, pp send,
// pp recv, collectives; extra lanes "... #2" where ops of one stream overlap, so no slice
// of a thread overlaps or nests in another), complete events named in the op string form,
// flow arrows SEND -> RECV written after every slice (each binds to its slice), counter
// tracks. Timestamps in microseconds from the step start, rounded to whole nanoseconds;
// strings escaped by the JSON library; ops with a negative start never ran and are left
// out (partial traces of failed runs).
#pragma once

#include <string>
#include <vector>

#include "core/table.h"
#include "core/timeline.h"

namespace pipeplan {

// A counter track of one rank: samples[i] has one value per key at times_s[i].
struct CounterTrack {
  int32_t rank = 0;
  std::string name;               // e.g. "memory GiB"
  std::vector<std::string> keys;  // e.g. weights, act_text, total
  std::vector<double> times_s;
  std::vector<std::vector<double>> samples;
};

struct TraceOptions {
  std::vector<int32_t> ranks;                        // empty = all ranks
  std::vector<int32_t> dp_replicas;                  // empty = all replicas
  std::string source;                                // "simulated" or "measured"
  const std::vector<double>* predicted_s = nullptr;  // per-op predicted durations (args)
};

std::string ChromeTrace(const Table& t, const Timeline& tl,
                        const std::vector<CounterTrack>& counters, const TraceOptions& o);

}  // namespace pipeplan
