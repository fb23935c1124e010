// pipeplan import-megatron SCRIPT|- [-o config.yaml] [--gpu NAME] [--nodes N] [--gpus-per-node G]
#include <fmt/format.h>

#include <iostream>
#include <iterator>
#include <memory>

#include "apps/common.h"
#include "core/files.h"
#include "planner/megatron_import.h"
#include "planner/yaml_doc.h"

namespace pipeplan {

Command MakeImportMegatronCommand() {
  struct Options {
    std::string script, output;
    MegatronImportOptions import;
  };
  auto o = std::make_shared<Options>();
  Command c;
  c.setup = [o](CLI::App* app) {
    app->add_option("script", o->script,
                    "Megatron-LM launch script or argument list (- for standard input)")
        ->required();
    app->add_option("-o,--output", o->output, "config to write (default: standard output)");
    app->add_option("--gpu", o->import.gpu, "the cluster's GPU (the arguments do not say)");
    app->add_option("--nodes", o->import.nodes,
                    "nodes (0: from #SBATCH --nodes or torchrun --nnodes, else 1)");
    app->add_option("--gpus-per-node", o->import.gpus_per_node,
                    "GPUs per node (0: from torchrun --nproc_per_node, else 8)");
  };
  c.run = [o]() -> int {
    std::string text;
    if (o->script == "-") {
      text.assign(std::istreambuf_iterator<char>(std::cin), {});
    } else {
      auto read = ReadFile(o->script);
      if (!read.ok()) return Report(read.status());
      text = std::move(*read);
    }
    const std::string name = o->script == "-" ? "<stdin>" : o->script;
    auto imported = ImportMegatron(text, name, o->import);
    if (!imported.ok()) return Report(imported.status());
    for (const std::string& n : imported->notes) fmt::print(stderr, "note: {}\n", n);
    if (!imported->ignored.empty())
      fmt::print(stderr, "ignored ({} arguments with no pipeplan meaning): {}\n",
                 imported->ignored.size(), fmt::join(imported->ignored, ", "));
    // The config must load as written; a file is written only then.
    const std::string where = o->output.empty() ? "the imported config" : o->output;
    auto doc = YamlDoc::FromString(where, imported->yaml);
    StatusOr<Config> config = doc.ok() ? ParseConfig(std::move(*doc)) : doc.status();
    if (o->output.empty()) fmt::print("{}", imported->yaml);
    if (!config.ok()) return Report(config.status());
    if (!o->output.empty()) {
      if (Status s = WriteFileAtomic(o->output, imported->yaml); !s.ok()) return Report(s);
      fmt::print(stderr, "wrote {}\n", o->output);
    }
    return 0;
  };
  return c;
}

}  // namespace pipeplan
