#include "executor/cpu_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "executor/fp8_storage.h"

namespace pipeplan {
namespace {

// The replica whose first stage consumes vision op i's output: the peer of its SEND_F,
// else its own rank (then a first stage).
std::map<std::tuple<int, int, int>, int> VisionConsumers(const Table& t) {
  std::map<std::tuple<int, int, int>, int> consumer;  // (mb, task, shard) -> replica
  for (OpId i = 0; i < t.size(); ++i) {
    if (t.module(i) != Module::kVision) continue;
    std::tuple<int, int, int> key{t.mb(i), t.task(i), t.chunk(i)};
    if (t.kind(i) == OpKind::kSendF)
      consumer[key] = t.ranks()[t.peer(i)].dp;
    else if (t.kind(i) == OpKind::kF && !consumer.count(key))
      consumer[key] = t.ranks()[t.rank(i)].dp;
  }
  return consumer;
}

Tensor Row0(const Tensor& x, int d) {
  return Tensor(x.begin(), x.begin() + d);
}

// FP8 storage (a forward marked saved_fp8): a saved tensor becomes E4M3 codes with block
// scales; what stays is the values its backward reads back from them.
void StoreFp8(Tensor* x, int row) {
  *x = DequantiseFp8(QuantiseFp8(*x, row));
}
void StoreFp8From(std::vector<Tensor>* saved, size_t first, int row) {
  for (size_t k = first; k < saved->size(); ++k) StoreFp8(&(*saved)[k], row);
}

}  // namespace

double MaxRelativeError(const Tensor& a, const Tensor& b) {
  if (a.size() != b.size()) return INFINITY;
  double diff = 0, scale = 1e-300;
  for (size_t i = 0; i < a.size(); ++i)
    diff = std::max(diff, std::abs(a[i] - b[i])), scale = std::max(scale, std::abs(b[i]));
  return diff / scale;
}

void HeldActivations::Put(int32_t holder, OpId offload, std::vector<Tensor> v) {
  std::lock_guard<std::mutex> lock(mu_);
  held_[{holder, offload}] = std::move(v);
}

bool HeldActivations::Take(int32_t holder, OpId offload, std::vector<Tensor>* v) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find({holder, offload});
  if (it == held_.end()) return false;
  *v = std::move(it->second);
  held_.erase(it);
  return true;
}

CpuBackend::CpuBackend(const Table& t, int32_t rank, std::shared_ptr<const TinyModel> model,
                       std::shared_ptr<HeldActivations> held)
    : t_(t),
      rank_(rank),
      stage_(t.ranks()[rank].pp),
      replica_(t.ranks()[rank].dp),
      stages_(t.meta().pp * t.meta().vp),
      m_(std::move(model)),
      grads_(m_->ZeroGrads()),
      held_(std::move(held)),
      sent_(m_->ZeroGrads()) {
  for (OpId i = t.rank_begin(rank); i < t.rank_end(rank); ++i) {
    grads_to_host_ = grads_to_host_ || (IsCopy(t.kind(i)) && t.module(i) == Module::kOptimizer);
    if (t.module(i) != Module::kVision) continue;
    TaskKey key{t.mb(i), t.task(i), t.chunk(i)};
    if (t.kind(i) == OpKind::kRecvF) ++vision_expected_[t.mb(i)];
    if (t.kind(i) == OpKind::kSendF) vision_remote_[key] = true;
  }
  // A task's output is made by its forward over its last layers (its last piece).
  for (OpId i = t.rank_begin(rank); i < t.rank_end(rank); ++i)
    if (t.module(i) == Module::kVision && t.kind(i) == OpKind::kF &&
        t.work(i).layer_end >= m_->vision_layers() &&
        !vision_remote_.count({t.mb(i), t.task(i), t.chunk(i)}))
      ++vision_expected_[t.mb(i)];
}

