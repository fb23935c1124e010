// PyTorch pipelining's schedule CSV (torch.distributed.pipelining, `_dump_csv` /
// `_load_csv`): one row per pipeline rank, one cell per action.
//
// Action grammar: `<stage><TYPE><mb>`, TYPE one of F (forward), B (full backward),
// I (input gradient), W (weight gradient), SEND_F, RECV_F, SEND_B, RECV_B; or an
// overlapped pair `(<action>;<action>)OVERLAP_F_B`; an empty cell is an idle step. Stage
// numbers are global virtual stages (V-shaped numbering where the plan is V-shaped).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "core/table.h"

namespace pipeplan {

struct TorchAction {
  int32_t stage = -1;
  OpKind kind = OpKind::kF;  // kF, kB, kI, kW or one of the four SEND/RECV kinds
  int32_t mb = -1;
  std::vector<TorchAction> pair;  // OVERLAP_F_B: its two actions (then stage/mb unused)
  int line = 0, column = 0;       // where it was read (1-based)
};
using TorchRow = std::vector<TorchAction>;

// Rows of replica `replica`'s ranks in pp order. Compute actions only, or with the SEND /
// RECV actions PyTorch's `_add_send_recv` inserts (same algorithm: ranks take turns, an
// action runs once its input has been sent, each send puts its RECV on the receiver's row).
// `*left_out` counts the vision and generator compute ops and the host copies PyTorch has
// no action for.
StatusOr<std::string> ToTorchCsv(const Table& t, int replica, bool comms, size_t* left_out);

// Parses a CSV; errors name `name`, the line and the column.
StatusOr<std::vector<TorchRow>> ParseTorchCsv(std::string_view text, const std::string& name);

}  // namespace pipeplan
