// A deterministic tiny multimodal model in double precision whose structure follows a
// plan: text layers (as many as the plan's text layer ranges), vision layers + projector,
// a generator head, and a squared-error loss. Every layer is x <- x + tanh(W x) on d-wide
// rows, so forward and backward are exact and cheap. Used by the CPU backend and by the
// sequential reference that checks it.
#pragma once

#include <cstdint>
#include <vector>

#include "core/table.h"
#include "executor/transport.h"

namespace pipeplan {

struct TinyDims {
  int width = 8;   // d
  int tokens = 4;  // rows of a text micro-batch
  uint64_t seed = 1;
};

// Gradients (or parameters) by module, flat: text [layers][d][d], vision [layers + 1
// (projector)][d][d], generator [d][d].
struct ParamSet {
  Tensor text, vision, generator;
  Tensor& of(Module m) {
    return m == Module::kVision ? vision : m == Module::kGenerator ? generator : text;
  }
  const Tensor& of(Module m) const { return const_cast<ParamSet*>(this)->of(m); }
};

class TinyModel {
 public:
  TinyModel(const Table& t, TinyDims dims);

  int width() const { return d_; }
  int text_layers() const { return text_layers_; }
  int vision_layers() const { return vision_layers_; }
  bool has_generator() const { return generator_; }
  const ParamSet& params() const { return p_; }
  ParamSet ZeroGrads() const;

  // Deterministic inputs: text rows of micro-batch mb of replica d; one vision row per
  // task shard; loss targets.
  Tensor TextInput(int replica, int mb) const;
  Tensor Target(int replica, int mb) const;
  Tensor VisionInput(int mb, int task, int shard) const;

  // Layers [begin, end) of `m` on rows x (n x d); `saved` gets each layer's input.
  void Forward(Module m, int begin, int end, Tensor* x, std::vector<Tensor>* saved) const;
  // dx: gradient w.r.t. the output in, w.r.t. the input out; weight grads added to g.
  void Backward(Module m, int begin, const std::vector<Tensor>& saved, Tensor* dx,
                ParamSet* g) const;
  // The same split in two (zero-bubble I and W): the input gradient, keeping each layer's
  // pre-activation gradient in dz; then the weight gradients from the layers' inputs and dz.
  // Backward = BackwardInput then WeightGrad, bit for bit.
  void BackwardInput(Module m, int begin, const std::vector<Tensor>& saved, Tensor* dx,
                     std::vector<Tensor>* dz) const;
  void WeightGrad(Module m, int begin, const std::vector<Tensor>& saved,
                  const std::vector<Tensor>& dz, ParamSet* g) const;
  // Vision projector: v = P u (one row).
  Tensor Project(const Tensor& u) const;
  Tensor ProjectBack(const Tensor& u, const Tensor& dv, ParamSet* g) const;
  // Generator head and loss: returns the loss; dx gets the gradient w.r.t. x.
  double Head(const Tensor& x, const Tensor& target, Tensor* dx, ParamSet* g) const;

 private:
  const Tensor& W(Module m, int layer) const;
  int d_;
  int text_layers_ = 0, vision_layers_ = 0;
  bool generator_ = false;
  TinyDims dims_;
  ParamSet p_;
};

}  // namespace pipeplan
