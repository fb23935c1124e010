#include "simulator/compare.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "core/files.h"

namespace pipeplan {
namespace {

bool IsP2PKind(const std::string& k) {
  return k.rfind("SEND", 0) == 0 || k.rfind("RECV", 0) == 0;
}
bool IsCollectiveKind(const std::string& k) {
  return k == "ALL_REDUCE" || k == "REDUCE_SCATTER" || k == "ALL_GATHER" || k == "ALL_TO_ALL";
}

void Add(ErrorStats* s, double p, double m) {
  s->mean_abs_rel_error =
      (s->mean_abs_rel_error * s->ops + (p > 0 ? std::abs(m - p) / p : 0)) / (s->ops + 1);
  ++s->ops;
  s->predicted_s += p, s->measured_s += m;
}

}  // namespace

StatusOr<std::map<std::string, TraceOp>> ReadTraceOps(const std::string& text) {
  std::map<std::string, TraceOp> ops;
  RETURN_IF_ERROR(CheckJsonDepth(text));
  try {
    // The JSON object format, or the array format, whose closing bracket may be missing: a
    // process that died while writing its trace journal (TraceJournal, one event per line)
    // left it open, perhaps in the middle of its last line, which is dropped.
    const size_t first = text.find_first_not_of(" \t\r\n");
    const size_t last = text.find_last_not_of(" \t\r\n");
    nlohmann::json j;
    if (first != std::string::npos && text[first] == '[' && text[last] != ']') {
      const size_t cut = text.rfind("},\n");
      j = nlohmann::json::parse(cut == std::string::npos ? std::string("[]")
                                                         : text.substr(0, cut + 1) + "]");
    } else {
      j = nlohmann::json::parse(text);
    }
    const nlohmann::json& events = j.is_array() ? j : j.at("traceEvents");
    for (const auto& e : events) {
      if (e.value("ph", "") != "X") continue;
      TraceOp op;
      op.start_us = e.at("ts").get<double>(), op.dur_us = e.at("dur").get<double>();
      if (auto a = e.find("args"); a != e.end())
        op.module = a->value("module", ""), op.kind = a->value("kind", "");
      ops[e.at("name").get<std::string>()] = op;
    }
  } catch (const nlohmann::json::exception& e) {
    return InvalidInput(fmt::format("not a Chrome trace: {}", e.what()));
  }
  return ops;
}

Comparison Compare(const std::map<std::string, TraceOp>& sim,
                   const std::map<std::string, TraceOp>& meas, size_t worst) {
  Comparison c;
  for (auto& [name, s] : sim)
    c.predicted_step_s = std::max(c.predicted_step_s, (s.start_us + s.dur_us) * 1e-6);
  for (auto& [name, m] : meas)
    c.measured_step_s = std::max(c.measured_step_s, (m.start_us + m.dur_us) * 1e-6);
  for (auto& [name, s] : sim) {
    auto it = meas.find(name);
    if (it == meas.end()) {
      ++c.only_simulated;
      continue;
    }
    ++c.matched;
    const double p = s.dur_us * 1e-6, m = it->second.dur_us * 1e-6;
    Add(&c.by_module[s.module], p, m);
    Add(&c.by_kind[s.kind], p, m);
    c.worst.push_back({name, m - p});
  }
  for (auto& [name, m] : meas) c.only_measured += !sim.count(name);
  std::stable_sort(c.worst.begin(), c.worst.end(),
                   [](auto& a, auto& b) { return std::abs(a.second) > std::abs(b.second); });
  if (c.worst.size() > worst) c.worst.resize(worst);
  return c;
}

std::string ComparisonText(const Comparison& c) {
  std::string s = fmt::format(
      "step time        predicted {:.6g} s, measured {:.6g} s ({:+.1f} %)\n", c.predicted_step_s,
      c.measured_step_s, 100 * (c.measured_step_s / std::max(c.predicted_step_s, 1e-300) - 1));
  s += fmt::format("ops              {} matched, {} only simulated, {} only measured\n\n",
                   c.matched, c.only_simulated, c.only_measured);
  auto table = [&](const char* title, const std::map<std::string, ErrorStats>& m) {
    s += fmt::format("{:<16} {:>8} {:>14} {:>14} {:>10} {:>12}\n", title, "ops", "predicted s",
                     "measured s", "ratio", "mean |err|%");
    for (auto& [k, e] : m)
      s += fmt::format("{:<16} {:>8} {:>14.6g} {:>14.6g} {:>10.3g} {:>12.1f}\n",
                       k.empty() ? "-" : k, e.ops, e.predicted_s, e.measured_s,
                       e.measured_s / std::max(e.predicted_s, 1e-300), 100 * e.mean_abs_rel_error);
    s += "\n";
  };
  table("module", c.by_module);
  table("kind", c.by_kind);
  s += "worst ops (measured - predicted):\n";
  for (auto& [name, d] : c.worst) s += fmt::format("  {:<40} {:+.6g} s\n", name, d);
  return s;
}

StatusOr<GpuSpec> Calibrate(const GpuSpec& spec, const Comparison& c) {
  GpuSpec out = spec;
  double cp = 0, cm = 0, lp = 0, lm = 0;  // compute and link (p2p + collective) totals
  double hp = 0, hm = 0;                  // host copies
  for (auto& [kind, e] : c.by_kind) {
    if (kind == "OFFLOAD" || kind == "RELOAD")
      hp += e.predicted_s, hm += e.measured_s;
    else if (IsP2PKind(kind) || IsCollectiveKind(kind))
      lp += e.predicted_s, lm += e.measured_s;
    else
      cp += e.predicted_s, cm += e.measured_s;
  }
  // Time scales as 1 / efficiency: the factor that makes predicted totals match.
  if (cp > 0 && cm > 0) {
    const double f = cp / cm;
    out.compute_efficiency *= f, out.attention_efficiency *= f, out.hbm_efficiency *= f;
  }
  if (lp > 0 && lm > 0) out.nvlink_efficiency *= lp / lm, out.nic_efficiency *= lp / lm;
  if (hp > 0 && hm > 0) out.host_link_efficiency *= hp / hm;
  for (auto [name, e] : {std::pair{"compute_efficiency", out.compute_efficiency},
                         {"attention_efficiency", out.attention_efficiency},
                         {"hbm_efficiency", out.hbm_efficiency},
                         {"nvlink_efficiency", out.nvlink_efficiency},
                         {"nic_efficiency", out.nic_efficiency},
                         {"host_link_efficiency", out.host_link_efficiency}})
    if (e > 1)
      return InvalidInput(fmt::format(
          "the fit gives {} = {:.3g}, above the {}'s peak: the measured trace is not from this "
          "GPU (a CPU run, or another machine?)",
          name, e, spec.name));
  return out;
}

std::string CalibrationYaml(const GpuSpec& g, const Comparison& c) {
  return fmt::format(
      "# pipeplan calibration of {}: efficiency factors fitted so that predicted totals match a\n"
      "# measured run (step {:.6g} s measured, {:.6g} s predicted). Load with simulate "
      "--calibration.\n"
      "cluster:\n  hardware:\n    compute_efficiency: {:.6g}\n    attention_efficiency: {:.6g}\n"
      "    hbm_efficiency: {:.6g}\n    nvlink_efficiency: {:.6g}\n    nic_efficiency: {:.6g}\n"
      "    host_link_efficiency: {:.6g}\n",
      g.name, c.measured_step_s, c.predicted_step_s, g.compute_efficiency, g.attention_efficiency,
      g.hbm_efficiency, g.nvlink_efficiency, g.nic_efficiency, g.host_link_efficiency);
}

}  // namespace pipeplan
