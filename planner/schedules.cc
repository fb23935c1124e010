#include "planner/schedules.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/files.h"
#include "core/torch_csv.h"
#include "planner/zero_bubble.h"

namespace pipeplan {
namespace {

// Megatron-core get_schedule_table: micro-batches in groups of `g`; inside a group all
// chunks in order, each over the group's micro-batches; the last group takes the rest.
std::vector<std::pair<int, int>> ScheduleTable(int m, int vp, int g) {
  std::vector<std::pair<int, int>> table;  // (micro-batch, chunk)
  table.reserve(static_cast<size_t>(m) * vp);
  for (int lo = 0; lo < m; lo += g) {
    int hi = (lo + g >= m) ? m : lo + g;
    for (int c = 0; c < vp; ++c)
      for (int mb = lo; mb < hi; ++mb) table.push_back({mb, c});
    if (hi == m) break;
  }
  return table;
}

StageOrder Gpipe(int m) {
  StageOrder o;
  for (int i = 0; i < m; ++i) o.push_back({OpKind::kF, 0, i});
  for (int i = 0; i < m; ++i) o.push_back({OpKind::kB, 0, i});
  return o;
}

// Warm-up F, then 1F1B pairs (F of k+warmup, B of k), then the remaining B.
StageOrder OneFOneB(int m, int warmup) {
  StageOrder o;
  for (int i = 0; i < warmup; ++i) o.push_back({OpKind::kF, 0, i});
  for (int i = 0; i < m - warmup; ++i) {
    o.push_back({OpKind::kF, 0, i + warmup});
    o.push_back({OpKind::kB, 0, i});
  }
  for (int i = m - warmup; i < m; ++i) o.push_back({OpKind::kB, 0, i});
  return o;
}

StageOrder Interleaved(int m, int vp, int g, int warmup) {
  auto table = ScheduleTable(m, vp, g);
  const int total = m * vp;
  auto fwd = [&](int k) { return Step{OpKind::kF, table[k].second, table[k].first}; };
  auto bwd = [&](int k) { return Step{OpKind::kB, vp - 1 - table[k].second, table[k].first}; };
  StageOrder o;
  o.reserve(2 * total);
  for (int k = 0; k < warmup; ++k) o.push_back(fwd(k));
  for (int k = 0; k < total - warmup; ++k) {
    o.push_back(fwd(k + warmup));
    o.push_back(bwd(k));
  }
  for (int k = total - warmup; k < total; ++k) o.push_back(bwd(k));
  return o;
}

}  // namespace

int EffectiveGroupSize(int pp, int m, int group_size) {
  if (group_size > 0) return group_size;
  if (m % pp == 0) return pp;
  return m / std::max(1, m / pp);
}

int WarmupForwards(PipelineKind kind, int pp, int vp, int m, int group_size, int stage) {
  switch (kind) {
    case PipelineKind::kGpipe:
      return m;
    case PipelineKind::k1F1B:
      return std::min(pp - stage - 1, m);
    case PipelineKind::kInterleaved1F1B: {
      int g = EffectiveGroupSize(pp, m, group_size);
      return std::min((pp - stage - 1) * 2 + (vp - 1) * g, m * vp);
    }
    default:
      return 0;  // the zero-bubble schedules have no closed-form warm-up
  }
  return 0;
}

int DefaultMaxPending(PipelineKind kind, int pp) {
  return kind == PipelineKind::kZbH1 ? pp : 2 * pp;
}

StatusOr<std::vector<StageOrder>> TextSchedule(PipelineKind kind, int pp, int vp, int m,
                                               int group_size, int max_pending) {
  if (pp < 1 || vp < 1 || m < 1) return InvalidInput("schedule needs pp, vp, m >= 1");
  const int pending = max_pending > 0 ? max_pending : DefaultMaxPending(kind, pp);
  switch (kind) {
    case PipelineKind::kZbH1:
    case PipelineKind::kZbH2:
      return ZeroBubbleH(pp, m, pending);
    case PipelineKind::kZbv:
      return ZeroBubbleV(pp, m, pending);
    case PipelineKind::kDualPipeV:
      return DualPipeV(pp, m);
    case PipelineKind::kInterleavedZb:
      return InterleavedZeroBubble(pp, vp, m);
    case PipelineKind::kCsv:
      return InvalidInput("a csv schedule is read from its file (ReadTorchCsvSchedule)");
    default:
      break;
  }
  if (kind != PipelineKind::kInterleaved1F1B && vp != 1)
    return InvalidInput(
        fmt::format("{} has one chunk per stage (vp = {})", PipelineName(kind), vp));
  std::vector<StageOrder> orders(pp);
  for (int s = 0; s < pp; ++s) {
    int warmup = WarmupForwards(kind, pp, vp, m, group_size, s);
    switch (kind) {
      case PipelineKind::kGpipe:
        orders[s] = Gpipe(m);
        break;
      case PipelineKind::k1F1B:
        orders[s] = OneFOneB(m, warmup);
        break;
      default:
        orders[s] = Interleaved(m, vp, EffectiveGroupSize(pp, m, group_size), warmup);
        break;
    }
  }
  return orders;
}

StatusOr<TorchCsvSchedule> ReadTorchCsvSchedule(const std::string& path, int pp, int vp, int m) {
  ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  return ParseTorchCsvSchedule(text, path, pp, vp, m);
}

StatusOr<TorchCsvSchedule> ParseTorchCsvSchedule(std::string_view text, const std::string& name,
                                                 int pp, int vp, int m) {
  ASSIGN_OR_RETURN(std::vector<TorchRow> rows, ParseTorchCsv(text, name));
  while (!rows.empty() && rows.back().empty()) rows.pop_back();  // trailing blank lines
  if (static_cast<int>(rows.size()) != pp)
    return InvalidInput(fmt::format("{}: {} rows, but a row per pipeline rank is needed (pp = {})",
                                    name, rows.size(), pp));
  const int S = pp * vp;
  auto at = [&](const TorchAction& a, const std::string& why) {
    return InvalidInput(fmt::format("{}:{}:{}: {}", name, a.line, a.column, why));
  };
  // The rank of each stage, and which placement it matches.
  std::vector<int> row_of(S, -1);
  bool loop = true, v = vp == 2 || vp == 1;
  for (int r = 0; r < pp; ++r)
    for (const TorchAction& cell : rows[r])
      for (const TorchAction& a : cell.pair.empty() ? TorchRow{cell} : cell.pair) {
        if (a.stage >= S)
          return at(a, fmt::format("stage {} does not exist (pp * vp = {} stages)", a.stage, S));
        if (IsP2P(a.kind)) continue;
        if (row_of[a.stage] >= 0 && row_of[a.stage] != r)
          return at(a, fmt::format("stage {} is also on row {}", a.stage, row_of[a.stage] + 1));
        row_of[a.stage] = r;
        loop = loop && HomeOf(StagePlacement::kLoop, pp, a.stage).pp_rank == r;
        v = v && HomeOf(StagePlacement::kV, pp, a.stage).pp_rank == r;
      }
  if (!loop && !v)
    return InvalidInput(fmt::format(
        "{}: the stages are placed neither in a loop (stage = chunk * pp + rank) nor in a V "
        "(rank r holds r and 2 pp - 1 - r)",
        name));
  TorchCsvSchedule out;
  out.placement = loop ? StagePlacement::kLoop : StagePlacement::kV;
  out.orders.resize(pp);
  // Per (stage, mb): bit 0 F, 1 B, 2 I, 3 W seen.
  std::vector<uint8_t> seen(static_cast<size_t>(S) * m, 0);
  for (int r = 0; r < pp; ++r) {
    for (const TorchAction& cell : rows[r]) {
      const bool pair = !cell.pair.empty();
      const TorchRow parts = pair ? cell.pair : TorchRow{cell};
      for (size_t q = 0; q < parts.size(); ++q) {
        const TorchAction& a = parts[q];
        if (IsP2P(a.kind)) continue;
        if (a.mb >= m)
          return at(a, fmt::format("micro-batch {} does not exist ({} per replica)", a.mb, m));
        uint8_t& s = seen[static_cast<size_t>(a.stage) * m + a.mb];
        const int bit = a.kind == OpKind::kF   ? 0
                        : a.kind == OpKind::kB ? 1
                        : a.kind == OpKind::kI ? 2
                                               : 3;
        if (s & (1 << bit))
          return at(
              a, fmt::format("stage {} micro-batch {}: {} twice", a.stage, a.mb, KindName(a.kind)));
        if (bit > 0 && !(s & 1))
          return at(a, fmt::format("stage {} micro-batch {}: {} before its F", a.stage, a.mb,
                                   KindName(a.kind)));
        if (bit == 3 && !(s & 4))
          return at(a, fmt::format("stage {} micro-batch {}: W before its I", a.stage, a.mb));
        if ((bit == 1 && (s & 12)) || (bit >= 2 && (s & 2)))
          return at(a, fmt::format("stage {} micro-batch {}: both B and I/W", a.stage, a.mb));
        s |= static_cast<uint8_t>(1 << bit);
        const StageHome home = HomeOf(out.placement, pp, a.stage);
        out.orders[r].push_back({a.kind, home.chunk, a.mb, pair && q == 0});
      }
    }
  }
  for (int g = 0; g < S; ++g)
    for (int mb = 0; mb < m; ++mb) {
      const uint8_t s = seen[static_cast<size_t>(g) * m + mb];
      if (s != 3 && s != 13)
        return InvalidInput(fmt::format(
            "{}: stage {} micro-batch {} is not run as F and B, or F, I and W", name, g, mb));
    }
  return out;
}

std::string FormatOrder(const StageOrder& order) {
  std::string s;
  for (const Step& st : order)
    s += fmt::format("{}{}{}.{}{}", s.empty() ? "" : " ", KindName(st.kind), st.chunk, st.mb,
                     st.overlap_next ? "&" : "");
  return s;
}

}  // namespace pipeplan
