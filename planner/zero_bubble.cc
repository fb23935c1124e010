#include "planner/zero_bubble.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <deque>
#include <optional>

namespace pipeplan {
namespace {

// Unit costs and memory of the zero-bubble constructions: every pass takes one unit,
// transfers are free; an F makes one micro-batch pending, its I keeps it, its W frees it.
constexpr double kCost = 1, kComm = 0;
constexpr int kMemF = 1, kMemI = 0, kMemW = -1;
enum Pass { kPassF = 0, kPassI = 1, kPassW = 2 };  // the authors' F, B (input gradient), W
constexpr OpKind kPassKind[3] = {OpKind::kF, OpKind::kI, OpKind::kW};

// The greedy construction of the ZB paper (section 3.1), one variant. State per stage: the
// passes placed so far (counts per kind), the time the stage is free, pending micro-batches,
// and the bubble it has accumulated since its first F.
class GreedyH {
 public:
  GreedyH(int pp, int m, int max_pending, bool allow_bubble_before_first_b, bool prioritize_b,
          bool no_bubble_greedy)
      : S_(pp),
        M_(m),
        limit_(max_pending),
        allow_(allow_bubble_before_first_b),
        prioritize_(prioritize_b),
        greedy_(no_bubble_greedy),
        n_(pp, {0, 0, 0}),
        end_(pp, 0),
        mem_(pp, 0),
        bubble_(pp, 0),
        t_(3 * static_cast<size_t>(pp) * m, 0),
        orders_(pp) {}

  // Returns false when the pending limit cannot be kept.
  bool Run() {
    for (int i = 0; i < M_; ++i) {
      if (i == 0) {
        First();
        continue;
      }
      // Micro-batch i >= 1. Each stage takes one more F, except (prioritize_b) a stage two
      // or more F ahead of the next one whose F (with the W the limit would force first)
      // would delay its I beyond what the largest bubble so far allows; and no stage takes
      // an F the stage after it does not.
      std::vector<int> want(S_, 0);
      for (int j = 0; j < S_; ++j) {
        if (n_[j][kPassF] >= M_) continue;
        if (j + 1 < S_ && n_[j][kPassF] >= n_[j + 1][kPassF] + 2 && prioritize_) {
          const double next = end_[j + 1] + kCost + kCost + kComm;
          if (end_[j] >= next) continue;
          double w_cost = 0;
          int w_cnt = 0, with_w = mem_[j] + kMemF;
          while (with_w > limit_ && n_[j][kPassW] + w_cnt < n_[j][kPassI]) {
            w_cost += kCost, with_w += kMemW, ++w_cnt;
          }
          if (end_[j] + kCost + w_cost <= next) {
            want[j] = 1;
            continue;
          }
          if (next - end_[j] <= MaxBubble() - bubble_[j]) continue;
        }
        want[j] = 1;
      }
      for (int j = S_ - 2; j >= 0; --j) want[j] = std::min(want[j], want[j + 1]);
      for (int j = 0; j < S_; ++j) {
        if (want[j] == 0) continue;
        if (!MakeRoom(j, kMemF)) return false;
        if (j > 0) FillUntil(j, T(kPassF, j - 1, n_[j][kPassF]) + kComm);
        Put(j, kPassF);
      }
      // Then micro-batch i's I, last stage first; the first stage runs its deferred W once
      // it has no F left.
      for (int j = S_ - 1; j >= 0; --j) {
        if (!MakeRoom(j, kMemI)) return false;
        if (j + 1 < S_) FillUntil(j, T(kPassI, j + 1, i) + kComm);
        if (j == 0 && n_[j][kPassF] == M_)
          while (n_[j][kPassW] < n_[j][kPassI]) Put(j, kPassW);
        Put(j, kPassI);
      }
    }
    for (int j = 0; j < S_; ++j)
      while (n_[j][kPassW] < M_) Put(j, kPassW);
    return true;
  }

