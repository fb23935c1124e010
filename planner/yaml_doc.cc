#include "planner/yaml_doc.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <sstream>

#include "core/files.h"

namespace pipeplan {
namespace {

std::vector<std::string> SplitLines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string Located(const std::string& name, const std::vector<std::string>& lines, int line,
                    int col, std::string_view msg) {
  std::string out = fmt::format("{}:{}:{}: {}", name, line + 1, col + 1, msg);
  if (line >= 0 && line < static_cast<int>(lines.size()))
    out += fmt::format("\n  {}\n  {}^", lines[line], std::string(std::max(col, 0), ' '));
  return out;
}

}  // namespace

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

StatusOr<YamlDoc> YamlDoc::FromFile(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  return FromString(path, text);
}

StatusOr<YamlDoc> YamlDoc::FromString(std::string name, const std::string& text) {
  YamlDoc doc;
  doc.name_ = std::move(name);
  doc.lines_ = SplitLines(text);
  try {
    doc.root_ = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return InvalidInput(Located(doc.name_, doc.lines_, e.mark.line, e.mark.column,
                                fmt::format("YAML syntax error: {}", e.msg)));
  }
  if (doc.root_.IsNull()) doc.root_ = YAML::Node(YAML::NodeType::Map);
  if (!doc.root_.IsMap())
    return InvalidInput(Located(doc.name_, doc.lines_, doc.root_.Mark().line,
                                doc.root_.Mark().column, "the config must be a YAML mapping"));
  return doc;
}

Status YamlDoc::ApplySet(const std::string& assignment) {
  size_t eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    return InvalidInput(fmt::format("--set {}: expected KEY.PATH=VALUE", assignment));
  std::string path = assignment.substr(0, eq);
  YAML::Node value;
  try {
    value = YAML::Load(assignment.substr(eq + 1));
  } catch (const YAML::Exception& e) {
    return InvalidInput(fmt::format("--set {}: bad value: {}", assignment, e.msg));
  }
  std::vector<std::string> keys;
  for (size_t b = 0;;) {
    size_t dot = path.find('.', b);
    keys.push_back(path.substr(b, dot - b));
    if (keys.back().empty())
      return InvalidInput(fmt::format("--set {}: empty key in path", assignment));
    if (dot == std::string::npos) break;
    b = dot + 1;
  }
  // yaml-cpp nodes are handles: walk with fresh handles and assign through them.
  std::vector<YAML::Node> chain{root_};
  for (size_t i = 0; i + 1 < keys.size(); ++i) {
    YAML::Node next = chain.back()[keys[i]];
    if (!next.IsDefined() || next.IsNull()) {
      chain.back()[keys[i]] = YAML::Node(YAML::NodeType::Map);
      next = chain.back()[keys[i]];
    }
    if (!next.IsMap())
      return InvalidInput(fmt::format("--set {}: '{}' is not a mapping", assignment, keys[i]));
    chain.push_back(next);
  }
  chain.back()[keys.back()] = value;
  set_origin_[path] = assignment;
  return Status::Ok();
}

YamlDoc YamlDoc::Clone() const {
  YamlDoc copy;  // its root_ an empty handle: assigning binds it (a bound one writes through)
  copy.name_ = name_, copy.lines_ = lines_, copy.set_origin_ = set_origin_;
  copy.root_ = YAML::Clone(root_);
  return copy;
}

void YamlDoc::Erase(const std::string& key_path) {
  // yaml-cpp's Node::operator= writes through the handle: walk with fresh handles.
  std::vector<YAML::Node> chain{root_};
  size_t b = 0;
  for (size_t dot; (dot = key_path.find('.', b)) != std::string::npos; b = dot + 1) {
    const std::string key = key_path.substr(b, dot - b);
    if (!chain.back().IsMap() || !chain.back()[key].IsMap()) return;
    chain.push_back(chain.back()[key]);
  }
  if (chain.back().IsMap()) chain.back().remove(key_path.substr(b));
  set_origin_.erase(key_path);
}

StatusOr<std::vector<std::string>> YamlDoc::LeafAssignments() const {
  // Aliases can make a small file a huge tree: the walk stops at kMaxNodes visits or
  // kMaxDepth levels (a config has a few hundred keys, 4 levels deep).
  constexpr size_t kMaxNodes = 100000;
  constexpr int kMaxDepth = 32;
  std::vector<std::string> out;
  size_t visited = 0;
  bool too_big = false;
  std::function<void(const YAML::Node&, const std::string&, int)> walk =
      [&](const YAML::Node& n, const std::string& path, int depth) {
        if (too_big || ++visited > kMaxNodes || depth > kMaxDepth) return void(too_big = true);
        if (n.IsMap()) {
          for (auto it = n.begin(); it != n.end() && !too_big; ++it) {
            // A key that is not a plain name cannot be a config key: passed on, it is rejected.
            std::string key = it->first.IsScalar() ? it->first.Scalar() : "<not a name>";
            walk(it->second, path.empty() ? key : path + "." + key, depth + 1);
          }
        } else if (n.IsScalar()) {
          out.push_back(path + "=" + n.Scalar());
        }
      };
  walk(root_, "", 0);
  if (too_big)
    return InvalidInput(fmt::format("{}: more than {} keys or {} levels (aliases expanding?)",
                                    name_, kMaxNodes, kMaxDepth));
  return out;
}

namespace {

std::string DumpTree(const YAML::Node& root) {
  YAML::Emitter out;
  out << root;
  return std::string(out.c_str()) + "\n";
}

}  // namespace

std::string YamlDoc::Dump() const {
  return DumpTree(root_);
}

YamlText::YamlText(const YamlDoc& doc) : state_(std::make_shared<State>()) {
  state_->root.emplace(doc.root());
}

const std::string& YamlText::str() const {
  static const std::string kEmpty;
  if (!state_) return kEmpty;
  std::call_once(state_->once, [s = state_.get()] {
    s->text = DumpTree(*s->root);
    s->root.reset();
  });
  return state_->text;
}

std::string YamlDoc::ErrorAt(const YAML::Node& node, const std::string& key_path,
                             std::string_view msg) const {
  // A value written by --set (or a map it created) has no position in the file.
  for (const auto& [path, assignment] : set_origin_) {
    bool inside = key_path == path || key_path.rfind(path + ".", 0) == 0 ||
                  key_path.rfind(path + "[", 0) == 0;
    bool created_parent = node.Mark().is_null() && path.rfind(key_path + ".", 0) == 0;
    if (inside || created_parent) return fmt::format("--set {}: {}", assignment, msg);
  }
  if (node.Mark().is_null()) return fmt::format("{}: {}: {}", name_, key_path, msg);
  return Located(name_, lines_, node.Mark().line, node.Mark().column, msg);
}

}  // namespace pipeplan