Status CpuBackend::Compute(OpId op) {
  const Module mod = t_.module(op);
  const OpKind k = t_.kind(op);
  if (k == OpKind::kOptStep) {                      // gradients are what the check compares
    while (!partition_.empty() && !grads_to_host_)  // ZeRO-2: the GPU's shards are the step's
      RETURN_IF_ERROR(PartitionBack(partition_.begin()->first));
    return Status::Ok();
  }
  if (IsCopy(k)) return mod == Module::kOptimizer ? GradCopy(op) : HostCopy(op);
  if (mod == Module::kText && k == OpKind::kF) return TextForward(op);
  if (mod == Module::kText && (k == OpKind::kB || k == OpKind::kI)) return TextBackward(op);
  if (mod == Module::kText && k == OpKind::kW) return TextWeightGrad(op);
  if (mod == Module::kVision && (k == OpKind::kF || k == OpKind::kRecompute))
    return VisionForward(op, k == OpKind::kRecompute);
  if (mod == Module::kVision && k == OpKind::kB) return VisionBackward(op);
  if (mod == Module::kGenerator && t_.chunk(op) >= 0) return GeneratorShard(op);
  if (mod == Module::kGenerator && k == OpKind::kF) {
    if (!out_.count({stages_ - 1, t_.mb(op)}))
      return Internal("the last stage's output is missing");
    return Status::Ok();
  }
  if (mod == Module::kGenerator && k == OpKind::kB) {
    const StageKey last{stages_ - 1, t_.mb(op)};
    if (!out_.count(last)) return Internal("the last stage's output is missing");
    loss_ += m_->Head(out_[last], m_->Target(replica_, t_.mb(op)), &dout_[last], &grads_);
    return Status::Ok();
  }
  return Internal(fmt::format("the CPU backend cannot run {}", KindName(k)));
}

namespace {

// The dependency of `op` of kind `kind` (its forward for an OFFLOAD, its OFFLOAD for a
// RELOAD), or UINT32_MAX.
OpId DepOfKind(const Table& t, OpId op, OpKind kind) {
  for (OpId d : t.deps(op))
    if (t.kind(d) == kind) return d;
  return UINT32_MAX;
}

bool AnyEmpty(const std::vector<Tensor>& v) {
  return std::any_of(v.begin(), v.end(), [](const Tensor& x) { return x.empty(); });
}

constexpr const char* kOnHost = "its saved activations are in host memory (no RELOAD ran)";

// A reduction per micro-batch (ZeRO-2): it contributes what its chunk's gradients
// gained since the previous one.
bool PerMicroBatch(const Table& t, OpId op) {
  return IsMicroBatchReduction(t.module(op), t.mb(op), t.kind(op));
}

}  // namespace

std::vector<std::pair<std::vector<Tensor>*, size_t>> CpuBackend::SavedBy(OpId f) {
  std::vector<std::pair<std::vector<Tensor>*, size_t>> out;
  if (t_.module(f) == Module::kText) {
    auto sv = saved_.find({t_.meta().global_stage(t_.chunk(f), stage_), t_.mb(f)});
    if (sv != saved_.end())
      for (size_t i = 0; i < sv->second.size(); ++i) out.push_back({&sv->second, i});
  } else if (t_.module(f) == Module::kVision) {
    auto sv = vision_saved_.find({t_.mb(f), t_.task(f), t_.chunk(f)});
    if (sv == vision_saved_.end()) return out;
    const int L = m_->vision_layers(), begin = std::max(0, t_.work(f).layer_begin);
    const int end = t_.work(f).layer_end < 0 ? L : std::min(L, t_.work(f).layer_end);
    for (int i = begin; i < end + (end == L ? 1 : 0); ++i)
      if (static_cast<size_t>(i) < sv->second.size()) out.push_back({&sv->second, i});
  }
  return out;  // the generator keeps nothing here (its head runs in its backward)
}

