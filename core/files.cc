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
#include <nlohmann/json.hpp>

namespace pipeplan {

StatusOr<std::string> ReadFile(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr)
    return InvalidInput(fmt::format("{}: cannot read file: {}", path, std::strerror(errno)));
  std::string out;
  struct stat st;
  if (fstat(fileno(f), &st) == 0 && S_ISREG(st.st_mode))
    out.reserve(static_cast<size_t>(st.st_size));  // one buffer for a regular file
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) return InvalidInput(fmt::format("{}: read error", path));
  return out;
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

}  // namespace

Status WriteFileAtomic(const std::string& path, const std::string& contents) {
  OutputFile f;
  RETURN_IF_ERROR(f.Open(path));
  RETURN_IF_ERROR(f.Write(contents));
  return f.Commit();
}

OutputFile::~OutputFile() {
  if (z_ != nullptr) {
    deflateEnd(static_cast<z_stream*>(z_));
    delete static_cast<z_stream*>(z_);
  }
  if (f_ != nullptr && f_ != stdout) std::fclose(f_);
  if (f_ != nullptr && !direct_) {  // never committed: no half-written file
    std::remove(tmp_.c_str());
    g_tmp_live = 0;
  }
}

Status OutputFile::Fail(const char* what) {
  failed_ = true;
  return Internal(fmt::format("{}: {}: {}", path_, what, std::strerror(errno)));
}

Status OutputFile::Open(const std::string& path, bool gzip) {
  path_ = target_ = path;
  if (gzip) {
    auto* z = new z_stream{};
    z_ = z;
    // windowBits 15 + 16: a gzip header and trailer around the deflate stream.
    if (deflateInit2(z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK)
      return Internal("zlib: deflateInit2 failed");
  }
  if (path == "-") {
    f_ = stdout, direct_ = true;
    return Status::Ok();
  }
  struct stat st;
  if (lstat(path.c_str(), &st) == 0) {
    if (S_ISLNK(st.st_mode)) {  // replace what the link points to (even missing), keep it
      char link[4096];
      const ssize_t n = readlink(path.c_str(), link, sizeof(link) - 1);
      if (n > 0) {
        link[n] = 0;
        const size_t slash = path.rfind('/');
        target_ = link[0] == '/' || slash == std::string::npos ? std::string(link)
                                                               : path.substr(0, slash + 1) + link;
      }
      if (stat(target_.c_str(), &st) != 0) st.st_mode = S_IFREG;
    }
    if (!S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)) {  // a device, FIFO or socket: write to it
      f_ = std::fopen(target_.c_str(), "wb");
      if (f_ == nullptr) return Fail("cannot write");
      direct_ = true;
      return Status::Ok();
    }
  }
  tmp_ = fmt::format("{}.tmp.{}", target_, static_cast<long>(getpid()));
  if (tmp_.size() < sizeof(g_tmp)) {
    static bool installed = false;
    if (!installed) {
      signal(SIGINT, RemoveTmpAndDie), signal(SIGTERM, RemoveTmpAndDie);
      installed = true;
    }
    std::memcpy(g_tmp, tmp_.c_str(), tmp_.size() + 1);
    g_tmp_live = 1;
  }
  f_ = std::fopen(tmp_.c_str(), "wb");
  if (f_ == nullptr) {
    g_tmp_live = 0;
    return Fail("cannot write");
  }
  return Status::Ok();
}

Status OutputFile::Put(const void* data, size_t n) {
  if (n > 0 && std::fwrite(data, 1, n, f_) != n) return Fail("write failed");
  return Status::Ok();
}

Status OutputFile::Write(std::string_view data) {
  if (f_ == nullptr || failed_) return Internal(fmt::format("{}: not open for writing", path_));
  bytes_ += data.size();
  if (z_ == nullptr) return Put(data.data(), data.size());
  auto* z = static_cast<z_stream*>(z_);
  unsigned char out[1 << 16];
  while (!data.empty()) {
    const size_t n = std::min<size_t>(data.size(), 1u << 30);
    z->next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
    z->avail_in = static_cast<uInt>(n);
    do {
      z->next_out = out, z->avail_out = sizeof(out);
      if (deflate(z, Z_NO_FLUSH) == Z_STREAM_ERROR) return Internal("zlib: deflate failed");
      RETURN_IF_ERROR(Put(out, sizeof(out) - z->avail_out));
    } while (z->avail_out == 0);
    data.remove_prefix(n);
  }
  return Status::Ok();
}

Status OutputFile::Commit() {
  if (f_ == nullptr || failed_) return Internal(fmt::format("{}: not open for writing", path_));
  if (z_ != nullptr) {
    auto* z = static_cast<z_stream*>(z_);
    unsigned char out[1 << 16];
    int rc = Z_OK;
    z->avail_in = 0;
    while (rc != Z_STREAM_END) {
      z->next_out = out, z->avail_out = sizeof(out);
      rc = deflate(z, Z_FINISH);
      if (rc == Z_STREAM_ERROR) return Internal("zlib: deflate did not finish");
      RETURN_IF_ERROR(Put(out, sizeof(out) - z->avail_out));
    }
  }
  FILE* f = f_;
  f_ = nullptr;
  if (direct_) {
    if ((f == stdout ? std::fflush(f) : std::fclose(f)) != 0) return Fail("write failed");
    return Status::Ok();
  }
  Status s = std::fclose(f) == 0 ? Status::Ok() : Fail("write failed");
  if (s.ok() && std::rename(tmp_.c_str(), target_.c_str()) != 0) s = Fail("write failed");
  if (!s.ok()) std::remove(tmp_.c_str());
  g_tmp_live = 0;
  return s;
}

std::string DumpJson(const nlohmann::json& j, int indent) {
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace pipeplan
