// Op vocabulary of the operator table and its canonical string form.
//
// String form (total, round-trips through ParseOp):
//   r<rank> [<module>.]<KIND>[ c<chunk>][ m<microbatch>][ t<task>][ p<piece>][ ->r<peer> |
//   <-r<peer> | @g<group>]
// The module prefix is omitted for text ops and for OPT_STEP (module optimizer).
// Examples: "r0 F c1 m3", "r2 SEND_F c0 m1 ->r3", "r3 RECV_F c0 m1 <-r2",
//           "r1 REDUCE_SCATTER c0 @g1", "r0 vision.F m4 t2", "r5 OPT_STEP".
// A compute op with a group ("r2 vision.F c1 m3 t0 @g7") is a gang: one shard of work
// that every rank of the group runs at the same time (multi-rank context parallelism).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/status.h"

namespace pipeplan {

enum class Module : uint8_t { kText = 0, kVision = 1, kGenerator = 2, kOptimizer = 3 };
inline constexpr int kNumModules = 4;

enum class OpKind : uint8_t {
  kF = 0,  // forward
  kB,      // full backward (input + weight gradients)
  kI,      // input-gradient backward (zero-bubble split)
  kW,      // weight-gradient backward (zero-bubble split)
  kSendF,  // send forward activations to the next stage
  kRecvF,  // receive forward activations from the previous stage
  kSendB,  // send activation gradients to the previous stage
  kRecvB,  // receive activation gradients from the next stage
  kAllReduce,
  kReduceScatter,
  kAllGather,
  kAllToAll,
  kOptStep,    // optimizer step over the rank's parameter shard
  kRecompute,  // forward recomputation before a backward
  kOffload,    // copy saved activations to host memory (device -> host), freeing them
  kReload,     // copy them back before the backward that needs them (host -> device)
};
inline constexpr int kNumOpKinds = 16;

std::string_view ModuleName(Module m);
std::string_view KindName(OpKind k);
bool ParseModule(std::string_view s, Module* out);
bool ParseKind(std::string_view s, OpKind* out);

inline bool IsSend(OpKind k) {
  return k == OpKind::kSendF || k == OpKind::kSendB;
}
inline bool IsRecv(OpKind k) {
  return k == OpKind::kRecvF || k == OpKind::kRecvB;
}
inline bool IsP2P(OpKind k) {
  return IsSend(k) || IsRecv(k);
}
inline bool IsCollective(OpKind k) {
  return k == OpKind::kAllReduce || k == OpKind::kReduceScatter || k == OpKind::kAllGather ||
         k == OpKind::kAllToAll;
}
inline bool IsCopy(OpKind k) {
  return k == OpKind::kOffload || k == OpKind::kReload;
}
inline bool IsCompute(OpKind k) {
  return !IsP2P(k) && !IsCollective(k) && !IsCopy(k);
}
// Kinds whose peer is a rank (SEND/RECV; a copy to or from another rank's memory), not a
// group.
inline bool PeerIsRank(OpKind k) {
  return IsP2P(k) || IsCopy(k);
}

// Execution streams of a rank. Compute ops and point-to-point transfers share the
// compute stream (Megatron's default blocking p2p); collectives run on their own stream,
// host copies on one stream per direction (the GPU's two copy engines), each ordered
// against the others only through explicit dependencies.
enum class Stream : uint8_t { kCompute = 0, kCollective = 1, kToHost = 2, kFromHost = 3 };
inline constexpr int kNumStreams = 4;
inline Stream StreamOf(OpKind k) {
  if (IsCollective(k)) return Stream::kCollective;
  if (k == OpKind::kOffload) return Stream::kToHost;
  if (k == OpKind::kReload) return Stream::kFromHost;
  return Stream::kCompute;
}

// One op's identity: everything the string form carries. -1 means "not applicable".
// A text gradient reduction of one micro-batch (ZeRO-2: one per micro-batch and chunk).
inline bool IsMicroBatchReduction(Module module, int32_t mb, OpKind k) {
  return module == Module::kText && mb >= 0 && IsCollective(k);
}

struct OpKey {
  int32_t rank = -1;
  OpKind kind = OpKind::kF;
  Module module = Module::kText;
  int32_t chunk = -1;  // local virtual chunk on the rank (global stage = chunk * pp + pp_rank)
  int32_t mb = -1;     // micro-batch index within the DP replica
  int32_t task = -1;   // modality task index within the micro-batch
  int32_t peer = -1;   // peer rank for SEND/RECV and remote copies, group id for collectives
  int32_t piece = -1;  // layer-group piece of a modality task (its layers: the op's work)

  friend bool operator==(const OpKey&, const OpKey&) = default;
};

std::string FormatOp(const OpKey& op);
void AppendOp(std::string* out, const OpKey& op);  // FormatOp, appended to *out
// FormatOp written at `p` (at most kMaxOpText bytes of letters, digits, spaces and _ . - < >
// @ only: nothing a JSON string escapes); returns the end.
inline constexpr size_t kMaxOpText = 128;
char* WriteOp(char* p, const OpKey& op);
StatusOr<OpKey> ParseOp(std::string_view text);

}  // namespace pipeplan
