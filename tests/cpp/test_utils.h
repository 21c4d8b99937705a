// Shared helpers for the ddpx GoogleTest suites that need torch: N Gloo ranks as threads over
// one in-memory store, GradBuckets built as DDP's Reducer builds them, deterministic nonzero
// inputs, and error-message capture.
//
// Not for test_kernels.cpp / test_cuda_kernels.cpp, which stay free of c10d.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <utility>
#include <vector>

#include "common/compat_internal.h"
#include "tensor_utils.h"

namespace ddpx_test {

using ddpx::ProcessGroupPtr;

// A desynchronised test (one rank skipped a collective) fails after this long instead of
// hanging until ctest's timeout.
constexpr std::chrono::milliseconds kGlooTimeout{30000};

// One rank's Gloo process group over `store`. Blocks until all `size` ranks have joined
// (construction is a rendezvous), so the ranks must be constructed concurrently.
inline ProcessGroupPtr make_gloo_group(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                       int size) {
  ddpx::compat::disable_flight_recorder_for_thread_ranks();  // ranks are threads here
  auto options = c10d::ProcessGroupGloo::Options::create(kGlooTimeout);
  // The loopback address avoids hostname resolution, which sandboxes often lack.
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  // Hooks issue one collective at a time per bucket; one worker thread per group is enough and
  // keeps 10 groups (world sizes 1..4) light on a 2-core machine.
  options->threads = 1;
  return ddpx::compat::make_gloo_group(store, rank, size, options);
}

// A process group whose allreduce and alltoall_base fail: each returns a Work whose future holds
// the error `message`, as a failed Gloo or NCCL collective reports it. No communication happens,
// so one rank can use it alone. Its backend name is "gloo". For tests of error propagation.
namespace detail {
class FailedWork final : public c10d::Work {
 public:
  explicit FailedWork(const std::string& message)
      : future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors())) {
    future_->setError(std::make_exception_ptr(std::runtime_error(message)));
  }
  bool wait(std::chrono::milliseconds) override {
    future_->value();  // throws the injected error, as a failed collective's wait() does
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// A collective that completed (the failing group's all-gather).
class DoneWork final : public c10d::Work {
 public:
  bool wait(std::chrono::milliseconds) override { return true; }
};

using FailingBase = ddpx::compat::Backend;

class FailingCollectives final : public FailingBase {
 public:
  FailingCollectives(int rank, int size, std::string message)
      : FailingBase(rank, size), message_(std::move(message)) {}
  const std::string getBackendName() const override { return "gloo"; }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>&,
                                           const c10d::AllreduceOptions&) override {
    return c10::make_intrusive<FailedWork>(message_);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor&, at::Tensor&, std::vector<int64_t>&,
                                               std::vector<int64_t>&,
                                               const c10d::AllToAllOptions&) override {
    return c10::make_intrusive<FailedWork>(message_);
  }
  // The hooks' agreement on their options (src/hooks/agreement.h) all-gathers one record before
  // the first collective: here every "rank" sent this one's, so the hooks agree and go on to the
  // collectives that fail.
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions&) override {
    for (at::Tensor& out : outputs.at(0)) out.copy_(inputs.at(0));
    return c10::make_intrusive<DoneWork>();
  }

 private:
  std::string message_;
};
}  // namespace detail

inline ProcessGroupPtr make_failing_group(int rank, int size, const std::string& message) {
  auto failing = c10::make_intrusive<detail::FailingCollectives>(rank, size, message);
  return ddpx::compat::process_group_of(
      c10::static_intrusive_pointer_cast<ddpx::compat::Backend>(failing),
      c10::make_intrusive<c10d::HashStore>(), rank, size);
}

