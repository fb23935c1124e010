// Chrome trace (JSON object format, as Perfetto and chrome://tracing read it).
// One process per rank, one thread per stream (compute, vision, generator, pp send,
// pp recv, collectives; extra lanes "... #2" where ops of one stream overlap, so no slice
// of a thread overlaps or nests in another), complete events named in the op string form,
// flow arrows SEND -> RECV written after every slice (each binds to its slice), counter
// tracks. Timestamps in microseconds from the step start, rounded to whole nanoseconds;
// strings escaped by the JSON library; ops with a negative start never ran and are left
// out (partial traces of failed runs).
#pragma once

#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
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

// The trace, handed to `sink` in pieces (about 1 MiB each): nothing but the op-to-lane
// map (8 bytes per op) and one piece are held in memory. Stops at the sink's first error.
Status StreamChromeTrace(const Table& t, const Timeline& tl,
                         const std::vector<CounterTrack>& counters, const TraceOptions& o,
                         const std::function<Status(std::string_view)>& sink);
// The whole trace as one string (tests; small plans).
std::string ChromeTrace(const Table& t, const Timeline& tl,
                        const std::vector<CounterTrack>& counters, const TraceOptions& o);
// Streams the trace to `path` (atomically; gzipped when the name ends in .gz); returns the
// uncompressed bytes written.
StatusOr<size_t> WriteChromeTrace(const std::string& path, const Table& t, const Timeline& tl,
                                  const std::vector<CounterTrack>& counters, const TraceOptions& o);

// A trace written while a process runs its ops: Chrome's JSON array format, one complete
// event per op appended and flushed to the file (write(2)) as the op ends, so a process
// that dies (SIGKILL, a launcher cancelling the job) leaves the events of every op it
// finished. The format lets the closing bracket be missing for exactly this; Perfetto,
// chrome://tracing and `compare` read it. The final trace of a run is written atomically as
// usual; a journal is the record of a run that did not get there.
class TraceJournal {
 public:
  // Starts `path` (replacing it) for `rank`'s ops of `t`.
  static StatusOr<std::unique_ptr<TraceJournal>> Open(const std::string& path, const Table& t,
                                                      int32_t rank);
  ~TraceJournal();
  TraceJournal(const TraceJournal&) = delete;
  TraceJournal& operator=(const TraceJournal&) = delete;
  // Op i ran [start_s, end_s] (seconds from the run's start). Best effort: a failed write is
  // not the run's failure.
  void Append(OpId i, double start_s, double end_s);
  // The run reached its end: the journal is not needed.
  void Remove();

 private:
  TraceJournal(const Table& t, std::string path, std::FILE* f)
      : t_(t), path_(std::move(path)), f_(f) {}
  const Table& t_;
  std::string path_;
  std::FILE* f_;
};

}  // namespace pipeplan
