// Megatron-LM arguments -> a pipeplan YAML config.
//
// Reads a launch script or an argument list: shell line continuations, quotes, `VAR=value`
// assignments and `$VAR` / `${VAR}` uses of them, `#SBATCH --nodes`, torchrun's
// `--nnodes` / `--nproc_per_node`. Every `--flag [value]` is either mapped to a config key
// or reported as ignored; nothing is dropped silently.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace pipeplan {

struct MegatronImportOptions {
  std::string gpu = "H100";  // the cluster's GPU (Megatron's arguments do not say)
  int nodes = 0;             // 0 = from the script (#SBATCH --nodes, torchrun --nnodes)
  int gpus_per_node = 0;     // 0 = from the script (torchrun --nproc_per_node), else 8
};

struct MegatronImport {
  std::string yaml;                  // the config, with a comment naming the source
  std::vector<std::string> ignored;  // arguments with no pipeplan meaning, as written
  std::vector<std::string> notes;    // assumptions made (defaults chosen, values derived)
};

StatusOr<MegatronImport> ImportMegatron(std::string_view script, const std::string& name,
                                        const MegatronImportOptions& o);

}  // namespace pipeplan
