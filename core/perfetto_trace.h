// Perfetto's native trace format (protobuf TrackEvent, `.pftrace`): the same content as the
// Chrome trace (a process per rank, a track per lane of each kind of work, slices named in
// the op string form with their numbers as arguments, SEND -> RECV flows, memory counters)
// at about a third of the size, read by the Perfetto UI and trace processor without the
// JSON importer's limits. Packets are written in time order (ends before begins at one
// time), so every slice of a track closes before the next one opens.
#pragma once

#include <string>
#include <vector>

#include "core/chrome_trace.h"
#include "core/status.h"
#include "core/table.h"
#include "core/timeline.h"

namespace pipeplan {

// Writes the trace to `path` (atomically; gzipped when the name ends in .gz); returns the
// uncompressed bytes written.
StatusOr<size_t> WritePerfettoTrace(const std::string& path, const Table& t, const Timeline& tl,
                                    const std::vector<CounterTrack>& counters,
                                    const TraceOptions& o);

}  // namespace pipeplan
