// Bucketed, in-place parameter averaging. See include/ddpx/averaging/average.h.
#include <ddpx/averaging/average.h>

#include <algorithm>
#include <deque>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

namespace ddpx {

namespace {

// A run of `len` elements of a flattened source tensor, from element `src_offset`, packed at
// element `dst_offset` of a staging bucket.
struct Segment {
  size_t source;  // index into Plan::sources
  int64_t src_offset;
  int64_t dst_offset;
  int64_t len;
};

// One allreduce: a parameter in its own storage, or a staging bucket of segments.
struct Job {
  int64_t inplace_source = -1;  // >= 0: index into Plan::sources reduced in place
  std::vector<Segment> segments;
  int64_t numel = 0;
};

struct Source {
  at::Tensor param;  // the caller's tensor
  at::Tensor flat;   // 1-D contiguous view of its values (a temporary copy if non-contiguous)
  bool temporary = false;
};

struct Plan {
  std::vector<Source> sources;
  std::vector<Job> jobs;
  int64_t max_staged = 0;  // largest staging bucket, in elements
};

// 16-bit values on CPU would be summed by Gloo (scalar code, and wrong for fp16; no bf16 in
// torch 1.13): average them in fp32 there. Other dtypes keep torch's promotion.
at::ScalarType compute_dtype(at::ScalarType promoted, const at::Device& device) {
  if (device.is_cpu() && (promoted == at::kHalf || promoted == at::kBFloat16)) return at::kFloat;
  return promoted;
}

Plan make_plan(const std::vector<at::Tensor>& params, at::ScalarType dtype, int64_t cap_elems) {
  Plan plan;
  const int64_t inplace_min = std::max<int64_t>(1, cap_elems / 4);
  Job open;  // the staging bucket being filled
  auto close = [&] {
    if (open.numel == 0) return;
    plan.max_staged = std::max(plan.max_staged, open.numel);
    plan.jobs.push_back(std::move(open));
    open = Job{};
  };
  for (const at::Tensor& p : params) {
    Source src;
    src.param = p;
    if (p.is_contiguous()) {
      src.flat = p.view({-1});
    } else {
      src.flat = p.contiguous().view({-1});
      src.temporary = true;
    }
    const size_t index = plan.sources.size();
    plan.sources.push_back(src);
    const int64_t n = p.numel();
    if (n == 0) continue;
    if (!src.temporary && p.scalar_type() == dtype && n >= inplace_min) {
      Job job;
      job.inplace_source = static_cast<int64_t>(index);
      job.numel = n;
      plan.jobs.push_back(std::move(job));
      continue;
    }
    // Pack, splitting across buckets when it does not fit.
    int64_t done = 0;
    while (done < n) {
      if (open.numel == cap_elems) close();
      const int64_t len = std::min(n - done, cap_elems - open.numel);
      open.segments.push_back(Segment{index, done, open.numel, len});
      open.numel += len;
      done += len;
    }
  }
  close();
  return plan;
}

struct InFlight {
  size_t job;
  int slot;  // staging slot, -1 for in place
  c10::intrusive_ptr<c10d::Work> work;
};

void average_on_device(const std::vector<at::Tensor>& params,
                       const c10::intrusive_ptr<c10d::ProcessGroup>& pg, at::ScalarType dtype,
                       int64_t cap_bytes, AverageStats& stats) {
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t cap_elems = std::max<int64_t>(1, cap_bytes / elem);
  Plan plan = make_plan(params, dtype, cap_elems);
  const int64_t world = pg->getSize();
  const auto options = params.front().options().dtype(dtype);

  // Two staging buffers, sized to the largest bucket of this call and allocated only if used.
  at::Tensor slots[2];
  bool slot_busy[2] = {false, false};
  std::deque<InFlight> in_flight;
  int64_t in_flight_elems = 0;

  auto finish_oldest = [&] {
    InFlight f = std::move(in_flight.front());
    in_flight.pop_front();
    f.work->wait();
    const Job& job = plan.jobs[f.job];
    in_flight_elems -= job.numel;
    if (f.slot >= 0) {
      // Unpack: copy_ casts back to each parameter's dtype.
      for (const Segment& s : job.segments) {
        plan.sources[s.source].flat.narrow(0, s.src_offset, s.len)
            .copy_(slots[f.slot].narrow(0, s.dst_offset, s.len));
      }
      slot_busy[f.slot] = false;
    }
  };

  for (size_t j = 0; j < plan.jobs.size(); ++j) {
    const Job& job = plan.jobs[j];
    // At most ~two buckets' worth of collectives in flight (bounds Gloo's own buffers too).
    while (!in_flight.empty() && in_flight_elems + job.numel > 2 * cap_elems) finish_oldest();
    at::Tensor values;
    int slot = -1;
    if (job.inplace_source >= 0) {
      values = plan.sources[job.inplace_source].flat;
      ++stats.inplace_tensors;
    } else {
      while (slot_busy[0] && slot_busy[1]) finish_oldest();
      slot = slot_busy[0] ? 1 : 0;
      if (!slots[slot].defined()) {
        slots[slot] = at::empty({plan.max_staged}, options);
        stats.staging_bytes += plan.max_staged * elem;
      }
      slot_busy[slot] = true;
      values = slots[slot].narrow(0, 0, job.numel);
      for (const Segment& s : job.segments) {
        values.narrow(0, s.dst_offset, s.len)
            .copy_(plan.sources[s.source].flat.narrow(0, s.src_offset, s.len));
      }
    }
    // torch's order of operations: divide by the group size, then sum.
    values.div_(world);
    std::vector<at::Tensor> tensors{values};
    auto work = pg->allreduce(tensors);
    ++stats.collectives;
    in_flight.push_back(InFlight{j, slot, std::move(work)});
    in_flight_elems += job.numel;
  }
  while (!in_flight.empty()) finish_oldest();

  // Non-contiguous parameters were averaged in a contiguous copy: write it back.
  for (const Source& src : plan.sources) {
    if (src.temporary) src.param.copy_(src.flat.view(src.param.sizes()));
  }
  // Count each staged parameter once, even when it spans several buckets.
  std::vector<bool> staged(plan.sources.size(), false);
  for (const Job& job : plan.jobs) {
    for (const Segment& s : job.segments) staged[s.source] = true;
  }
  stats.staged_tensors += std::count(staged.begin(), staged.end(), true);
}

}  // namespace

std::vector<at::Tensor> params_with_grad(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  out.reserve(params.size());
  for (const at::Tensor& p : params) {
    if (p.defined() && p.grad().defined()) out.push_back(p);
  }
  return out;
}

AverageStats average_parameters(const std::vector<at::Tensor>& params,
                                const c10::intrusive_ptr<c10d::ProcessGroup>& process_group,
                                const AverageOptions& options) {
  TORCH_CHECK_VALUE(options.bucket_cap_bytes > 0,
                    "average_parameters: bucket_cap_bytes must be positive, got ",
                    options.bucket_cap_bytes);
  AverageStats stats;
  if (!process_group || params.empty()) return stats;
  at::ScalarType promoted = at::ScalarType::Undefined;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK_VALUE(p.defined(), "average_parameters: parameter ", i, " is undefined");
    TORCH_CHECK_VALUE(p.layout() == at::kStrided, "average_parameters: parameter ", i,
                      " is not a dense tensor (layout ", p.layout(), ")");
    TORCH_CHECK_VALUE(p.is_floating_point() || p.is_complex(), "average_parameters: parameter ",
                      i, " has dtype ", p.scalar_type(), "; only floating-point values average");
    promoted = i == 0 ? p.scalar_type() : c10::promoteTypes(promoted, p.scalar_type());
  }
  stats.tensors = static_cast<int64_t>(params.size());
  // A group of one: x / 1 summed over one rank is x, bit for bit.
  if (process_group->getSize() == 1) return stats;

  c10::AutoGradMode no_grad(false);
  // One pass per device, in order of first appearance (the same on every rank).
  std::vector<std::pair<at::Device, std::vector<at::Tensor>>> by_device;
  for (const at::Tensor& p : params) {
    auto it = std::find_if(by_device.begin(), by_device.end(),
                           [&](const auto& e) { return e.first == p.device(); });
    if (it == by_device.end()) {
      by_device.emplace_back(p.device(), std::vector<at::Tensor>{});
      it = std::prev(by_device.end());
    }
    it->second.push_back(p);
  }
  for (const auto& entry : by_device) {
    average_on_device(entry.second, process_group, compute_dtype(promoted, entry.first),
                      options.bucket_cap_bytes, stats);
  }
  return stats;
}

}  // namespace ddpx
