// The owner side of the RPC DistributedOptimizer (ddpx/optim/rpc_local_optimizer.h): building a
// local optimizer from torch's argument names (defaults, every argument, refusals), stepping it
// with a context's gradient dict (parameters without a gradient skipped), the per-process
// registry (ids, unknown and deleted ids), and concurrent steps serialized by the process lock
// (no update lost).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <ddpx/optim/rpc_local_optimizer.h>
#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace {

using ddpx::optim::make_rpc_local_optimizer;
using ddpx::optim::OptimizerArgs;

c10::Dict<at::Tensor, at::Tensor> grads_of(const std::vector<at::Tensor>& params,
                                           const std::vector<at::Tensor>& grads) {
  c10::Dict<at::Tensor, at::Tensor> d;
  for (size_t i = 0; i < params.size(); ++i) {
    if (grads[i].defined()) d.insert(params[i], grads[i]);
  }
  return d;
}

TEST(RpcLocalOptimizer, SgdWithMomentumSkipsParametersWithoutAGradient) {
  std::vector<at::Tensor> params{at::ones({3}), at::ones({2})};
  auto opt = make_rpc_local_optimizer("sgd", params, {{"lr", 0.5}, {"momentum", 0.9}});
  opt->step(grads_of(params, {at::ones({3}), at::Tensor()}));
  opt->step(grads_of(params, {at::ones({3}), at::Tensor()}));
  // buf = 1, then 0.9 * 1 + 1 = 1.9: 1 - 0.5 - 0.95.
  EXPECT_TRUE(at::allclose(params[0], at::full({3}, -0.45)));
  EXPECT_TRUE(at::equal(params[1], at::ones({2})));  // never had a gradient
  auto state = opt->state();
  ASSERT_EQ(state.size(), 2u);
  EXPECT_TRUE(at::allclose(state[0].at("momentum_buffer"), at::full({3}, 1.9)));
  EXPECT_TRUE(state[1].empty());
}

TEST(RpcLocalOptimizer, AdamAndAdamWDefaultsAreTorchs) {
  std::vector<at::Tensor> a{at::ones({4})}, w{at::ones({4})};
  auto adam = make_rpc_local_optimizer("adam", a, {{"lr", 0.1}});
  auto adamw = make_rpc_local_optimizer("adamw", w, {{"lr", 0.1}});
  adam->step(grads_of(a, {at::full({4}, 2.0)}));
  adamw->step(grads_of(w, {at::full({4}, 2.0)}));
  // First Adam step: p - lr * sign(g) (bias-corrected m / sqrt(v) = 1, up to eps).
  EXPECT_TRUE(at::allclose(a[0], at::full({4}, 0.9), 1e-6, 1e-6));
  // AdamW: weight_decay 1e-2 first: p * (1 - lr * wd), then the same step.
  EXPECT_TRUE(at::allclose(w[0], at::full({4}, 1.0 * (1 - 0.1 * 1e-2) - 0.1), 1e-6, 1e-6));
}

TEST(RpcLocalOptimizer, AdagradAndRmspropTakeTorchsArguments) {
  std::vector<at::Tensor> a{at::ones({4})}, r{at::ones({4})};
  auto adagrad = make_rpc_local_optimizer(
      "adagrad", a, {{"lr", 0.1}, {"initial_accumulator_value", 0.0}, {"eps", 0.0}});
  auto rmsprop = make_rpc_local_optimizer(
      "rmsprop", r, {{"lr", 0.1}, {"alpha", 0.0}, {"eps", 0.0}, {"centered", 0}, {"momentum", 0}});
  adagrad->step(grads_of(a, {at::full({4}, 2.0)}));
  rmsprop->step(grads_of(r, {at::full({4}, 2.0)}));
  // Adagrad: sum = g^2, p -= lr * g / sqrt(sum) = lr. RMSprop with alpha 0: avg = g^2, the same.
  EXPECT_TRUE(at::allclose(a[0], at::full({4}, 0.9)));
  EXPECT_TRUE(at::allclose(r[0], at::full({4}, 0.9)));
  EXPECT_THROW(make_rpc_local_optimizer("adagrad", a, {{"lr_decay", -1}}), c10::ValueError);
  EXPECT_THROW(make_rpc_local_optimizer("rmsprop", r, {{"betas", 0.9}}), c10::ValueError);
}

TEST(RpcLocalOptimizer, BadArgumentsAreValueErrors) {
  std::vector<at::Tensor> p{at::ones({2})};
  EXPECT_THROW(make_rpc_local_optimizer("lbfgs", p, {}), c10::ValueError);
  EXPECT_THROW(make_rpc_local_optimizer("sgd", p, {{"lr", 0.1}, {"colour", 1}}), c10::ValueError);
  EXPECT_THROW(make_rpc_local_optimizer("sgd", p, {{"lr", -1}}), c10::ValueError);
  EXPECT_THROW(make_rpc_local_optimizer("sgd", p, {{"lr", 0.1}, {"nesterov", 0.5}}),
               c10::ValueError);
  EXPECT_THROW(make_rpc_local_optimizer("adam", p, {{"beta1", 1.0}}), c10::ValueError);
}

TEST(RpcLocalOptimizer, Registry) {
  std::vector<at::Tensor> p{at::zeros({2})};
  const int64_t a =
      ddpx::optim::register_rpc_local_optimizer(make_rpc_local_optimizer("sgd", p, {{"lr", 1.0}}));
  const int64_t b =
      ddpx::optim::register_rpc_local_optimizer(make_rpc_local_optimizer("sgd", p, {{"lr", 1.0}}));
  EXPECT_GT(b, a);
  ddpx::optim::step_rpc_local_optimizer(a, grads_of(p, {at::ones({2})}));
  EXPECT_TRUE(at::equal(p[0], at::full({2}, -1.0)));
  ddpx::optim::unregister_rpc_local_optimizer(a);
  EXPECT_THROW(ddpx::optim::step_rpc_local_optimizer(a, grads_of(p, {at::ones({2})})),
               c10::ValueError);
  EXPECT_THROW(ddpx::optim::rpc_local_optimizer(123456789), c10::ValueError);
  ddpx::optim::unregister_rpc_local_optimizer(a);  // twice: ignored
  ddpx::optim::unregister_rpc_local_optimizer(b);
}

// Steps from several threads (several trainers' RPCs) on one optimizer are serialized: with
// plain SGD, lr 1 and a gradient of ones, every one of the updates lands. 1M elements, so that
// unserialized steps would overlap (a read-modify-write race then loses updates).
TEST(RpcLocalOptimizer, ConcurrentStepsLoseNoUpdate) {
  constexpr int64_t kNumel = 1 << 20;
  std::vector<at::Tensor> p{at::zeros({kNumel})};
  const int64_t id =
      ddpx::optim::register_rpc_local_optimizer(make_rpc_local_optimizer("sgd", p, {{"lr", 1.0}}));
  constexpr int kThreads = 4, kSteps = 50;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int s = 0; s < kSteps; ++s) {
        ddpx::optim::step_rpc_local_optimizer(id, grads_of(p, {at::ones({kNumel})}));
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_TRUE(at::equal(p[0], at::full({kNumel}, -static_cast<double>(kThreads * kSteps))));
  ddpx::optim::unregister_rpc_local_optimizer(id);
}

}  // namespace
