// Whole-file I/O. Writes to a regular file are atomic: a temp file beside the target, then
// rename, so a failed or interrupted run (SIGINT, SIGTERM: the temp file is removed) never
// leaves a half-written output. A symlink keeps pointing at the replaced file; a device,
// FIFO or socket is written directly; "-" is standard output.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>

#include "core/status.h"

namespace pipeplan {

StatusOr<std::string> ReadFile(const std::string& path);

// JSON we read nests a few levels; deeper input (which recursive writers and destructors
// would follow down the stack) is refused before parsing. Counts [ and { outside strings.
inline constexpr int kMaxJsonDepth = 64;
Status CheckJsonDepth(std::string_view text, int max_depth = kMaxJsonDepth);
// JSON text of `j` (indent < 0: one line); strings that are not UTF-8 (a config or CSV may
// hold any bytes) have those bytes replaced by U+FFFD instead of throwing.
std::string DumpJson(const nlohmann::json& j, int indent = 1);
Status WriteFileAtomic(const std::string& path, const std::string& contents);

// A file written in pieces (streamed: what is written is not held in memory), with the
// same atomic replacement as WriteFileAtomic; gzip-compressed on the way when `gzip`.
// Nothing replaces the target until Commit succeeds; a destroyed uncommitted file is
// removed.
class OutputFile {
 public:
  OutputFile() = default;
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  ~OutputFile();
  Status Open(const std::string& path, bool gzip = false);
  Status Write(std::string_view data);
  Status Commit();
  size_t bytes_written() const { return bytes_; }  // before compression

 private:
  Status Fail(const char* what);
  Status Put(const void* data, size_t n);
  std::string path_, target_, tmp_;
  FILE* f_ = nullptr;
  bool direct_ = false;  // stdout, a device, FIFO or socket: written as is
  bool failed_ = false;
  void* z_ = nullptr;  // z_stream while gzipping
  size_t bytes_ = 0;
};

}  // namespace pipeplan
