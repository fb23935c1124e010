// CPU backend: runs a plan's compute ops on the tiny model (executor/tiny_model.h) with
// real numerics, and a sequential reference over the same micro-batches. A rank that
// finds an input missing when an op runs reports it (a missing dependency in the plan).
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "executor/runner.h"
#include "executor/tiny_model.h"

namespace pipeplan {

// Saved tensors that remote OFFLOADs put in another rank's memory, by (holder rank, OFFLOAD):
// shared by the ranks of one process.
class HeldActivations {
 public:
  void Put(int32_t holder, OpId offload, std::vector<Tensor> v);
  bool Take(int32_t holder, OpId offload, std::vector<Tensor>* v);

 private:
  std::mutex mu_;
  std::map<std::pair<int32_t, OpId>, std::vector<Tensor>> held_;
};

class CpuBackend : public Backend {
 public:
  // `held`: the other ranks' memory for remote offload (null: no other rank in this process).
  CpuBackend(const Table& t, int32_t rank, std::shared_ptr<const TinyModel> model,
             std::shared_ptr<HeldActivations> held = nullptr);
  Status Compute(OpId op) override;
  StatusOr<Tensor> Outgoing(OpId send) override;
  Status Incoming(OpId recv, Tensor data) override;
  StatusOr<Tensor> Contribution(OpId collective) override;
  Status Reduced(OpId collective, Tensor sum) override;

  const ParamSet& grads() const { return grads_; }
  double loss() const { return loss_; }

 private:
  using StageKey = std::pair<int, int>;       // (global stage, micro-batch)
  using TaskKey = std::tuple<int, int, int>;  // (micro-batch, task, shard)
  Status TextForward(OpId op);
  Status TextBackward(OpId op);
  Status TextWeightGrad(OpId op);
  bool Here(int global_stage) const { return t_.meta().home(global_stage).pp_rank == stage_; }
  Status VisionForward(OpId op, bool recompute);
  Status VisionBackward(OpId op);
  StatusOr<Tensor> VisionOutputGradient(OpId op);  // from the consumer (or this rank)
  Status GeneratorShard(OpId op);
  Status HostCopy(OpId op);  // OFFLOAD or RELOAD
  Status GradCopy(OpId op);  // pipeline ZeRO-2: a gradient shard to its host partition or back
  // ZeRO-2: a reduced shard of one micro-batch added to its chunk's partition (host memory
  // with host gradients, else the GPU's shard); the partition replacing the chunk's
  // gradients (RELOAD, or the optimizer step without host gradients).
  Status AddToPartition(int chunk, const Tensor& shard);
  Status PartitionBack(int chunk);
  // The saved tensors of forward op f (its layers' inputs; the projector's input after an
  // encoder's last layer) as (stack, index) pairs.
  std::vector<std::pair<std::vector<Tensor>*, size_t>> SavedBy(OpId f);
  Tensor* Slice(OpId collective, size_t* offset, size_t* length);

  const Table& t_;
  int32_t rank_, stage_, replica_, stages_;
  std::shared_ptr<const TinyModel> m_;
  ParamSet grads_;
  double loss_ = 0;
  std::map<StageKey, Tensor> in_, out_, dout_, din_;  // stage inputs/outputs and their gradients
  std::map<StageKey, std::vector<Tensor>> saved_;
  // micro-batch -> (task, shard) -> visual row: summed into the input in that order, the
  // reference's, whatever order they arrived in
  std::map<int, std::map<std::pair<int, int>, Tensor>> vision_in_;
  std::map<int, int> vision_expected_;  // micro-batch -> how many
  std::map<int, Tensor> dx0_;           // micro-batch -> gradient of the first row
  std::map<TaskKey, Tensor> vision_out_, vision_grad_;
  std::map<TaskKey, std::vector<Tensor>> vision_saved_;  // inputs of the layers run so far
  std::map<TaskKey, Tensor> vision_act_, vision_dx_;     // between pieces: activation, gradient
  std::map<StageKey, Tensor> text_dx_;                   // between backward pieces
  struct WeightInputs {  // what a split backward's W needs, kept by its I
    int begin = 0, done = 0;
    std::vector<Tensor> inputs, dz;
  };
  std::map<StageKey, WeightInputs> wgrad_;
  std::map<int, Tensor> gen_in_, gen_dx_;  // split generator: micro-batch -> input, its gradient
  std::map<TaskKey, bool> vision_remote_;  // output goes to another rank
  // Host memory: per OFFLOAD, the saved tensors it moved out (their places on the device
  // stay, empty, until the RELOAD moves them back).
  std::map<OpId, std::vector<Tensor>> host_;
  std::shared_ptr<HeldActivations> held_;
  // ZeRO-2: what each micro-batch's reduction has already sent (text gradients), the
  // reduced gradient of (chunk, micro-batch) in the GPU buffer until its OFFLOAD (host
  // gradients), each chunk's partition.
  ParamSet sent_;
  bool grads_to_host_ = false;
  std::map<std::pair<int, int>, Tensor> grad_buffer_;
  std::map<int, Tensor> partition_;
};

struct Reference {
  ParamSet grads;
  double loss = 0;
  // For the check's error bound: per parameter, the sum over micro-batches of the absolute
  // value of each micro-batch's contribution; the same for the loss; how many
  // contributions were summed, and the layers each passes through.
  ParamSet abs_grads;
  double abs_loss = 0;
  int terms = 0, depth = 0;
};
// The same micro-batches, run one after another in one process. With `fp8_storage`, the
// tensors the plan's forwards store in FP8 (Work::saved_fp8) are stored the same way here.
Reference RunReference(const Table& t, const TinyModel& m, bool fp8_storage);

// Max relative error of a against b: max |a - b| / max(max |b|, 1e-300).
double MaxRelativeError(const Tensor& a, const Tensor& b);

}  // namespace pipeplan
