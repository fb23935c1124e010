// A YAML document with positions, `--set` overrides and compiler-style error messages.
#pragma once

#include <yaml-cpp/yaml.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace pipeplan {

class YamlDoc {
 public:
  static StatusOr<YamlDoc> FromFile(const std::string& path);
  static StatusOr<YamlDoc> FromString(std::string name, const std::string& text);

  // Applies "a.b.c=value": the value is parsed as YAML (so 4, true, [1,2], {k: v} work);
  // missing maps along the path are created. Unknown keys are caught by the typed reader.
  Status ApplySet(const std::string& assignment);
  // A deep copy (YAML::Node copies share their tree): overrides of one leave the other as
  // it is. The copy's nodes keep their values and the --set origins, not their positions.
  YamlDoc Clone() const;
  // Removes the key "a.b.c" if the document has it.
  void Erase(const std::string& key_path);

  const YAML::Node& root() const { return root_; }
  const std::string& name() const { return name_; }
  std::string Dump() const;  // the document after overrides, as YAML
  // Every scalar leaf as "a.b.c=value" (a calibration file turned into --set overrides).
  StatusOr<std::vector<std::string>> LeafAssignments() const;

  // "FILE:LINE:COL: message\n  <line>\n  ^" for a node read from the file, or
  // "--set KEY=VALUE: message" for one that came from the command line.
  std::string ErrorAt(const YAML::Node& node, const std::string& key_path,
                      std::string_view msg) const;
  // Whether `--set` wrote this key path.
  bool FromSet(const std::string& key_path) const { return set_origin_.count(key_path) > 0; }

 private:
  std::string name_;
  std::vector<std::string> lines_;
  YAML::Node root_;
  std::map<std::string, std::string> set_origin_;  // key path -> the --set that wrote it
};

// A document's YAML text, written out on first use (once, thread-safe): a config keeps
// the YAML it was read from for the plans it makes, and most configs parsed (sweep and
// tune points) never write it. It holds the document's tree (not its source lines) until
// then; copies share the text. The tree must not change afterwards.
class YamlText {
 public:
  YamlText() = default;
  explicit YamlText(const YamlDoc& doc);
  const std::string& str() const;

 private:
  struct State {
    std::optional<YAML::Node> root;  // reset, not assigned: assigning writes through
    std::once_flag once;
    std::string text;
  };
  std::shared_ptr<State> state_;
};

// Levenshtein distance, for "did you mean" hints.
size_t EditDistance(std::string_view a, std::string_view b);

}  // namespace pipeplan
