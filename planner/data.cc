#include "planner/data.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include "core/files.h"

namespace pipeplan {
namespace {

// SplitMix64: a tiny, portable, seeded generator (same stream on every platform).
struct Rng {
  uint64_t s;
  uint64_t Next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
};

int64_t VisualTokens(const Config& c, const Sample& s) {
  const VisionConfig& v = c.model.vision;
  if (!v.enabled) return 0;
  int64_t t = 0;
  for (const Image& img : s.images)
    t += (Patches(img, v.patch) + v.merge * v.merge - 1) / (v.merge * v.merge);
  return t;
}

Sample DrawSample(const Config& c, Rng* rng, int index, int64_t capacity) {
  const DataConfig& d = c.data;
  Sample s;
  s.name = fmt::format("sample {}", index);
  double total = 0;
  for (const ImageClass& ic : d.images) total += ic.weight;
  // Up to images_per_sample draws; an image that would overflow the micro-batch (with
  // the sample's text) is dropped, so every drawn sample fits.
  const int64_t text = d.text_tokens > 0 ? d.text_tokens : 1;
  for (int i = 0; i < d.images_per_sample && total > 0; ++i) {
    double u = rng->Uniform() * total;
    size_t k = 0;
    while (k + 1 < d.images.size() && u >= d.images[k].weight) u -= d.images[k++].weight;
    s.images.push_back({d.images[k].height, d.images[k].width, d.images[k].frames});
    if (text + VisualTokens(c, s) > capacity) s.images.pop_back();
  }
  s.gen_height = d.generate_height, s.gen_width = d.generate_width;
  s.text_tokens =
      d.text_tokens > 0 ? d.text_tokens : std::max<int64_t>(1, capacity - VisualTokens(c, s));
  return s;
}

StatusOr<std::vector<Sample>> ReadManifest(const Config& c) {
  const std::string& path = c.data.manifest;
  ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  std::vector<Sample> out;
  std::istringstream in(text);
  int line_no = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto bad = [&](const std::string& why) {
      return InvalidInput(fmt::format("{}:{}: {}", path, line_no, why));
    };
    nlohmann::json j;
    if (Status s = CheckJsonDepth(line); !s.ok()) return bad(s.message());
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      return bad(fmt::format("not valid JSON: {}", e.what()));
    }
    if (!j.is_object()) return bad("expected a JSON object per line");
    Sample s;
    s.name = fmt::format("line {}", line_no);
    if (j.contains("id")) {
      const auto& id = j["id"];
      if (!id.is_string() && !id.is_number_integer())
        return bad("'id' must be a string or an integer");
      s.name = id.is_string() ? id.get<std::string>() : id.dump();
    }
    // Integers in range, or an error (never a silent wrap-around).
    auto integer = [&](const nlohmann::json& v, int64_t lo, int64_t hi, int* into) {
      if (!v.is_number_integer()) return false;
      const int64_t x = v.get<int64_t>();
      if (x < lo || x > hi) return false;
      *into = static_cast<int>(x);
      return true;
    };
    auto image = [&](const nlohmann::json& v, bool video) {
      Image img;
      const size_t n = video ? 3 : 2;
      if (!v.is_array() || v.size() != n) return false;
      if (video && !integer(v[0], 1, kMaxFrames, &img.frames)) return false;
      if (!integer(v[n - 2], 1, kMaxImageSide, &img.height) ||
          !integer(v[n - 1], 1, kMaxImageSide, &img.width))
        return false;
      s.images.push_back(img);
      return true;
    };
    for (auto& [key, value] : j.items()) {
      try {
        if (key == "id") continue;
        if (key == "text_tokens") {
          int tokens = 0;
          if (!integer(value, 0, std::numeric_limits<int>::max(), &tokens))
            return bad(fmt::format("'text_tokens' must be an integer in [0, {}]",
                                   std::numeric_limits<int>::max()));
          s.text_tokens = tokens;
        } else if (key == "images" || key == "videos") {
          const bool video = key == "videos";
          bool ok = value.is_array();
          for (size_t k = 0; ok && k < value.size(); ++k) ok = image(value[k], video);
          if (!ok)
            return bad(fmt::format("bad value for '{}': {} with sides in [1, {}]{}", key,
                                   video ? "[[frames, h, w], ...]" : "[[h, w], ...]", kMaxImageSide,
                                   video ? fmt::format(" and frames in [1, {}]", kMaxFrames) : ""));
        } else if (key == "generate") {
          if (!value.is_array() || value.size() != 2 ||
              !integer(value[0], 1, kMaxImageSide, &s.gen_height) ||
              !integer(value[1], 1, kMaxImageSide, &s.gen_width))
            return bad(fmt::format("bad value for 'generate': [h, w] with sides in [1, {}]",
                                   kMaxImageSide));
        } else {
          return bad(fmt::format(
              "unknown key '{}' (expected id, text_tokens, images, videos, generate)", key));
        }
      } catch (const nlohmann::json::exception&) {
        return bad(
            fmt::format("bad value for '{}' (images: [[h, w], ...], videos: [[frames, h, w], ...], "
                        "generate: [h, w], text_tokens: integer)",
                        key));
      }
    }
    out.push_back(std::move(s));
  }
  if (out.empty()) return InvalidInput(fmt::format("{}: no samples", path));
  return out;
}