// A Gloo backend whose `fail_at`-th all-to-all (0-based) fails on this rank only after it has
// completed on every rank: the peers' data arrived, this rank's future and wait() report
// `message`. For tests of how a hook's later rounds handle one rank's failure.
namespace detail {
class FailAfterWork final : public c10d::Work {
 public:
  FailAfterWork(c10::intrusive_ptr<c10d::Work> inner, const std::string& message)
      : inner_(std::move(inner)),
        message_(message),
        future_(inner_->getFuture()->then(
            [message](c10::ivalue::Future& f) -> c10::IValue {
              f.value();
              throw std::runtime_error(message);
            },
            c10::ListType::ofTensors())) {}
  bool wait(std::chrono::milliseconds timeout) override {
    inner_->wait(timeout);
    throw std::runtime_error(message_);
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::string message_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class FailOneAllToAll final : public ddpx::compat::Backend {
 public:
  FailOneAllToAll(c10::intrusive_ptr<ddpx::compat::Backend> inner, int rank, int size, int fail_at,
                  std::string message)
      : ddpx::compat::Backend(rank, size),
        inner_(std::move(inner)),
        fail_at_(fail_at),
        message_(std::move(message)) {}
  const std::string getBackendName() const override { return "gloo"; }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    return inner_->allgather(outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    return inner_->allreduce(tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in,
                                               std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions& opts) override {
    auto work = inner_->alltoall_base(out, in, out_splits, in_splits, opts);
    if (calls_++ != fail_at_) return work;
    return c10::make_intrusive<FailAfterWork>(std::move(work), message_);
  }

 private:
  c10::intrusive_ptr<ddpx::compat::Backend> inner_;
  int fail_at_;
  std::string message_;
  int calls_ = 0;
};
}  // namespace detail

// `size` Gloo process groups over one fresh store, rank `fail_rank`'s wrapped so that its
// `fail_at`-th all-to-all fails after completing (detail::FailOneAllToAll).
inline std::vector<ProcessGroupPtr> make_gloo_world_failing_alltoall(int size, int fail_rank,
                                                                     int fail_at,
                                                                     const std::string& message) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<ProcessGroupPtr> pgs(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      ddpx::compat::disable_flight_recorder_for_thread_ranks();
      auto options = c10d::ProcessGroupGloo::Options::create(kGlooTimeout);
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      options->threads = 1;
      c10::intrusive_ptr<ddpx::compat::Backend> gloo =
          c10::make_intrusive<c10d::ProcessGroupGloo>(store, r, size, options);
      if (r == fail_rank) {
        gloo = c10::make_intrusive<detail::FailOneAllToAll>(gloo, r, size, fail_at, message);
      }
      pgs[r] = ddpx::compat::process_group_of(gloo, store, r, size);
    });
  }
  for (auto& t : threads) t.join();
  return pgs;
}

// `size` process groups, one per rank, over one fresh c10d::HashStore.
inline std::vector<ProcessGroupPtr> make_gloo_world(int size) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<ProcessGroupPtr> pgs(size);
  std::vector<std::thread> threads;
  std::mutex mu;
  std::string error;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        pgs[r] = make_gloo_group(store, r, size);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        error += "rank " + std::to_string(r) + ": " + e.what() + "\n";
      }
    });
  }
  for (auto& t : threads) t.join();
  TORCH_CHECK(error.empty(), "make_gloo_world(", size, ") failed:\n", error);
  return pgs;
}

// The process groups of world size `size`, created on first use and shared by every test in
// the binary (creating a Gloo mesh costs a rendezvous; tests only need the ranks in step).
// Thread-safe.
inline const std::vector<ProcessGroupPtr>& shared_gloo_world(int size) {
  static std::mutex mu;
  static std::map<int, std::vector<ProcessGroupPtr>> worlds;
  std::lock_guard<std::mutex> lock(mu);
  auto it = worlds.find(size);
  if (it == worlds.end()) it = worlds.emplace(size, make_gloo_world(size)).first;
  return it->second;
}

// Runs fn(rank, pg) on one thread per rank and joins them. An exception escaping a rank is
// reported as a test failure naming the rank (gtest assertions are thread-safe on POSIX).
inline void run_ranks(const std::vector<ProcessGroupPtr>& pgs,
                      const std::function<void(int, const ProcessGroupPtr&)>& fn) {
  std::vector<std::thread> threads;
  std::mutex mu;
  std::vector<std::string> errors;
  for (int r = 0; r < static_cast<int>(pgs.size()); ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, pgs[r]);
      } catch (const c10::Error& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back("rank " + std::to_string(r) + " threw: " + e.what_without_backtrace());
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back("rank " + std::to_string(r) + " threw: " + e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) ADD_FAILURE() << e;
}

// Convenience: run_ranks over the shared world of `size` ranks.
inline void run_ranks(int size, const std::function<void(int, const ProcessGroupPtr&)>& fn) {
  run_ranks(shared_gloo_world(size), fn);
}

// A GradBucket over `buffer` laid out as DDP lays out a bucket: up to two gradients back to
// back (shapes {n/2} and {1, n - n/2}). Owns the shape storage the bucket's IntArrayRefs point
// into, so keep the TestBucket alive as long as the bucket.
struct TestBucket {
  std::vector<std::vector<int64_t>> shapes;
  std::vector<c10::IntArrayRef> sizes;
  std::unique_ptr<c10d::GradBucket> bucket;

  c10d::GradBucket& get() { return *bucket; }
};

inline std::unique_ptr<TestBucket> make_bucket(const at::Tensor& buffer, size_t index = 0,
                                               size_t bucket_count = 1) {
  auto tb = std::make_unique<TestBucket>();
  const int64_t n = buffer.numel();
  std::vector<size_t> offsets, lengths;
  if (n >= 2) {
    tb->shapes = {{n / 2}, {1, n - n / 2}};
    offsets = {0, static_cast<size_t>(n / 2)};
    lengths = {static_cast<size_t>(n / 2), static_cast<size_t>(n - n / 2)};
  } else {
    tb->shapes = {{n}};
    offsets = {0};
    lengths = {static_cast<size_t>(n)};
  }
  std::vector<at::Tensor> params;
  for (const auto& s : tb->shapes) {
    tb->sizes.emplace_back(s);
    params.push_back(at::zeros(s, at::TensorOptions().dtype(at::kFloat)));
  }
  tb->bucket = std::make_unique<c10d::GradBucket>(ddpx::compat::make_grad_bucket(
      index, bucket_count, buffer, offsets, lengths, tb->sizes, params));
  return tb;
}

