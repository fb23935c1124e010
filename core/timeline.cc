#include "core/timeline.h"

namespace pipeplan {

double Timeline::Makespan() const {
  double m = 0;
  for (double e : end) m = std::max(m, e);
  return m;
}

}  // namespace pipeplan
