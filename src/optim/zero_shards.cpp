// ZeRO's engine, ZeroShards: bucket views, the parameter exchange, the state gather. See
// include/ddpx/optim/zero.h.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <ddpx/optim/zero.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <numeric>
#include <unordered_map>
#include <utility>

#include "comm/packer.h"

namespace ddpx {
namespace optim {

namespace {

constexpr int64_t kGatherAlign = 64;  // bytes; every packed tensor starts at a multiple

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

int64_t align_up(int64_t n) { return (n + kGatherAlign - 1) / kGatherAlign * kGatherAlign; }

// `bytes` (a 1-D byte tensor) from `offset` seen as a tensor of `dtype` and `sizes`.
at::Tensor typed_view(const at::Tensor& bytes, int64_t offset, at::ScalarType dtype,
                      at::IntArrayRef sizes) {
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const int64_t n = numel * static_cast<int64_t>(c10::elementSize(dtype));
  return bytes.narrow(0, offset, n).view(dtype).view(sizes);
}

}  // namespace

// ---- ZeroShards ------------------------------------------------------------------------------

ZeroShards::ZeroShards(std::vector<at::Tensor> params, std::vector<int64_t> owners,
                       std::vector<bool> trainable, ProcessGroupPtr pg, ZeroOptions options)
    : params_(std::move(params)),
      owners_(std::move(owners)),
      trainable_(std::move(trainable)),
      pg_(std::move(pg)),
      options_(options) {
  TORCH_CHECK_VALUE(pg_,
                    "ZeroRedundancyOptimizer: process_group is null (this rank is not a "
                    "member of the group)");
  TORCH_CHECK_VALUE(!params_.empty(), "ZeroRedundancyOptimizer got an empty parameter list");
  TORCH_CHECK_VALUE(owners_.size() == params_.size() && trainable_.size() == params_.size(),
                    "ZeroShards: owners and trainable must have one entry per parameter (",
                    params_.size(), "), got ", owners_.size(), " and ", trainable_.size());
  TORCH_CHECK_VALUE(options_.bucket_cap_bytes > 0,
                    "ZeroRedundancyOptimizer: bucket_cap_bytes must be positive, got ",
                    options_.bucket_cap_bytes);
  rank_ = pg_->getRank();
  world_size_ = pg_->getSize();
  const at::Tensor& first = params_.front();
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    TORCH_CHECK_VALUE(p.defined(), "ZeroRedundancyOptimizer: parameter ", i, " is undefined");
    TORCH_CHECK_VALUE(p.layout() == c10::kStrided,
                      "ZeroRedundancyOptimizer only supports dense parameters; parameter ", i,
                      " is ", p.layout());
    TORCH_CHECK_VALUE(
        p.scalar_type() == first.scalar_type() && p.device().type() == first.device().type(),
        "ZeroRedundancyOptimizer only supports parameters of one dense type; "
        "parameter 0 is ",
        first.toString(), ", parameter ", i, " is ", p.toString());
    TORCH_CHECK_VALUE(owners_[i] >= 0 && owners_[i] < world_size_, "ZeroShards: owner ", owners_[i],
                      " of parameter ", i, " is not a rank of a group of ", world_size_);
  }
  build_buckets();
  plan();
}

std::vector<int64_t> ZeroShards::owned_by(int64_t rank) const {
  std::vector<int64_t> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (owners_[i] == rank) out.push_back(static_cast<int64_t>(i));
  }
  return out;
}

void ZeroShards::rebuild(std::vector<bool> trainable) {
  TORCH_CHECK_VALUE(trainable.size() == params_.size(), "ZeroShards::rebuild: ", params_.size(),
                    " entries expected, got ", trainable.size());
  trainable_ = std::move(trainable);
  build_buckets();
  plan();
}

at::Tensor ZeroShards::data(int64_t index) const { return params_[index].detach(); }

