#include "planner/placement.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <queue>
#include <set>
#include <tuple>

namespace pipeplan {
namespace {

constexpr uint32_t kModalityTagBase = 0x80000000u;   // SEND/RECV of modality tasks
constexpr uint32_t kGeneratorTagBase = 0xA0000000u;  // split generator: gangs, then p2p
constexpr uint32_t kGangTagBase = 0xC0000000u;       // gang ops: 4 per piece (F, B, RECOMPUTE)

int FirstStage(const PipelineShape& s, int d) {
  return s.rank(d, 0);
}
int LastStage(const PipelineShape& s, int d) {
  return s.rank(d, s.home(s.stages() - 1).pp_rank);
}

Anchor Before(OpKind k, int chunk, int mb) {
  return {k, chunk, mb, false};
}
Anchor After(OpKind k, int chunk, int mb) {
  return {k, chunk, mb, true};
}
Anchor End() {
  return {OpKind::kF, 0, -1, false};
}

}  // namespace

std::vector<VisionPlacement> PlaceVisionInline(const PipelineShape& s, const ModalityWork& w) {
  std::vector<VisionPlacement> out;
  for (const VisionTask& t : w.vision)
    out.push_back(
        {FirstStage(s, t.d), Before(OpKind::kF, 0, t.mb), After(OpKind::kB, 0, t.mb), false});
  return out;
}

std::vector<VisionPlacement> PlaceVisionDecoupled(const PipelineShape&, const ModalityWork& w,
                                                  bool recompute) {
  // On the ranks dynamic CP chose (balanced over the job): all forwards before the rank's
  // first text op, all backwards after its last one. A gang waits for all of its ranks:
  // its forward shards come first on each rank (every rank starts there at once), its
  // backward shards last (ranks end their text at different times; their own tasks fill
  // the wait), in the job's order of gangs.
  std::vector<VisionPlacement> out;
  for (const VisionTask& t : w.vision) {
    out.push_back({t.rank, Before(OpKind::kF, 0, 0), End(), recompute});
    if (!t.gang_ranks.empty()) out.back().f_at = -1, out.back().b_at = 1;
  }
  return out;
}

std::vector<GeneratorPlacement> PlaceGenerator(const PipelineShape& s, const ModalityWork& w) {
  std::vector<GeneratorPlacement> out;
  const int last = s.vp - 1;
  for (const GeneratorTask& t : w.generator)
    out.push_back(
        {LastStage(s, t.d), After(OpKind::kF, last, t.mb), After(OpKind::kF, last, t.mb)});
  return out;
}

Status InsertModality(std::vector<RankSeq>* seqs, const PipelineShape& s, const ModalityWork& w,
                      const ModalityWorkIds& ids, const std::vector<VisionPlacement>& vision,
                      const std::vector<GeneratorPlacement>& generator,
                      const std::vector<std::vector<GeneratorPlacement>>& shards,
                      TableBuilder* builder) {
  // One group per gang: the ranks of its shards, in shard order.
  std::map<std::tuple<int, int, int>, std::pair<int32_t, uint32_t>>
      gang;  // (d, mb, task) -> group, tag
  {
    std::map<std::tuple<int, int, int>, std::vector<int32_t>> members;
    for (size_t i = 0; i < w.vision.size(); ++i)
      if (w.vision[i].shard >= 0)
        members[{w.vision[i].d, w.vision[i].mb, w.vision[i].task}].push_back(vision[i].rank);
    uint32_t next = 0;
    for (auto& [key, ranks] : members) {
      std::set<int32_t> distinct(ranks.begin(), ranks.end());
      if (distinct.size() != ranks.size()) return Internal("a gang has two shards on one rank");
      gang[key] = {builder->AddGroup(ranks), kGangTagBase + 4 * kMaxPieces * next++};
    }
  }
  // Position of every text compute op (F, B, I, W) per rank, by (kind, chunk, micro-batch);
  // -1 where a rank has none.
  const size_t per_rank = size_t{4} * s.vp * s.m;
  auto anchor_index = [&](size_t r, OpKind kind, int chunk, int mb) -> int64_t {
    const int k = kind == OpKind::kF ? 0 : kind == OpKind::kB ? 1 : kind == OpKind::kI ? 2 : 3;
    const bool text =
        kind == OpKind::kF || kind == OpKind::kB || kind == OpKind::kI || kind == OpKind::kW;
    if (!text || chunk < 0 || chunk >= s.vp || mb < 0 || mb >= s.m) return -1;
    return static_cast<int64_t>(r * per_rank + (static_cast<size_t>(k) * s.vp + chunk) * s.m + mb);
  };
  std::vector<int64_t> pos(seqs->size() * per_rank, -1);
  for (size_t r = 0; r < seqs->size(); ++r)
    for (size_t i = 0; i < (*seqs)[r].size(); ++i) {
      const OpKey& k = (*seqs)[r][i].key;
      const int64_t x = anchor_index(r, k.kind, k.chunk, k.mb);
      if (x < 0) continue;
      pos[x] = i;
      // The I of a split backward is where the backward's anchors are (it produces the
      // input gradient).
      if (k.kind == OpKind::kI) pos[anchor_index(r, OpKind::kB, k.chunk, k.mb)] = i;
    }
  // Insertions: (position, slot, sequence number) -> op. Slots order ops at one position:
  // 0 gradient sends after a text backward, 1 modality compute (and their RECV_B / SEND_F
  // in order), 2 RECV_F right before the text forward that consumes them.
  struct Ins {
    size_t pos;
    int slot;
    double at;  // planned start (list-scheduled policies), else an order key (decoupled)
    size_t seq;
    PendingOp op;
  };
  std::vector<std::vector<Ins>> ins(seqs->size());
  size_t counter = 0;
  Status error;
  auto at = [&](int rank, const Anchor& a) -> size_t {
    if (a.mb < 0) return (*seqs)[rank].size();
    const int64_t x = anchor_index(rank, a.kind, a.chunk, a.mb);
    if (x < 0 || pos[x] < 0) {
      error = Internal(
          fmt::format("no anchor {} c{} m{} on rank {}", KindName(a.kind), a.chunk, a.mb, rank));
      return 0;
    }
    return static_cast<size_t>(pos[x]) + (a.after ? 1 : 0);
  };
  auto add = [&](int rank, size_t p, int slot, double when, OpKey key, WorkId work,
                 uint32_t tag = 0) {
    key.rank = rank;
    ins[rank].push_back({p, slot, when, counter++, {key, work, tag}});
  };
  for (size_t i = 0; i < w.vision.size(); ++i) {
    const VisionTask& t = w.vision[i];
    const VisionPlacement& p = vision[i];
    const int c = FirstStage(s, t.d);
    const uint32_t tag = kModalityTagBase + static_cast<uint32_t>(i) * 4;
    OpKey base{0, OpKind::kF, Module::kVision, t.shard, t.mb, t.task, -1};
    uint32_t gang_tag = 0;
    if (t.shard >= 0) std::tie(base.peer, gang_tag) = gang[{t.d, t.mb, t.task}];
    // The task as pieces (a whole task is one piece, index -1): forwards in layer order,
    // the output sent after the last; its gradient received before the last piece's
    // backward, which runs first.
    std::vector<VisionPlacement::Piece> pieces = p.pieces;
    if (pieces.empty()) pieces.push_back({p.f, p.b, p.f_at, p.b_at});
    const int n = static_cast<int>(pieces.size());
    auto piece_key = [&](OpKind kind, int piece) {
      OpKey k = base;
      k.kind = kind, k.piece = n > 1 ? piece : -1;
      return k;
    };
    auto piece_tag = [&](int piece, uint32_t kind) {
      return gang_tag ? gang_tag + 4 * static_cast<uint32_t>(piece) + kind : 0;
    };
    for (int q = 0; q < n; ++q)
      add(p.rank, at(p.rank, pieces[q].f), 1, pieces[q].f_at, piece_key(OpKind::kF, q),
          n > 1 ? ids.piece_f[i][q] : ids.vision_f[i], piece_tag(q, 0));
    const size_t fpos = at(p.rank, pieces.back().f), bpos = at(p.rank, pieces.back().b);
    const double f_at = pieces.back().f_at, b_at = pieces.back().b_at;
    if (p.rank != c) {
      OpKey k = base;
      k.kind = OpKind::kSendF, k.peer = c;
      add(p.rank, fpos, 1, f_at, k, ids.vision_out[i], tag);
      k.kind = OpKind::kRecvF, k.peer = p.rank;
      add(c, at(c, Before(OpKind::kF, 0, t.mb)), 2, 0, k, ids.vision_out[i], tag);
      k.kind = OpKind::kSendB, k.peer = p.rank;
      add(c, at(c, After(OpKind::kB, 0, t.mb)), 0, 0, k, ids.vision_out[i], tag + 1);
      k.kind = OpKind::kRecvB, k.peer = c;
      add(p.rank, bpos, 1, b_at, k, ids.vision_out[i], tag + 1);
    }
    if (p.recompute)
      add(p.rank, bpos, 1, b_at, piece_key(OpKind::kRecompute, 0), ids.vision_recompute[i],
          piece_tag(0, 2));
    for (int q = n - 1; q >= 0; --q)
      add(p.rank, at(p.rank, pieces[q].b), 1, pieces[q].b_at, piece_key(OpKind::kB, q),
          n > 1 ? ids.piece_b[i][q] : ids.vision_b[i], piece_tag(q, 1));
  }
  std::vector<int32_t> replica_group(s.dp, -1);
  for (size_t i = 0; i < w.generator.size(); ++i) {
    const GeneratorTask& t = w.generator[i];
    OpKey k{0, OpKind::kF, Module::kGenerator, -1, t.mb, -1, -1};
    if (shards.empty()) {
      const GeneratorPlacement& p = generator[i];
      add(p.rank, at(p.rank, p.f), 1, -1, k, ids.generator_f[i]);
      k.kind = OpKind::kB;
      add(p.rank, at(p.rank, p.b), 1, -1, k, ids.generator_b[i]);
      continue;
    }
    // Split over the replica's ranks: a gang (F then B) per shard; shard = the rank's stage.
    if (replica_group[t.d] < 0) {
      std::vector<int32_t> members;
      for (int st = 0; st < s.pp; ++st) members.push_back(s.rank(t.d, st));
      replica_group[t.d] = builder->AddGroup(std::move(members));
    }
    const int last = LastStage(s, t.d), vlast = s.vp - 1;
    const uint32_t gang_tag = kGeneratorTagBase + static_cast<uint32_t>(i) * 4;
    for (const GeneratorPlacement& p : shards[static_cast<size_t>(t.d) * s.m + t.mb]) {
      const uint32_t tag = kGeneratorTagBase + 0x08000000u +
                           (static_cast<uint32_t>(i) * s.pp + static_cast<uint32_t>(p.shard)) * 2;
      const size_t where = at(p.rank, p.f);
      OpKey g{0, OpKind::kRecvF, Module::kGenerator, p.shard, t.mb, -1, last};
      if (p.rank != last) {
        g.kind = OpKind::kSendF, g.peer = p.rank;
        add(last, at(last, After(OpKind::kF, vlast, t.mb)), 0, 0, g, ids.generator_io, tag);
        g.kind = OpKind::kRecvF, g.peer = last;
        add(p.rank, where, 1, p.at, g, ids.generator_io, tag);
      }
      g.kind = OpKind::kF, g.peer = replica_group[t.d];
      add(p.rank, where, 1, p.at, g, ids.generator_f[i], gang_tag);
      g.kind = OpKind::kB;
      add(p.rank, where, 1, p.at, g, ids.generator_b[i], gang_tag + 1);
      if (p.rank != last) {
        g.kind = OpKind::kSendB, g.peer = last;
        add(p.rank, where, 1, p.at, g, ids.generator_io, tag + 1);
        g.kind = OpKind::kRecvB, g.peer = p.rank;
        add(last, at(last, Before(OpKind::kB, vlast, t.mb)), 2, 0, g, ids.generator_io, tag + 1);
      }
    }
  }
  if (!error.ok()) return error;
  ForEachRank(*seqs, 0, [&](size_t r) {
    if (ins[r].empty()) return;
    std::stable_sort(ins[r].begin(), ins[r].end(), [](const Ins& a, const Ins& b) {
      return std::tie(a.pos, a.slot, a.at, a.seq) < std::tie(b.pos, b.slot, b.at, b.seq);
    });
    RankSeq out;
    out.reserve((*seqs)[r].size() + ins[r].size());
    size_t j = 0;
    for (size_t i = 0; i <= (*seqs)[r].size(); ++i) {
      for (; j < ins[r].size() && ins[r][j].pos == i; ++j) out.push_back(ins[r][j].op);
      if (i < (*seqs)[r].size()) out.push_back((*seqs)[r][i]);
    }
    (*seqs)[r] = std::move(out);
  });
  return Status::Ok();
}

}  // namespace pipeplan