// Reorders micro-batch indices by encoder FLOPs, the k-th lightest to the front for even
// k and to the back for odd k: the lightest at both ends, the heaviest in the middle
// (ties keep the drawn order).
void LightEnds(const std::vector<MicroBatch>& mbs, std::vector<size_t>* ids) {
  std::vector<size_t> by = *ids;
  std::stable_sort(by.begin(), by.end(),
                   [&](size_t a, size_t b) { return mbs[a].vision_flops < mbs[b].vision_flops; });
  size_t front = 0, back = ids->size();
  for (size_t k = 0; k < by.size(); ++k) (*ids)[k % 2 == 0 ? front++ : --back] = by[k];
}

}  // namespace

int64_t Patches(const Image& img, int patch) {
  return static_cast<int64_t>((img.height + patch - 1) / patch) *
         ((img.width + patch - 1) / patch) * img.frames;
}

double VisionImageFlops(const Config& c, int64_t patches) {
  const VisionConfig& v = c.model.vision;
  const double P = static_cast<double>(patches), d = v.hidden, m = v.mlp;
  // Per layer: projections 2*P*4*d^2, MLP 2*P*2*d*m, bidirectional attention 4*P^2*d.
  double layer = 2 * P * (4 * d * d + 2 * d * m) + 4 * P * P * d;
  // Merger: merge^2 patches -> one token, MLP (merge^2 d -> h -> h).
  const double tokens = P / (v.merge * v.merge), in = d * v.merge * v.merge, h = c.model.llm.hidden;
  return v.layers * layer + 2 * tokens * (in * h + h * h);
}

StatusOr<StepBatch> MakeStepBatch(const Config& c) {
  const int dp = c.parallel.dp, m = c.training.microbatches;
  const int64_t capacity =
      static_cast<int64_t>(c.training.seq_length) * c.training.micro_batch_size;
  const size_t needed = static_cast<size_t>(dp) * m;
  std::vector<Sample> manifest;
  if (!c.data.manifest.empty()) {
    ASSIGN_OR_RETURN(manifest, ReadManifest(c));
  }
  Rng rng{c.data.seed};
  std::vector<MicroBatch> mbs(1);
  StepBatch batch;
  for (size_t i = 0;; ++i) {
    Sample s;
    if (!manifest.empty()) {
      if (i == manifest.size()) {
        if (mbs.size() == needed && !mbs.back().samples.empty()) break;
        return InvalidInput(
            fmt::format("{}: {} samples pack into {} micro-batches; the step needs {} "
                        "(dp {} x {} micro-batches)",
                        c.data.manifest, manifest.size(), mbs.size() - mbs.back().samples.empty(),
                        needed, dp, m));
      }
      s = manifest[i];
    } else {
      s = DrawSample(c, &rng, static_cast<int>(i), capacity);
    }
    const int64_t visual = VisualTokens(c, s), tokens = s.text_tokens + visual;
    if (tokens > capacity)
      return InvalidInput(
          fmt::format("{}: {} text + {} visual tokens do not fit in a micro-batch of {} tokens "
                      "(seq_length x micro_batch_size)",
                      s.name, s.text_tokens, visual, capacity));
    if (mbs.back().text_tokens + mbs.back().visual_tokens + tokens > capacity) {
      if (mbs.size() == needed) break;
      mbs.emplace_back();
    }
    MicroBatch& mb = mbs.back();
    mb.text_tokens += s.text_tokens, mb.visual_tokens += visual;
    if (c.model.vision.enabled)
      for (const Image& img : s.images)
        mb.vision_flops += VisionImageFlops(c, Patches(img, c.model.vision.patch));
    mb.samples.push_back(std::move(s));
  }
  // Replicas: longest-processing-time first by vision cost, m micro-batches each.
  std::vector<size_t> order(mbs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return mbs[a].vision_flops > mbs[b].vision_flops; });
  std::vector<double> load(dp, 0);
  std::vector<std::vector<size_t>> assigned(dp);
  for (size_t i : order) {
    int best = -1;
    for (int d = 0; d < dp; ++d)
      if (static_cast<int>(assigned[d].size()) < m && (best < 0 || load[d] < load[best])) best = d;
    assigned[best].push_back(i);
    load[best] += mbs[i].vision_flops;
  }
  batch.replicas.resize(dp);
  for (int d = 0; d < dp; ++d) {
    std::sort(assigned[d].begin(), assigned[d].end());
    if (c.data.order == MicrobatchOrder::kLightEnds) LightEnds(mbs, &assigned[d]);
    for (size_t i : assigned[d]) {
      batch.samples += static_cast<int64_t>(mbs[i].samples.size());
      batch.tokens += mbs[i].text_tokens + mbs[i].visual_tokens;
      batch.replicas[d].push_back(std::move(mbs[i]));
    }
  }
  return batch;
}

}  // namespace pipeplan