void ZeroShards::build_buckets() {
  buckets_.clear();
  if (!options_.parameters_as_bucket_view) return;
  at::NoGradGuard no_grad;
  std::vector<c10::Device> devices;
  for (const at::Tensor& p : params_) {
    if (std::find(devices.begin(), devices.end(), p.device()) == devices.end()) {
      devices.push_back(p.device());
    }
  }
  for (const c10::Device& device : devices) {
    std::vector<at::Tensor> per_rank;
    for (int64_t r = 0; r < world_size_; ++r) {
      int64_t size = 0;
      for (size_t i = 0; i < params_.size(); ++i) {
        if (owners_[i] != r || params_[i].device() != device) continue;
        if (trainable_[i]) {
          size += params_[i].numel();
        } else {
          // A private copy: the parameter may still be a view of an old bucket.
          params_[i].set_data(data(static_cast<int64_t>(i)).clone());
        }
      }
      if (size == 0) {
        per_rank.push_back(at::zeros({1}, at::TensorOptions().device(device)));
        continue;
      }
      at::Tensor bucket = at::empty(
          {size}, at::TensorOptions().dtype(params_.front().scalar_type()).device(device));
      int64_t offset = 0;
      for (size_t i = 0; i < params_.size(); ++i) {
        if (owners_[i] != r || params_[i].device() != device || !trainable_[i]) continue;
        const at::Tensor values = data(static_cast<int64_t>(i));
        at::Tensor view = bucket.narrow(0, offset, values.numel()).view(values.sizes());
        view.copy_(values);
        params_[i].set_data(view);
        offset += values.numel();
      }
      per_rank.push_back(bucket);
    }
    buckets_.push_back(std::move(per_rank));
  }
}

void ZeroShards::plan() {
  if (!options_.parameters_as_bucket_view) {
    std::vector<int64_t> all(params_.size());
    std::iota(all.begin(), all.end(), int64_t{0});
    plan_loose(all, chunks_, unchunked_);
  } else {
    plan_bucket_slices();
  }
  // Staging buffers live across exchanges when all of them together take at most two buckets
  // (models with many small parameters: no allocation and page faults per step).
  int64_t staged = 0;
  for (const auto& chunks : chunks_) {
    for (const Chunk& c : chunks) {
      if (c.staged()) staged += c.numel * static_cast<int64_t>(params_.front().element_size());
    }
  }
  keep_staging_ = staged <= 2 * options_.bucket_cap_bytes;
}

// Bucket views: each rank's bucket cut into chunks of whole parameters, in place.
void ZeroShards::plan_bucket_slices() {
  chunks_.assign(static_cast<size_t>(world_size_), {});
  unchunked_.clear();
  const int64_t cap = options_.bucket_cap_bytes;
  for (int64_t r = 0; r < world_size_; ++r) {
    std::vector<Chunk>& chunks = chunks_[r];
    for (const auto& per_rank : buckets_) {
      const at::Tensor& bucket = per_rank[r];
      const c10::Device device = bucket.device();
      const int64_t elem = static_cast<int64_t>(bucket.element_size());
      Chunk open;
      open.owner = r;
      open.device = device;
      int64_t start = 0;
      auto close = [&]() {
        if (open.params.empty()) return;
        open.bucket_slice = bucket.narrow(0, start, open.numel);
        start += open.numel;
        chunks.push_back(open);
        open.params.clear();
        open.numel = 0;
        open.bucket_slice = at::Tensor();
      };
      for (size_t i = 0; i < params_.size(); ++i) {
        if (owners_[i] != r || params_[i].device() != device || !trainable_[i]) continue;
        const int64_t n = params_[i].numel();
        if (!open.params.empty() && (open.numel + n) * elem > cap) close();
        open.params.push_back(static_cast<int64_t>(i));
        open.numel += n;
      }
      close();
    }
    if (r == rank_) {
      for (size_t i = 0; i < params_.size(); ++i) {
        if (owners_[i] == r && !trainable_[i]) unchunked_.push_back(static_cast<int64_t>(i));
      }
    }
  }
}

