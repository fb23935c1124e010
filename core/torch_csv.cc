#include "core/torch_csv.h"

#include <fmt/format.h>

#include <set>
#include <tuple>

namespace pipeplan {
namespace {

bool TextCompute(OpKind k) {
  return k == OpKind::kF || k == OpKind::kB || k == OpKind::kI || k == OpKind::kW;
}

std::string Format(const TorchAction& a) {
  if (!a.pair.empty())
    return fmt::format("({};{})OVERLAP_F_B", Format(a.pair[0]), Format(a.pair[1]));
  return fmt::format("{}{}{}", a.stage, KindName(a.kind), a.mb);
}

// PyTorch's _add_send_recv over one replica's compute rows.
StatusOr<std::vector<TorchRow>> AddSendRecv(std::vector<TorchRow> compute, const PlanMeta& m) {
  const int32_t S = m.pp * m.vp;
  auto rank_of = [&](int32_t stage) { return m.home(stage).pp_rank; };
  auto has_comms = [&](const TorchAction& a) {
    if (a.kind == OpKind::kF) return a.stage != S - 1 && rank_of(a.stage + 1) != rank_of(a.stage);
    if (a.kind == OpKind::kI || a.kind == OpKind::kB)
      return a.stage != 0 && rank_of(a.stage - 1) != rank_of(a.stage);
    return false;
  };
  using Key = std::tuple<int32_t, OpKind, int32_t>;
  std::vector<std::set<Key>> done(compute.size());
  std::vector<TorchRow> out(compute.size());
  auto ready = [&](const TorchAction& a, const std::set<Key>& seen) {
    if (a.kind == OpKind::kF && a.stage != 0)
      return seen.count({a.stage, OpKind::kRecvF, a.mb}) ||
             seen.count({a.stage - 1, OpKind::kF, a.mb});
    if ((a.kind == OpKind::kI || a.kind == OpKind::kB) && a.stage != S - 1)
      return seen.count({a.stage, OpKind::kRecvB, a.mb}) ||
             seen.count({a.stage + 1, OpKind::kI, a.mb}) ||
             seen.count({a.stage + 1, OpKind::kB, a.mb});
    return true;
  };
  std::vector<size_t> next(compute.size(), 0);
  for (;;) {
    bool left = false, progress = false;
    for (size_t r = 0; r < compute.size(); ++r) {
      if (next[r] == compute[r].size()) continue;
      left = true;
      const TorchAction& a = compute[r][next[r]];
      const std::vector<TorchAction> one{a};
      const std::vector<TorchAction>& all = a.pair.empty() ? one : a.pair;
      bool ok = true;
      for (const TorchAction& x : all) ok = ok && ready(x, done[r]);
      if (!ok) continue;
      out[r].push_back(a);
      for (const TorchAction& x : all) {
        done[r].insert({x.stage, x.kind, x.mb});
        if (!has_comms(x)) continue;
        const bool fwd = x.kind == OpKind::kF;
        const TorchAction send{x.stage, fwd ? OpKind::kSendF : OpKind::kSendB, x.mb};
        const TorchAction recv{fwd ? x.stage + 1 : x.stage - 1,
                               fwd ? OpKind::kRecvF : OpKind::kRecvB, x.mb};
        out[r].push_back(send);
        done[r].insert({send.stage, send.kind, send.mb});
        const size_t to = static_cast<size_t>(rank_of(recv.stage));
        out[to].push_back(recv);
        done[to].insert({recv.stage, recv.kind, recv.mb});
      }
      ++next[r];
      progress = true;
    }
    if (!left) break;
    if (!progress)
      return InvalidPlan(
          "the compute order cannot be given sends and receives (PyTorch's "
          "_add_send_recv would stop here)");
  }
  return out;
}

}  // namespace

StatusOr<std::string> ToTorchCsv(const Table& t, int replica, bool comms, size_t* left_out) {
  const PlanMeta& m = t.meta();
  if (replica < 0 || replica >= m.dp)
    return InvalidInput(fmt::format("replica {} does not exist (dp = {})", replica, m.dp));
  *left_out = 0;
  std::vector<TorchRow> rows(m.pp);
  for (int32_t s = 0; s < m.pp; ++s) {
    const int32_t r = replica * m.pp + s;
    bool pair_open = false;  // the last action is the first half of an overlapped pair
    for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i) {
      const OpKind k = t.kind(i);
      if (IsCopy(k)) {  // host copies: no action in PyTorch's schedule
        ++*left_out;
        continue;
      }
      if (t.module(i) != Module::kText) {
        if (IsCompute(k) && t.module(i) != Module::kOptimizer && t.piece(i) <= 0) ++*left_out;
        continue;
      }
      if (!TextCompute(k) || t.piece(i) > 0) continue;  // a split backward is one action
      const TorchAction a{m.global_stage(t.chunk(i), s), k, t.mb(i)};
      if (pair_open) {
        rows[s].back().pair.push_back(a);
        pair_open = false;
      } else if (t.overlaps_next(i)) {
        TorchAction pair;
        pair.pair.push_back(a);
        rows[s].push_back(pair);
        pair_open = true;
      } else {
        rows[s].push_back(a);
      }
    }
    if (pair_open) {  // a pair without its second half: the first runs alone
      TorchAction single = rows[s].back().pair[0];
      rows[s].back() = single;
    }
  }
  if (comms) {
    ASSIGN_OR_RETURN(rows, AddSendRecv(std::move(rows), m));
  }
  std::string out;
  for (const TorchRow& row : rows) {
    for (size_t j = 0; j < row.size(); ++j) {
      if (j > 0) out += ',';
      out += Format(row[j]);
    }
    out += '\n';
  }
  return out;
}

