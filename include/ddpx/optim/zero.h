// ZeRO stage 1 (torch.distributed.optim.ZeroRedundancyOptimizer): the optimizer state is sharded
// across the ranks of a group. Each rank owns a subset of the parameters (torch's sorted-greedy
// partition: whole tensors), updates only those, and the ranks then exchange the updated values
// so that every replica holds the same parameters.
//
// The layers, shared by the Python class ddpx.optim.ZeroRedundancyOptimizer and the C++ one:
// - ZeroLayout (zero_layout.h): the partition, the units (parameters or their pieces) each rank
//   steps, the gradient binding of split parameters;
// - ZeroShards: the engine. The optional flat bucket views of each rank's parameters
//   (parameters_as_bucket_view), the parameter exchange and the bulk state gather to one rank;
// - step_sgd / step_adam: the fused shard steps (the update inside the exchange);
// - ZeroRedundancyOptimizer: the C++ class for libtorch programs, over any torch::optim
//   optimizer built by a factory for this rank's shard.
//
// The exchange is a broadcast from each owner, chunk by chunk: without bucket views, a chunk is
// a message of the owner's parameters as comm's packer cuts them (the one run_bucketed uses: at
// most bucket_cap_bytes of small parameters packed per chunk; a contiguous parameter of 256 KiB,
// or a quarter bucket if less, goes in its own storage without a copy); with them, a slice of the
// owner's bucket. Chunks go in rounds: round k carries every rank's
// k-th chunk, and a rank's own chunk k is updated (ChunkUpdate) just before round k starts, so the
// broadcasts of round k run while chunk k+1 is being updated. At most two rounds of staging
// memory are alive at once.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <ddpx/comm/bucketed.h>
#include <ddpx/common/process_group.h>
#include <ddpx/optim/functional.h>
#include <ddpx/optim/zero_layout.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

namespace torch {
namespace optim {
class SGD;
}  // namespace optim
}  // namespace torch

namespace ddpx {
namespace comm {
class Packer;
}  // namespace comm
namespace optim {

struct ZeroOptions {
  // true: each rank's trainable parameters (per device) are packed into one flat tensor and
  // every such parameter's data becomes a view of it (torch's parameters_as_bucket_view).
  bool parameters_as_bucket_view = false;
  // Exchange granularity: small parameters are packed into chunks of at most this many bytes;
  // a contiguous parameter of at least 256 KiB (or a quarter of this, if less) travels in its
  // own storage (comm's packer, as in run_bucketed).
  int64_t bucket_cap_bytes = comm::kDefaultBucketBytes;
  // Read by ZeroRedundancyOptimizer only (ZeroShards is given its owners). With kBalanced, each
  // parameter group is partitioned on its own, and parameters_as_bucket_view flattens each group
  // (ZeroLayout's flatten) instead of packing each rank's parameters.
  ZeroPartition partition = ZeroPartition::kSortedGreedy;
  // Read by ZeroRedundancyOptimizer only: the step runs inside DDP's backward pass, through a
  // comm hook from hook_with_zero_step (hooks/ddp_zero_hook.h), and step() does nothing.
  // parameters_as_bucket_view is then ignored (a warning), as in torch: the exchange goes bucket
  // by bucket of DDP's, which bucket views would not match.
  bool overlap_with_ddp = false;
};

// What one exchange did (tests and benchmarks).
struct ZeroExchangeStats {
  // Counts of what the exchange issued.
  int64_t rounds = 0;
  int64_t broadcasts = 0;
  int64_t inplace_broadcasts = 0;  // broadcasts of a parameter's or bucket's own storage
  int64_t staged_bytes = 0;        // bytes copied through staging buffers on this rank
};

class ZeroShards {
 public:
  // Runs on this rank's thread with the indices (into params()) of one chunk of this rank's
  // parameters, before that chunk is sent. Must update exactly those parameters' values (in
  // place) and leave the others alone.
  using ChunkUpdate = std::function<void(const std::vector<int64_t>& param_indices)>;

