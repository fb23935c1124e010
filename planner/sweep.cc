#include "planner/sweep.h"

#include <fmt/format.h>

#include <algorithm>
#include <mutex>
#include <numeric>

#include "core/parallel.h"
#include "planner/plan.h"

namespace pipeplan {
namespace {

std::string CsvField(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string q = "\"";
  for (char ch : s) q += ch == '"' ? std::string("\"\"") : std::string(1, ch);
  return q + "\"";
}

std::string FirstLine(const std::string& s) {
  return s.substr(0, s.find('\n'));
}

void RunPoint(const std::string& path, const std::vector<std::string>& sets,
              const std::vector<VaryAxis>& axes, PlanShare* share, SweepPoint* p) {
  std::vector<std::string> all = sets;
  for (size_t a = 0; a < axes.size(); ++a)
    all.push_back(fmt::format("{}={}", axes[a].key, p->values[a]));
  auto config = LoadConfig(path, all);
  if (!config.ok()) return void(p->error = FirstLine(config.status().message()));
  MemoryChoice choice;
  auto table = BuildPlan(*config, &choice, share);
  if (!table.ok()) return void(p->error = FirstLine(table.status().message()));
  auto sim = RunSimulation(*table, SimOptionsFor(WithChoice(*config, choice)));
  if (!sim.ok()) return void(p->error = FirstLine(sim.status().message()));
  p->metrics = std::move(sim->metrics);
  p->metrics.critical_path.clear();
  p->ok = true;
  if (p->metrics.oom) p->error = "out of memory";
}

}  // namespace

StatusOr<VaryAxis> ParseVary(const std::string& spec) {
  size_t eq = spec.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == spec.size())
    return InvalidInput(fmt::format("--vary {}: expected KEY=V1,V2,...", spec));
  VaryAxis a;
  a.key = spec.substr(0, eq);
  std::string rest = spec.substr(eq + 1);
  for (size_t b = 0;;) {
    size_t comma = rest.find(',', b);
    std::string v = rest.substr(b, comma - b);
    if (v.empty()) return InvalidInput(fmt::format("--vary {}: empty value", spec));
    a.values.push_back(v);
    if (comma == std::string::npos) break;
    b = comma + 1;
  }
  return a;
}

StatusOr<size_t> GridSize(const std::vector<VaryAxis>& axes) {
  size_t n = 1;
  for (const VaryAxis& a : axes) {
    if (a.values.empty() || n > kMaxSweepPoints / a.values.size())
      return InvalidInput(
          fmt::format("the sweep has more than {} points (or an empty --vary)", kMaxSweepPoints));
    n *= a.values.size();
  }
  return n;
}

std::vector<SweepPoint> ExpandGrid(const std::vector<VaryAxis>& axes) {
  std::vector<SweepPoint> points(1);
  for (const VaryAxis& a : axes) {
    std::vector<SweepPoint> next;
    for (const SweepPoint& p : points)
      for (const std::string& v : a.values) {
        SweepPoint q = p;
        q.values.push_back(v);
        next.push_back(std::move(q));
      }
    points = std::move(next);
  }
  return points;
}

std::vector<SweepPoint> RunSweep(const std::string& path, const std::vector<std::string>& sets,
                                 const std::vector<VaryAxis>& axes, int jobs,
                                 const std::function<void(size_t, size_t)>& progress) {
  std::vector<SweepPoint> points = ExpandGrid(axes);
  // Points that differ only in their modality policy run one after another, so that their
  // plans share what the policies have in common (PlanShare).
  std::vector<size_t> order(points.size());
  std::iota(order.begin(), order.end(), size_t{0});
  const auto policy = std::find_if(axes.begin(), axes.end(),
                                   [](const VaryAxis& a) { return a.key == "schedule.modality"; });
  if (policy != axes.end()) {
    const size_t axis = policy - axes.begin();
    std::vector<std::vector<std::string>> others(points.size());  // the other axes' values
    for (size_t i = 0; i < points.size(); ++i) {
      others[i] = points[i].values;
      others[i].erase(others[i].begin() + axis);
    }
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t x, size_t y) { return others[x] < others[y]; });
  }
  const size_t threads = static_cast<size_t>(std::max(1, jobs));
  PlanShare share(2 * threads);
  size_t done = 0;
  std::mutex mu;
  RunParallel(
      points.size(),
      [&](size_t i) {
        RunPoint(path, sets, axes, &share, &points[order[i]]);
        std::lock_guard<std::mutex> lock(mu);
        if (progress) progress(++done, points.size());
      },
      threads);
  MarkPareto(&points);
  return points;
}

std::vector<bool> ParetoFront(const std::vector<const Metrics*>& points) {
  std::vector<bool> front(points.size(), true);
  for (size_t i = 0; i < points.size(); ++i) {
    // Throughput, not step time: points with different batch sizes compare fairly.
    const double pt = points[i]->tokens_per_s, pm = points[i]->peak_memory_bytes;
    for (size_t j = 0; j < points.size() && front[i]; ++j) {
      const double qt = points[j]->tokens_per_s, qm = points[j]->peak_memory_bytes;
      if (j != i && qt >= pt && qm <= pm && (qt > pt || qm < pm)) front[i] = false;
    }
  }
  return front;
}

void MarkPareto(std::vector<SweepPoint>* points) {
  std::vector<SweepPoint*> feasible;
  std::vector<const Metrics*> metrics;
  for (SweepPoint& p : *points) {
    p.pareto = false;
    if (p.ok && !p.metrics.oom) feasible.push_back(&p), metrics.push_back(&p.metrics);
  }
  const std::vector<bool> front = ParetoFront(metrics);
  for (size_t i = 0; i < feasible.size(); ++i) feasible[i]->pareto = front[i];
}

std::string SweepCsv(const std::vector<VaryAxis>& axes, const std::vector<SweepPoint>& points) {
  std::string out;
  for (const VaryAxis& a : axes) out += CsvField(a.key) + ",";
  out +=
      "step_time_s,bubble_fraction,mfu,tokens_per_s,samples_per_s,peak_memory_bytes,oom,pareto,"
      "error\n";
  for (const SweepPoint& p : points) {
    for (const std::string& v : p.values) out += CsvField(v) + ",";
    if (p.ok) {
      const Metrics& m = p.metrics;
      out += fmt::format("{:.9g},{:.6f},{:.6f},{:.9g},{:.9g},{:.0f},{},", m.step_time_s,
                         m.bubble_fraction, m.mfu, m.tokens_per_s, m.samples_per_s,
                         m.peak_memory_bytes, m.oom ? 1 : 0);
    } else {
      out += ",,,,,,,";
    }
    out += fmt::format("{},{}\n", p.pareto ? 1 : 0, CsvField(p.error));
  }
  return out;
}

}  // namespace pipeplan