// OFFLOAD moves its forward's saved tensors to host memory (or into the holder rank's);
// RELOAD moves them back.
Status CpuBackend::HostCopy(OpId op) {
  const int32_t holder = t_.peer(op);
  if (holder >= 0 && !held_)
    return Internal(
        fmt::format("its activations are held by rank {}, not in this process "
                    "(remote offload runs with --local-ranks)",
                    holder));
  const bool out = t_.kind(op) == OpKind::kOffload;
  const OpId offload = out ? op : DepOfKind(t_, op, OpKind::kOffload);
  if (offload == UINT32_MAX) return Internal("it reloads what no OFFLOAD moved out");
  const OpId f = DepOfKind(t_, offload, OpKind::kF);
  if (f == UINT32_MAX) return Internal("its OFFLOAD does not follow a forward");
  auto slots = SavedBy(f);
  if (out) {
    std::vector<Tensor> moved;
    for (auto [stack, i] : slots) moved.push_back(std::move((*stack)[i])), (*stack)[i].clear();
    if (holder >= 0)
      held_->Put(holder, op, std::move(moved));
    else if (!host_.emplace(op, std::move(moved)).second)
      return Internal("it runs twice");
    return Status::Ok();
  }
  std::vector<Tensor> back;
  if (holder >= 0 ? !held_->Take(holder, offload, &back) : host_.count(offload) == 0)
    return Internal("it runs before its OFFLOAD");
  if (holder < 0) back = std::move(host_[offload]), host_.erase(offload);
  if (back.size() != slots.size())
    return Internal("the activations it reloads no longer have their places");
  for (size_t k = 0; k < slots.size(); ++k) (*slots[k].first)[slots[k].second] = std::move(back[k]);
  return Status::Ok();
}

// OFFLOAD: the reduced gradient of (chunk, micro-batch) leaves the GPU buffer and is added
// to the chunk's host partition; RELOAD: the partition replaces the chunk's gradients.
Status CpuBackend::GradCopy(OpId op) {
  const int chunk = t_.chunk(op);
  if (t_.kind(op) == OpKind::kReload) return PartitionBack(chunk);
  auto it = grad_buffer_.find({chunk, t_.mb(op)});
  if (it == grad_buffer_.end()) return Internal("its reduced gradient is not in the buffer");
  RETURN_IF_ERROR(AddToPartition(chunk, it->second));
  grad_buffer_.erase(it);
  return Status::Ok();
}

Status CpuBackend::AddToPartition(int chunk, const Tensor& shard) {
  Tensor& part = partition_[chunk];
  if (part.empty()) part.assign(shard.size(), 0.0);
  if (part.size() != shard.size()) return Internal("gradient shards of different sizes");
  for (size_t k = 0; k < part.size(); ++k) part[k] += shard[k];
  return Status::Ok();
}

Status CpuBackend::PartitionBack(int chunk) {
  // The chunk's slice: the one its reductions use.
  OpId reduce = UINT32_MAX;
  for (OpId i = t_.rank_begin(rank_); i < t_.rank_end(rank_) && reduce == UINT32_MAX; ++i)
    if (PerMicroBatch(t_, i) && IsCollective(t_.kind(i)) && t_.chunk(i) == chunk) reduce = i;
  auto it = partition_.find(chunk);
  if (reduce == UINT32_MAX || it == partition_.end())
    return Internal("no reduced gradient of its chunk was kept");
  size_t off, len;
  Tensor* all = Slice(reduce, &off, &len);
  if (it->second.size() != len) return Internal("the partition has the wrong size");
  std::copy(it->second.begin(), it->second.end(), all->begin() + off);
  partition_.erase(it);
  return Status::Ok();
}

