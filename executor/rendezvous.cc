#include "executor/rendezvous.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <thread>

#include "core/files.h"
#include "executor/deadline.h"

namespace pipeplan {
namespace {

constexpr char kMagic[] = "pipeplan-nccl-id";

std::string Hex(const std::string& bytes) {
  std::string out;
  for (unsigned char c : bytes) out += fmt::format("{:02x}", c);
  return out;
}

bool Unhex(const std::string& hex, std::string* bytes) {
  if (hex.size() % 2) return false;
  bytes->clear();
  for (size_t i = 0; i < hex.size(); i += 2) {
    char* end = nullptr;
    const std::string pair = hex.substr(i, 2);
    long v = std::strtol(pair.c_str(), &end, 16);
    if (end != pair.c_str() + 2) return false;
    bytes->push_back(static_cast<char>(v));
  }
  return true;
}

}  // namespace

std::string DefaultRendezvousKey() {
  const char* job = std::getenv("SLURM_JOB_ID");
  const char* step = std::getenv("SLURM_STEP_ID");
  if (job == nullptr) return "";
  return step ? fmt::format("{}.{}", job, step) : std::string(job);
}

Status ShareThroughFile(const FileRendezvous& r, int process, int world, std::string* id) {
  const std::string path = r.path();
  if (process == 0)
    return WriteFileAtomic(path, fmt::format("{} world={}\n{}\n", kMagic, world, Hex(*id)));
  const auto deadline = Deadline(r.timeout_s);
  for (;;) {
    if (auto text = ReadFile(path); text.ok()) {
      std::istringstream in(*text);
      std::string magic, world_field, hex;
      in >> magic >> world_field >> hex;
      if (magic != kMagic || !Unhex(hex, id))
        return InvalidInput(fmt::format("{}: not a pipeplan rendezvous file", path));
      if (world_field != fmt::format("world={}", world))
        return InvalidInput(fmt::format(
            "{}: written for {} processes, this job has {} (a leftover of another job? give each "
            "job its own --rendezvous-key)",
            path, world_field.substr(world_field.find('=') + 1), world));
      return Status::Ok();
    }
    if (std::chrono::steady_clock::now() > deadline)
      return Internal(
          fmt::format("process {}: timed out after {} s waiting for process 0 to write {}", process,
                      r.timeout_s, path));
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void RemoveRendezvousFile(const FileRendezvous& r) {
  std::remove(r.path().c_str());
}

}  // namespace pipeplan