  // params: every parameter of the optimizer, in its global order (all dense, one dtype and one
  // device type); owners[i]: the group rank that updates params[i] (e.g. from
  // partition_sorted_greedy); trainable[i]: params[i] requires a gradient. Every rank of `pg`
  // must construct it alike. With parameters_as_bucket_view, the parameters' data become views
  // of the buckets (their values kept). Raises c10::ValueError for bad arguments.
  ZeroShards(std::vector<at::Tensor> params, std::vector<int64_t> owners,
             std::vector<bool> trainable, ProcessGroupPtr pg, ZeroOptions options = {});

  // The constructor's arguments and what they determine: this rank, the group, each
  // parameter's owning rank.
  int64_t rank() const { return rank_; }
  int64_t world_size() const { return world_size_; }
  const ProcessGroupPtr& process_group() const { return pg_; }
  const ZeroOptions& options() const { return options_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  const std::vector<int64_t>& owners() const { return owners_; }
  // Indices of the parameters `rank` owns, in global order.
  std::vector<int64_t> owned_by(int64_t rank) const;

  // Lays the exchange out again for a new trainability mask (torch rebuilds its buckets when
  // requires_grad changes): bucket views are rebuilt (a parameter no longer trainable gets a
  // private copy of its values), chunks re-planned.
  void rebuild(std::vector<bool> trainable);

  // parameters_as_bucket_view: buckets()[d][r] is rank r's flat bucket on the d-th device (in
  // order of first appearance); a one-element zero tensor where r has no trainable parameter
  // there, as torch. Empty otherwise.
  const std::vector<std::vector<at::Tensor>>& buckets() const { return buckets_; }

  // Every parameter takes its owner's values (torch exchanges the trainable ones with bucket
  // views, all of them otherwise). With `update`, this rank's parameters are updated chunk by
  // chunk as described above; the owned parameters in no chunk (not trainable, with bucket
  // views) are passed to one call first. Blocks until done. Every rank must call it.
  ZeroExchangeStats exchange(const ChunkUpdate& update = nullptr);
  // The same for the parameters `subset` only (indices into params(); every rank passes the same
  // list), chunked for this call: the overlap with DDP steps and exchanges one DDP bucket's
  // parameters at a time. Needs parameters_as_bucket_view = false.
  ZeroExchangeStats exchange(const ChunkUpdate& update, const std::vector<int64_t>& subset);

  // Gathers each rank's `tensors` (dense; any dtype, shapes and count per rank) to group rank
  // `to`, in bulk: each other rank sends one buffer (its tensors packed) straight to `to`, and
  // no third rank sends or receives anything. On `to`, result[r] holds rank r's tensors
  // (result[to] is `tensors` itself; the others are views of one received buffer per rank, on
  // `device`); elsewhere the result is empty. Every rank must call it. `device` is where the
  // bytes travel (the group's device: CPU for Gloo, CUDA for NCCL).
  std::vector<std::vector<at::Tensor>> gather(int64_t to, const std::vector<at::Tensor>& tensors,
                                              const c10::Device& device) const;

 private:
  struct Chunk {
    int64_t owner = 0;
    // Indices into params_ of the parameters updated just before the chunk is sent: those whose
    // first element it carries.
    std::vector<int64_t> params;
    int64_t numel = 0;  // elements in all
    // Bucket views: the slice of its owner's bucket it is. Otherwise the packer of its owner's
    // parameters on its device (comm's one packer) and the chunk's message there: a parameter's
    // own storage or a staging bucket.
    at::Tensor bucket_slice;
    std::shared_ptr<comm::Packer> packer;
    size_t message = 0;
    c10::Device device = c10::Device(c10::kCPU);
    // Staged chunks: the buffer, kept from one exchange to the next when every staged chunk
    // together is small (keep_staging_), allocated per exchange otherwise.
    at::Tensor staging;
    bool staged() const;
  };
  struct Round;

  void build_buckets();
  void plan();
  void plan_bucket_slices();
  // Chunks of the parameters `indices` (each with its owner) as the exchange without bucket
  // views sends them; `unchunked` gets this rank's parameters with nothing to send.
  void plan_loose(const std::vector<int64_t>& indices, std::vector<std::vector<Chunk>>& table,
                  std::vector<int64_t>& unchunked) const;
  ZeroExchangeStats run(std::vector<std::vector<Chunk>>& table,
                        const std::vector<int64_t>& unchunked, const ChunkUpdate& update,
                        bool keep_staging);
  at::Tensor data(int64_t index) const;

  std::vector<at::Tensor> params_;
  std::vector<int64_t> owners_;
  std::vector<bool> trainable_;
  ProcessGroupPtr pg_;
  ZeroOptions options_;
  int64_t rank_ = 0;
  int64_t world_size_ = 1;
  std::vector<std::vector<at::Tensor>> buckets_;
  std::vector<std::vector<Chunk>> chunks_;  // chunks_[r]: rank r's chunks, in send order
  std::vector<int64_t> unchunked_;          // this rank's parameters in no chunk
  bool keep_staging_ = false;
};

// The shard's update fused with the exchange: ddpx's functional SGD / Adam / AdamW
// (optim/functional.h) run chunk by chunk as the ChunkUpdate, so each chunk's broadcast starts as
// soon as it is updated. A group lists the parameters (indices into shards.params()) of one
// parameter group that this rank owns, with their gradients (an undefined gradient skips its
// parameter, as torch skips a None .grad) and their state, updated in place; options may differ
// between groups.
struct ZeroSGDGroup {
  // Indices of the group's parameters, their gradients (same order) and hyper-parameters.
  std::vector<int64_t> params;
  std::vector<at::Tensor> grads;
  // One per parameter; an undefined one is created on the parameter's first step (with
  // momentum) and the vector then holds it.
  std::vector<at::Tensor> momentum_buffers;
  SGDOptions options;
};

struct ZeroAdamGroup {
  // Indices of the group's parameters, their gradients (same order) and hyper-parameters.
  std::vector<int64_t> params;
  std::vector<at::Tensor> grads;
  std::vector<at::Tensor> exp_avgs, exp_avg_sqs, max_exp_avg_sqs;  // max_: with amsgrad only
  // One 0-dim tensor per parameter (torch's state["step"]), incremented in place.
  std::vector<at::Tensor> steps;
  AdamOptions options;  // AdamW: options.decoupled_weight_decay
};

// With `subset` (as ZeroShards::exchange's), only those parameters are exchanged, and every
// stepped parameter must be one of them.
ZeroExchangeStats step_sgd(ZeroShards& shards, std::vector<ZeroSGDGroup>& groups,
                           const std::vector<int64_t>* subset = nullptr);
ZeroExchangeStats step_adam(ZeroShards& shards, std::vector<ZeroAdamGroup>& groups,
                            const std::vector<int64_t>* subset = nullptr);

// Whether the fused steps take these groups: every stepped parameter float32/float64 and
// contiguous, its gradient dense and contiguous with the parameter's dtype, device and shape, its
// defined state tensors likewise (steps: one element). Where not, the caller runs its optimizer's
// own step and then ZeroShards::exchange() (the collectives are the same either way, so ranks
// may decide differently).
bool fused_step_supported(const ZeroShards& shards, const std::vector<ZeroSGDGroup>& groups);
bool fused_step_supported(const ZeroShards& shards, const std::vector<ZeroAdamGroup>& groups);

// ZeroRedundancyOptimizer for C++ programs: the parameter groups are partitioned as the Python
// class partitions them (ZeroLayout: torch's sorted-greedy partition, or the balanced one),
// `make_local` builds this rank's optimizer over its share of each group (a group whose share is
// empty is passed empty, so group indices match), and step() runs it and exchanges the
// parameters. With a torch::optim::SGD, Adam or AdamW local optimizer (float32/float64, dense
// gradients) and no closure, step() runs ddpx's fused step instead, as the Python class does: the
// shard's update in ddpx's kernels chunk by chunk, each chunk's broadcast starting as soon as it
// is updated, on the local optimizer's own state (created as it creates it).
//
//   auto zero = ddpx::optim::ZeroRedundancyOptimizer(
//       {torch::optim::OptimizerParamGroup(model->parameters())},
//       [](std::vector<torch::optim::OptimizerParamGroup> groups) {
//         return std::make_shared<torch::optim::Adam>(std::move(groups),
//                                                     torch::optim::AdamOptions(1e-3));
//       },
//       pg);
//   zero.zero_grad(); loss.backward(); zero.step();
class ZeroRedundancyOptimizer {
 public:
  // Builds the local optimizer over this rank's shard of the parameter groups.
  using LocalFactory = std::function<std::shared_ptr<torch::optim::Optimizer>(
      std::vector<torch::optim::OptimizerParamGroup>)>;