Status CpuBackend::TextForward(OpId op) {
  const int g = t_.meta().global_stage(t_.chunk(op), stage_), mb = t_.mb(op);
  Tensor x;
  if (g == 0) {
    x = m_->TextInput(replica_, mb);
    auto& rows = vision_in_[mb];
    if (static_cast<int>(rows.size()) != vision_expected_[mb])
      return Internal(
          fmt::format("{} of {} visual inputs arrived", rows.size(), vision_expected_[mb]));
    for (const auto& [task, v] : rows)
      for (int j = 0; j < m_->width(); ++j) x[j] += v[j];
  } else {
    auto it = in_.find({g, mb});
    if (it == in_.end()) return Internal("its input from the previous stage has not arrived");
    x = std::move(it->second);
    in_.erase(it);
  }
  const Work& w = t_.work(op);
  if (w.layer_begin < 0 || w.layer_end > m_->text_layers())
    return Internal("its layer range is outside the model");
  auto& saved = saved_[{g, mb}];
  const size_t first = saved.size();
  m_->Forward(Module::kText, w.layer_begin, w.layer_end, &x, &saved);
  if (w.saved_fp8) StoreFp8From(&saved, first, m_->width());
  if (g == stages_ - 1 && !m_->has_generator())
    loss_ += m_->Head(x, m_->Target(replica_, mb), &dout_[{g, mb}], &grads_);
  if (g + 1 < stages_ && Here(g + 1)) in_[{g + 1, mb}] = x;  // next chunk on this rank
  out_[{g, mb}] = std::move(x);
  return Status::Ok();
}

// A backward split into bucket pieces runs from the last layers to the first: the first
// piece takes the output gradient, the others the gradient the piece before left; the
// piece that reaches the chunk's first layer finishes as a whole backward does.
Status CpuBackend::TextBackward(OpId op) {
  const int g = t_.meta().global_stage(t_.chunk(op), stage_), mb = t_.mb(op);
  auto sv = saved_.find({g, mb});
  if (sv == saved_.end()) return Internal("it runs before its forward");
  std::vector<Tensor>& saved = sv->second;
  const Work& w = t_.work(op);
  const size_t layers = static_cast<size_t>(w.layer_end - w.layer_begin);
  auto& source = t_.piece(op) > 0 ? text_dx_ : dout_;
  auto it = source.find({g, mb});
  if (it == source.end())
    return Internal(t_.piece(op) > 0 ? "it runs before the piece of its later layers"
                                     : "its output gradient has not arrived");
  if (w.layer_begin < 0 || layers > saved.size())
    return Internal("its layer range is outside its forward's");
  std::vector<Tensor> mine(saved.end() - static_cast<std::ptrdiff_t>(layers), saved.end());
  if (AnyEmpty(mine)) return Internal(kOnHost);
  Tensor dx = std::move(it->second);
  source.erase(it);
  saved.resize(saved.size() - layers);
  if (t_.kind(op) == OpKind::kI) {  // the weight gradients wait for W: keep inputs and dz
    WeightInputs& keep = wgrad_[{g, mb}];
    keep.begin = w.layer_begin;
    keep.inputs = mine;
    m_->BackwardInput(Module::kText, w.layer_begin, mine, &dx, &keep.dz);
  } else {
    m_->Backward(Module::kText, w.layer_begin, mine, &dx, &grads_);
  }
  if (!saved.empty()) {
    text_dx_[{g, mb}] = std::move(dx);
    return Status::Ok();
  }
  saved_.erase(sv);
  out_.erase({g, mb});
  if (g == 0)
    dx0_[mb] = Row0(dx, m_->width());
  else if (Here(g - 1))
    dout_[{g - 1, mb}] = dx;  // previous chunk on this rank
  din_[{g, mb}] = std::move(dx);
  return Status::Ok();
}

// W of a split backward: the weight gradients of its layers (all the I kept, or one bucket
// piece's layers) from the inputs and pre-activation gradients its I kept.
Status CpuBackend::TextWeightGrad(OpId op) {
  const int g = t_.meta().global_stage(t_.chunk(op), stage_), mb = t_.mb(op);
  auto it = wgrad_.find({g, mb});
  if (it == wgrad_.end()) return Internal("it runs before its input-gradient pass (I)");
  WeightInputs& keep = it->second;
  const Work& w = t_.work(op);
  const int lo = w.layer_begin - keep.begin, hi = w.layer_end - keep.begin;
  if (w.layer_begin < 0 || lo < 0 || hi > static_cast<int>(keep.inputs.size()) || lo > hi)
    return Internal("its layer range is outside its I's");
  const std::vector<Tensor> in(keep.inputs.begin() + lo, keep.inputs.begin() + hi);
  const std::vector<Tensor> dz(keep.dz.begin() + lo, keep.dz.begin() + hi);
  m_->WeightGrad(Module::kText, w.layer_begin, in, dz, &grads_);
  keep.done += hi - lo;
  if (keep.done >= static_cast<int>(keep.inputs.size())) wgrad_.erase(it);
  return Status::Ok();
}

