// ZeRO's partition and layout. See include/ddpx/optim/zero_layout.h.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <ddpx/optim/zero_layout.h>

#include <algorithm>
#include <numeric>
#include <utility>

namespace ddpx {
namespace optim {

std::vector<std::vector<int64_t>> partition_sorted_greedy(
    const std::vector<std::vector<int64_t>>& numels, int64_t world_size) {
  TORCH_CHECK_VALUE(world_size > 0, "partition_sorted_greedy: world_size must be positive, got ",
                    world_size);
  std::vector<int64_t> totals(static_cast<size_t>(world_size), 0);
  std::vector<std::vector<int64_t>> owners;
  owners.reserve(numels.size());
  for (const auto& group : numels) {
    std::vector<size_t> order(group.size());
    std::iota(order.begin(), order.end(), size_t{0});
    // Python's sorted(..., reverse=True) keeps equal sizes in their original order.
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return group[a] > group[b]; });
    std::vector<int64_t> owner(group.size(), 0);
    for (size_t i : order) {
      const auto least = std::min_element(totals.begin(), totals.end());  // first minimum
      owner[i] = least - totals.begin();
      *least += group[i];
    }
    owners.push_back(std::move(owner));
  }
  return owners;
}

std::vector<std::vector<ZeroPiece>> partition_balanced(const std::vector<int64_t>& numels,
                                                       const std::vector<bool>& splittable,
                                                       int64_t world_size, int64_t align) {
  TORCH_CHECK_VALUE(world_size > 0, "partition_balanced: world_size must be positive, got ",
                    world_size);
  TORCH_CHECK_VALUE(align > 0, "partition_balanced: align must be positive, got ", align);
  TORCH_CHECK_VALUE(splittable.size() == numels.size(), "partition_balanced: ", numels.size(),
                    " numels but ", splittable.size(), " splittable flags");
  int64_t total = 0;
  for (int64_t n : numels) {
    TORCH_CHECK_VALUE(n >= 0, "partition_balanced: a negative numel (", n, ")");
    total += n;
  }
  // cuts[r]: where rank r's share of the line begins (cuts[W] = T).
  std::vector<int64_t> cuts(static_cast<size_t>(world_size) + 1);
  for (int64_t r = 0; r <= world_size; ++r) {
    cuts[static_cast<size_t>(r)] =
        static_cast<int64_t>((static_cast<__int128>(total) * r) / world_size);
  }
  // The rank whose share holds element x of the line (the last rank for x == T).
  const auto owner_of = [&](int64_t x) -> int64_t {
    const auto it = std::upper_bound(cuts.begin() + 1, cuts.end() - 1, x);
    return it - (cuts.begin() + 1);
  };
  std::vector<std::vector<ZeroPiece>> out;
  out.reserve(numels.size());
  int64_t start = 0;  // the parameter's first element on the line
  for (size_t i = 0; i < numels.size(); ++i) {
    const int64_t n = numels[i];
    std::vector<int64_t> bounds{0};
    if (splittable[i]) {
      for (int64_t r = 1; r < world_size; ++r) {
        const int64_t cut = cuts[static_cast<size_t>(r)] - start;
        if (cut <= 0 || cut >= n) continue;
        const int64_t aligned = (cut + align / 2) / align * align;
        if (aligned > bounds.back() && aligned < n) bounds.push_back(aligned);
      }
    }
    bounds.push_back(n);
    std::vector<ZeroPiece> pieces;
    for (size_t k = 0; k + 1 < bounds.size(); ++k) {
      ZeroPiece piece;
      piece.begin = bounds[k];
      piece.end = bounds[k + 1];
      // The rank holding the piece's middle element: the whole parameter's when it is not cut.
      piece.owner = owner_of(start + (piece.begin + piece.end) / 2);
      if (!pieces.empty() && pieces.back().owner == piece.owner) {
        pieces.back().end = piece.end;  // two cuts rounded into one rank's share
      } else {
        pieces.push_back(piece);
      }
    }
    out.push_back(std::move(pieces));
    start += n;
  }
  return out;
}

