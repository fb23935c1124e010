#include "planner/lower.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <tuple>

#include "core/memory.h"
#include "core/parallel.h"

namespace pipeplan {

uint32_t CollectiveTag(OpKind kind, Module module, int32_t chunk, int bucket) {
  return (static_cast<uint32_t>(bucket) << 26) | (static_cast<uint32_t>(module) << 24) |
         (static_cast<uint32_t>(kind) << 16) | static_cast<uint32_t>(chunk + 1);
}

void ForEachRank(const std::vector<RankSeq>& seqs, size_t from,
                 const std::function<void(size_t)>& f) {
  if (from >= seqs.size()) return;
  size_t ops = 0;
  for (size_t r = from; r < seqs.size(); ++r) ops += seqs[r].size();
  RunParallel(
      seqs.size() - from, [&](size_t k) { f(from + k); }, ops >= kParallelFromOps ? 0 : 1);
}

std::vector<RankSeq> ExpandStages(const std::vector<StageOrder>& orders, const PipelineShape& shape,
                                  const TextWorkIds& works) {
  std::vector<RankSeq> seqs(static_cast<size_t>(shape.dp) * shape.pp);
  const bool per_rank =
      orders.size() == seqs.size() && orders.size() != static_cast<size_t>(shape.pp);
  for (int d = 0; d < shape.dp; ++d) {
    for (int s = 0; s < shape.pp; ++s) {
      RankSeq& seq = seqs[shape.rank(d, s)];
      const StageOrder& order = orders[per_rank ? shape.rank(d, s) : s];
      seq.reserve(order.size() * 3 + 8);
      for (const Step& st : order) {
        OpKey k{shape.rank(d, s), st.kind, Module::kText, st.chunk, st.mb};
        seq.push_back({k, works.of(st.kind, shape.global(st.chunk, s)),
                       st.overlap_next ? kOverlapNextTag : 0});
      }
    }
  }
  return seqs;
}

void AddSendRecv(std::vector<RankSeq>* seqs, const PipelineShape& shape, WorkId p2p_work) {
  const int S = shape.stages();
  auto tag = [&](int d, int sender_stage, int mb, int dir) {
    return static_cast<uint32_t>(
        1 + ((static_cast<int64_t>(d) * S + sender_stage) * shape.m + mb) * 2 + dir);
  };
  ForEachRank(*seqs, 0, [&](size_t r) {
    RankSeq& seq = (*seqs)[r];
    if (seq.empty()) return;
    RankSeq out;
    out.reserve(seq.size() * 2 + 8);
    // The receive (before) or send (after) of a text op, if it has one: F receives from the
    // stage before and sends to the one after, B or I the other way; stages on the same
    // rank hand their data over locally.
    auto emit = [&](const PendingOp& op, bool recv, RankSeq* to) {
      const OpKey& k = op.key;
      if (k.module != Module::kText) return;
      const bool fwd = k.kind == OpKind::kF;
      if (!fwd && k.kind != OpKind::kB && k.kind != OpKind::kI) return;
      const int d = k.rank / shape.pp, s = k.rank % shape.pp, g = shape.global(k.chunk, s);
      const int other = fwd == recv ? g - 1 : g + 1;  // F receives from g - 1, B from g + 1
      if (other < 0 || other >= S) return;
      const int peer = shape.home(other).pp_rank;
      if (peer == s) return;
      const OpKind kind =
          recv ? (fwd ? OpKind::kRecvF : OpKind::kRecvB) : (fwd ? OpKind::kSendF : OpKind::kSendB);
      const int sender = recv ? other : g;
      to->push_back({OpKey{k.rank, kind, Module::kText, k.chunk, k.mb, -1, shape.rank(d, peer)},
                     p2p_work, tag(d, sender, k.mb, fwd ? 0 : 1)});
    };
    for (size_t j = 0; j < seq.size(); ++j) {
      // An overlapped pair receives both inputs first and sends both outputs after. A pair
      // that other work came between runs as two ops.
      const bool text = seq[j].key.module == Module::kText;
      if (text && seq[j].tag == kOverlapNextTag &&
          (j + 1 == seq.size() || seq[j + 1].key.module != Module::kText ||
           !(seq[j + 1].key.kind == OpKind::kB || seq[j + 1].key.kind == OpKind::kI)))
        seq[j].tag = 0;
      const size_t n = text && seq[j].tag == kOverlapNextTag ? 2 : 1;
      for (size_t q = j; q < j + n; ++q) emit(seq[q], true, &out);
      for (size_t q = j; q < j + n; ++q) out.push_back(seq[q]);
      for (size_t q = j; q < j + n; ++q) emit(seq[q], false, &out);
      j += n - 1;
    }
    seq = std::move(out);
  });
}

void AddGradSync(std::vector<RankSeq>* seqs, const PipelineShape& shape, int zero_stage,
                 const GradSyncWorks& works, const std::vector<int32_t>& dp_group_of_stage,
                 const std::vector<ModalitySync>& modality) {
  const bool sync = shape.dp > 1;
  const OpKind reduce = zero_stage >= 1 ? OpKind::kReduceScatter : OpKind::kAllReduce;
  const bool buckets = sync && !works.bucket_piece.empty();
  // The tags of the text reductions of replica 0's rank of each stage, in its order. DP
  // members must issue their collectives in one order (NCCL matches them in issue order,
  // the engine's collective stream runs them in sequence order), and the W passes the
  // list scheduler moves into a rank's gaps can differ between replicas: every replica
  // issues its reductions in replica 0's order, a reduction whose backward ran early
  // waiting for the ones before it.
  std::vector<std::vector<uint32_t>> reduce_order(shape.pp);
  auto lower_rank = [&](size_t rank) {
    const auto r = static_cast<int32_t>(rank);
    RankSeq& seq = (*seqs)[r];
    const int s = r % shape.pp;
    // Weight gradients of a chunk are complete after its last B or W.
    auto weight_grad = [](const OpKey& k) {
      return k.module == Module::kText && (k.kind == OpKind::kB || k.kind == OpKind::kW);
    };
    std::vector<int> backwards_left(shape.vp, 0);
    for (const PendingOp& op : seq)
      if (weight_grad(op.key)) ++backwards_left[op.key.chunk];
    auto gathers = [&](RankSeq* out) {
      for (int c = 0; c < shape.vp; ++c) {
        OpKey gk{r, OpKind::kAllGather, Module::kText, c, -1, -1, dp_group_of_stage[s]};
        out->push_back({gk, works.gather[shape.global(c, s)],
                        CollectiveTag(OpKind::kAllGather, Module::kText, c)});
      }
    };
    const bool gather = sync && zero_stage >= 1;
    std::vector<const ModalitySync*> mine;  // this rank's modality syncs
    for (const ModalitySync& m : modality)
      if (m.member[r]) mine.push_back(&m);
    auto modality_op = [&](const ModalitySync& m, OpKind kind, WorkId work, RankSeq* out) {
      out->push_back(
          {OpKey{r, kind, m.module, -1, -1, -1, m.group}, work, CollectiveTag(kind, m.module, -1)});
    };
    RankSeq out;
    out.reserve(seq.size() + (3 + kMaxBuckets) * shape.vp + 2 * mine.size() + 1);
    if (gather && works.gather_first) gathers(&out);
    for (const ModalitySync* m : mine)
      if (m->gather_first) modality_op(*m, OpKind::kAllGather, m->gather_work, &out);
    // A reduction goes after the SEND/RECV run that follows its backward: an executor that
    // runs a rank's collectives on its host thread, in sequence order, then sends the
    // gradient before it waits in the collective (the engine's streams, and `execute`'s,
    // do not need it). Pending: each reduction with the ops that follow it (its shard's
    // OFFLOAD).
    RankSeq pending;
    std::vector<uint32_t>& order = reduce_order[s];
    const bool leader = r < shape.pp;
    size_t next = 0;                   // in `order`: the reduction this rank issues next
    std::map<uint32_t, RankSeq> held;  // by tag: reductions waiting for the ones before
    auto flush = [&] {
      if (leader) {
        for (PendingOp& p : pending) {
          if (IsCollective(p.key.kind)) order.push_back(p.tag);
          out.push_back(std::move(p));
        }
        pending.clear();
        return;
      }
      uint32_t tag = 0;
      for (PendingOp& p : pending) {
        if (IsCollective(p.key.kind)) tag = p.tag;
        held[tag].push_back(std::move(p));
      }
      pending.clear();
      for (auto it = held.end(); next < order.size() && (it = held.find(order[next])) != held.end();
           ++next) {
        for (PendingOp& p : it->second) out.push_back(std::move(p));
        held.erase(it);
      }
    };
    const bool per_mb = sync && !works.mb_reduce.empty();  // ZeRO-2
    const bool host_grads = per_mb && !works.grad_out.empty();
    // Nor may such an executor wait in a reduction while another rank waits for an encoder
    // or generator gradient this rank sends after it: a chunk's reduction (one per chunk,
    // after its last backward) goes after the rank's last such SEND. Its dependency (the chunk's
    // last backward) and its place among the rank's collectives stay the same, so the simulated
    // step does too.
    size_t modality_sends_end = 0;
    if (!buckets && !per_mb)
      for (size_t j = 0; j < seq.size(); ++j)
        if (seq[j].key.module != Module::kText && seq[j].key.kind == OpKind::kSendB)
          modality_sends_end = j + 1;
    for (size_t j = 0; j < seq.size(); ++j) {
      const PendingOp& op = seq[j];
      if (!IsP2P(op.key.kind) && j >= modality_sends_end) flush();
      const bool last = sync && weight_grad(op.key) && --backwards_left[op.key.chunk] == 0;
      const int g = shape.global(op.key.chunk, s);
      if (per_mb && weight_grad(op.key)) {  // ZeRO-2: every micro-batch's
        out.push_back(op);
        const int32_t c = op.key.chunk, mb = op.key.mb;
        pending.push_back(
            {OpKey{r, OpKind::kReduceScatter, Module::kText, c, mb, -1, dp_group_of_stage[s]},
             works.mb_reduce[g], GradTag(c, mb)});
        if (host_grads)  // its shard into the host partition
          pending.push_back(
              {OpKey{r, OpKind::kOffload, Module::kOptimizer, c, mb}, works.grad_out[g]});
      } else if (!last) {
        out.push_back(op);
      } else if (buckets) {
        const auto& pieces =
            (op.key.kind == OpKind::kW ? works.bucket_piece_w : works.bucket_piece)[g];
        for (size_t k = 0; k < pieces.size(); ++k) {
          flush();
          OpKey pk = op.key;
          pk.piece = static_cast<int32_t>(k);
          out.push_back({pk, pieces[k], k + 1 == pieces.size() ? op.tag : 0});
          OpKey ck{r,  reduce, Module::kText,        op.key.chunk,
                   -1, -1,     dp_group_of_stage[s], static_cast<int32_t>(k)};
          pending.push_back(
              {ck, works.bucket_reduce[g][k],
               CollectiveTag(reduce, Module::kText, op.key.chunk, static_cast<int>(k))});
        }
      } else {
        out.push_back(op);
        OpKey ck{r, reduce, Module::kText, op.key.chunk, -1, -1, dp_group_of_stage[s]};
        pending.push_back(
            {ck, works.reduce[g], CollectiveTag(reduce, Module::kText, op.key.chunk)});
      }
    }
    flush();
    for (auto& [tag, unit] : held)  // none: every replica has replica 0's reductions
      for (PendingOp& p : unit) out.push_back(std::move(p));
    if (host_grads)  // the gradient shards back before anything reads them
      for (int c = 0; c < shape.vp; ++c)
        out.push_back(
            {OpKey{r, OpKind::kReload, Module::kOptimizer, c}, works.grad_in[shape.global(c, s)]});
    for (const ModalitySync* m : mine) modality_op(*m, m->reduce, m->reduce_work, &out);
    // Muon's exchanges: bucket 0 (piece -1) gathers, bucket 1 sends the updates back.
    auto muon_op = [&](int chunk, int bucket, WorkId work) {
      out.push_back({OpKey{r, works.muon_kind, Module::kOptimizer, chunk, -1, -1,
                           dp_group_of_stage[s], bucket > 0 ? bucket : -1},
                     work, CollectiveTag(works.muon_kind, Module::kOptimizer, chunk, bucket)});
    };
    const std::vector<WorkId> none;
    const auto& muon_gather =
        sync && s < static_cast<int>(works.muon_gather.size()) ? works.muon_gather[s] : none;
    const bool pipelined = !muon_gather.empty() && works.muon_kind == OpKind::kAllToAll;
    if (!muon_gather.empty()) muon_op(pipelined ? 0 : -1, 0, muon_gather[0]);
    out.push_back({OpKey{r, OpKind::kOptStep, Module::kOptimizer}, works.opt_step[s]});
    for (size_t c = 0; pipelined && c < muon_gather.size(); ++c) {
      if (c + 1 < muon_gather.size()) muon_op(c + 1, 0, muon_gather[c + 1]);
      out.push_back({OpKey{r, OpKind::kOptStep, Module::kOptimizer, static_cast<int32_t>(c)},
                     works.muon_step[s][c]});
      muon_op(c, 1, works.muon_scatter[s][c]);
    }
    if (gather && !works.gather_first) gathers(&out);
    for (const ModalitySync* m : mine)
      if (!m->gather_first && m->gather_work >= 0)
        modality_op(*m, OpKind::kAllGather, m->gather_work, &out);
    seq = std::move(out);
  };
  // Replica 0's ranks first: the others issue their reductions in its order.
  const size_t leaders = std::min(seqs->size(), static_cast<size_t>(shape.pp));
  for (size_t r = 0; r < leaders; ++r) lower_rank(r);
  ForEachRank(*seqs, leaders, lower_rank);
}

CopyKey CopyKeyOf(const OpKey& k) {
  return {static_cast<int32_t>(k.module), k.chunk, k.mb, k.task,
          k.module == Module::kText ? -1 : k.piece};
}

std::vector<uint8_t> ChooseRemote(const std::vector<RemoteSpan>& spans,
                                  const std::vector<std::pair<double, double>>& curve, double cap) {
  std::vector<uint8_t> chosen(spans.size(), 0);
  std::vector<double> left(curve.size()), held(curve.size(), 0.0);
  for (size_t k = 0; k < curve.size(); ++k) left[k] = curve[k].second;
  // Samples in [from, to): the curve's steps that start there.
  auto range = [&](double from, double to) {
    auto lo = std::lower_bound(curve.begin(), curve.end(), std::pair{from, -HUGE_VAL});
    auto hi = std::lower_bound(curve.begin(), curve.end(), std::pair{to, -HUGE_VAL});
    return std::pair{static_cast<size_t>(lo - curve.begin()),
                     static_cast<size_t>(hi - curve.begin())};
  };
  const double highest = curve.empty() ? 0 : *std::max_element(left.begin(), left.end());
  for (;;) {
    const size_t top =
        static_cast<size_t>(std::max_element(left.begin(), left.end()) - left.begin());
    if (top >= curve.size()) break;
    const double t = curve[top].first;
    // Of the unchosen spans away at t that the holder can take, the one away longest where
    // the rank is within one span's bytes of its current highest (where it must go down).
    size_t best = spans.size();
    double best_score = -1;
    for (size_t j = 0; j < spans.size(); ++j) {
      const RemoteSpan& s = spans[j];
      if (chosen[j] || !(s.away_from <= t && t < s.away_to)) continue;
      auto [lo, hi] = range(s.away_from, s.held_to);
      double most = 0;
      for (size_t k = lo; k < hi; ++k) most = std::max(most, held[k]);
      if (most + s.bytes > cap) continue;
      std::tie(lo, hi) = range(s.away_from, s.away_to);
      double score = 0;
      for (size_t k = lo; k < hi; ++k)
        if (left[k] > left[top] - s.bytes)
          score += (k + 1 < curve.size() ? curve[k + 1].first : s.away_to) - curve[k].first;
      if (score > best_score) best = j, best_score = score;
    }
    if (best == spans.size()) break;
    chosen[best] = 1;
    const RemoteSpan& s = spans[best];
    auto [lo, hi] = range(s.away_from, s.away_to);
    for (size_t k = lo; k < hi; ++k) left[k] -= s.bytes;
    std::tie(lo, hi) = range(s.away_from, s.held_to);
    for (size_t k = lo; k < hi; ++k) held[k] += s.bytes;
  }
  // Spans that do not lower the rank's peak would only fill the holder.
  if (curve.empty() || *std::max_element(left.begin(), left.end()) >= highest)
    std::fill(chosen.begin(), chosen.end(), 0);
  return chosen;
}

Status AddHostCopies(std::vector<RankSeq>* seqs, const HostCopyModel& model, TableBuilder* b) {
  std::map<double, std::pair<WorkId, WorkId>> works;  // bytes -> (OFFLOAD, RELOAD) work
  auto copy_works = [&](double bytes) {
    auto [it, added] = works.try_emplace(bytes);
    if (added) {
      Work out, in;
      out.payload_bytes = in.payload_bytes = bytes;
      out.mem_delta_bytes = -bytes, in.mem_delta_bytes = bytes;
      it->second = {b->AddWork(out), b->AddWork(in)};
    }
    return it->second;
  };
  struct Pair {
    int f = 0, reader = 0;  // compute indices of the forward and of its first reader
    double seconds = 0;     // one copy
    double bytes = 0;
    WorkId out = 0, in = 0;
    OpKey key;
  };
  for (RankSeq& seq : *seqs) {
    std::vector<size_t> compute;                    // positions of the compute ops
    std::vector<double> start, end;                 // their predicted times
    std::vector<std::pair<CopyKey, int>> readers;   // (key, compute index)
    std::vector<std::pair<int, double>> producers;  // (compute index, bytes)
    for (size_t p = 0; p < seq.size(); ++p) {
      const OpKey& k = seq[p].key;
      if (!IsCompute(k.kind)) continue;
      const int ci = static_cast<int>(compute.size());
      compute.push_back(p);
      const auto [s, e] = model.times(seq[p]);
      if (s < 0)
        return Internal(fmt::format("{}: no predicted time to place copies by", FormatOp(k)));
      start.push_back(s), end.push_back(end.empty() ? e : std::max(e, end.back()));
      if (ReadsSaved(k.kind)) readers.push_back({CopyKeyOf(k), ci});
      if (k.kind == OpKind::kF)
        if (const double bytes = model.saved(seq[p]); bytes > 0) producers.push_back({ci, bytes});
    }
    if (producers.empty()) continue;
    std::sort(readers.begin(), readers.end());
    std::vector<Pair> pairs;
    for (auto [ci, bytes] : producers) {
      const OpKey& k = seq[compute[ci]].key;
      auto r = std::upper_bound(readers.begin(), readers.end(), std::pair{CopyKeyOf(k), ci});
      if (r == readers.end() || r->first != CopyKeyOf(k)) continue;
      auto [out, in] = copy_works(bytes);
      const int32_t holder = model.holder(seq[compute[ci]]);
      pairs.push_back(
          {ci, r->second, model.copy_seconds(bytes, k.rank, holder), bytes, out, in, k});
      pairs.back().key.peer = holder;
    }
    // RELOADs run as late as their readers allow, one after another (latest reader first),
    // and OFFLOADs as early as their forwards allow; a pair whose OFFLOAD would not end
    // before its RELOAD starts stays on the device.
    std::sort(pairs.begin(), pairs.end(),
              [](const Pair& x, const Pair& y) { return x.reader < y.reader; });
    std::vector<double> reload_start(pairs.size());
    double free_from = std::numeric_limits<double>::infinity();
    for (size_t j = pairs.size(); j-- > 0;) {
      reload_start[j] = std::min(start[pairs[j].reader], free_from) - pairs[j].seconds;
      free_from = reload_start[j];
    }
    std::vector<size_t> order(pairs.size());
    for (size_t j = 0; j < order.size(); ++j) order[j] = j;
    std::sort(order.begin(), order.end(),
              [&](size_t x, size_t y) { return pairs[x].f < pairs[y].f; });
    std::vector<std::tuple<size_t, int, PendingOp>> inserts;  // (after position, order, op)
    // Each RELOAD follows the last compute op that ends by its start (after the forward).
    std::vector<int> after(pairs.size());
    for (size_t j = 0; j < pairs.size(); ++j)
      after[j] = static_cast<int>(std::upper_bound(end.begin(), end.end(), reload_start[j]) -
                                  end.begin()) -
                 1;
    // Remote pairs (host pairs of another module may share the rank): those that even
    // memory.
    std::vector<uint8_t> chosen(pairs.size(), 1);
    std::vector<size_t> remote;
    std::vector<RemoteSpan> spans;
    for (size_t j = 0; j < pairs.size(); ++j) {
      if (pairs[j].key.peer < 0) continue;
      const double back = after[j] >= 0 ? end[after[j]] : 0;  // the RELOAD starts
      remote.push_back(j);
      spans.push_back(
          {end[pairs[j].f] + pairs[j].seconds, back, back + pairs[j].seconds, pairs[j].bytes});
    }
    if (!remote.empty()) {
      const int32_t rank = pairs[remote[0]].key.rank;
      const std::vector<uint8_t> sent =
          ChooseRemote(spans, model.curve(rank), model.hold_cap(rank));
      for (size_t k = 0; k < remote.size(); ++k) chosen[remote[k]] = sent[k];
    }
    double out_free = 0;
    for (size_t j : order) {
      const Pair& q = pairs[j];
      const double out_end = std::max(end[q.f], out_free) + q.seconds;
      if (!chosen[j] || out_end > reload_start[j] || after[j] <= q.f || after[j] >= q.reader)
        continue;
      out_free = out_end;
      OpKey k = q.key;  // its peer: the holder (a gang's group is not the copy's)
      k.kind = OpKind::kOffload;
      inserts.push_back({compute[q.f], -1, PendingOp{k, q.out}});
      k.kind = OpKind::kReload;
      inserts.push_back({compute[after[j]], q.reader, PendingOp{k, q.in}});
    }
    if (inserts.empty()) continue;
    std::sort(inserts.begin(), inserts.end(), [](const auto& x, const auto& y) {
      return std::tie(std::get<0>(x), std::get<1>(x)) < std::tie(std::get<0>(y), std::get<1>(y));
    });
    RankSeq out;
    out.reserve(seq.size() + inserts.size());
    size_t next = 0;
    for (size_t p = 0; p < seq.size(); ++p) {
      out.push_back(seq[p]);
      for (; next < inserts.size() && std::get<0>(inserts[next]) == p; ++next)
        out.push_back(std::get<2>(inserts[next]));
    }
    seq = std::move(out);
  }
  return Status::Ok();
}

namespace {

// Sorts tag << 32 | op values by tag, stably (two passes of 16 bits). Ops were added in
// increasing order, so equal tags stay in op order: the order of sorting the values whole.
void SortByTag(std::vector<uint64_t>* v) {
  std::vector<uint64_t> tmp(v->size());
  for (int shift : {32, 48}) {
    std::vector<size_t> start(size_t{1} << 16 | 1, 0);
    for (uint64_t x : *v) ++start[(x >> shift & 0xffff) + 1];
    for (size_t k = 1; k < start.size(); ++k) start[k] += start[k - 1];
    for (uint64_t x : *v) tmp[start[x >> shift & 0xffff]++] = x;
    v->swap(tmp);
  }
}

// What linking ranks [from, to) of the sequences found: their dependencies in the order
// found, SENDs and RECVs as tag << 32 | op.
struct Linked {
  std::vector<std::pair<TableBuilder::Handle, TableBuilder::Handle>> deps;
  std::vector<uint64_t> sends, recvs;
  Status status = Status::Ok();
};

// Links ranks [from, to): their ops become handles from `first` on, in sequence order
// (TableBuilder::Set; the columns are sized). Their SENDs and RECVs are paired later.
Linked LinkRanks(std::vector<RankSeq>& seqs, size_t from, size_t to, TableBuilder::Handle first,
                 size_t total, TableBuilder* b) {
  Linked out;
  // (tag, op) as tag << 32 | op: sorted as the pairs would be, by one integer compare.
  static_assert(sizeof(TableBuilder::Handle) == 4);
  auto tagged = [](uint32_t tag, TableBuilder::Handle h) { return uint64_t{tag} << 32 | h; };
  auto dep = [&](TableBuilder::Handle op, TableBuilder::Handle on) {
    out.deps.push_back({op, on});
  };
  TableBuilder::Handle next = first;
  size_t ops = 0, linked = 0;
  for (size_t r = from; r < to; ++r) ops += seqs[r].size();
  out.sends.reserve(ops / 4);
  out.recvs.reserve(ops / 4);
  for (size_t r = from; r < to; ++r) {
    RankSeq& seq = seqs[r];
    // Last backward per (module, chunk) so far, and the rank's gradient collectives.
    std::vector<std::pair<int64_t, TableBuilder::Handle>> last_backward;
    std::vector<TableBuilder::Handle> grad_collectives;
    TableBuilder::Handle opt_step = UINT32_MAX;  // the last OPT_STEP so far
    std::vector<std::pair<int32_t, TableBuilder::Handle>> steps, muon_gathers,
        muon_back;  // (chunk, op)
    // Host copies: the last compute op, activations on their way out and back.
    TableBuilder::Handle last_compute = UINT32_MAX;
    // Pipeline ZeRO-2: the last per-micro-batch reduction, gradient copies per chunk.
    TableBuilder::Handle last_grad_reduce = UINT32_MAX;
    std::map<int32_t, std::vector<TableBuilder::Handle>> grad_out;
    std::vector<TableBuilder::Handle> grad_out_all, grad_in;
    std::vector<std::pair<CopyKey, TableBuilder::Handle>> offloaded, reloaded;
    auto take = [](std::vector<std::pair<CopyKey, TableBuilder::Handle>>& v, const CopyKey& key) {
      auto it = std::find_if(v.begin(), v.end(), [&](auto& x) { return x.first == key; });
      if (it == v.end()) return TableBuilder::Handle{UINT32_MAX};
      const TableBuilder::Handle h = it->second;
      *it = v.back();
      v.pop_back();
      return h;
    };
    // All-gathers that open the step: (module, chunk or -1 for a modality, op).
    std::vector<std::tuple<Module, int32_t, TableBuilder::Handle>> early_gather;
    for (const PendingOp& op : seq) {
      const OpKey& k = op.key;
      if (k.rank != static_cast<int32_t>(r)) {  // each part appends to its own ranks only
        out.status = Internal(fmt::format("{} in the sequence of rank {}", FormatOp(k), r));
        return out;
      }
      const TableBuilder::Handle h = next++;
      b->Set(h, k, op.work, op.tag);
      b->Append(h);
      // Text gradients sync per chunk; modality gradients once per module (chunks are shards).
      const int32_t chunk = k.module == Module::kText ? k.chunk : -1;
      const int64_t mc = static_cast<int64_t>(k.module) << 32 | static_cast<uint32_t>(chunk);
      auto last = std::find_if(last_backward.begin(), last_backward.end(),
                               [&](auto& x) { return x.first == mc; });
      if (IsCopy(k.kind) && k.module == Module::kOptimizer) {
        // Gradient shards (pipeline ZeRO-2): an OFFLOAD after its reduction; a RELOAD after
        // its chunk's last OFFLOAD; the optimizer step after the RELOADs.
        if (k.kind == OpKind::kOffload) {
          if (last_grad_reduce != UINT32_MAX) dep(h, last_grad_reduce);
          grad_out[k.chunk].push_back(h);
          grad_out_all.push_back(h);
        } else {
          if (!grad_out[k.chunk].empty()) dep(h, grad_out[k.chunk].back());
          grad_in.push_back(h);
        }
      } else if (IsCopy(k.kind)) {  // saved activations: after the compute op before it
        if (last_compute != UINT32_MAX) dep(h, last_compute);
        if (k.kind == OpKind::kOffload) {
          offloaded.push_back({CopyKeyOf(k), h});
        } else {
          const TableBuilder::Handle o = take(offloaded, CopyKeyOf(k));
          if (o == UINT32_MAX) {
            out.status = Internal(fmt::format("{}: no OFFLOAD before it", FormatOp(k)));
            return out;
          }
          dep(h, o);
          reloaded.push_back({CopyKeyOf(k), h});
        }
      } else if (IsCompute(k.kind)) {
        last_compute = h;
        if (ReadsSaved(k.kind) && !reloaded.empty())
          if (const TableBuilder::Handle back = take(reloaded, CopyKeyOf(k)); back != UINT32_MAX)
            dep(h, back);
      }
      if (IsSend(k.kind)) {
        out.sends.push_back(tagged(op.tag, h));
      } else if (IsRecv(k.kind)) {
        out.recvs.push_back(tagged(op.tag, h));
      } else if (k.kind == OpKind::kB || k.kind == OpKind::kW) {
        // Pipeline ZeRO-2: the rank's gradient double buffer is free again once the shard
        // of the weight gradients two backwards back (any chunk) is on the host.
        if (k.module == Module::kText && grad_out_all.size() >= 2)
          dep(h, grad_out_all[grad_out_all.size() - 2]);
        if (last == last_backward.end())
          last_backward.push_back({mc, h});
        else
          last->second = h;
      } else if (IsCollective(k.kind) && k.module == Module::kOptimizer) {
        // Muon: a gather follows the gradients (back from the host too); the updates sent
        // back follow their chunk's step.
        if (k.piece == 1) {
          for (auto [step_chunk, step] : steps)
            if (step_chunk == k.chunk) dep(h, step);
          muon_back.push_back({k.chunk, h});
        } else {
          for (TableBuilder::Handle g : grad_in) dep(h, g);
          for (TableBuilder::Handle c : grad_collectives) dep(h, c);
          muon_gathers.push_back({k.chunk, h});
        }
      } else if (k.kind == OpKind::kOptStep) {
        // The step over the shard (chunk -1) after every gradient collective; a Muon chunk's
        // step after its gather; each after the gradients back from the host.
        opt_step = h;
        steps.push_back({k.chunk, h});
        if (k.chunk < 0)
          for (TableBuilder::Handle c : grad_collectives) dep(h, c);
        for (auto [gather_chunk, g] : muon_gathers)
          if (gather_chunk == k.chunk) dep(h, g);
        for (TableBuilder::Handle c : grad_in) dep(h, c);
      } else if (k.kind == OpKind::kAllGather && opt_step != UINT32_MAX) {
        dep(h, opt_step);
        for (auto [chunk_back, back] : muon_back)  // the updated parameters are back
          if (chunk_back == k.chunk && k.module == Module::kText) dep(h, back);
      } else if (k.kind == OpKind::kAllGather) {
        early_gather.push_back({k.module, k.module == Module::kText ? k.chunk : -1, h});
      } else if (k.kind == OpKind::kF) {
        for (auto& [module, gather_chunk, g] : early_gather)
          if (module == k.module && gather_chunk == chunk && g != UINT32_MAX)
            dep(h, g), g = UINT32_MAX;
      } else if (IsCollective(k.kind) && k.module == Module::kText && k.chunk < 0) {
        // The tied embedding's gradient: complete after the rank's last text backward (and
        // back from the host, pipeline ZeRO-2).
        for (auto& [key, op_h] : last_backward)
          if (key >> 32 == static_cast<int64_t>(Module::kText)) dep(h, op_h);
        for (TableBuilder::Handle g : grad_in) dep(h, g);
        grad_collectives.push_back(h);
      } else if (IsCollective(k.kind)) {
        if (last != last_backward.end()) dep(h, last->second);
        grad_collectives.push_back(h);
        if (k.mb >= 0) last_grad_reduce = h;  // a per-micro-batch reduction
      }
    }
    RankSeq().swap(seq);  // in the builder now: released as it goes
    if (total >= kReleaseFromOps && ++linked % 256 == 0) ReleaseFreeMemory();
  }
  return out;
}

}  // namespace

Status Link(std::vector<RankSeq> seqs, TableBuilder* b, size_t parallel_from) {
  const size_t R = seqs.size();
  std::vector<size_t> begin(R + 1, b->size());  // each rank's first handle
  for (size_t r = 0; r < R; ++r) begin[r + 1] = begin[r] + seqs[r].size();
  const size_t total = begin[R] - begin[0];
  // The sequences' growth (sends, receives, collectives added) leaves freed blocks behind;
  // the columns below take memory as the ranks are linked and their sequences released.
  if (total >= kReleaseFromOps) ReleaseFreeMemory();
  b->Resize(begin[R]);
  // Large tables are linked in two parts of ranks side by side (the rank that holds the
  // middle op starts the second), each into its own handles; the dependencies are added in
  // rank order, as one pass over the ranks would add them.
  const size_t mid =
      total >= parallel_from
          ? std::upper_bound(begin.begin(), begin.end(), begin[0] + total / 2) - begin.begin() - 1
          : R;
  std::array<Linked, 2> part;
  RunParallel(mid < R ? 2 : 1, [&](size_t k) {
    const size_t from = k == 0 ? 0 : mid, to = k == 0 ? mid : R;
    part[k] = LinkRanks(seqs, from, to, static_cast<TableBuilder::Handle>(begin[from]), total, b);
  });
  for (Linked& p : part) RETURN_IF_ERROR(p.status);
  auto tag_of = [](uint64_t x) { return static_cast<uint32_t>(x >> 32); };
  auto op_of = [](uint64_t x) { return static_cast<TableBuilder::Handle>(x); };
  std::vector<uint64_t> sends = std::move(part[0].sends), recvs = std::move(part[0].recvs);
  sends.insert(sends.end(), part[1].sends.begin(), part[1].sends.end());
  recvs.insert(recvs.end(), part[1].recvs.begin(), part[1].recvs.end());
  for (Linked& p : part) b->AddDeps(std::move(p.deps));
  SortByTag(&sends);
  SortByTag(&recvs);
  for (size_t i = 1; i < sends.size(); ++i)
    if (tag_of(sends[i]) == tag_of(sends[i - 1]))
      return Internal(fmt::format("two sends share tag {} ({})", tag_of(sends[i]),
                                  FormatOp(b->key(op_of(sends[i])))));
  size_t j = 0;
  for (const uint64_t recv : recvs) {
    const uint32_t tag = tag_of(recv);
    while (j < sends.size() && tag_of(sends[j]) < tag) ++j;
    if (j == sends.size() || tag_of(sends[j]) != tag)
      return Internal(fmt::format("no send for {}", FormatOp(b->key(op_of(recv)))));
    b->AddDep(op_of(recv), op_of(sends[j]));
  }
  return Status::Ok();
}

}  // namespace pipeplan
