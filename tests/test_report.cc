// The HTML report, loaded in a real browser: Debian's Chromium, headless (scripts/deps.sh
// installs it). The page records what it drew on <body> (data-drawn-*); the DOM after its
// scripts ran is read with --dump-dom, console messages from Chromium's log.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "helpers.h"

using namespace pipeplan;
using namespace pipeplan::test;

namespace {

struct Page {
  std::string dom, console;  // console: the page's console lines from Chromium's log
  std::map<std::string, std::string> drawn;  // data-drawn-* of <body>
};

Page LoadInChromium(const std::string& html_path) {
  Page p;
  const RunResult which = RunShell("command -v chromium");
  REQUIRE_MESSAGE(which.exit_code == 0,
                  "chromium is not installed: scripts/deps.sh installs it (Debian's package)");
  const std::string flags = "--headless --no-sandbox --disable-gpu --no-first-run";
  const RunResult r = RunShell(
      fmt::format("chromium {} --enable-logging=stderr --v=0 --dump-dom file://{} 2>{}.log", flags,
                  html_path, html_path));
  REQUIRE(r.exit_code == 0);
  p.dom = r.out;
  for (const std::string& line : {Slurp(html_path + ".log")}) {
    std::istringstream in(line);
    std::string l;
    while (std::getline(in, l))
      if (l.find(":CONSOLE") != std::string::npos) p.console += l + "\n";
  }
  std::smatch body;
  REQUIRE(std::regex_search(p.dom, body, std::regex("<body([^>]*)>")));
  const std::string attrs = body[1];
  const std::regex attr("data-drawn([a-z-]*)=\"([^\"]*)\"");
  for (auto it = std::sregex_iterator(attrs.begin(), attrs.end(), attr);
       it != std::sregex_iterator(); ++it)
    p.drawn[(*it)[1]] = (*it)[2];
  return p;
}

size_t Count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("report of a step: self-contained, drawn in Chromium without console errors") {
  const std::string dir = TempDir();
  const std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/default.yaml";
  REQUIRE(RunCli("report " + cfg + " -o " + dir + "/r.html").exit_code == 0);
  const std::string html = Slurp(dir + "/r.html");
  // Nothing from the network: no external script, style, image or font.
  CHECK(html.find("src=") == std::string::npos);
  CHECK(html.find("<link") == std::string::npos);
  CHECK(html.find("url(") == std::string::npos);
  CHECK(html.find("@import") == std::string::npos);

  const RunResult sim = RunCli("simulate " + cfg + " --json");
  REQUIRE(sim.exit_code == 0);
  const nlohmann::json m = nlohmann::json::parse(sim.out);

  Page p = LoadInChromium(dir + "/r.html");
  CHECK(p.console == "");
  CHECK(p.drawn[""] == "yes");  // the script ran to its end
  // One rectangle per op (every op of this plan ran), one row per rank.
  CHECK(p.drawn["-ops"] == std::to_string(m["ops"].get<size_t>()));
  CHECK(Count(p.dom, "class=\"op\"") == m["ops"].get<size_t>());
  CHECK(p.drawn["-cells"] == "0");
  CHECK(p.drawn["-rows"] == std::to_string(m["ranks"].size()));
  CHECK(p.drawn["-memory-curves"] == "8");
  CHECK(Count(p.dom, "class=\"mem\"") == 8);
  CHECK(p.drawn["-oom-line"] == "1");
  // The summary shows the simulator's step time.
  CHECK(p.dom.find(fmt::format("{:.4f} s", m["step_time_s"].get<double>())) != std::string::npos);
  // Hover text: an op's string form and its numbers.
  CHECK(p.dom.find("<title>r0 F c0 m0") != std::string::npos);

  const std::string png = dir + "/report.png";
  REQUIRE(
      RunShell(fmt::format("chromium --headless --no-sandbox --disable-gpu --hide-scrollbars "
                           "--window-size=1400,1600 --screenshot={} file://{}/r.html 2>/dev/null",
                           png, dir))
          .exit_code == 0);
  const std::string shot = Slurp(png);
  CHECK(shot.substr(0, 8) == "\x89PNG\r\n\x1a\n");
  CHECK(shot.size() > 20000);  // a drawn page, not a blank one
}

TEST_CASE("report of a large plan draws aggregated time bins, per stage over the replicas") {
  const std::string dir = TempDir();
  const std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/k3_scale.yaml";
  const RunResult r = RunCli("report " + cfg + " -o " + dir + "/k3.html");
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("aggregated") != std::string::npos);
  Page p = LoadInChromium(dir + "/k3.html");
  CHECK(p.console == "");
  CHECK(p.drawn[""] == "yes");
  CHECK(p.drawn["-ops"] == "0");
  CHECK(p.drawn["-rows"] == "16");  // 2,048 ranks: one row per pp stage
  const int cells = std::stoi(p.drawn["-cells"]);
  CHECK(cells > 16 * 100);                           // busy bins everywhere
  CHECK(cells <= 16 * 2 * 400);                      // at most a cell per (row, band, bin)
  CHECK(Slurp(dir + "/k3.html").size() < 2u << 20);  // not one element per op (983,248)
}

TEST_CASE("report of a sweep: the Pareto frontier of the CSV's points that fit") {
  const std::string dir = TempDir();
  const std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/default.yaml";
  REQUIRE(RunCli("sweep " + cfg +
                 " --vary training.micro_batch_size=1,2 --vary parallelism.pp=2,4 -o " + dir +
                 "/s.csv")
              .exit_code == 0);
  REQUIRE(RunCli("report " + dir + "/s.csv -o " + dir + "/s.html").exit_code == 0);
  // What the CSV says: points that ran, and the Pareto marks.
  std::istringstream csv(Slurp(dir + "/s.csv"));
  std::string line;
  std::getline(csv, line);
  int ran = 0, pareto = 0;
  while (std::getline(csv, line)) {
    std::vector<std::string> f;
    std::stringstream ls(line);
    for (std::string x; std::getline(ls, x, ',');) f.push_back(x);
    REQUIRE(f.size() >= 10);
    if (!f[2].empty()) ++ran;
    if (f[9] == "1") ++pareto;
  }
  REQUIRE(ran > 0);
  REQUIRE(pareto > 0);
  Page p = LoadInChromium(dir + "/s.html");
  CHECK(p.console == "");
  CHECK(p.drawn[""] == "yes");
  CHECK(p.drawn["-points"] == std::to_string(ran));
  CHECK(p.drawn["-pareto"] == std::to_string(pareto));
  CHECK(Count(p.dom, "class=\"point") == static_cast<size_t>(ran));

  // Not a sweep CSV: a clear error naming the file.
  REQUIRE(RunShell("echo 'a,b' > " + dir + "/bad.csv").exit_code == 0);
  const RunResult bad = RunCli("report " + dir + "/bad.csv -o " + dir + "/bad.html");
  CHECK(bad.exit_code == 2);
  CHECK(bad.out.find("bad.csv:1: not a sweep CSV") != std::string::npos);
  CHECK(!Exists(dir + "/bad.html"));
}