ZeroLayout::ZeroLayout(int64_t world_size, int64_t rank, ZeroPartition partition, bool flatten,
                       int64_t align)
    : world_size_(world_size),
      rank_(rank),
      partition_(partition),
      flatten_(flatten),
      align_(align) {
  TORCH_CHECK_VALUE(world_size > 0, "ZeroLayout: world_size must be positive, got ", world_size);
  TORCH_CHECK_VALUE(rank >= 0 && rank < world_size, "ZeroLayout: rank ", rank,
                    " is not a rank of a group of ", world_size);
  TORCH_CHECK_VALUE(align > 0, "ZeroLayout: align must be positive, got ", align);
  TORCH_CHECK_VALUE(!flatten || partition == ZeroPartition::kBalanced,
                    "ZeroLayout: flatten is for the balanced partition (torch's partition keeps "
                    "its bucket views in ZeroShards)");
}

std::pair<size_t, size_t> ZeroLayout::group_range(size_t g) const {
  TORCH_CHECK_INDEX(g < group_begin_.size(), "ZeroLayout: group ", g, " of ", group_begin_.size());
  const size_t last = g + 1 < group_begin_.size() ? group_begin_[g + 1] : params_.size();
  return {group_begin_[g], last};
}

void ZeroLayout::flatten_group(const std::vector<at::Tensor>& params) {
  // One flat tensor per device, in the order devices first appear; the parameters keep their
  // values and become views of it.
  std::vector<c10::Device> devices;
  for (const at::Tensor& p : params) {
    if (std::find(devices.begin(), devices.end(), p.device()) == devices.end()) {
      devices.push_back(p.device());
    }
  }
  at::NoGradGuard no_grad;
  for (const c10::Device& device : devices) {
    int64_t total = 0;
    at::ScalarType dtype = at::kFloat;
    for (const at::Tensor& p : params) {
      if (p.device() != device) continue;
      total += p.numel();
      dtype = p.scalar_type();
    }
    at::Tensor flat = at::empty({total}, at::TensorOptions().dtype(dtype).device(device));
    int64_t offset = 0;
    for (const at::Tensor& p : params) {
      if (p.device() != device) continue;
      at::Tensor view = flat.narrow(0, offset, p.numel()).view(p.sizes());
      view.copy_(p.detach());
      const_cast<at::Tensor&>(p).set_data(view);
      offset += p.numel();
    }
    flat_.push_back(std::move(flat));
  }
}

size_t ZeroLayout::add_group(const std::vector<at::Tensor>& params) {
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK_VALUE(params[i].defined(), "ZeroLayout: parameter ", i,
                      " of the new group is "
                      "undefined");
    TORCH_CHECK_VALUE(params[i].layout() == c10::kStrided, "ZeroLayout: parameter ", i,
                      " of the new group is not dense");
  }
  TORCH_CHECK_VALUE(assigned_.empty(), "ZeroLayout: no group can be added after assign()");
  if (flatten_ && !params.empty()) flatten_group(params);
  const size_t first = params_.size();
  group_begin_.push_back(first);
  std::vector<int64_t> numels;
  for (const at::Tensor& p : params) numels.push_back(p.numel());
  numels_.push_back(numels);
  params_.insert(params_.end(), params.begin(), params.end());
  if (partition_ == ZeroPartition::kBalanced) {
    std::vector<bool> splittable;
    for (const at::Tensor& p : params) splittable.push_back(p.is_contiguous());
    // Each group's line is cut on its own, so the earlier groups keep their pieces.
    const auto rows = partition_balanced(numels, splittable, world_size_, align_);
    pieces_.insert(pieces_.end(), rows.begin(), rows.end());
  } else {
    // The running totals over the earlier groups decide this one's owners, as in torch.
    const auto owners = partition_sorted_greedy(numels_, world_size_).back();
    for (size_t i = 0; i < params.size(); ++i) {
      pieces_.push_back({ZeroPiece{0, numels[i], owners[i]}});
    }
  }
  add_units(first);
  return group_begin_.size() - 1;
}

void ZeroLayout::add_units(size_t first_param) {
  for (size_t i = first_param; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    const auto& row = pieces_[i];
    first_unit_.push_back(units_.size());
    for (const ZeroPiece& piece : row) {
      // A cut parameter's piece is a view of its flattened values: the local optimizer updates
      // the parameter's storage in place.
      units_.push_back(row.size() == 1 ? p : p.detach().view(-1).slice(0, piece.begin, piece.end));
      unit_owners_.push_back(piece.owner);
      unit_params_.push_back(static_cast<int64_t>(i));
    }
  }
}