  // The longest span of a stage, from the start of its first F to the end of its last W.
  double Span() const {
    double best = 0;
    for (int j = 0; j < S_; ++j)
      best = std::max(best, T(kPassW, j, M_ - 1) - T(kPassF, j, 0) + kCost);
    return best;
  }
  std::vector<StageOrder> TakeOrders() { return std::move(orders_); }

 private:
  double& T(int pass, int stage, int mb) {
    return t_[(static_cast<size_t>(pass) * S_ + stage) * M_ + mb];
  }
  double T(int pass, int stage, int mb) const {
    return t_[(static_cast<size_t>(pass) * S_ + stage) * M_ + mb];
  }
  double MaxBubble() const { return *std::max_element(bubble_.begin(), bubble_.end()); }

  void Put(int j, int pass) {
    const int mb = n_[j][pass];
    double end = end_[j] + kCost;
    const double no_bubble = end;
    if (j > 0 && pass == kPassF) end = std::max(end, T(kPassF, j - 1, mb) + kComm + kCost);
    if (j < S_ - 1 && pass == kPassI) end = std::max(end, T(kPassI, j + 1, mb) + kComm + kCost);
    if (n_[j][kPassF] > 0) bubble_[j] += end - no_bubble;
    end_[j] = end;
    T(pass, j, mb) = end;
    mem_[j] += pass == kPassF ? kMemF : pass == kPassI ? kMemI : kMemW;
    ++n_[j][pass];
    orders_[j].push_back({kPassKind[pass], 0, mb});
  }

  // Deferred W passes run first while the next pass would exceed the pending limit.
  bool MakeRoom(int j, int mem) {
    while (mem_[j] + mem > limit_) {
      if (n_[j][kPassW] >= n_[j][kPassI]) return false;
      Put(j, kPassW);
    }
    return true;
  }

  // Deferred W passes fill the wait for an input that arrives at `ready`: those that end by
  // then, and one more that runs past it when the stage's bubble may grow that much (or
  // when it has already grown beyond the largest).
  void FillUntil(int j, double ready) {
    auto pending_w = [&] { return n_[j][kPassW] < n_[j][kPassI]; };
    while (pending_w() && end_[j] + kCost <= ready) Put(j, kPassW);
    if (pending_w() && end_[j] < ready) {
      if (ready - end_[j] <= MaxBubble() - bubble_[j]) {
        if (greedy_) Put(j, kPassW);
      } else {
        Put(j, kPassW);
      }
    }
  }

  // Micro-batch 0: its F on every stage, then as many further F as fit before its I comes
  // back (within the pending limit; each stage fewer than the one before), then its I.
  void First() {
    for (int j = 0; j < S_; ++j) Put(j, kPassF);
    std::vector<int> want(S_, 0);
    double last = 0;
    for (int j = S_ - 1; j >= 0; --j) {
      if (j == S_ - 1) {
        last = T(kPassF, j, 0) + kCost;
        continue;
      }
      int mem = mem_[j];
      double cost = end_[j];
      while (n_[j][kPassF] + want[j] < M_ && mem + kMemF <= limit_) {
        if (allow_ ? cost + kCost > last + kComm : cost >= last + kComm) break;
        mem += kMemF, cost += kCost, ++want[j];
      }
      last = std::max(cost, last + kComm) + kCost;
    }
    for (int j = 1; j < S_; ++j)
      while (want[j] > 0 && want[j] >= want[j - 1] && n_[j][kPassF] + want[j] < M_) --want[j];
    for (int j = 0; j < S_; ++j)
      for (int k = 0; k < want[j]; ++k) Put(j, kPassF);
    for (int j = S_ - 1; j >= 0; --j) Put(j, kPassI);
  }

