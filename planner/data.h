// The data of one step: samples (text, images, videos, generation targets), packed into
// micro-batches of seq_length * micro_batch_size LLM tokens, assigned to DP replicas.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "planner/config.h"

namespace pipeplan {

struct Image {
  int height = 0, width = 0;  // pixels
  int frames = 1;             // > 1: video clip
};

struct Sample {
  std::string name;  // manifest id, or "sample N" for drawn samples
  int64_t text_tokens = 0;
  std::vector<Image> images;
  int gen_height = 0, gen_width = 0;  // generation target, pixels (0 = none)
};

struct MicroBatch {
  std::vector<Sample> samples;
  int64_t text_tokens = 0;
  int64_t visual_tokens = 0;  // after the spatial merge
  double vision_flops = 0;    // one encoder forward over all images (for balancing)
};

struct StepBatch {
  std::vector<std::vector<MicroBatch>> replicas;  // [dp][micro-batch]
  int64_t samples = 0;
  int64_t tokens = 0;  // LLM tokens (text + visual) in the step
};

// Physical bounds of inputs (config reference): pixels per image side, frames per clip.
inline constexpr int kMaxImageSide = 1 << 20, kMaxFrames = 1 << 16;

// Patches of one image (all frames): ceil(h/p) * ceil(w/p) * frames.
int64_t Patches(const Image& img, int patch);
// Encoder forward FLOPs of one image over all layers (P and P^2 terms) plus the merger.
double VisionImageFlops(const Config& c, int64_t patches);

// Draws (seeded) or reads (manifest) samples, packs them, balances replicas by cost, and
// orders each replica's micro-batches (data.microbatch_order).
StatusOr<StepBatch> MakeStepBatch(const Config& c);

}  // namespace pipeplan