bool ZeroShards::Chunk::staged() const {
  return packer && packer->messages()[message].own_source < 0;
}

void ZeroShards::plan_loose(const std::vector<int64_t>& indices,
                            std::vector<std::vector<Chunk>>& table,
                            std::vector<int64_t>& unchunked) const {
  table.assign(static_cast<size_t>(world_size_), {});
  unchunked.clear();
  for (int64_t r = 0; r < world_size_; ++r) {
    // Rank r's parameters per device, devices in order of first appearance: one packer each.
    std::vector<std::pair<c10::Device, std::vector<int64_t>>> per_device;
    for (const int64_t i : indices) {
      if (owners_[i] != r) continue;
      if (params_[i].numel() == 0) {
        if (r == rank_) unchunked.push_back(i);
        continue;
      }
      auto it = std::find_if(per_device.begin(), per_device.end(),
                             [&](const auto& d) { return d.first == params_[i].device(); });
      if (it == per_device.end()) {
        per_device.emplace_back(params_[i].device(), std::vector<int64_t>{});
        it = per_device.end() - 1;
      }
      it->second.push_back(i);
    }
    for (const auto& [device, owned] : per_device) {
      std::vector<at::Tensor> tensors;
      for (int64_t i : owned) tensors.push_back(params_[i]);
      // The packer keeps the parameters themselves, so data rebound since (bucket views,
      // `p.data = ...`) are read and written where they are at exchange time.
      auto packer =
          std::make_shared<comm::Packer>(std::move(tensors), params_[owned[0]].scalar_type(),
                                         options_.bucket_cap_bytes, comm::OwnStorage::kContiguous);
      for (size_t m = 0; m < packer->messages().size(); ++m) {
        Chunk chunk;
        chunk.owner = r;
        chunk.device = device;
        chunk.packer = packer;
        chunk.message = m;
        chunk.numel = packer->messages()[m].numel;
        for (size_t s : packer->starting_in(m)) chunk.params.push_back(owned[s]);
        table[r].push_back(std::move(chunk));
      }
    }
  }
}

struct ZeroShards::Round {
  struct Item {
    const Chunk* chunk;
    at::Tensor staged;  // defined: values went through this buffer
    c10::intrusive_ptr<c10d::Work> work;
  };
  std::vector<Item> items;
};

ZeroExchangeStats ZeroShards::exchange(const ChunkUpdate& update) {
  return run(chunks_, unchunked_, update, keep_staging_);
}

ZeroExchangeStats ZeroShards::exchange(const ChunkUpdate& update,
                                       const std::vector<int64_t>& subset) {
  TORCH_CHECK_VALUE(!options_.parameters_as_bucket_view,
                    "ZeroShards: an exchange of some parameters needs "
                    "parameters_as_bucket_view=false");
  std::vector<char> seen(params_.size(), 0);
  for (int64_t i : subset) {
    TORCH_CHECK_VALUE(i >= 0 && i < static_cast<int64_t>(params_.size()),
                      "ZeroShards::exchange: parameter index ", i, " out of range (",
                      params_.size(), " parameters)");
    TORCH_CHECK_VALUE(!seen[i], "ZeroShards::exchange: parameter ", i, " listed twice");
    seen[i] = 1;
  }
  std::vector<std::vector<Chunk>> table;
  std::vector<int64_t> unchunked;
  plan_loose(subset, table, unchunked);
  return run(table, unchunked, update, /*keep_staging=*/false);
}