// A vision forward runs the layers of its work: a whole task, or one layer-group piece
// (pieces run in layer order on one rank; each appends its layers' inputs to the task's
// saved stack, and the last one projects).
Status CpuBackend::VisionForward(OpId op, bool recompute) {
  const TaskKey key{t_.mb(op), t_.task(op), t_.chunk(op)};
  const int begin = std::max(0, t_.work(op).layer_begin), L = m_->vision_layers();
  const int end = t_.work(op).layer_end < 0 ? L : std::min(L, t_.work(op).layer_end);
  Tensor u;
  std::vector<Tensor>& saved = vision_saved_[key];
  if (begin == 0) {
    u = m_->VisionInput(t_.mb(op), t_.task(op), std::max(0, t_.chunk(op)));
    saved.clear();
  } else {
    auto it = vision_act_.find(key);
    if (it == vision_act_.end() || static_cast<int>(saved.size()) != begin)
      return Internal("it runs before the piece of its earlier layers");
    u = std::move(it->second);
    vision_act_.erase(it);
  }
  const size_t first = saved.size();
  m_->Forward(Module::kVision, begin, end, &u, &saved);
  if (end == L) saved.push_back(u);  // projector input
  if (t_.work(op).saved_fp8) StoreFp8From(&saved, first, m_->width());
  if (end < L) {
    vision_act_[key] = std::move(u);
    return Status::Ok();
  }
  if (recompute) return Status::Ok();
  Tensor v = m_->Project(u);
  if (vision_remote_.count(key))
    vision_out_[key] = std::move(v);
  else
    vision_in_[t_.mb(op)][{t_.task(op), t_.chunk(op)}] = std::move(v);
  return Status::Ok();
}

// Backward pieces run from the last layers to the first; the last layers' piece takes the
// gradient of the task's output, the others the gradient the later piece left.
Status CpuBackend::VisionBackward(OpId op) {
  const TaskKey key{t_.mb(op), t_.task(op), t_.chunk(op)};
  const int begin = std::max(0, t_.work(op).layer_begin), L = m_->vision_layers();
  const int end = t_.work(op).layer_end < 0 ? L : std::min(L, t_.work(op).layer_end);
  auto sv = vision_saved_.find(key);
  if (sv == vision_saved_.end()) return Internal("it runs before its forward");
  std::vector<Tensor>& saved = sv->second;
  if (AnyEmpty(
          std::vector<Tensor>(saved.begin() + std::min<size_t>(begin, saved.size()), saved.end())))
    return Internal(kOnHost);
  Tensor du;
  if (end < L) {
    auto it = vision_dx_.find(key);
    if (it == vision_dx_.end() || static_cast<int>(saved.size()) != end)
      return Internal("it runs before the piece of its later layers");
    du = std::move(it->second);
    vision_dx_.erase(it);
  } else {
    if (static_cast<int>(saved.size()) != L + 1) return Internal("it runs before its forward");
    StatusOr<Tensor> dv = VisionOutputGradient(op);
    if (!dv.ok()) return dv.status();
    du = m_->ProjectBack(saved.back(), *dv, &grads_);
    saved.pop_back();
  }
  std::vector<Tensor> mine(saved.begin() + begin, saved.end());
  saved.resize(begin);
  m_->Backward(Module::kVision, begin, mine, &du, &grads_);
  if (begin > 0)
    vision_dx_[key] = std::move(du);
  else
    vision_saved_.erase(sv);
  return Status::Ok();
}