void ZeroLayout::assign(const std::vector<std::vector<int64_t>>& per_rank) {
  TORCH_CHECK_VALUE(partition_ == ZeroPartition::kSortedGreedy,
                    "ZeroLayout::assign: the balanced partition makes its own pieces");
  TORCH_CHECK_VALUE(group_begin_.size() == 1,
                    "ZeroLayout::assign: only a layout of a single parameter group can be "
                    "assigned, this one has ",
                    group_begin_.size());
  TORCH_CHECK_VALUE(static_cast<int64_t>(per_rank.size()) == world_size_,
                    "ZeroLayout::assign: one list per rank expected (", world_size_, "), got ",
                    per_rank.size());
  const int64_t n = static_cast<int64_t>(params_.size());
  std::vector<int64_t> owner(params_.size(), -1);
  for (int64_t r = 0; r < world_size_; ++r) {
    for (int64_t i : per_rank[static_cast<size_t>(r)]) {
      TORCH_CHECK_VALUE(i >= 0 && i < n, "ZeroLayout::assign: parameter index ", i,
                        " out of range (", n, " parameters)");
      TORCH_CHECK_VALUE(owner[i] < 0, "ZeroLayout::assign: parameter ", i, " listed twice");
      owner[i] = r;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(owner[i] >= 0, "ZeroLayout::assign: parameter ", i,
                      " is assigned to no rank");
    pieces_[i] = {ZeroPiece{0, params_[i].numel(), owner[i]}};
    unit_owners_[first_unit_[i]] = owner[i];
  }
  assigned_ = per_rank;
}

std::vector<std::vector<int64_t>> ZeroLayout::local_units(int64_t rank) const {
  TORCH_CHECK_VALUE(rank >= 0 && rank < world_size_, "ZeroLayout: rank ", rank,
                    " is not a rank of a group of ", world_size_);
  std::vector<std::vector<int64_t>> out(group_begin_.size());
  if (!assigned_.empty()) {
    for (int64_t i : assigned_[static_cast<size_t>(rank)]) {
      out[0].push_back(static_cast<int64_t>(first_unit_[i]));
    }
    return out;
  }
  for (size_t g = 0; g < group_begin_.size(); ++g) {
    const auto range = group_range(g);
    std::vector<size_t> order(range.second - range.first);
    std::iota(order.begin(), order.end(), range.first);
    if (partition_ == ZeroPartition::kSortedGreedy) {
      // torch's order: largest first, equal sizes in the group's order.
      std::stable_sort(order.begin(), order.end(),
                       [&](size_t a, size_t b) { return params_[a].numel() > params_[b].numel(); });
    }
    for (size_t i : order) {
      for (size_t k = 0; k < pieces_[i].size(); ++k) {
        if (pieces_[i][k].owner == rank) out[g].push_back(static_cast<int64_t>(first_unit_[i] + k));
      }
    }
  }
  return out;
}

std::vector<int64_t> ZeroLayout::bind_piece_grads() const {
  std::vector<int64_t> bound;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& row = pieces_[i];
    if (row.size() == 1) continue;
    const at::Tensor& grad = params_[i].grad();
    for (size_t k = 0; k < row.size(); ++k) {
      if (row[k].owner != rank_) continue;
      const size_t u = first_unit_[i] + k;
      const_cast<at::Tensor&>(units_[u]).mutable_grad() =
          grad.defined() ? grad.reshape(-1).slice(0, row[k].begin, row[k].end) : at::Tensor();
      bound.push_back(static_cast<int64_t>(u));
    }
  }
  return bound;
}

void ZeroLayout::unbind_piece_grads() const {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (pieces_[i].size() == 1) continue;
    for (size_t k = 0; k < pieces_[i].size(); ++k) {
      if (pieces_[i][k].owner == rank_) {
        const_cast<at::Tensor&>(units_[first_unit_[i] + k]).mutable_grad() = at::Tensor();
      }
    }
  }
}

}  // namespace optim
}  // namespace ddpx