  const int S_, M_, limit_;
  const bool allow_, prioritize_, greedy_;
  std::vector<std::array<int, 3>> n_;
  std::vector<double> end_;
  std::vector<int> mem_;
  std::vector<double> bubble_;
  std::vector<double> t_;  // end time per (pass, stage, mb)
  std::vector<StageOrder> orders_;
};

// ZB-V (the authors' V-shaped construction). Chunk 0 runs down the ranks, chunk 1 back up;
// in the construction's own numbering a backward of "chunk 0" is the backward of forward
// chunk 1 (it starts on rank 0, where the loss is), so backward chunks are flipped on
// output. Passes are counted per (kind, chunk): index kind*2 + chunk.
class GreedyV {
 public:
  GreedyV(int pp, int m, int max_pending) : S_(pp), M_(m), limit_(max_pending) {}

  struct Result {
    std::vector<StageOrder> orders;
    double max_bubble = 0;
    bool ok = false;
  };

  Result Try(bool fill_f, bool fill_b, const std::vector<double>* approved) {
    Reset(approved);
    Result r;
    if (!Build(fill_f, fill_b)) return r;
    r.ok = true;
    r.max_bubble = MaxBubble(-1);
    if (approved_max_ < 0 || r.max_bubble < approved_max_) {
      const std::vector<double> mine = bubble_;
      std::vector<StageOrder> orders = std::move(orders_);
      Result again = Try(fill_f, fill_b, &mine);
      if (again.ok && again.max_bubble < r.max_bubble) return again;
      r.orders = std::move(orders);
      return r;
    }
    r.orders = std::move(orders_);
    return r;
  }

 private:
  size_t Id(int cat, int chunk, int stage, int mb) const {
    return ((static_cast<size_t>(cat) * 2 + chunk) * S_ + stage) * M_ + mb;
  }
  double End(int cat, int chunk, int stage, int mb) const {
    return end_time_[Id(cat, chunk, stage, mb)];
  }

  void Reset(const std::vector<double>* approved) {
    count_.assign(S_, {0, 0, 0, 0, 0, 0});
    end_time_.assign(6 * static_cast<size_t>(S_) * M_, -1);
    cur_.assign(S_, 0);
    mem_.assign(S_, 0);
    bubble_.assign(S_, 0);
    pending_w_.assign(S_, {});
    orders_.assign(S_, {});
    approved_ = approved ? *approved : std::vector<double>(S_, -1);
    approved_max_ = *std::max_element(approved_.begin(), approved_.end());
  }

  double MaxBubble(int stage) const {
    double b = *std::max_element(bubble_.begin(), bubble_.end());
    if (stage >= 0) b = std::max(b, approved_max_ - approved_[stage]);
    return b;
  }

  bool Put(int cat, int chunk, int stage) {
    double end = cur_[stage] + kCost;
    const double no_bubble = end;
    const int n = count_[stage][cat * 2 + chunk];
    if (n >= M_) return false;
    const int mem = cat == 0 ? kMemF : cat == 1 ? kMemI : kMemW;
    if (mem_[stage] + mem > limit_) return false;
    // Its own earlier pass on the rank: F chunk 0 -> F chunk 1 -> B "0" -> B "1"; W after
    // its B.
    if (cat == 2 ? End(1, chunk, stage, n) < 0
                 : (cat > 0 || chunk > 0) &&
                       End((cat * 2 + chunk - 1) / 2, (cat * 2 + chunk - 1) % 2, stage, n) < 0)
      return false;
    if (cat < 2) {
      // Data dependencies: F chunk 0 and B "chunk 0" flow down the ranks, chunk 1 up.
      if (chunk == 1 && stage < S_ - 1) {
        const double e = End(cat, chunk, stage + 1, n);
        if (e < 0) return false;
        end = std::max(end, e + kComm + kCost);
      }
      if (chunk == 0 && stage > 0) {
        const double e = End(cat, chunk, stage - 1, n);
        if (e < 0) return false;
        end = std::max(end, e + kComm + kCost);
      }
    }
    if (count_[stage][0] > 0) bubble_[stage] += end - no_bubble;
    end_time_[Id(cat, chunk, stage, n)] = end;
    cur_[stage] = end;
    mem_[stage] += mem;
    // Backward chunks of the construction are flipped: its "chunk 0" is forward chunk 1.
    orders_[stage].push_back({kPassKind[cat], cat == 0 ? chunk : 1 - chunk, n});
    if (cat == 1) pending_w_[stage].push_back(chunk);
    ++count_[stage][cat * 2 + chunk];
    return true;
  }
  bool PutW(int stage) {
    if (pending_w_[stage].empty()) return false;
    const int chunk = pending_w_[stage].front();
    pending_w_[stage].pop_front();
    return Put(2, chunk, stage);
  }
  // Deferred W fill the wait for the input of the next pass (ready at fa_end + comm).
  bool Fill(int stage, double fa_end, bool has_fa, bool fill) {
    while (!pending_w_[stage].empty() && has_fa && fa_end + kComm >= cur_[stage] + kCost)
      if (!PutW(stage)) return false;
    const double e = has_fa ? fa_end : -1;  // no producer: never worth a W
    if (!pending_w_[stage].empty() && e + kComm - cur_[stage] > MaxBubble(stage) - bubble_[stage])
      if (fill && !PutW(stage)) return false;
    return true;
  }