ZeroExchangeStats ZeroShards::run(std::vector<std::vector<Chunk>>& table,
                                  const std::vector<int64_t>& unchunked, const ChunkUpdate& update,
                                  bool keep_staging) {
  ZeroExchangeStats stats;
  at::NoGradGuard no_grad;
  if (update && !unchunked.empty()) update(unchunked);
  size_t rounds = 0;
  for (const auto& chunks : table) rounds = std::max(rounds, chunks.size());
  const std::vector<Chunk>& mine = table[rank_];
  if (world_size_ == 1) {
    if (update) {
      for (const Chunk& c : mine) update(c.params);
    }
    stats.rounds = static_cast<int64_t>(rounds);
    return stats;
  }
  const at::ScalarType dtype = params_.front().scalar_type();
  auto finish = [&](Round& round) {
    for (Round::Item& item : round.items) {
      item.work->wait();
      if (!item.staged.defined()) continue;
      comm::Packer& packer = *item.chunk->packer;
      if (item.chunk->owner == rank_) {
        packer.release(item.chunk->message);
      } else {
        packer.unpack(item.chunk->message, item.staged);
      }
    }
  };
  std::deque<Round> in_flight;
  for (size_t k = 0; k < rounds; ++k) {
    if (update && k < mine.size()) update(mine[k].params);
    Round round;
    for (int64_t r = 0; r < world_size_; ++r) {
      if (k >= table[r].size()) continue;
      Chunk& chunk = table[r][k];
      Round::Item item{&chunk, at::Tensor(), {}};
      at::Tensor values;
      if (chunk.bucket_slice.defined()) {
        values = chunk.bucket_slice;
        ++stats.inplace_broadcasts;
      } else if (!chunk.staged()) {
        values = chunk.packer->own_values(chunk.message);
        ++stats.inplace_broadcasts;
      } else {
        if (keep_staging && chunk.staging.defined()) {
          values = chunk.staging;
        } else {
          values = at::empty({chunk.numel}, at::TensorOptions().dtype(dtype).device(chunk.device));
          if (keep_staging) chunk.staging = values;
        }
        if (r == rank_) chunk.packer->pack(chunk.message, values);
        item.staged = values;
        stats.staged_bytes += nbytes(values);
      }
      item.work = comm::Broadcast(r).start(*pg_, values);
      ++stats.broadcasts;
      round.items.push_back(std::move(item));
    }
    in_flight.push_back(std::move(round));
    if (in_flight.size() > 1) {
      finish(in_flight.front());
      in_flight.pop_front();
    }
  }
  while (!in_flight.empty()) {
    finish(in_flight.front());
    in_flight.pop_front();
  }
  stats.rounds = static_cast<int64_t>(rounds);
  return stats;
}