namespace {

// One cell: an action or an overlapped pair; errors name the line and the cell's column.
StatusOr<TorchAction> ParseAction(std::string_view cell, const std::string& name, int line,
                                  int column) {
  auto bad = [&](const std::string& why) {
    return InvalidInput(fmt::format("{}:{}:{}: '{}': {}", name, line, column, cell, why));
  };
  TorchAction a;
  a.line = line, a.column = column;
  constexpr std::string_view kPair = "OVERLAP_F_B";
  if (!cell.empty() && cell.front() == '(') {
    const size_t close = cell.find(')');
    if (close == std::string_view::npos || cell.substr(close + 1) != kPair)
      return bad("an overlapped pair is written (<action>;<action>)OVERLAP_F_B");
    std::string_view inner = cell.substr(1, close - 1);
    const size_t semi = inner.find(';');
    if (semi == std::string_view::npos || inner.find(';', semi + 1) != std::string_view::npos)
      return bad("an overlapped pair holds exactly two actions");
    for (std::string_view part : {inner.substr(0, semi), inner.substr(semi + 1)}) {
      ASSIGN_OR_RETURN(TorchAction x, ParseAction(part, name, line, column));
      if (!x.pair.empty()) return bad("overlapped pairs do not nest");
      a.pair.push_back(x);
    }
    if (a.pair[0].kind != OpKind::kF ||
        !(a.pair[1].kind == OpKind::kB || a.pair[1].kind == OpKind::kI))
      return bad("an overlapped pair is a forward and a backward, in that order");
    return a;
  }
  size_t p = 0;
  auto number = [&](int32_t* out) {
    const size_t start = p;
    int64_t v = 0;
    while (p < cell.size() && cell[p] >= '0' && cell[p] <= '9' && p - start < 9)
      v = v * 10 + (cell[p++] - '0');
    *out = static_cast<int32_t>(v);
    return p > start;
  };
  if (!number(&a.stage)) return bad("an action starts with its stage number, e.g. 2F0");
  const size_t type_at = p;
  while (p < cell.size() && (cell[p] < '0' || cell[p] > '9')) ++p;
  const std::string_view type = cell.substr(type_at, p - type_at);
  if (type == "UNSHARD" || type == "RESHARD" || type == "REDUCE_GRAD")
    return bad("FSDP actions (UNSHARD, RESHARD, REDUCE_GRAD) are not supported");
  if (!ParseKind(type, &a.kind) || !(TextCompute(a.kind) || IsP2P(a.kind)))
    return bad(
        fmt::format("unknown action type '{}' (F, B, I, W, SEND_F, RECV_F, SEND_B, "
                    "RECV_B or an OVERLAP_F_B pair)",
                    type));
  if (!number(&a.mb) || p != cell.size())
    return bad("an action ends with its micro-batch number, e.g. 2F0");
  return a;
}

}  // namespace

StatusOr<std::vector<TorchRow>> ParseTorchCsv(std::string_view text, const std::string& name) {
  std::vector<TorchRow> rows;
  int line = 0;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string_view::npos) end = text.size();
    std::string_view row = text.substr(at, end - at);
    at = end + 1;
    ++line;
    if (!row.empty() && row.back() == '\r') row.remove_suffix(1);
    TorchRow actions;
    size_t c = 0;
    while (c <= row.size()) {
      size_t comma = row.find(',', c);
      if (comma == std::string_view::npos) comma = row.size();
      std::string_view cell = row.substr(c, comma - c);
      const int column = static_cast<int>(c) + 1;
      if (cell.size() >= 2 && cell.front() == '"' && cell.back() == '"')
        cell = cell.substr(1, cell.size() - 2);  // csv.writer quoting of a plain action
      while (!cell.empty() && cell.front() == ' ') cell.remove_prefix(1);
      while (!cell.empty() && cell.back() == ' ') cell.remove_suffix(1);
      if (!cell.empty()) {
        ASSIGN_OR_RETURN(TorchAction a, ParseAction(cell, name, line, column));
        actions.push_back(std::move(a));
      }
      c = comma + 1;
    }
    rows.push_back(std::move(actions));
  }
  return rows;
}

}  // namespace pipeplan
