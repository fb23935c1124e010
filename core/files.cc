#include "core/files.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace pipeplan {

StatusOr<std::string> Gzip(std::string_view data) {
  z_stream z{};
  // windowBits 15 + 16: a gzip header and trailer around the deflate stream.
  if (deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK)
    return Internal("zlib: deflateInit2 failed");
  std::string out(deflateBound(&z, data.size()) + 64, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
  z.avail_in = static_cast<uInt>(data.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  const int rc = deflate(&z, Z_FINISH);
  const size_t n = z.total_out;
  deflateEnd(&z);
  if (rc != Z_STREAM_END) return Internal("zlib: deflate did not finish");
  out.resize(n);
  return out;
}

StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return InvalidInput(fmt::format("{}: cannot read file: {}", path, std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return InvalidInput(fmt::format("{}: read error", path));
  return ss.str();
}

Status CheckJsonDepth(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char ch : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (ch == '\\')
        escaped = true;
      else if (ch == '"')
        in_string = false;
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '[' || ch == '{') {
      if (++depth > max_depth)
        return InvalidInput(fmt::format("JSON nested more than {} levels deep", max_depth));
    } else if (ch == ']' || ch == '}') {
      --depth;
    }
  }
  return Status::Ok();
}

namespace {

// The temp file being written, removed if SIGINT or SIGTERM ends the process meanwhile.
char g_tmp[4096];
volatile sig_atomic_t g_tmp_live = 0;

void RemoveTmpAndDie(int sig) {
  if (g_tmp_live) unlink(g_tmp);
  signal(sig, SIG_DFL);
  raise(sig);
}

Status WriteAll(FILE* f, const std::string& path, const std::string& contents, bool close) {
  bool ok = std::fwrite(contents.data(), 1, contents.size(), f) == contents.size();
  ok = (close ? std::fclose(f) == 0 : std::fflush(f) == 0) && ok;
  if (!ok) return Internal(fmt::format("{}: write failed: {}", path, std::strerror(errno)));
  return Status::Ok();
}

}  // namespace

Status WriteFileAtomic(const std::string& path, const std::string& contents) {
  if (path == "-") return WriteAll(stdout, path, contents, false);
  std::string target = path;
  struct stat st;
  if (lstat(path.c_str(), &st) == 0) {
    if (S_ISLNK(st.st_mode)) {  // replace what the link points to (even missing), keep it
      char link[4096];
      const ssize_t n = readlink(path.c_str(), link, sizeof(link) - 1);
      if (n > 0) {
        link[n] = 0;
        const size_t slash = path.rfind('/');
        target = link[0] == '/' || slash == std::string::npos ? std::string(link)
                                                              : path.substr(0, slash + 1) + link;
      }
      if (stat(target.c_str(), &st) != 0) st.st_mode = S_IFREG;
    }
    if (!S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)) {  // a device, FIFO or socket: write to it
      FILE* f = std::fopen(target.c_str(), "wb");
      if (f == nullptr)
        return Internal(fmt::format("{}: cannot write: {}", path, std::strerror(errno)));
      return WriteAll(f, path, contents, true);
    }
  }
  std::string tmp = fmt::format("{}.tmp.{}", target, static_cast<long>(getpid()));
  if (tmp.size() < sizeof(g_tmp)) {
    static bool installed = false;
    if (!installed) {
      signal(SIGINT, RemoveTmpAndDie), signal(SIGTERM, RemoveTmpAndDie);
      installed = true;
    }
    std::memcpy(g_tmp, tmp.c_str(), tmp.size() + 1);
    g_tmp_live = 1;
  }
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    g_tmp_live = 0;
    return Internal(fmt::format("{}: cannot write: {}", path, std::strerror(errno)));
  }
  Status s = WriteAll(f, path, contents, true);
  if (s.ok() && std::rename(tmp.c_str(), target.c_str()) != 0)
    s = Internal(fmt::format("{}: write failed: {}", path, std::strerror(errno)));
  if (!s.ok()) std::remove(tmp.c_str());
  g_tmp_live = 0;
  return s;
}

}  // namespace pipeplan