std::vector<std::vector<at::Tensor>> ZeroShards::gather(int64_t to,
                                                        const std::vector<at::Tensor>& tensors,
                                                        const c10::Device& device) const {
  TORCH_CHECK_VALUE(to >= 0 && to < world_size_, "consolidate_state_dict: to=", to,
                    " is not a rank of a group of ", world_size_);
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK_VALUE(tensors[i].defined() && tensors[i].layout() == c10::kStrided,
                      "ZeroShards::gather: tensor ", i, " is undefined or not dense");
  }
  std::vector<std::vector<at::Tensor>> result;
  if (rank_ == to) result.resize(static_cast<size_t>(world_size_));
  if (world_size_ == 1) {
    result[0] = tensors;
    return result;
  }
  at::NoGradGuard no_grad;
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  const auto bytes_on = at::TensorOptions().dtype(at::kByte).device(device);
  // One message per tag: 0 the header's length, 1 the header, then 2, 3, ... the data (the
  // packed buffer, if any, then each tensor sent in its own storage, in order).
  auto start_send = [&](std::vector<at::Tensor>& v, int tag) {
    return pg_->send(v, static_cast<int>(to), tag);
  };
  auto start_recv = [&](std::vector<at::Tensor>& v, int64_t src, int tag) {
    return pg_->recv(v, static_cast<int>(src), tag);
  };
  if (rank_ != to) {
    // Header: count, packed bytes, then per tensor dtype, dim, sizes..., and its byte offset in
    // the packed buffer, or -1: sent in its own storage (contiguous, on `device`, large).
    std::vector<int64_t> header{static_cast<int64_t>(tensors.size()), 0};
    int64_t total = 0;
    std::vector<int64_t> offsets;
    for (const at::Tensor& t : tensors) {
      header.push_back(static_cast<int64_t>(t.scalar_type()));
      header.push_back(t.dim());
      for (int64_t s : t.sizes()) header.push_back(s);
      const bool alone = t.is_contiguous() && t.device() == device &&
                         nbytes(t) >= comm::own_storage_min_bytes(comm::kDefaultBucketBytes);
      offsets.push_back(alone ? -1 : total);
      header.push_back(offsets.back());
      if (!alone) total = align_up(total + nbytes(t));
    }
    header[1] = total;
    std::vector<std::vector<at::Tensor>> messages;
    messages.push_back({at::full({1}, static_cast<int64_t>(header.size()), i64).to(device)});
    messages.push_back({at::tensor(header, i64).to(device)});
    if (total > 0) {
      at::Tensor buffer = at::empty({total}, bytes_on);
      for (size_t i = 0; i < tensors.size(); ++i) {
        if (offsets[i] < 0) continue;
        typed_view(buffer, offsets[i], tensors[i].scalar_type(), tensors[i].sizes())
            .copy_(tensors[i]);
      }
      messages.push_back({buffer});
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (offsets[i] < 0) messages.push_back({tensors[i].view(-1).view(at::kByte)});
    }
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (size_t m = 0; m < messages.size(); ++m) {
      works.push_back(start_send(messages[m], static_cast<int>(m)));
    }
    for (auto& w : works) w->wait();
    return result;
  }
  result[to] = tensors;
  // Headers first (small), then every data message of every rank in flight at once.
  std::vector<std::vector<at::Tensor>> inbox;       // data messages' targets, as byte tensors
  std::vector<std::pair<int64_t, int>> inbox_from;  // (source rank, tag)
  for (int64_t src = 0; src < world_size_; ++src) {
    if (src == to) continue;
    std::vector<at::Tensor> len{at::empty({1}, i64.device(device))};
    start_recv(len, src, 0)->wait();
    const int64_t header_len = len[0].cpu().item<int64_t>();
    TORCH_CHECK(header_len >= 2, "ZeroShards::gather: malformed header from rank ", src);
    std::vector<at::Tensor> header_t{at::empty({header_len}, i64.device(device))};
    start_recv(header_t, src, 1)->wait();
    const at::Tensor header = header_t[0].cpu().contiguous();
    const int64_t* h = header.data_ptr<int64_t>();
    const int64_t count = h[0];
    const int64_t total = h[1];
    int tag = 2;
    at::Tensor buffer;
    if (total > 0) {
      buffer = at::empty({total}, bytes_on);
      inbox.push_back({buffer});
      inbox_from.emplace_back(src, tag++);
    }
    std::vector<at::Tensor> received;
    received.reserve(static_cast<size_t>(count));
    int64_t pos = 2;
    for (int64_t i = 0; i < count; ++i) {
      const auto dtype = static_cast<at::ScalarType>(h[pos++]);
      const int64_t dim = h[pos++];
      std::vector<int64_t> sizes(h + pos, h + pos + dim);
      pos += dim;
      const int64_t offset = h[pos++];
      if (offset >= 0) {
        received.push_back(typed_view(buffer, offset, dtype, sizes));
      } else {
        at::Tensor own = at::empty(sizes, at::TensorOptions().dtype(dtype).device(device));
        inbox.push_back({own.view(-1).view(at::kByte)});
        inbox_from.emplace_back(src, tag++);
        received.push_back(own);
      }
    }
    result[src] = std::move(received);
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (size_t m = 0; m < inbox.size(); ++m) {
    works.push_back(start_recv(inbox[m], inbox_from[m].first, inbox_from[m].second));
  }
  for (auto& w : works) w->wait();
  return result;
}

}  // namespace optim
}  // namespace ddpx
