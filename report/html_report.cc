#include "report/html_report.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <nlohmann/json.hpp>

#include "core/files.h"
#include "core/version.h"

namespace pipeplan {
namespace {

using nlohmann::json;

// Colour classes of the schedule chart.
enum Class {
  kTextF = 0,
  kTextB,
  kTextW,
  kVisionF,
  kVisionB,
  kGeneratorF,
  kGeneratorB,
  kRecompute,
  kOptimizer,
  kP2P,
  kCollective,
  kHostCopy,
  kNumClasses
};
constexpr std::array<std::pair<const char*, const char*>, kNumClasses> kClasses = {{
    {"text forward", "#4e79a7"},
    {"text backward (B, I)", "#f28e2b"},
    {"text weight gradient (W)", "#edc948"},
    {"vision forward", "#59a14f"},
    {"vision backward", "#8cd17d"},
    {"generator forward", "#b07aa1"},
    {"generator backward", "#d4a6c8"},
    {"recompute", "#9c755f"},
    {"optimizer", "#76b7b2"},
    {"pp send / recv", "#bab0ac"},
    {"collective", "#e15759"},
    {"host copy (offload, reload)", "#ff9da7"},
}};

Class ClassOf(const Table& t, OpId i) {
  const OpKind k = t.kind(i);
  if (IsP2P(k)) return kP2P;
  if (IsCollective(k)) return kCollective;
  if (IsCopy(k)) return kHostCopy;
  if (k == OpKind::kOptStep || t.module(i) == Module::kOptimizer) return kOptimizer;
  if (k == OpKind::kRecompute) return kRecompute;
  const bool fwd = k == OpKind::kF;
  switch (t.module(i)) {
    case Module::kVision:
      return fwd ? kVisionF : kVisionB;
    case Module::kGenerator:
      return fwd ? kGeneratorF : kGeneratorB;
    default:
      return fwd ? kTextF : k == OpKind::kW ? kTextW : kTextB;
  }
}
// Band of the row: compute ops above, communication below.
int BandOf(Class c) {
  return c == kP2P || c == kCollective || c == kHostCopy ? 1 : 0;
}

int64_t Us(double s) {
  return std::llround(s * 1e6);
}
double Gib(double bytes) {
  return std::round(bytes / double(1 << 30) * 1000) / 1000;  // GiB, 3 decimals
}

std::string Escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// JSON inside <script>: "</" would end the element.
std::string ScriptJson(const json& j) {
  std::string s = DumpJson(j, -1);
  for (size_t p = 0; (p = s.find("</", p)) != std::string::npos; p += 3) s.replace(p, 2, "<\\/");
  return s;
}

std::string OpDetail(const Table& t, OpId i, double dur_s) {
  const Work& w = t.work(i);
  std::string d = fmt::format("{:.3f} ms", dur_s * 1e3);
  if (w.flops > 0) d += fmt::format(", {:.3g} TFLOP", w.flops / 1e12);
  if (w.payload_bytes > 0) d += fmt::format(", {:.3g} MB per GPU", w.payload_bytes / 1e6);
  if (w.hbm_bytes > 0) d += fmt::format(", {:.3g} GB HBM traffic", w.hbm_bytes / 1e9);
  return d;
}

json StepData(const StepReportInput& in) {
  const Table& t = *in.table;
  const SimResult& sim = *in.sim;
  const Metrics& m = sim.metrics;
  const Timeline& tl = sim.timeline;
  const double step = std::max(m.step_time_s, 1e-12);
  const int32_t R = t.num_ranks();
  const bool by_stage = R > kMaxRows;
  const int32_t rows = by_stage ? t.meta().pp : R;
  auto row_of = [&](int32_t r) { return by_stage ? t.ranks()[r].pp : r; };
  std::vector<int32_t> ranks_in_row(rows, 0);
  for (int32_t r = 0; r < R; ++r) ++ranks_in_row[row_of(r)];

  json classes = json::array();
  for (auto [name, color] : kClasses) classes.push_back({{"name", name}, {"color", color}});
  json row_info = json::array();
  for (int32_t w = 0; w < rows; ++w) {
    double busy = 0, idle = 0, peak = 0;
    bool oom = false;
    for (const RankMetrics& rm : m.ranks) {
      if (row_of(rm.rank) != w) continue;
      busy += rm.busy_s, idle += rm.idle_s, peak = std::max(peak, rm.peak_memory_bytes);
      oom = oom || rm.oom;
    }
    const RankInfo& ri = t.ranks()[by_stage ? 0 : w];
    const std::string label =
        by_stage ? fmt::format("pp stage {} (mean of {} ranks)", w, ranks_in_row[w])
                 : fmt::format("rank {} (dp {} pp {})", w, ri.dp, ri.pp);
    row_info.push_back({{"label", label},
                        {"busy_s", busy / ranks_in_row[w]},
                        {"idle_s", idle / ranks_in_row[w]},
                        {"peak_gib", Gib(peak)},
                        {"oom", oom}});
  }

  json schedule = {{"step_us", Us(step)}, {"rows", rows}};
  if (t.size() <= kMaxDrawnOps) {
    json ops = json::array();
    for (OpId i = 0; i < t.size(); ++i) {
      if (tl.start[i] < 0) continue;
      const Class c = ClassOf(t, i);
      const double dur = tl.end[i] - tl.start[i];
      ops.push_back({t.rank(i), BandOf(c), Us(tl.start[i]), Us(dur), static_cast<int>(c), t.str(i),
                     OpDetail(t, i, dur)});
    }
    schedule["mode"] = "ops";
    schedule["ops"] = std::move(ops);
  } else {
    // Busy seconds per (row, band, bin, class), spread over the bins each op covers.
    const double bin_s = step / kTimeBins;
    std::vector<double> busy(static_cast<size_t>(rows) * 2 * kTimeBins * kNumClasses, 0.0);
    auto at = [&](int32_t w, int band, int bin, int c) -> double& {
      return busy[((static_cast<size_t>(w) * 2 + band) * kTimeBins + bin) * kNumClasses + c];
    };
    for (OpId i = 0; i < t.size(); ++i) {
      if (tl.start[i] < 0 || tl.end[i] <= tl.start[i]) continue;
      const Class c = ClassOf(t, i);
      const int32_t w = row_of(t.rank(i));
      const int b0 = std::clamp(static_cast<int>(tl.start[i] / bin_s), 0, kTimeBins - 1);
      const int b1 = std::clamp(static_cast<int>(tl.end[i] / bin_s), 0, kTimeBins - 1);
      for (int b = b0; b <= b1; ++b) {
        const double lo = std::max(tl.start[i], b * bin_s),
                     hi = std::min(tl.end[i], (b + 1) * bin_s);
        if (hi > lo) at(w, BandOf(c), b, c) += hi - lo;
      }
    }
    json cells = json::array();
    for (int32_t w = 0; w < rows; ++w)
      for (int band = 0; band < 2; ++band)
        for (int b = 0; b < kTimeBins; ++b) {
          double total = 0, most = 0;
          int dominant = 0;
          for (int c = 0; c < kNumClasses; ++c) {
            const double v = at(w, band, b, c);
            total += v;
            if (v > most) most = v, dominant = c;
          }
          // Busy per mille of the bin, averaged over the row's ranks (communication may
          // overlap itself: capped at 1000).
          const int permille = std::min(
              1000, static_cast<int>(std::lround(total / (bin_s * ranks_in_row[w]) * 1000)));
          if (permille > 0) cells.push_back({w, band, b, dominant, permille});
        }
    schedule["mode"] = "bins";
    schedule["bins"] = kTimeBins;
    schedule["cells"] = std::move(cells);
  }

  // Memory: the ranks with the highest peaks, each curve reduced to at most kMemoryPoints
  // samples by keeping the highest of each time bucket.
  std::vector<int32_t> order(R);
  for (int32_t r = 0; r < R; ++r) order[r] = r;
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return sim.memory[a].peak_bytes > sim.memory[b].peak_bytes;
  });
  order.resize(std::min<size_t>(order.size(), kMemoryRanks));
  json series = json::array();
  for (int32_t r : order) {
    const auto& curve = sim.memory[r].curve;
    std::vector<std::pair<double, double>> pts;  // (time s, total bytes)
    for (const MemorySample& s : curve) {
      double total = 0;
      for (double b : s.bytes) total += b;
      pts.push_back({s.time_s, total});
    }
    if (pts.size() > static_cast<size_t>(kMemoryPoints)) {
      std::vector<std::pair<double, double>> kept;
      const double bucket = step / kMemoryPoints;
      for (const auto& p : pts) {
        const auto k = static_cast<int64_t>(p.first / bucket);
        if (!kept.empty() && static_cast<int64_t>(kept.back().first / bucket) == k) {
          if (p.second > kept.back().second) kept.back() = p;
        } else {
          kept.push_back(p);
        }
      }
      pts = std::move(kept);
    }
    json ts = json::array(), gib = json::array();
    for (const auto& p : pts) ts.push_back(Us(p.first)), gib.push_back(Gib(p.second));
    series.push_back(
        {{"label", fmt::format("rank {} (dp {} pp {})", r, t.ranks()[r].dp, t.ranks()[r].pp)},
         {"peak_gib", Gib(sim.memory[r].peak_bytes)},
         {"t_us", std::move(ts)},
         {"gib", std::move(gib)}});
  }