  bool Build(bool fill_f, bool fill_b) {
    for (int i = 0; i < S_; ++i)
      if (!Put(0, 0, i)) return false;
    for (int i = S_ - 1; i >= 0; --i) {
      if (i == S_ - 1) {
        if (!Put(0, 1, i)) return false;
        continue;
      }
      const double ready = End(0, 1, i + 1, 0) + kComm;
      while (mem_[i] + kMemF * (2 + i * 2) <= limit_ && cur_[i] + kCost <= ready &&
             count_[i][0] < M_)
        for (int j = 0; j <= i; ++j)
          if (!Put(0, 0, j)) return false;
      if (!Put(0, 1, i)) return false;
    }
    int chunk = 0;
    for (int i = 1; i < S_; ++i) {
      auto behind = [&] {
        const auto &c = count_[i], &p = count_[i - 1];
        return c[0] + c[1] < p[0] + p[1] || (c[1] <= p[1] && p[1] < M_);
      };
      while (behind()) {
        for (int j = S_ - 1; j >= i; --j)
          if (count_[j][chunk] < M_ && !Put(0, chunk, j)) return false;
        chunk = 1 - chunk;
      }
    }
    for (int round = 0; round < 2 * M_; ++round) {
      for (int i = 0; i < S_; ++i)
        while (mem_[i] + kMemI > limit_)
          if (!PutW(i)) return false;
      std::vector<int> b0, b1;
      for (int i = 0; i < S_; ++i) {
        if (count_[i][3] >= count_[i][2]) {
          b0.push_back(i);
        } else if (i == S_ - 1) {
          b1.push_back(i);
        } else if (End(1, 1, i + 1, count_[i][3]) >= 0 || count_[i][2] >= M_) {
          b1.push_back(i);
        } else {
          b0.push_back(i);
        }
      }
      std::vector<std::pair<int, int>> order;
      for (auto it = b1.rbegin(); it != b1.rend(); ++it) order.push_back({*it, 1});
      for (int i : b0) order.push_back({i, 0});
      for (auto [i, c] : order) {
        bool has = false;
        double fa = -1;
        if (c == 1 && i < S_ - 1) has = true, fa = End(1, 1, i + 1, count_[i][3]);
        if (c == 0 && i > 0) has = true, fa = End(1, 0, i - 1, count_[i][2]);
        if (!Fill(i, fa, has, c == 1 || fill_b)) return false;
        if (!Put(1, c, i)) return false;
      }
      for (int i = 0; i < S_; ++i) {
        if (count_[i][1] >= M_) continue;
        int item = -1;
        if (count_[i][1] >= count_[i][0]) {
          item = 0;
        } else if (i == S_ - 1) {
          item = 1;
        } else if (End(0, 1, i + 1, count_[i][1]) >= 0) {
          item = 1;
        } else if (count_[i][0] < M_) {
          if (i == 0 || End(0, 0, i - 1, count_[i][0]) >= 0) item = 0;
        }
        if (item < 0) continue;
        while (mem_[i] + kMemF > limit_)
          if (!PutW(i)) return false;
        bool has = false;
        double fa = -1;
        if (item == 0 && i > 0) has = true, fa = End(0, 0, i - 1, count_[i][0]);
        if (item == 1 && i < S_ - 1) has = true, fa = End(0, 1, i + 1, count_[i][1]);
        if (!Fill(i, fa, has, fill_f)) return false;
        if (!Put(0, item, i)) return false;
      }
    }
    for (int i = 0; i < S_; ++i)
      while (!pending_w_[i].empty())
        if (!PutW(i)) return false;
    return true;
  }

