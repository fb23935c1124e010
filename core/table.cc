#include "core/table.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>

#include "core/memory.h"

namespace pipeplan {

std::string_view PlacementName(StagePlacement p) {
  return p == StagePlacement::kV ? "v" : "loop";
}

bool ParsePlacement(std::string_view s, StagePlacement* out) {
  if (s == "loop") return *out = StagePlacement::kLoop, true;
  if (s == "v") return *out = StagePlacement::kV, true;
  return false;
}
Work LayerShare(const Work& w, int begin, int end) {
  const int layers = std::max(1, w.layer_end - w.layer_begin), n = end - begin;
  const double s = static_cast<double>(n) / layers;
  Work p = w;
  p.flops *= s, p.attn_flops *= s, p.fp8_flops *= s, p.model_flops *= s, p.hbm_bytes *= s;
  p.tp_bytes *= s, p.ep_bytes *= s, p.mem_delta_bytes *= s;
  p.ep_overlap_bytes *= s, p.ep_overlap_flops *= s;
  p.tp_calls = w.tp_calls * n / layers, p.ep_calls = w.ep_calls * n / layers;
  p.ep_overlap_calls = w.ep_overlap_calls * n / layers;
  p.kernels = std::max(1, w.kernels * n / layers);
  p.layer_begin = w.layer_begin + begin, p.layer_end = w.layer_begin + end;
  return p;
}

size_t WorkHash::operator()(const Work& w) const {
  // Each field's bits mixed in (multiply and fold); a real as its bits with -0.0 as 0.0
  // (they compare equal, so they must hash equal).
  uint64_t h = 0;
  auto mix = [&h](uint64_t v) {
    h = (h ^ v) * 0x9e3779b97f4a7c15ULL;
    h ^= h >> 29;
  };
  auto real = [&mix](double v) { mix(std::bit_cast<uint64_t>(v + 0.0)); };
  auto count = [&mix](int32_t v) { mix(static_cast<uint32_t>(v)); };
  real(w.flops), real(w.attn_flops), real(w.fp8_flops), real(w.model_flops), real(w.hbm_bytes);
  real(w.payload_bytes), real(w.mem_delta_bytes), real(w.tp_bytes), real(w.ep_bytes);
  count(w.tp_calls), count(w.ep_calls), count(w.kernels), count(w.layer_begin);
  count(w.layer_end), mix(w.saved_fp8);
  real(w.ep_overlap_bytes), real(w.ep_overlap_flops), count(w.ep_overlap_calls);
  return h;
}

OpKey Table::key(OpId i) const {
  return OpKey{rank_[i], kind_[i], module_[i], chunk_[i], mb_[i], task_[i], peer_[i], piece_[i]};
}

size_t Table::MemoryBytes() const {
  size_t per_op = sizeof(int32_t) * 5 + sizeof(OpKind) + sizeof(Module) + sizeof(uint32_t) * 3;
  return size() * per_op + deps_.size() * sizeof(uint32_t) + works_.size() * sizeof(Work) +
         ranks_.size() * sizeof(RankInfo) + group_ranks_.size() * sizeof(int32_t);
}

TableBuilder::TableBuilder(std::vector<RankInfo> ranks)
    : ranks_(std::move(ranks)), seq_(ranks_.size()) {}

WorkId TableBuilder::AddWork(const Work& w) {
  auto [it, inserted] = work_index_.try_emplace(w, static_cast<WorkId>(works_.size()));
  if (inserted) works_.push_back(w);
  return it->second;
}

int32_t TableBuilder::AddGroup(std::vector<int32_t> ranks) {
  group_ranks_.insert(group_ranks_.end(), ranks.begin(), ranks.end());
  group_begin_.push_back(static_cast<uint32_t>(group_ranks_.size()));
  return static_cast<int32_t>(group_begin_.size()) - 2;
}

void TableBuilder::Resize(size_t ops) {
  Table& t = ops_;
  ResizeHuge(t.rank_, ops), ResizeHuge(t.kind_, ops), ResizeHuge(t.module_, ops);
  ResizeHuge(t.chunk_, ops), ResizeHuge(t.mb_, ops), ResizeHuge(t.task_, ops);
  ResizeHuge(t.peer_, ops), ResizeHuge(t.piece_, ops), ResizeHuge(t.tag_, ops);
  ResizeHuge(t.work_, ops);
}

void TableBuilder::Set(Handle h, const OpKey& key, WorkId work, uint32_t tag) {
  Table& t = ops_;
  t.rank_[h] = key.rank, t.kind_[h] = key.kind, t.module_[h] = key.module;
  t.chunk_[h] = key.chunk, t.mb_[h] = key.mb, t.task_[h] = key.task;
  t.peer_[h] = key.peer, t.piece_[h] = key.piece;
  t.tag_[h] = tag, t.work_[h] = work;
}

void TableBuilder::AddDeps(std::vector<std::pair<Handle, Handle>> deps) {
  if (edges_.empty()) {
    edges_ = std::move(deps);
  } else {
    edges_.insert(edges_.end(), deps.begin(), deps.end());
  }
}

TableBuilder::Handle TableBuilder::Add(const OpKey& key, WorkId work, uint32_t tag) {
  Table& t = ops_;
  t.rank_.push_back(key.rank), t.kind_.push_back(key.kind), t.module_.push_back(key.module);
  t.chunk_.push_back(key.chunk), t.mb_.push_back(key.mb), t.task_.push_back(key.task);
  t.peer_.push_back(key.peer), t.piece_.push_back(key.piece);
  t.tag_.push_back(tag), t.work_.push_back(work);
  return static_cast<Handle>(t.kind_.size() - 1);
}

StatusOr<Table> TableBuilder::Finish(PlanMeta meta) {
  Table t;
  const size_t n = ops_.size();
  std::vector<OpId> id_of(n, UINT32_MAX);
  OpId next = 0;
  bool in_order = true;  // handle h is op h
  for (size_t r = 0; r < seq_.size(); ++r) {
    for (Handle h : seq_[r]) {
      if (ops_.rank_[h] != static_cast<int32_t>(r))
        return Internal(fmt::format("op {} sequenced on rank {}", ops_.str(h), r));
      if (id_of[h] != UINT32_MAX)
        return Internal(fmt::format("op {} sequenced twice", ops_.str(h)));
      in_order = in_order && h == next;
      id_of[h] = next++;
    }
    t.rank_begin_.push_back(next);
  }
  if (next != n) return Internal("an op was added but never sequenced");
  seq_ = {};
  // The columns move to the table; out of order, each is permuted in turn (one column's
  // copy at a time on top of the builder's).
  auto take = [&](auto& from, auto& to) {
    if (!in_order) {
      std::remove_reference_t<decltype(to)> permuted;
      ResizeHuge(permuted, n);
      for (size_t h = 0; h < n; ++h) permuted[id_of[h]] = from[h];
      from = std::move(permuted);
    }
    to = std::move(from);
  };
  Table& o = ops_;
  take(o.rank_, t.rank_), take(o.kind_, t.kind_), take(o.module_, t.module_);
  take(o.chunk_, t.chunk_), take(o.mb_, t.mb_), take(o.task_, t.task_), take(o.peer_, t.peer_);
  take(o.piece_, t.piece_), take(o.tag_, t.tag_), take(o.work_, t.work_);
  // CSR of dependencies (counting sort by op), each op's list sorted and deduplicated in
  // place (the lists move down over the duplicates; the offsets are rewritten as they go).
  std::vector<uint32_t>& begin = t.dep_begin_;
  ResizeHuge(begin, n + 1);
  std::fill(begin.begin(), begin.end(), 0);
  for (auto& [op, on] : edges_) ++begin[id_of[op] + 1];
  for (size_t i = 0; i < n; ++i) begin[i + 1] += begin[i];
  std::vector<uint32_t>& deps = t.deps_;
  ResizeHuge(deps, edges_.size());
  {
    std::vector<uint32_t> fill(begin.begin(), begin.end() - 1);
    for (auto& [op, on] : edges_) deps[fill[id_of[op]]++] = id_of[on];
  }
  edges_ = {}, id_of = {};
  uint32_t kept = 0;
  for (size_t i = 0; i < n; ++i) {
    const auto first = deps.begin() + begin[i], last = deps.begin() + begin[i + 1];
    if (last - first > 1) std::sort(first, last);
    const auto end = std::unique(first, last);
    begin[i] = kept;
    for (auto d = first; d != end; ++d) deps[kept++] = *d;
  }
  begin[n] = kept;
  deps.resize(kept);
  t.ranks_ = std::move(ranks_);
  t.works_ = std::move(works_);
  t.group_begin_ = std::move(group_begin_);
  t.group_ranks_ = std::move(group_ranks_);
  t.meta_ = std::move(meta);
  return t;
}

Status TableColumns::CheckConsistent() const {
  const Table& t = *t_;
  const size_t n = t.kind_.size();
  for (size_t len :
       {t.rank_.size(), t.module_.size(), t.chunk_.size(), t.mb_.size(), t.task_.size(),
        t.peer_.size(), t.piece_.size(), t.tag_.size(), t.work_.size()})
    if (len != n) return InvalidInput("plan columns have different lengths");
  const PlanMeta& m = t.meta_;
  for (int32_t v : {m.pp, m.vp, m.dp, m.tp, m.cp, m.ep, m.microbatches, m.gpus_per_node})
    if (v < 1) return InvalidInput("plan metadata: parallel sizes and micro-batches must be >= 1");
  if (static_cast<int64_t>(m.dp) * m.pp != static_cast<int64_t>(t.ranks_.size()))
    return InvalidInput(
        fmt::format("plan has {} ranks but dp x pp = {} x {}", t.ranks_.size(), m.dp, m.pp));
  if (static_cast<int64_t>(m.dp) * m.pp * m.vp * m.microbatches > (int64_t{1} << 31))
    return InvalidInput("plan metadata: too many micro-batches");
  for (size_t r = 0; r < t.ranks_.size(); ++r) {
    const RankInfo& ri = t.ranks_[r];
    if (ri.dp != static_cast<int32_t>(r) / m.pp || ri.pp != static_cast<int32_t>(r) % m.pp ||
        ri.gpus < 1)
      return InvalidInput(fmt::format("rank {} has inconsistent coordinates or no GPU", r));
  }
  if (t.dep_begin_.size() != n + 1 || t.dep_begin_.front() != 0 ||
      t.dep_begin_.back() != t.deps_.size())
    return InvalidInput("plan dependency index is inconsistent");
  for (size_t i = 0; i + 1 < t.dep_begin_.size(); ++i)
    if (t.dep_begin_[i] > t.dep_begin_[i + 1])
      return InvalidInput("plan dependency index decreases");
  if (t.rank_begin_.size() != t.ranks_.size() + 1 || t.rank_begin_.front() != 0 ||
      t.rank_begin_.back() != n)
    return InvalidInput("plan rank index is inconsistent");
  for (size_t r = 0; r + 1 < t.rank_begin_.size(); ++r)
    if (t.rank_begin_[r] > t.rank_begin_[r + 1]) return InvalidInput("plan rank index decreases");
  if (t.group_begin_.empty() || t.group_begin_.front() != 0 ||
      t.group_begin_.back() != t.group_ranks_.size())
    return InvalidInput("plan group index is inconsistent");
  for (size_t g = 0; g + 1 < t.group_begin_.size(); ++g)
    if (t.group_begin_[g] > t.group_begin_[g + 1])
      return InvalidInput("plan group index decreases");
  for (size_t r = 0; r + 1 < t.rank_begin_.size(); ++r)
    for (OpId i = t.rank_begin_[r]; i < t.rank_begin_[r + 1]; ++i)
      if (t.rank_[i] != static_cast<int32_t>(r))
        return InvalidInput(fmt::format("op {} is stored in rank {}'s sequence", i, r));
  for (uint32_t d : t.deps_)
    if (d >= n) return InvalidInput(fmt::format("dependency on op {} which does not exist", d));
  for (uint32_t w : t.work_)
    if (w >= t.works_.size()) return InvalidInput("op refers to a missing work entry");
  for (const Work& w : t.works_) {
    for (double v :
         {w.flops, w.attn_flops, w.fp8_flops, w.model_flops, w.hbm_bytes, w.payload_bytes,
          w.tp_bytes, w.ep_bytes, w.ep_overlap_bytes, w.ep_overlap_flops})
      if (!std::isfinite(v) || v < 0)
        return InvalidInput("a work entry has a negative or non-finite amount");
    if (w.attn_flops + w.fp8_flops > w.flops * (1 + 1e-9))
      return InvalidInput("a work entry's attention and FP8 FLOPs exceed its FLOPs");
    if (w.ep_overlap_bytes > w.ep_bytes * (1 + 1e-9) || w.ep_overlap_calls < 0 ||
        w.ep_overlap_calls > w.ep_calls)
      return InvalidInput("a work entry's overlapped all-to-alls exceed its all-to-alls");
    if (!std::isfinite(w.mem_delta_bytes) || w.tp_calls < 0 || w.ep_calls < 0 || w.kernels < 0 ||
        w.layer_begin < -1 || w.layer_end < w.layer_begin || w.layer_end > (1 << 20))
      return InvalidInput("a work entry has an invalid memory effect, call count or layer range");
  }
  for (int32_t r : t.group_ranks_)
    if (r < 0 || r >= t.num_ranks()) return InvalidInput("group refers to a missing rank");
  for (size_t i = 0; i < n; ++i) {
    if (static_cast<int>(t.kind_[i]) >= kNumOpKinds ||
        static_cast<int>(t.module_[i]) >= kNumModules)
      return InvalidInput(fmt::format("op {} has an unknown kind or module", i));
    if (IsP2P(t.kind_[i]) && (t.peer_[i] < 0 || t.peer_[i] >= t.num_ranks()))
      return InvalidInput(fmt::format("op {} sends to a missing rank", i));
    if (IsCopy(t.kind_[i]) && (t.peer_[i] >= t.num_ranks() || t.peer_[i] == t.rank_[i]))
      return InvalidInput(fmt::format("op {} copies to a missing rank or its own", i));
    if ((IsCollective(t.kind_[i]) && t.peer_[i] < 0) ||
        (!PeerIsRank(t.kind_[i]) && t.peer_[i] >= t.num_groups()))
      return InvalidInput(fmt::format("op {} uses a missing group", i));
  }
  return Status::Ok();
}

}  // namespace pipeplan