  json headline = json::array();
  auto add = [&](const char* k, std::string v) { headline.push_back({k, std::move(v)}); };
  const char* unit = m.unit_costs ? " units" : " s";
  add("step time", fmt::format("{:.4f}{}", m.step_time_s, unit));
  if (!m.unit_costs) {
    add("throughput", fmt::format("{:.0f} tokens/s", m.tokens_per_s));
    add("MFU", fmt::format("{:.2f} %", m.mfu * 100));
  }
  add("bubble (idle / ranks x step)", fmt::format("{:.2f} %", m.bubble_fraction * 100));
  add("peak memory per GPU",
      fmt::format("{:.2f} GiB of {:.2f} GiB{}", m.peak_memory_bytes / double(1 << 30),
                  m.hbm_bytes / double(1 << 30), m.oom ? " (OUT OF MEMORY)" : ""));
  add("plan", fmt::format("{} / {}; {} ranks (dp {} x pp {}), vp {}, {} ops", t.meta().schedule,
                          t.meta().modality.empty() ? "text only" : t.meta().modality, R,
                          t.meta().dp, t.meta().pp, t.meta().vp, t.size()));
  return {{"kind", "step"},
          {"title", in.title},
          {"headline", std::move(headline)},
          {"classes", std::move(classes)},
          {"rows", std::move(row_info)},
          {"schedule", std::move(schedule)},
          {"memory", {{"hbm_gib", Gib(m.hbm_bytes)}, {"series", std::move(series)}}}};
}

