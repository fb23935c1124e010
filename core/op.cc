#include "core/op.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <charconv>

namespace pipeplan {
namespace {

constexpr std::array<std::string_view, kNumModules> kModuleNames = {"text", "vision", "generator",
                                                                    "optimizer"};
constexpr std::array<std::string_view, kNumOpKinds> kKindNames = {
    "F",          "B",          "I",        "W",          "SEND_F",
    "RECV_F",     "SEND_B",     "RECV_B",   "ALL_REDUCE", "REDUCE_SCATTER",
    "ALL_GATHER", "ALL_TO_ALL", "OPT_STEP", "RECOMPUTE",  "OFFLOAD",
    "RELOAD"};

bool ParseInt(std::string_view s, int32_t* out) {
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size() && *out >= 0;
}

Module DefaultModule(OpKind k) {
  return k == OpKind::kOptStep ? Module::kOptimizer : Module::kText;
}

}  // namespace

std::string_view ModuleName(Module m) {
  return kModuleNames[static_cast<int>(m)];
}
std::string_view KindName(OpKind k) {
  return kKindNames[static_cast<int>(k)];
}

bool ParseModule(std::string_view s, Module* out) {
  for (int i = 0; i < kNumModules; ++i)
    if (kModuleNames[i] == s) return *out = static_cast<Module>(i), true;
  return false;
}

bool ParseKind(std::string_view s, OpKind* out) {
  for (int i = 0; i < kNumOpKinds; ++i)
    if (kKindNames[i] == s) return *out = static_cast<OpKind>(i), true;
  return false;
}

char* WriteOp(char* p, const OpKey& op) {
  auto text = [&](std::string_view s) { p = std::copy_n(s.data(), s.size(), p); };
  auto num = [&](std::string_view prefix, int32_t v) {
    text(prefix);
    p = std::to_chars(p, p + 11, v).ptr;
  };
  num("r", op.rank);
  *p++ = ' ';
  if (op.module != DefaultModule(op.kind)) text(ModuleName(op.module)), *p++ = '.';
  text(KindName(op.kind));
  if (op.chunk >= 0) num(" c", op.chunk);
  if (op.mb >= 0) num(" m", op.mb);
  if (op.task >= 0) num(" t", op.task);
  if (op.piece >= 0) num(" p", op.piece);
  if (op.peer >= 0)
    num(IsSend(op.kind) || op.kind == OpKind::kOffload  ? " ->r"
        : IsRecv(op.kind) || op.kind == OpKind::kReload ? " <-r"
                                                        : " @g",
        op.peer);
  return p;
}

void AppendOp(std::string* out, const OpKey& op) {
  char text[kMaxOpText];
  out->append(text, WriteOp(text, op));
}

std::string FormatOp(const OpKey& op) {
  std::string s;
  AppendOp(&s, op);
  return s;
}

StatusOr<OpKey> ParseOp(std::string_view text) {
  auto bad = [&](std::string_view why) {
    return InvalidInput(fmt::format("bad op '{}': {}", text, why));
  };
  std::array<std::string_view, 9> tok{};
  size_t n = 0;
  for (size_t i = 0; i < text.size();) {
    while (i < text.size() && text[i] == ' ') ++i;
    size_t j = i;
    while (j < text.size() && text[j] != ' ') ++j;
    if (j > i) {
      if (n == tok.size()) return bad("too many fields");
      tok[n++] = text.substr(i, j - i);
    }
    i = j;
  }
  if (n < 2) return bad("expected 'r<rank> <KIND> ...'");
  OpKey op;
  if (tok[0][0] != 'r' || !ParseInt(tok[0].substr(1), &op.rank)) return bad("expected r<rank>");
  std::string_view kind = tok[1];
  bool has_module = false;
  if (size_t dot = kind.find('.'); dot != std::string_view::npos) {
    if (!ParseModule(kind.substr(0, dot), &op.module)) return bad("unknown module");
    kind = kind.substr(dot + 1);
    has_module = true;
  }
  if (!ParseKind(kind, &op.kind)) return bad(fmt::format("unknown kind '{}'", kind));
  if (!has_module) op.module = DefaultModule(op.kind);
  for (size_t i = 2; i < n; ++i) {
    std::string_view t = tok[i];
    int32_t* field = nullptr;
    size_t skip = 1;
    if (t[0] == 'c')
      field = &op.chunk;
    else if (t[0] == 'm')
      field = &op.mb;
    else if (t[0] == 't')
      field = &op.task;
    else if (t[0] == 'p')
      field = &op.piece;
    else if (t.substr(0, 3) == "->r" && (IsSend(op.kind) || op.kind == OpKind::kOffload))
      field = &op.peer, skip = 3;
    else if (t.substr(0, 3) == "<-r" && (IsRecv(op.kind) || op.kind == OpKind::kReload))
      field = &op.peer, skip = 3;
    else if (t.substr(0, 2) == "@g" && !PeerIsRank(op.kind))
      field = &op.peer, skip = 2;
    if (field == nullptr || *field != -1 || !ParseInt(t.substr(skip), field))
      return bad(fmt::format("bad field '{}'", t));
  }
  if (FormatOp(op) != text) return bad("fields out of canonical order");
  return op;
}

}  // namespace pipeplan
