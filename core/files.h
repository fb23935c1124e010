// Whole-file I/O. Writes are atomic: a temp file beside the target, then rename, so a
// failed run never leaves a half-written output.
#pragma once

#include <string>

#include "core/status.h"

namespace pipeplan {

StatusOr<std::string> ReadFile(const std::string& path);
Status WriteFileAtomic(const std::string& path, const std::string& contents);

}  // namespace pipeplan