StatusOr<Tensor> CpuBackend::VisionOutputGradient(OpId op) {
  const TaskKey key{t_.mb(op), t_.task(op), t_.chunk(op)};
  Tensor dv;
  if (vision_remote_.count(key)) {
    auto it = vision_grad_.find(key);
    if (it == vision_grad_.end()) return Internal("its gradient has not arrived");
    dv = std::move(it->second);
    vision_grad_.erase(it);
  } else {
    auto it = dx0_.find(t_.mb(op));
    if (it == dx0_.end()) return Internal("its gradient does not exist yet");
    dv = it->second;
  }
  return dv;
}

// A shard of a generator split over k ranks (its gang): each computes the head on the last
// stage's hidden states with weight 1/k, so the shards' losses, weight gradients and input
// gradients add up to the whole generator's; the last stage sums the input gradients.
Status CpuBackend::GeneratorShard(OpId op) {
  const int mb = t_.mb(op);
  const bool last = Here(stages_ - 1);
  const StageKey out{stages_ - 1, mb};
  const Tensor* x = nullptr;
  if (last) {
    auto it = out_.find(out);
    x = it == out_.end() ? nullptr : &it->second;
  } else {
    auto it = gen_in_.find(mb);
    x = it == gen_in_.end() ? nullptr : &it->second;
  }
  if (x == nullptr) return Internal("the last stage's output has not arrived");
  if (t_.kind(op) == OpKind::kF) return Status::Ok();
  const double k = static_cast<double>(t_.group(t_.peer(op)).size());
  ParamSet g = m_->ZeroGrads();
  Tensor dx;
  loss_ += m_->Head(*x, m_->Target(replica_, mb), &dx, &g) / k;
  for (Module mod : {Module::kText, Module::kVision, Module::kGenerator}) {
    Tensor& mine = grads_.of(mod);
    const Tensor& part = g.of(mod);
    for (size_t i = 0; i < part.size(); ++i) mine[i] += part[i] / k;
  }
  for (double& v : dx) v /= k;
  if (last) {
    Tensor& sum = dout_[out];
    sum.resize(dx.size(), 0.0);
    for (size_t i = 0; i < dx.size(); ++i) sum[i] += dx[i];
  } else {
    gen_in_.erase(mb);
    gen_dx_[mb] = std::move(dx);
  }
  return Status::Ok();
}

StatusOr<Tensor> CpuBackend::Outgoing(OpId op) {
  const int g = t_.meta().global_stage(t_.chunk(op), stage_), mb = t_.mb(op);
  if (t_.module(op) == Module::kGenerator) {
    if (t_.kind(op) == OpKind::kSendF) {
      auto it = out_.find({stages_ - 1, mb});
      if (it == out_.end()) return Internal("the output it sends does not exist yet");
      return it->second;
    }
    auto it = gen_dx_.find(mb);
    if (it == gen_dx_.end()) return Internal("the gradient it sends does not exist yet");
    Tensor dx = std::move(it->second);
    gen_dx_.erase(it);
    return dx;
  }
  if (t_.module(op) == Module::kVision) {
    if (t_.kind(op) == OpKind::kSendB) {
      auto it = dx0_.find(mb);
      if (it == dx0_.end()) return Internal("the gradient it sends does not exist yet");
      return it->second;
    }
    auto it = vision_out_.find({mb, t_.task(op), t_.chunk(op)});
    if (it == vision_out_.end()) return Internal("the output it sends does not exist yet");
    Tensor v = std::move(it->second);
    vision_out_.erase(it);
    return v;
  }
  auto& from = t_.kind(op) == OpKind::kSendF ? out_ : din_;
  auto it = from.find({g, mb});
  if (it == from.end()) return Internal("the tensor it sends does not exist yet");
  Tensor x = it->second;
  if (t_.kind(op) == OpKind::kSendB) din_.erase(it);
  return x;
}

