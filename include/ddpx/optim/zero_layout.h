// ZeRO's partition of the parameters between the ranks, shared by the Python
// ddpx.optim.ZeroRedundancyOptimizer and the C++ ZeroRedundancyOptimizer (zero.h): which rank owns
// (steps) which parameter or piece of a parameter, the tensors each rank's local optimizer holds
// (its "units"), and the binding of the parameters' gradients to the pieces of split parameters.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace ddpx {
namespace optim {

// torch's partition: the parameters of each group, largest first (stable for equal sizes), each
// to the rank with the fewest elements so far (the lowest such rank); the running totals carry
// over from one group to the next. numels[g][i] is the element count of group g's parameter i;
// the result has the same shape and holds each parameter's owning rank. world_size must be
// positive (c10::ValueError otherwise).
std::vector<std::vector<int64_t>> partition_sorted_greedy(
    const std::vector<std::vector<int64_t>>& numels, int64_t world_size);

// One piece of a parameter under the balanced partition: elements [begin, end) of the
// parameter's flattened values, updated by rank `owner`.
struct ZeroPiece {
  // [begin, end) of the flattened values, and the rank that owns (steps) them.
  int64_t begin = 0;
  int64_t end = 0;
  int64_t owner = 0;
};

// The balanced partition (ddpx's, opt-in): the parameters, in order, laid end to end; rank r owns
// the elements [r * T / W, (r + 1) * T / W) of that line (T elements in all, W ranks), so a
// parameter that straddles a boundary is split between ranks. A cut inside a parameter is moved to
// a multiple of `align` elements from the parameter's start (aligned slices for vector loads and
// no slivers); a parameter with splittable[i] false (not contiguous) is never cut and goes whole
// to the rank that holds its middle element. Each rank then holds T / W elements to within
// `align` per cut (plus half of any unsplittable parameter). Returns, per parameter, its pieces in
// element order (one piece covering it when it is not cut); empty parameters get one empty piece
// owned by the rank holding their position. c10::ValueError for world_size < 1, align < 1, a
// negative numel or mismatched lengths.
std::vector<std::vector<ZeroPiece>> partition_balanced(const std::vector<int64_t>& numels,
                                                       const std::vector<bool>& splittable,
                                                       int64_t world_size, int64_t align = 32);

// How ZeroRedundancyOptimizer (both classes) assigns parameters to ranks.
enum class ZeroPartition {
  kSortedGreedy,  // torch's: whole tensors (partition_sorted_greedy)
  kBalanced,      // ddpx's: even shares, large tensors split (partition_balanced); only for
              // optimizers whose update is elementwise (SGD, Adam, AdamW, Adagrad, RMSprop, ...)
};

// The balanced partition's cut granularity (elements).
constexpr int64_t kZeroBalancedAlign = 32;

// The partition of parameter groups between the ranks of a group, group by group: a group once
// added keeps its owners and pieces (torch's add_param_group leaves earlier groups' partition
// alone; under kSortedGreedy the running totals carry over to later groups, as in torch).
//
// A "unit" is what a rank's local optimizer holds and the exchange (ZeroShards) moves: the
// parameter itself, or, for a parameter the balanced partition cuts, a view of one piece of its
// flattened values. units() lists them in the parameters' order, each parameter's pieces in
// element order.
class ZeroLayout {
 public:
  // flatten (kBalanced only): each added group's parameters, per device, become views of one
  // flat tensor (their values kept), so that a rank's pieces are slices of one buffer
  // (parameters_as_bucket_view under the balanced partition). c10::ValueError for world_size < 1,
  // a rank outside [0, world_size), align < 1 or flatten with kSortedGreedy.
  ZeroLayout(int64_t world_size, int64_t rank, ZeroPartition partition, bool flatten = false,
             int64_t align = kZeroBalancedAlign);

  // Partitions `params` as a new group (after the existing ones) and returns its index.
  // Under kBalanced the parameters must be defined and dense; a non-contiguous one is never cut.
  size_t add_group(const std::vector<at::Tensor>& params);
  // torch's params_per_rank (kSortedGreedy, a layout of exactly one group): rank r steps the
  // group's parameters per_rank[r] (indices into the group, in that order). Every parameter must
  // be listed exactly once (c10::ValueError otherwise).
  void assign(const std::vector<std::vector<int64_t>>& per_rank);

  // The constructor's arguments.
  int64_t world_size() const { return world_size_; }
  int64_t rank() const { return rank_; }
  ZeroPartition partition() const { return partition_; }

  // Every parameter, in the groups' order; the number of groups; each parameter's group.
  const std::vector<at::Tensor>& params() const { return params_; }
  size_t num_groups() const { return group_begin_.size(); }
  // Parameter index range [first, last) of group g.
  std::pair<size_t, size_t> group_range(size_t g) const;
  // Parameter `index`'s pieces in element order (one covering it when it is not cut), and the
  // rank that owns its first piece.
  const std::vector<ZeroPiece>& pieces(size_t index) const { return pieces_.at(index); }
  int64_t owner_of(size_t index) const { return pieces_.at(index).front().owner; }
  // The index (into units()) of parameter `index`'s first unit; its pieces' units follow it.
  size_t first_unit(size_t index) const { return first_unit_.at(index); }

  // The units, their owners and the index of the parameter each belongs to.
  const std::vector<at::Tensor>& units() const { return units_; }
  const std::vector<int64_t>& unit_owners() const { return unit_owners_; }
  const std::vector<int64_t>& unit_params() const { return unit_params_; }
  // Per group, the indices (into units()) of the units rank `rank` steps, in the order its local
  // optimizer holds them: torch's (largest first, stable) under kSortedGreedy, the parameters'
  // order under kBalanced, the assigned order after assign().
  std::vector<std::vector<int64_t>> local_units(int64_t rank) const;
  // With flatten: the flat tensors the parameters are views of, one per (group, device).
  const std::vector<at::Tensor>& flat_buffers() const { return flat_; }

  // Gives this rank's pieces of cut parameters the matching slices of their parameter's
  // gradient (none where the parameter has none) and returns the indices of those units; the
  // caller drops them (unbind_piece_grads) after the step. Whole units need nothing: they are
  // the parameters.
  std::vector<int64_t> bind_piece_grads() const;
  void unbind_piece_grads() const;

 private:
  void flatten_group(const std::vector<at::Tensor>& params);
  void add_units(size_t first_param);

  int64_t world_size_;
  int64_t rank_;
  ZeroPartition partition_;
  bool flatten_;
  int64_t align_;
  std::vector<at::Tensor> params_;
  std::vector<size_t> group_begin_;             // first parameter of each group
  std::vector<std::vector<int64_t>> numels_;    // per group (kSortedGreedy's running totals)
  std::vector<std::vector<ZeroPiece>> pieces_;  // per parameter
  std::vector<at::Tensor> units_;
  std::vector<int64_t> unit_owners_, unit_params_;
  std::vector<size_t> first_unit_;              // per parameter: its first unit
  std::vector<std::vector<int64_t>> assigned_;  // assign()'s per-rank order, if called
  std::vector<at::Tensor> flat_;
};

}  // namespace optim
}  // namespace ddpx