// Splits one CSV line (RFC 4180 quoting: "" inside quotes is a quote).
std::vector<std::string> CsvRow(std::string_view line) {
  std::vector<std::string> out(1);
  bool quoted = false;
  for (size_t k = 0; k < line.size(); ++k) {
    const char c = line[k];
    if (quoted) {
      if (c == '"' && k + 1 < line.size() && line[k + 1] == '"')
        out.back() += '"', ++k;
      else if (c == '"')
        quoted = false;
      else
        out.back() += c;
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      out.emplace_back();
    } else if (c != '\r') {
      out.back() += c;
    }
  }
  return out;
}

const char* kStyle = R"css(
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
table { border-collapse: collapse; } td, th { padding: 2px 10px; border-bottom: 1px solid #ddd; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.legend span { display: inline-block; margin-right: 14px; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: -2px; }
#tip { position: fixed; display: none; background: #fff; border: 1px solid #888; padding: 4px 8px;
       pointer-events: none; white-space: pre; font: 12px monospace; box-shadow: 2px 2px 6px #0003; }
svg text { font: 11px system-ui, sans-serif; fill: #333; }
pre { background: #f6f6f6; padding: 8px; overflow-x: auto; }
)css";

// Draws the charts from the JSON block; records what it drew on <body> (data-drawn-*).
const char* kScript = R"js(
(function () {
  'use strict';
  const data = JSON.parse(document.getElementById('data').textContent);
  const NS = 'http://www.w3.org/2000/svg';
  const tip = document.getElementById('tip');
  const drawn = document.body.dataset;
  function svgEl(tag, attrs, parent, title) {
    const e = document.createElementNS(NS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (title !== undefined) {
      const t = document.createElementNS(NS, 'title');
      t.textContent = title;
      e.appendChild(t);
    }
    if (parent) parent.appendChild(e);
    return e;
  }
  function htmlEl(tag, text, parent, cls) {
    const e = document.createElement(tag);
    if (text !== undefined) e.textContent = text;
    if (cls) e.className = cls;
    if (parent) parent.appendChild(e);
    return e;
  }
  function hover(svg) {
    svg.addEventListener('mousemove', function (ev) {
      const t = ev.target.querySelector ? ev.target.querySelector('title') : null;
      if (!t) { tip.style.display = 'none'; return; }
      tip.textContent = t.textContent;
      tip.style.left = (ev.clientX + 14) + 'px';
      tip.style.top = (ev.clientY + 14) + 'px';
      tip.style.display = 'block';
    });
    svg.addEventListener('mouseleave', function () { tip.style.display = 'none'; });
  }
  function timeLabel(us) {
    return us >= 1e6 ? (us / 1e6).toFixed(3) + ' s' : (us / 1e3).toFixed(2) + ' ms';
  }
  function table(parent, head, rows, numeric) {
    const t = htmlEl('table', undefined, parent);
    const tr = htmlEl('tr', undefined, t);
    head.forEach(function (h) { htmlEl('th', h, tr); });
    rows.forEach(function (r) {
      const row = htmlEl('tr', undefined, t);
      r.forEach(function (v, k) { htmlEl('td', String(v), row, numeric[k] ? 'num' : ''); });
    });
    return t;
  }
  function legend(parent, items) {
    const d = htmlEl('div', undefined, parent, 'legend');
    items.forEach(function (it) {
      const s = htmlEl('span', undefined, d);
      const i = htmlEl('i', undefined, s);
      i.style.background = it.color;
      s.appendChild(document.createTextNode(it.name));
    });
  }
  // Ticks along x from 0 to max (axis units), labelled by fmt.
  function xAxis(svg, x0, w, y, max, fmt) {
    svgEl('line', {x1: x0, x2: x0 + w, y1: y, y2: y, stroke: '#888'}, svg);
    for (let k = 0; k <= 10; ++k) {
      const x = x0 + w * k / 10;
      svgEl('line', {x1: x, x2: x, y1: y, y2: y + 4, stroke: '#888'}, svg);
      svgEl('text', {x: x, y: y + 16, 'text-anchor': 'middle'}, svg).textContent = fmt(max * k / 10);
    }
  }

  function drawStep() {
    const main = document.getElementById('main');
    htmlEl('h2', 'Step', main);
    table(main, ['', ''], data.headline, [false, false]);

    const s = data.schedule;
    htmlEl('h2', 'Schedule (rank x time' + (s.mode === 'bins' ?
        ', aggregated: each cell is ' + timeLabel(s.step_us / s.bins) + ', shaded by the share of it busy)' :
        '; gaps are idle time, hover an op for its numbers)'), main);
    legend(main, data.classes);
    const left = 200, w = 1100, rowH = 18, top = 6;
    const h = top + s.rows * rowH + 30;
    const svg = svgEl('svg', {id: 'schedule', width: left + w + 50, height: h,
                              'data-mode': s.mode}, main);
    for (let r = 0; r < s.rows; ++r) {
      const y = top + r * rowH;
      svgEl('rect', {x: left, y: y, width: w, height: rowH - 3, fill: '#f3f3f3', class: 'row'}, svg);
      svgEl('text', {x: left - 6, y: y + 11, 'text-anchor': 'end'}, svg).textContent = data.rows[r].label;
    }
    const scale = w / s.step_us;
    const bandY = [0, 12], bandH = [11, 4];
    let drawnOps = 0, drawnCells = 0;
    if (s.mode === 'ops') {
      s.ops.forEach(function (o) {
        const cls = data.classes[o[4]];
        svgEl('rect', {x: (left + o[2] * scale).toFixed(2), y: top + o[0] * rowH + bandY[o[1]],
                       width: Math.max(0.5, o[3] * scale).toFixed(2), height: bandH[o[1]],
                       fill: cls.color, class: 'op'}, svg,
              o[5] + '\nstart ' + timeLabel(o[2]) + ', ' + o[6]);
        ++drawnOps;
      });
    } else {
      const bw = w / s.bins, binUs = s.step_us / s.bins;
      s.cells.forEach(function (c) {
        const cls = data.classes[c[3]];
        svgEl('rect', {x: (left + c[2] * bw).toFixed(2), y: top + c[0] * rowH + bandY[c[1]],
                       width: bw.toFixed(2), height: bandH[c[1]], fill: cls.color,
                       'fill-opacity': (0.15 + 0.85 * c[4] / 1000).toFixed(3), class: 'cell'}, svg,
              data.rows[c[0]].label + ', ' + timeLabel(c[2] * binUs) + ' to ' +
              timeLabel((c[2] + 1) * binUs) + ': ' + (c[4] / 10).toFixed(1) + ' % busy, mostly ' +
              cls.name);
        ++drawnCells;
      });
    }
    xAxis(svg, left, w, top + s.rows * rowH + 2, s.step_us, timeLabel);
    hover(svg);
    drawn.drawnOps = drawnOps;
    drawn.drawnCells = drawnCells;
    drawn.drawnRows = s.rows;

    htmlEl('h2', 'Busy and idle time per ' + (data.rows.length && data.rows[0].label.startsWith('pp') ?
        'pipeline stage' : 'rank'), main);
    table(main, ['', 'busy', 'idle (bubble + communication)', 'idle share', 'peak memory'],
          data.rows.map(function (r) {
            const total = r.busy_s + r.idle_s;
            return [r.label, r.busy_s.toFixed(4) + ' s', r.idle_s.toFixed(4) + ' s',
                    (total > 0 ? 100 * r.idle_s / total : 0).toFixed(1) + ' %',
                    r.peak_gib.toFixed(2) + ' GiB' + (r.oom ? ' (out of memory)' : '')];
          }), [false, true, true, true, true]);

    const mem = data.memory;
    htmlEl('h2', 'Device memory over the step (the ' + mem.series.length +
           ' ranks with the highest peaks; the red line is the HBM capacity)', main);
    const palette = ['#4e79a7', '#f28e2b', '#59a14f', '#b07aa1', '#76b7b2', '#edc948', '#9c755f', '#bab0ac'];
    legend(main, mem.series.map(function (sr, k) {
      return {name: sr.label + ': peak ' + sr.peak_gib.toFixed(2) + ' GiB', color: palette[k % 8]};
    }));
    let ymax = mem.hbm_gib;
    mem.series.forEach(function (sr) { ymax = Math.max(ymax, sr.peak_gib); });
    ymax = ymax * 1.08 || 1;
    const mh = 260, mtop = 10;
    const msvg = svgEl('svg', {id: 'memory', width: left + w + 50, height: mtop + mh + 30}, main);
    const yOf = function (g) { return mtop + mh - mh * g / ymax; };
    for (let k = 0; k <= 4; ++k) {
      const g = ymax * k / 4;
      svgEl('line', {x1: left, x2: left + w, y1: yOf(g), y2: yOf(g), stroke: '#eee'}, msvg);
      svgEl('text', {x: left - 6, y: yOf(g) + 4, 'text-anchor': 'end'}, msvg).textContent = g.toFixed(1) + ' GiB';
    }
    let curves = 0;
    mem.series.forEach(function (sr, k) {
      const pts = [];
      let prev = null;
      for (let i = 0; i < sr.t_us.length; ++i) {
        const x = (left + sr.t_us[i] * scale).toFixed(2);
        if (prev !== null) pts.push(x + ',' + prev);  // memory holds its value until it changes
        prev = yOf(sr.gib[i]).toFixed(2);
        pts.push(x + ',' + prev);
      }
      if (prev !== null) pts.push((left + w).toFixed(2) + ',' + prev);
      svgEl('polyline', {points: pts.join(' '), fill: 'none', stroke: palette[k % 8],
                         'stroke-width': 1.5, class: 'mem'}, msvg, sr.label + ': peak ' + sr.peak_gib.toFixed(2) + ' GiB');
      ++curves;
    });
    let oom = 0;
    if (mem.hbm_gib > 0) {
      svgEl('line', {x1: left, x2: left + w, y1: yOf(mem.hbm_gib), y2: yOf(mem.hbm_gib),
                     stroke: '#d00', 'stroke-dasharray': '6 4', 'stroke-width': 2, class: 'oom'}, msvg,
            'HBM capacity ' + mem.hbm_gib.toFixed(2) + ' GiB: out of memory above');
      oom = 1;
    }
    xAxis(msvg, left, w, mtop + mh, s.step_us, timeLabel);
    hover(msvg);
    drawn.drawnMemoryCurves = curves;
    drawn.drawnOomLine = oom;
  }

  function drawSweep() {
    const main = document.getElementById('main');
    const pts = data.points.filter(function (p) { return p.ok; });
    htmlEl('h2', 'Throughput against peak memory (' + pts.length + ' of ' + data.points.length +
           ' points ran; filled: the Pareto frontier among points that fit; x: out of memory)', main);
    const left = 90, w = 900, h = 420, top = 10;
    const svg = svgEl('svg', {id: 'pareto', width: left + w + 40, height: top + h + 40}, main);
    let xmax = 0, ymax = 0;
    pts.forEach(function (p) { xmax = Math.max(xmax, p.peak_gib); ymax = Math.max(ymax, p.tokens_per_s); });
    xmax = xmax * 1.08 || 1; ymax = ymax * 1.08 || 1;
    const xOf = function (g) { return left + w * g / xmax; };
    const yOf = function (v) { return top + h - h * v / ymax; };
    for (let k = 0; k <= 4; ++k) {
      const v = ymax * k / 4;
      svgEl('line', {x1: left, x2: left + w, y1: yOf(v), y2: yOf(v), stroke: '#eee'}, svg);
      svgEl('text', {x: left - 6, y: yOf(v) + 4, 'text-anchor': 'end'}, svg).textContent = v.toExponential(2);
    }
    svgEl('text', {x: 4, y: top + 12}, svg).textContent = 'tokens/s';
    xAxis(svg, left, w, top + h, xmax, function (g) { return g.toFixed(1) + ' GiB'; });
    const front = pts.filter(function (p) { return p.pareto; })
                     .sort(function (a, b) { return a.peak_gib - b.peak_gib; });
    if (front.length > 1)
      svgEl('polyline', {points: front.map(function (p) { return xOf(p.peak_gib).toFixed(2) + ',' +
                                                            yOf(p.tokens_per_s).toFixed(2); }).join(' '),
                         fill: 'none', stroke: '#4e79a7', 'stroke-width': 1.5, class: 'frontier'}, svg);
    let points = 0, pareto = 0, oom = 0;
    pts.forEach(function (p) {
      const x = xOf(p.peak_gib), y = yOf(p.tokens_per_s);
      const title = p.label + '\n' + p.tokens_per_s.toFixed(0) + ' tokens/s, step ' +
                    p.step_time_s.toFixed(4) + ' s, peak ' + p.peak_gib.toFixed(2) + ' GiB' +
                    (p.oom ? ' (out of memory)' : '') + (p.pareto ? ' (Pareto)' : '');
      if (p.oom) {
        svgEl('path', {d: 'M' + (x - 5) + ',' + (y - 5) + 'l10,10m0,-10l-10,10', stroke: '#d00',
                       'stroke-width': 2, class: 'point oom'}, svg, title);
        ++oom;
      } else {
        svgEl('circle', {cx: x.toFixed(2), cy: y.toFixed(2), r: 5, class: 'point' + (p.pareto ? ' pareto' : ''),
                         fill: p.pareto ? '#4e79a7' : '#fff', stroke: '#4e79a7', 'stroke-width': 1.5}, svg, title);
        if (p.pareto) ++pareto;
      }
      ++points;
    });
    hover(svg);
    drawn.drawnPoints = points;
    drawn.drawnPareto = pareto;
    drawn.drawnOom = oom;
    htmlEl('h2', 'Points', main);
    table(main, data.axes.concat(['step', 'tokens/s', 'peak memory', 'fits', 'Pareto', 'error']),
          data.points.map(function (p) {
            return p.values.concat(p.ok ? [p.step_time_s.toFixed(4) + ' s', p.tokens_per_s.toFixed(0),
                                           p.peak_gib.toFixed(2) + ' GiB', p.oom ? 'no' : 'yes',
                                           p.pareto ? 'yes' : '', ''] : ['', '', '', '', '', p.error]);
          }), data.axes.map(function () { return false; }).concat([true, true, true, false, false, false]));
  }

  if (data.kind === 'step') drawStep(); else drawSweep();
  drawn.drawn = 'yes';
})();
)js";

std::string Page(const std::string& title, const json& data, const std::string& footer_html) {
  return fmt::format(
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n<title>{0}</title>\n"
      "<style>{1}</style></head>\n<body>\n<h1>{0}</h1>\n<div id=\"main\"></div>\n{2}\n"
      "<p>Written by pipeplan {3}. Self-contained: this file loads nothing from the network."
      "</p>\n<div id=\"tip\"></div>\n<script type=\"application/json\" id=\"data\">{4}</script>\n"
      "<script>{5}</script>\n</body></html>\n",
      Escape(title), kStyle, footer_html, kVersion, ScriptJson(data), kScript);
}

}  // namespace

std::string StepReportHtml(const StepReportInput& in) {
  const json data = StepData(in);
  std::string footer =
      "<h2>Metrics</h2>\n<pre>" + Escape(MetricsText(in.sim->metrics)) + "</pre>\n";
  if (!in.config_yaml.empty())
    footer +=
        "<details><summary>Config</summary><pre>" + Escape(in.config_yaml) + "</pre></details>\n";
  return Page("pipeplan report: " + in.title, data, footer);
}

StatusOr<std::string> SweepReportHtml(const std::string& title, const std::string& csv) {
  std::vector<std::vector<std::string>> lines;
  size_t pos = 0;
  while (pos < csv.size()) {
    size_t end = pos;
    bool quoted = false;  // a quoted field may hold a newline
    while (end < csv.size() && (quoted || csv[end] != '\n')) quoted ^= csv[end++] == '"';
    if (end > pos) lines.push_back(CsvRow(std::string_view(csv).substr(pos, end - pos)));
    pos = end + 1;
  }
  if (lines.empty()) return InvalidInput(fmt::format("{}: empty sweep CSV", title));
  const std::vector<std::string>& head = lines[0];
  const auto first = std::find(head.begin(), head.end(), "step_time_s");
  const std::vector<std::string> metrics = {"step_time_s",  "bubble_fraction", "mfu",
                                            "tokens_per_s", "samples_per_s",   "peak_memory_bytes",
                                            "oom",          "pareto",          "error"};
  if (first == head.end() || static_cast<size_t>(head.end() - first) != metrics.size() ||
      !std::equal(metrics.begin(), metrics.end(), first))
    return InvalidInput(fmt::format("{}:1: not a sweep CSV (expected axis columns, then {})", title,
                                    fmt::join(metrics, ",")));
  const size_t axes = static_cast<size_t>(first - head.begin());
  json points = json::array();
  for (size_t l = 1; l < lines.size(); ++l) {
    const std::vector<std::string>& f = lines[l];
    if (f.size() != head.size())
      return InvalidInput(
          fmt::format("{}:{}: {} fields, the header has {}", title, l + 1, f.size(), head.size()));
    json values = json::array();
    std::string label;
    for (size_t a = 0; a < axes; ++a) {
      values.push_back(f[a]);
      label += fmt::format("{}{}={}", a ? ", " : "", head[a], f[a]);
    }
    const bool ok = !f[axes].empty();
    json p = {{"values", values}, {"label", label}, {"ok", ok}, {"error", f[axes + 8]}};
    if (ok) {
      auto num = [&](size_t k, const char* name) -> StatusOr<double> {
        try {
          size_t used = 0;
          const double v = std::stod(f[axes + k], &used);
          if (used == f[axes + k].size() && std::isfinite(v)) return v;
        } catch (const std::exception&) {
        }
        return InvalidInput(
            fmt::format("{}:{}: {} '{}' is not a number", title, l + 1, name, f[axes + k]));
      };
      ASSIGN_OR_RETURN(double step, num(0, "step_time_s"));
      ASSIGN_OR_RETURN(double tps, num(3, "tokens_per_s"));
      ASSIGN_OR_RETURN(double peak, num(5, "peak_memory_bytes"));
      p["step_time_s"] = step;
      p["tokens_per_s"] = tps;
      p["peak_gib"] = Gib(peak);
      p["oom"] = f[axes + 6] == "1";
    }
    p["pareto"] = f[axes + 7] == "1";
    points.push_back(std::move(p));
  }
  json axes_names = json::array();
  for (size_t a = 0; a < axes; ++a) axes_names.push_back(head[a]);
  const json data = {{"kind", "sweep"}, {"axes", axes_names}, {"points", points}};
  return Page("pipeplan sweep report: " + title.substr(title.find_last_of('/') + 1), data, "");
}

}  // namespace pipeplan
