#include "executor/check.h"

#include <fmt/format.h>

#include <cmath>

#include "executor/cpu_backend.h"

namespace pipeplan {

CheckResult CompareWithReference(const Table& t, const TinyModel& model,
                                 const std::vector<ParamSet>& grads, double loss) {
  CheckResult res;
  res.loss = loss;
  Reference ref = RunReference(t, model, /*fp8_storage=*/true);
  res.reference_loss = ref.loss;
  res.loss_error = std::abs(res.loss - ref.loss) / std::max(std::abs(ref.loss), 1e-300);
  constexpr double u = 0x1.0p-53;
  const double orders = 2.0 * (std::max(1, ref.terms) - 1 + ref.depth) * u;
  auto bound = [&](double abs_sum, double sum) {
    return std::max(1e-12, orders * abs_sum / std::max(std::abs(sum), 1e-300));
  };
  res.loss_tolerance = bound(ref.abs_loss, ref.loss);
  // Text gradients: each layer from the replica-0 rank whose forward runs it (reduced over
  // DP); stages may hold different numbers of layers.
  std::vector<int32_t> owner(model.text_layers(), 0);
  for (OpId i = 0; i < t.size(); ++i)
    if (t.module(i) == Module::kText && t.kind(i) == OpKind::kF && t.ranks()[t.rank(i)].dp == 0)
      for (int layer = std::max(0, t.work(i).layer_begin);
           layer < std::min(model.text_layers(), t.work(i).layer_end); ++layer)
        owner[layer] = t.rank(i);
  const size_t dd = static_cast<size_t>(model.width()) * model.width();
  Tensor text(ref.grads.text.size());
  for (int layer = 0; layer < model.text_layers(); ++layer) {
    const Tensor& g = grads[owner[layer]].text;
    std::copy(g.begin() + dd * layer, g.begin() + dd * (layer + 1), text.begin() + dd * layer);
  }
  // Modality gradients: when the plan syncs them, a member of the sync group holds their
  // sum over the group (every rank that has any); else summed here.
  int32_t synced[3] = {-1, -1, -1};
  for (OpId i = 0; i < t.size(); ++i)
    if (IsCollective(t.kind(i)) && t.kind(i) != OpKind::kAllGather &&
        (t.module(i) == Module::kVision || t.module(i) == Module::kGenerator))
      synced[static_cast<int>(t.module(i))] = t.rank(i);
  auto modality = [&](Module m) {
    ParamSet sum = model.ZeroGrads();
    const int32_t member = synced[static_cast<int>(m)];
    for (size_t r = 0; r < grads.size(); ++r) {
      if (member >= 0 && static_cast<int32_t>(r) != member) continue;
      ParamSet g = grads[r];
      for (size_t k = 0; k < sum.of(m).size(); ++k) sum.of(m)[k] += g.of(m)[k];
    }
    return sum.of(m);
  };
  struct Part {
    const char* name;
    Tensor got, want;
  };
  std::vector<Part> parts = {{"text", text, ref.grads.text},
                             {"vision", modality(Module::kVision), ref.grads.vision},
                             {"generator", modality(Module::kGenerator), ref.grads.generator}};
  const Tensor* abs_of[3] = {&ref.abs_grads.text, &ref.abs_grads.vision, &ref.abs_grads.generator};
  double worst_ratio = 0;
  for (size_t k = 0; k < parts.size(); ++k) {
    const Part& p = parts[k];
    if (p.want.empty()) continue;
    double e = MaxRelativeError(p.got, p.want);
    double abs_max = 0, want_max = 0;
    for (size_t i = 0; i < p.want.size(); ++i)
      abs_max = std::max(abs_max, (*abs_of[k])[i]),
      want_max = std::max(want_max, std::abs(p.want[i]));
    const double tol = bound(abs_max, want_max);
    if (e / tol > worst_ratio || res.worst.empty())
      worst_ratio = e / tol, res.max_grad_error = e, res.grad_tolerance = tol, res.worst = p.name;
  }
  for (OpId i = 0; i < t.size(); ++i)  // the generator keeps nothing here to quantise
    res.fp8_storage |= t.work(i).saved_fp8 && t.module(i) != Module::kGenerator;
  if (res.fp8_storage) {
    const Reference plain = RunReference(t, model, /*fp8_storage=*/false);
    for (Module m : {Module::kText, Module::kVision, Module::kGenerator})
      if (!plain.grads.of(m).empty())
        res.fp8_effect =
            std::max(res.fp8_effect, MaxRelativeError(ref.grads.of(m), plain.grads.of(m)));
  }
  return res;
}

StatusOr<CheckResult> RunCpuLocal(const Table& t, const RunOptions& o, bool check,
                                  Timeline* measured) {
  auto model = std::make_shared<const TinyModel>(t, TinyDims{});
  std::vector<std::unique_ptr<Backend>> backends;
  auto held = std::make_shared<HeldActivations>();  // every rank runs in this process
  for (int32_t r = 0; r < t.num_ranks(); ++r)
    backends.push_back(std::make_unique<CpuBackend>(t, r, model, held));
  RETURN_IF_ERROR(RunLocal(t, backends, o, measured));
  std::vector<ParamSet> grads;
  double loss = 0;
  for (auto& b : backends) {
    const auto& cpu = static_cast<const CpuBackend&>(*b);
    grads.push_back(cpu.grads());
    loss += cpu.loss();
  }
  if (!check) {
    CheckResult res;
    res.loss = loss;
    return res;
  }
  return CompareWithReference(t, *model, grads, loss);
}

}  // namespace pipeplan