Status CpuBackend::Incoming(OpId op, Tensor data) {
  const int g = t_.meta().global_stage(t_.chunk(op), stage_), mb = t_.mb(op);
  if (t_.module(op) == Module::kGenerator) {
    if (t_.kind(op) == OpKind::kRecvF) {
      gen_in_[mb] = std::move(data);
    } else {
      Tensor& sum = dout_[{stages_ - 1, mb}];
      sum.resize(data.size(), 0.0);
      for (size_t i = 0; i < data.size(); ++i) sum[i] += data[i];
    }
    return Status::Ok();
  }
  if (t_.module(op) == Module::kVision) {
    if (t_.kind(op) == OpKind::kRecvF)
      vision_in_[mb][{t_.task(op), t_.chunk(op)}] = std::move(data);
    else
      vision_grad_[{mb, t_.task(op), t_.chunk(op)}] = std::move(data);
    return Status::Ok();
  }
  (t_.kind(op) == OpKind::kRecvF ? in_ : dout_)[{g, mb}] = std::move(data);
  return Status::Ok();
}

// The gradient slice a collective reduces: a text chunk's layers, or a whole module.
Tensor* CpuBackend::Slice(OpId op, size_t* offset, size_t* length) {
  const size_t dd = static_cast<size_t>(m_->width()) * m_->width();
  Tensor& all = grads_.of(t_.module(op));
  *offset = 0, *length = all.size();
  if (t_.module(op) == Module::kText) {
    // The layers of the chunk (its forward), or of one bucket (its backward piece).
    const bool bucket = t_.piece(op) >= 0;
    for (OpId i = t_.rank_begin(rank_); i < t_.rank_end(rank_); ++i) {
      const OpKind k = t_.kind(i);
      if (t_.module(i) != Module::kText || t_.chunk(i) != t_.chunk(op) ||
          !(bucket ? k == OpKind::kB || k == OpKind::kW : k == OpKind::kF) ||
          t_.piece(i) != t_.piece(op))
        continue;
      const Work& w = t_.work(i);
      *offset = dd * w.layer_begin, *length = dd * (w.layer_end - w.layer_begin);
      return &all;
    }
    *length = 0;  // no compute of that chunk here: nothing to reduce
  }
  return &all;
}

namespace {

// Parameters' all-gathers and Muon's exchanges carry nothing numeric here: the check
// compares gradients, and the optimizer step does not run.
bool NothingNumeric(const Table& t, OpId op) {
  return t.kind(op) == OpKind::kAllGather || t.module(op) == Module::kOptimizer;
}

}  // namespace

StatusOr<Tensor> CpuBackend::Contribution(OpId op) {
  if (NothingNumeric(t_, op)) return Tensor{};
  size_t off, len;
  Tensor* all = Slice(op, &off, &len);
  Tensor mine(all->begin() + off, all->begin() + off + len);
  if (PerMicroBatch(t_, op)) {
    Tensor& sent = sent_.of(Module::kText);
    for (size_t k = 0; k < len; ++k) mine[k] -= sent[off + k], sent[off + k] += mine[k];
  }
  return mine;
}

Status CpuBackend::Reduced(OpId op, Tensor sum) {
  if (NothingNumeric(t_, op)) return Status::Ok();
  size_t off, len;
  Tensor* all = Slice(op, &off, &len);
  if (sum.size() != len) return Internal("reduced gradient has the wrong size");
  if (PerMicroBatch(t_, op)) {
    if (!grads_to_host_) return AddToPartition(t_.chunk(op), sum);
    grad_buffer_[{t_.chunk(op), t_.mb(op)}] = std::move(sum);  // until its OFFLOAD
    return Status::Ok();
  }
  std::copy(sum.begin(), sum.end(), all->begin() + off);
  return Status::Ok();
}

