#include "planner/lower.h"

#include <fmt/format.h>

#include <algorithm>

namespace pipeplan {

uint32_t CollectiveTag(OpKind kind, Module module, int32_t chunk, int bucket) {
  return (static_cast<uint32_t>(bucket) << 26) | (static_cast<uint32_t>(module) << 24) |
         (static_cast<uint32_t>(kind) << 16) | static_cast<uint32_t>(chunk + 1);
}

std::vector<RankSeq> ExpandStages(const std::vector<StageOrder>& orders, const PipelineShape& shape,
                                  const std::vector<WorkId>& f_work,
                                  const std::vector<WorkId>& b_work) {
  std::vector<RankSeq> seqs(static_cast<size_t>(shape.dp) * shape.pp);
  for (int d = 0; d < shape.dp; ++d) {
    for (int s = 0; s < shape.pp; ++s) {
      RankSeq& seq = seqs[shape.rank(d, s)];
      seq.reserve(orders[s].size() * 3 + 8);
      for (const Step& st : orders[s]) {
        int g = st.chunk * shape.pp + s;
        OpKey k{shape.rank(d, s), st.kind, Module::kText, st.chunk, st.mb};
        seq.push_back({k, st.kind == OpKind::kF ? f_work[g] : b_work[g]});
      }
    }
  }
  return seqs;
}

void AddSendRecv(std::vector<RankSeq>* seqs, const PipelineShape& shape, WorkId p2p_work) {
  if (shape.pp == 1) return;  // all stages on one rank: data stays local
  const int S = shape.stages();
  auto tag = [&](int d, int sender_stage, int mb, int dir) {
    return static_cast<uint32_t>(
        1 + ((static_cast<int64_t>(d) * S + sender_stage) * shape.m + mb) * 2 + dir);
  };
  for (RankSeq& seq : *seqs) {
    if (seq.empty()) continue;
    RankSeq out;
    out.reserve(seq.size() * 2 + 8);
    for (const PendingOp& op : seq) {
      const OpKey& k = op.key;
      const int d = k.rank / shape.pp, s = k.rank % shape.pp, g = k.chunk * shape.pp + s;
      auto p2p = [&](OpKind kind, int other_stage, int sender_stage, int dir) {
        OpKey pk{
            k.rank, kind, Module::kText, k.chunk, k.mb, -1, shape.rank(d, other_stage % shape.pp)};
        out.push_back({pk, p2p_work, tag(d, sender_stage, k.mb, dir)});
      };
      if (k.module != Module::kText || (k.kind != OpKind::kF && k.kind != OpKind::kB)) {
        out.push_back(op);
        continue;
      }
      if (k.kind == OpKind::kF) {
        if (g > 0) p2p(OpKind::kRecvF, g - 1, g - 1, 0);
        out.push_back(op);
        if (g < S - 1) p2p(OpKind::kSendF, g + 1, g, 0);
      } else {
        if (g < S - 1) p2p(OpKind::kRecvB, g + 1, g + 1, 1);
        out.push_back(op);
        if (g > 0) p2p(OpKind::kSendB, g - 1, g, 1);
      }
    }
    seq = std::move(out);
  }
}

void AddGradSync(std::vector<RankSeq>* seqs, const PipelineShape& shape, int zero_stage,
                 const GradSyncWorks& works, const std::vector<int32_t>& dp_group_of_stage,
                 const std::vector<ModalitySync>& modality) {
  const bool sync = shape.dp > 1;
  const OpKind reduce = zero_stage >= 1 ? OpKind::kReduceScatter : OpKind::kAllReduce;
  const bool buckets = sync && !works.bucket_piece.empty();
  for (int32_t r = 0; r < static_cast<int32_t>(seqs->size()); ++r) {
    RankSeq& seq = (*seqs)[r];
    const int s = r % shape.pp;
    std::vector<int> backwards_left(shape.vp, 0);
    for (const PendingOp& op : seq)
      if (op.key.module == Module::kText && op.key.kind == OpKind::kB)
        ++backwards_left[op.key.chunk];
    auto gathers = [&](RankSeq* out) {
      for (int c = 0; c < shape.vp; ++c) {
        OpKey gk{r, OpKind::kAllGather, Module::kText, c, -1, -1, dp_group_of_stage[s]};
        out->push_back({gk, works.gather[c * shape.pp + s],
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
    // runs a rank's ops one by one then sends the gradient before it blocks in the
    // collective (the engine's streams do not need it; a blocking executor would deadlock).
    RankSeq pending;
    auto flush = [&] {
      for (PendingOp& p : pending) out.push_back(std::move(p));
      pending.clear();
    };
    for (const PendingOp& op : seq) {
      if (!IsP2P(op.key.kind)) flush();
      const bool text_b = op.key.module == Module::kText && op.key.kind == OpKind::kB;
      const bool last = sync && text_b && --backwards_left[op.key.chunk] == 0;
      const int g = op.key.chunk * shape.pp + s;
      if (!last) {
        out.push_back(op);
      } else if (buckets) {
        for (size_t k = 0; k < works.bucket_piece[g].size(); ++k) {
          flush();
          OpKey pk = op.key;
          pk.piece = static_cast<int32_t>(k);
          out.push_back({pk, works.bucket_piece[g][k]});
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
    for (const ModalitySync* m : mine) modality_op(*m, m->reduce, m->reduce_work, &out);
    out.push_back({OpKey{r, OpKind::kOptStep, Module::kOptimizer}, works.opt_step[s]});
    if (gather && !works.gather_first) gathers(&out);
    for (const ModalitySync* m : mine)
      if (!m->gather_first && m->gather_work >= 0)
        modality_op(*m, OpKind::kAllGather, m->gather_work, &out);
    seq = std::move(out);
  }
}

Status Link(std::vector<RankSeq> seqs, TableBuilder* b) {
  size_t total = 0;
  for (const RankSeq& s : seqs) total += s.size();
  b->Reserve(total);
  using Tagged = std::pair<uint32_t, TableBuilder::Handle>;  // (tag, op)
  std::vector<Tagged> sends, recvs;
  sends.reserve(total / 4);
  recvs.reserve(total / 4);
  for (RankSeq& seq : seqs) {
    // Last backward per (module, chunk) so far, and the rank's gradient collectives.
    std::vector<std::pair<int64_t, TableBuilder::Handle>> last_backward;
    std::vector<TableBuilder::Handle> grad_collectives;
    TableBuilder::Handle opt_step = UINT32_MAX;
    // All-gathers that open the step: (module, chunk or -1 for a modality, op).
    std::vector<std::tuple<Module, int32_t, TableBuilder::Handle>> early_gather;
    for (const PendingOp& op : seq) {
      const OpKey& k = op.key;
      TableBuilder::Handle h = b->AddAndAppend(k, op.work, op.tag);
      // Text gradients sync per chunk; modality gradients once per module (chunks are shards).
      const int32_t chunk = k.module == Module::kText ? k.chunk : -1;
      const int64_t mc = static_cast<int64_t>(k.module) << 32 | static_cast<uint32_t>(chunk);
      auto last = std::find_if(last_backward.begin(), last_backward.end(),
                               [&](auto& x) { return x.first == mc; });
      if (IsSend(k.kind)) {
        sends.push_back({op.tag, h});
      } else if (IsRecv(k.kind)) {
        recvs.push_back({op.tag, h});
      } else if (k.kind == OpKind::kB || k.kind == OpKind::kW) {
        if (last == last_backward.end())
          last_backward.push_back({mc, h});
        else
          last->second = h;
      } else if (k.kind == OpKind::kOptStep) {
        opt_step = h;
        for (TableBuilder::Handle c : grad_collectives) b->AddDep(h, c);
      } else if (k.kind == OpKind::kAllGather && opt_step != UINT32_MAX) {
        b->AddDep(h, opt_step);
      } else if (k.kind == OpKind::kAllGather) {
        early_gather.push_back({k.module, k.module == Module::kText ? k.chunk : -1, h});
      } else if (k.kind == OpKind::kF) {
        for (auto& [module, gather_chunk, g] : early_gather)
          if (module == k.module && gather_chunk == chunk && g != UINT32_MAX)
            b->AddDep(h, g), g = UINT32_MAX;
      } else if (IsCollective(k.kind)) {
        if (last != last_backward.end()) b->AddDep(h, last->second);
        grad_collectives.push_back(h);
      }
    }
  }
  std::sort(sends.begin(), sends.end());
  std::sort(recvs.begin(), recvs.end());
  for (size_t i = 1; i < sends.size(); ++i)
    if (sends[i].first == sends[i - 1].first)
      return Internal(fmt::format("two sends share tag {} ({})", sends[i].first,
                                  FormatOp(b->key(sends[i].second))));
  size_t j = 0;
  for (auto [tag, h] : recvs) {
    while (j < sends.size() && sends[j].first < tag) ++j;
    if (j == sends.size() || sends[j].first != tag)
      return Internal(fmt::format("no send for {}", FormatOp(b->key(h))));
    b->AddDep(h, sends[j].second);
  }
  return Status::Ok();
}

}  // namespace pipeplan
