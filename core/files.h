// Whole-file I/O. Writes to a regular file are atomic: a temp file beside the target, then
// rename, so a failed or interrupted run (SIGINT, SIGTERM: the temp file is removed) never
// leaves a half-written output. A symlink keeps pointing at the replaced file; a device,
// FIFO or socket is written directly; "-" is standard output.
#pragma once

#include <string>

#include "core/status.h"

namespace pipeplan {

StatusOr<std::string> ReadFile(const std::string& path);

// JSON we read nests a few levels; deeper input (which recursive writers and destructors
// would follow down the stack) is refused before parsing. Counts [ and { outside strings.
inline constexpr int kMaxJsonDepth = 64;
Status CheckJsonDepth(std::string_view text, int max_depth = kMaxJsonDepth);
Status WriteFileAtomic(const std::string& path, const std::string& contents);
// gzip (RFC 1952) of `data`, as gzip -6 writes it.
StatusOr<std::string> Gzip(std::string_view data);

}  // namespace pipeplan
