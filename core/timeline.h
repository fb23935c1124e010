// A timeline: start and end of every op of a table, in seconds from the step start.
// The simulator predicts one; the executor measures one. Same type, same trace writer.
#pragma once

#include <algorithm>
#include <vector>

namespace pipeplan {

struct Timeline {
  std::vector<double> start;  // seconds; negative = the op never ran (measured timelines)
  std::vector<double> end;    // seconds
  double Makespan() const;    // latest end, seconds
};

}  // namespace pipeplan