  // Partitions `param_groups` over the ranks of `pg` and builds this rank's local optimizer with
  // `make_local`. Under the balanced partition, parameters_as_bucket_view makes each group's
  // parameters (per device) views of one flat tensor, so each rank's pieces are slices of it.
  ZeroRedundancyOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                          const LocalFactory& make_local, ProcessGroupPtr pg,
                          ZeroOptions options = {});

  // This rank's shard of the update, then the exchange: the fused step where it applies (see the
  // class comment), else the local optimizer's step (with the closure, if any) followed by the
  // exchange. Returns the closure's loss (undefined without one). Every rank must call it. With
  // the balanced partition the local optimizer holds slices of split parameters (views of their
  // flattened values): they are given the matching slices of the parameters' gradients for the
  // step, and none after it.
  at::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr);
  // Every parameter's gradient (not only the shard's): dropped, or zeroed with false.
  void zero_grad(bool set_to_none = true);
  // Whether the last step() (or step_params()) ran the fused step (false: the local optimizer's
  // own step).
  bool last_step_fused() const { return last_step_fused_; }

  // The overlap with DDP (overlap_with_ddp; called by the hooks of hooks/ddp_zero_hook.h): steps
  // this rank's share of `params` (one or more DDP buckets' parameters, the same list on every
  // rank) with `grads` (their reduced gradients, same order and shapes), then exchanges those
  // parameters only. The local optimizer sees exactly these gradients for the step (its
  // parameters' own .grad are put back afterwards). Every rank must call it with the same
  // parameters. c10::ValueError for a parameter this optimizer does not hold or a gradient of
  // another shape; c10::Error if a parameter's requires_grad changed since construction.
  void step_params(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads);