Reference RunReference(const Table& t, const TinyModel& m, bool fp8_storage) {
  // Which saved tensors the plan's forwards store in FP8: text layers per replica, a vision
  // task's layer inputs and its projector input (index L).
  const int L = m.vision_layers();
  std::vector<std::vector<char>> text_fp8(t.meta().dp, std::vector<char>(m.text_layers(), 0));
  std::map<std::tuple<int, int, int>, std::vector<char>> vision_fp8;
  for (OpId i = 0; fp8_storage && i < t.size(); ++i) {
    const Work& w = t.work(i);
    // Vision forwards, or the RECOMPUTE that rebuilds what a forward did not keep.
    if (!(t.kind(i) == OpKind::kF || t.kind(i) == OpKind::kRecompute) || !w.saved_fp8) continue;
    if (t.module(i) == Module::kText) {
      for (int layer = std::max(0, w.layer_begin); layer < std::min(m.text_layers(), w.layer_end);
           ++layer)
        text_fp8[t.ranks()[t.rank(i)].dp][layer] = 1;
    } else if (t.module(i) == Module::kVision) {
      auto& flags = vision_fp8[{t.mb(i), t.task(i), t.chunk(i)}];
      flags.resize(L + 1, 0);
      const int end = w.layer_end < 0 ? L : std::min(L, w.layer_end);
      for (int k = std::max(0, w.layer_begin); k < end + (end == L ? 1 : 0); ++k) flags[k] = 1;
    }
  }
  auto store = [&](std::vector<Tensor>* saved, const std::vector<char>& flags) {
    for (size_t k = 0; k < saved->size() && k < flags.size(); ++k)
      if (flags[k]) StoreFp8(&(*saved)[k], m.width());
  };
  Reference ref;
  ref.grads = m.ZeroGrads();
  ref.abs_grads = m.ZeroGrads();
  ref.depth = m.text_layers() + m.vision_layers() + 2;
  ParamSet mine = m.ZeroGrads();  // one micro-batch's contribution
  const int d = m.width(), dp = t.meta().dp, M = t.meta().microbatches;
  std::map<std::pair<int, int>, std::vector<std::tuple<int, int, int>>>
      tasks;  // (replica, mb) -> tasks
  for (auto& [key, replica] : VisionConsumers(t)) tasks[{replica, std::get<0>(key)}].push_back(key);
  for (int r = 0; r < dp; ++r) {
    for (int mb = 0; mb < M; ++mb) {
      Tensor x = m.TextInput(r, mb);
      std::vector<std::vector<Tensor>> vsaved;
      for (auto& [tmb, task, shard] : tasks[{r, mb}]) {
        Tensor u = m.VisionInput(tmb, task, std::max(0, shard));
        std::vector<Tensor> saved;
        m.Forward(Module::kVision, 0, m.vision_layers(), &u, &saved);
        saved.push_back(u);
        if (auto it = vision_fp8.find({tmb, task, shard}); it != vision_fp8.end())
          store(&saved, it->second);
        Tensor v = m.Project(u);
        for (int j = 0; j < d; ++j) x[j] += v[j];
        vsaved.push_back(std::move(saved));
      }
      std::vector<Tensor> saved;
      m.Forward(Module::kText, 0, m.text_layers(), &x, &saved);
      store(&saved, text_fp8[r]);
      Tensor dx;
      for (Module mod : {Module::kText, Module::kVision, Module::kGenerator})
        std::fill(mine.of(mod).begin(), mine.of(mod).end(), 0.0);
      const double loss = m.Head(x, m.Target(r, mb), &dx, &mine);
      ref.loss += loss, ref.abs_loss += std::abs(loss);
      m.Backward(Module::kText, 0, saved, &dx, &mine);
      const Tensor dv = Row0(dx, d);
      for (auto& vs : vsaved) {
        Tensor du = m.ProjectBack(vs.back(), dv, &mine);
        vs.pop_back();
        m.Backward(Module::kVision, 0, vs, &du, &mine);
      }
      for (Module mod : {Module::kText, Module::kVision, Module::kGenerator})
        for (size_t k = 0; k < mine.of(mod).size(); ++k)
          ref.grads.of(mod)[k] += mine.of(mod)[k],
              ref.abs_grads.of(mod)[k] += std::abs(mine.of(mod)[k]);
      ref.terms += 1 + static_cast<int>(vsaved.size());
    }
  }
  return ref;
}

}  // namespace pipeplan