// A GradBucket over `buffer` holding one gradient per tensor of `params`, back to back in that
// order and with the parameters' shapes (their numels must add up to buffer.numel()). The bucket
// holds the parameter tensors themselves: hooks with per-parameter state (PowerSGD) recognise
// parameters by identity, so pass the same tensors at every step of one model.
inline std::unique_ptr<TestBucket> make_bucket(const at::Tensor& buffer,
                                               const std::vector<at::Tensor>& params,
                                               size_t index = 0, size_t bucket_count = 1) {
  auto tb = std::make_unique<TestBucket>();
  std::vector<size_t> offsets, lengths;
  size_t pos = 0;
  for (const auto& p : params) {
    tb->shapes.emplace_back(p.sizes().begin(), p.sizes().end());
    offsets.push_back(pos);
    lengths.push_back(static_cast<size_t>(p.numel()));
    pos += static_cast<size_t>(p.numel());
  }
  TORCH_CHECK(pos == static_cast<size_t>(buffer.numel()), "make_bucket: the parameters hold ", pos,
              " elements, the buffer ", buffer.numel());
  // Filled only now: the IntArrayRefs point into tb->shapes, which must not grow any more.
  for (const auto& s : tb->shapes) tb->sizes.emplace_back(s);
  tb->bucket = std::make_unique<c10d::GradBucket>(ddpx::compat::make_grad_bucket(
      index, bucket_count, buffer, offsets, lengths, tb->sizes, params));
  return tb;
}

// splitmix64: decorrelates seeds built from small integers (test id, rank).
inline uint64_t mix_seed(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
inline uint64_t rank_seed(uint64_t test_seed, int rank) {
  return mix_seed(mix_seed(test_seed) ^ static_cast<uint64_t>(rank + 1));
}

// n values sign * U[1, 2) * 2^e with e uniform in [emin, emax]: never zero, spread over
// several binades so that relative errors are exercised at different exponents.
inline std::vector<double> random_values(uint64_t seed, int64_t n, int emin = -6, int emax = 2) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> mant(1.0, 2.0);
  std::uniform_int_distribution<int> expo(emin, emax);
  std::bernoulli_distribution neg(0.5);
  std::vector<double> v(static_cast<size_t>(n));
  for (auto& x : v) x = (neg(gen) ? -1.0 : 1.0) * std::ldexp(mant(gen), expo(gen));
  return v;
}

// A 1-D tensor of dtype `dtype` holding `values` rounded to that dtype (round to nearest even).
inline at::Tensor make_tensor(const std::vector<double>& values, at::ScalarType dtype) {
  at::Tensor t = at::empty({static_cast<int64_t>(values.size())}, at::kDouble);
  if (!values.empty()) std::memcpy(t.data_ptr<double>(), values.data(), values.size() * 8);
  return t.to(dtype);
}

// The values of `t` as doubles (exact for every floating dtype ddpx handles).
inline std::vector<double> to_doubles(const at::Tensor& t) {
  at::Tensor d = t.to(at::kDouble).contiguous().reshape({-1});
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

// Unit roundoff (half an ulp of 1) of a floating dtype: the largest relative error of one
// round-to-nearest conversion into it (normal range).
inline double unit_roundoff(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf:
      return std::ldexp(1.0, -11);
    case at::kBFloat16:
      return std::ldexp(1.0, -8);
    case at::kFloat:
      return std::ldexp(1.0, -24);
    case at::kDouble:
      return std::ldexp(1.0, -53);
    default:
      TORCH_CHECK(false, "unit_roundoff: not a floating dtype: ", dtype);
  }
}

// Runs f and returns the message of the c10::Error it throws (without backtrace); records a
// failure when it throws something else or nothing.
template <typename F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a c10::Error, got std::exception: " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected a c10::Error, nothing was thrown";
  return {};
}

// Runs f and returns the message of the c10::ValueError it throws (without backtrace); records
// a failure when it throws another error or nothing.
template <typename F>
std::string value_error(F&& f) {
  try {
    f();
  } catch (const c10::ValueError& e) {
    return e.what_without_backtrace();
  } catch (const c10::Error& e) {
    ADD_FAILURE() << "expected a c10::ValueError, got another c10::Error: "
                  << e.what_without_backtrace();
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a c10::ValueError, got std::exception: " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected a c10::ValueError, nothing was thrown";
  return {};
}

}  // namespace ddpx_test