  // The local optimizer over this rank's shard, and the shards' layout.
  torch::optim::Optimizer& local() { return *local_; }
  const std::shared_ptr<torch::optim::Optimizer>& local_ptr() const { return local_; }
  const ZeroShards& shards() const { return *shards_; }
  const ZeroLayout& layout() const { return layout_; }
  // Every parameter, in the groups' order, and the rank that owns each (under the balanced
  // partition: the owner of its first piece; pieces(index) has them all).
  const std::vector<at::Tensor>& params() const { return layout_.params(); }
  int64_t owner_of(size_t index) const { return layout_.owner_of(index); }
  const std::vector<ZeroPiece>& pieces(size_t index) const { return layout_.pieces(index); }

 private:
  // The fused step of every local parameter with a gradient; with `subset` (step_params), the
  // exchange of those units only.
  bool fused_step(const std::vector<int64_t>* subset = nullptr);
  template <typename Optim, typename State>
  bool fused_adam(Optim& optim, bool decoupled, const std::vector<int64_t>* subset);
  bool fused_sgd(torch::optim::SGD& optim, const std::vector<int64_t>* subset);

  ZeroLayout layout_;
  std::shared_ptr<torch::optim::Optimizer> local_;
  std::unique_ptr<ZeroShards> shards_;
  // Per group, the indices (into layout_.units()) of the local optimizer's parameters, in order.
  std::vector<std::vector<int64_t>> local_units_;
  bool last_step_fused_ = false;
  // step_params' lookup: each parameter's index (into params()) by its TensorImpl, and whether
  // it required a gradient at construction.
  std::unordered_map<const void*, size_t> param_index_;
  std::vector<bool> trainable_;
};

}  // namespace optim
}  // namespace ddpx