  const int S_, M_, limit_;
  std::vector<std::array<int, 6>> count_;
  std::vector<double> end_time_, cur_, bubble_, approved_;
  double approved_max_ = -1;
  std::vector<int> mem_;
  std::vector<std::deque<int>> pending_w_;
  std::vector<StageOrder> orders_;
};

}  // namespace

StatusOr<std::vector<StageOrder>> ZeroBubbleH(int pp, int m, int max_pending) {
  if (pp < 1 || m < 1 || max_pending < 1)
    return InvalidInput("zero-bubble schedules need pp, micro-batches and the pending limit >= 1");
  std::optional<double> best;
  std::vector<StageOrder> orders;
  for (bool allow : {true, false})
    for (bool prioritize : {true, false})
      for (bool greedy : {true, false}) {
        GreedyH g(pp, m, max_pending, allow, prioritize, greedy);
        if (!g.Run()) continue;
        const double span = g.Span();
        if (!best || span < *best) best = span, orders = g.TakeOrders();
      }
  if (!best)
    return InvalidInput(
        fmt::format("no zero-bubble schedule keeps at most {} micro-batches pending", max_pending));
  return orders;
}

StatusOr<std::vector<StageOrder>> ZeroBubbleV(int pp, int m, int max_pending) {
  if (pp < 1 || m < 1 || max_pending < 1)
    return InvalidInput("zbv needs pp, micro-batches and the pending limit >= 1");
  std::optional<double> best;
  std::vector<StageOrder> orders;
  for (bool fill_b : {true, false})
    for (bool fill_f : {true, false}) {
      GreedyV g(pp, m, max_pending);
      GreedyV::Result r = g.Try(fill_f, fill_b, nullptr);
      if (!r.ok) continue;
      if (!best || r.max_bubble < *best) best = r.max_bubble, orders = std::move(r.orders);
    }
  if (!best)
    return InvalidInput(fmt::format(
        "no zbv schedule keeps at most {} chunk activations pending per rank", max_pending));
  return orders;
}

// PyTorch's interleaved zero bubble: Megatron's interleaved 1F1B over rounds of
// m / max(1, m / pp) micro-batches, each backward an I, and rank r's W deferred by r
// backwards (then one W after each I, the rest at the end).
StatusOr<std::vector<StageOrder>> InterleavedZeroBubble(int pp, int vp, int m) {
  if (pp < 1 || vp < 1 || m < 1) return InvalidInput("interleaved-zb needs pp, vp, m >= 1");
  const int rounds = std::max(1, m / pp), per_round = m / rounds;
  if (m % rounds != 0)
    return InvalidInput(fmt::format(
        "interleaved-zb needs the micro-batches ({}) to be a multiple of the rounds ({})", m,
        rounds));
  std::vector<StageOrder> orders(pp);
  for (int r = 0; r < pp; ++r) {
    const int total = vp * m;
    const int warmup = std::min((vp - 1) * per_round + (pp - 1 - r), total);
    auto fwd_chunk = [&](int op) { return (op / per_round) % vp; };
    auto bwd_chunk = [&](int op) { return vp - 1 - ((op - warmup) / per_round) % vp; };
    std::vector<int> next_f(vp, 0), next_i(vp, 0), next_w(vp, 0);
    std::vector<int> backward_ops;
    size_t weights = 0;
    StageOrder& o = orders[r];
    auto add = [&](OpKind k, int chunk, std::vector<int>& next) {
      o.push_back({k, chunk, next[chunk]++});
    };
    auto weight = [&] { add(OpKind::kW, bwd_chunk(backward_ops[weights++]), next_w); };
    for (int op = 0; op < total + warmup; ++op) {
      if (op < total) add(OpKind::kF, fwd_chunk(op), next_f);
      if (op < warmup) continue;
      add(OpKind::kI, bwd_chunk(op), next_i);
      backward_ops.push_back(op);
      if (op - warmup >= r) weight();
    }
    while (weights < backward_ops.size()) weight();
  }
  return orders;
}

// PyTorch's DualPipeV (DeepSeek's DualPipe folded into a V): chunk 0 holds stage r, chunk
// 1 stage 2 pp - 1 - r. Backwards are whole (B) except where the schedule uses zero
// bubble (I now, its W from a FIFO later); the main phase pairs a forward of one chunk
// with a backward of the other (overlap_next on the forward).
StatusOr<std::vector<StageOrder>> DualPipeV(int pp, int m) {
  if (pp < 1 || m < 2 * pp)
    return InvalidInput(fmt::format(
        "dualpipev needs at least as many micro-batches as stages (2 pp = {}), got {}", 2 * pp, m));
  std::vector<StageOrder> orders(pp);
  for (int r = 0; r < pp; ++r) {
    StageOrder& o = orders[r];
    int next_f[2] = {0, 0}, next_b[2] = {0, 0};
    std::deque<std::pair<int, int>> weights;  // (chunk, mb) of I whose W is pending
    auto forward = [&](int c, bool overlap = false) {
      o.push_back({OpKind::kF, c, next_f[c]++, overlap});
    };
    auto backward = [&](int c, bool split) {
      const int mb = next_b[c]++;
      o.push_back({split ? OpKind::kI : OpKind::kB, c, mb});
      if (split) weights.push_back({c, mb});
    };
    auto weight = [&] {
      if (weights.empty()) return;
      o.push_back({OpKind::kW, weights.front().first, weights.front().second});
      weights.pop_front();
    };
    auto pair = [&](int fc, int bc) {
      forward(fc, true);
      backward(bc, false);
    };
    for (int i = 0; i < 2 * (pp - r - 1); ++i) forward(0);
    for (int i = 0; i <= r; ++i) forward(0), forward(1);
    for (int i = 0; i < pp - r - 1; ++i) {
      backward(1, true);
      weight();
      forward(1);
    }
    for (int i = 0; i < m - 2 * pp + r + 1; ++i) {
      if (i == 0 && r == pp - 1) {  // not overlapped: a smaller bubble
        forward(0);
        backward(1, false);
      } else {
        pair(0, 1);
      }
      pair(1, 0);
    }
    for (int i = 0; i < pp - r - 1; ++i) {
      backward(1, false);
      pair(1, 0);
    }
    bool zb = false;
    const int half = (r + 1) / 2;
    for (int i = 0; i <= r; ++i) {
      if (i == half && r % 2 == 1) zb = true;
      backward(1, zb);
      if (i == half && r % 2 == 0) zb = true;
      backward(0, zb);
    }
    for (int i = 0; i < pp - r - 1; ++i) {
      weight();
      backward(0, zb);
    }
    for (int i = 0; i <= r; ++i) weight();
  }
  return orders;
}

}  // namespace pipeplan
