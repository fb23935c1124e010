#include "planner/schedules.h"

#include <fmt/format.h>

#include <algorithm>

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
  }
  return 0;
}

StatusOr<std::vector<StageOrder>> TextSchedule(PipelineKind kind, int pp, int vp, int m,
                                               int group_size) {
  if (pp < 1 || vp < 1 || m < 1) return InvalidInput("schedule needs pp, vp, m >= 1");
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
      case PipelineKind::kInterleaved1F1B:
        orders[s] = Interleaved(m, vp, EffectiveGroupSize(pp, m, group_size), warmup);
        break;
    }
  }
  return orders;
}

std::string FormatOrder(const StageOrder& order) {
  std::string s;
  for (const Step& st : order)
    s += fmt::format("{}{}{}.{}", s.empty() ? "" : " ", KindName(st.kind), st.chunk, st.mb);
  return s;
}

}  // namespace pipeplan
