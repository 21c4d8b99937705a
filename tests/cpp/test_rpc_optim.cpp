// The owner side of the RPC DistributedOptimizer (ddpx/optim/rpc_local_optimizer.h): building a
// local optimizer from typed options (the kind each stands for, torch's refusals), stepping it
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

using ddpx::optim::AdagradOptions;
using ddpx::optim::AdamOptions;
using ddpx::optim::make_rpc_local_optimizer;
using ddpx::optim::RMSpropOptions;
using ddpx::optim::SGDOptions;

SGDOptions sgd_lr_one() {
  SGDOptions o;
  o.lr = 1.0;
  return o;
}

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
  SGDOptions o;
  o.lr = 0.5;
  o.momentum = 0.9;
  auto opt = make_rpc_local_optimizer(params, o);
  EXPECT_EQ(opt->kind(), "sgd");
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
  AdamOptions ao, wo = AdamOptions::adamw_defaults();
  ao.lr = wo.lr = 0.1;
  auto adam = make_rpc_local_optimizer(a, ao);
  auto adamw = make_rpc_local_optimizer(w, wo);
  EXPECT_EQ(adam->kind(), "adam");
  EXPECT_EQ(adamw->kind(), "adamw");
  adam->step(grads_of(a, {at::full({4}, 2.0)}));
  adamw->step(grads_of(w, {at::full({4}, 2.0)}));
  // First Adam step: p - lr * sign(g) (bias-corrected m / sqrt(v) = 1, up to eps).
  EXPECT_TRUE(at::allclose(a[0], at::full({4}, 0.9), 1e-6, 1e-6));
  // AdamW: weight_decay 1e-2 first: p * (1 - lr * wd), then the same step.
  EXPECT_TRUE(at::allclose(w[0], at::full({4}, 1.0 * (1 - 0.1 * 1e-2) - 0.1), 1e-6, 1e-6));
}

TEST(RpcLocalOptimizer, AdagradAndRmsprop) {
  std::vector<at::Tensor> a{at::ones({4})}, r{at::ones({4})};
  AdagradOptions go;
  go.lr = 0.1;
  go.eps = 0;
  RMSpropOptions ro;
  ro.lr = 0.1;
  ro.alpha = 0;
  ro.eps = 0;
  auto adagrad = make_rpc_local_optimizer(a, go);
  auto rmsprop = make_rpc_local_optimizer(r, ro);
  EXPECT_EQ(adagrad->kind(), "adagrad");
  EXPECT_EQ(rmsprop->kind(), "rmsprop");
  adagrad->step(grads_of(a, {at::full({4}, 2.0)}));
  rmsprop->step(grads_of(r, {at::full({4}, 2.0)}));
  // Adagrad: sum = g^2, p -= lr * g / sqrt(sum) = lr. RMSprop with alpha 0: avg = g^2, the same.
  EXPECT_TRUE(at::allclose(a[0], at::full({4}, 0.9)));
  EXPECT_TRUE(at::allclose(r[0], at::full({4}, 0.9)));
}

// Options torch refuses are refused when the optimizer is built (torch's ValueErrors).
TEST(RpcLocalOptimizer, BadOptionsAreValueErrors) {
  std::vector<at::Tensor> p{at::ones({2})};
  SGDOptions negative_lr;
  negative_lr.lr = -1;
  EXPECT_THROW(make_rpc_local_optimizer(p, negative_lr), c10::ValueError);
  SGDOptions nesterov_without_momentum;
  nesterov_without_momentum.nesterov = true;
  EXPECT_THROW(make_rpc_local_optimizer(p, nesterov_without_momentum), c10::ValueError);
  AdamOptions beta1_one;
  beta1_one.beta1 = 1.0;
  EXPECT_THROW(make_rpc_local_optimizer(p, beta1_one), c10::ValueError);
  AdagradOptions negative_decay;
  negative_decay.lr_decay = -1;
  EXPECT_THROW(make_rpc_local_optimizer(p, negative_decay), c10::ValueError);
  RMSpropOptions negative_alpha;
  negative_alpha.alpha = -1;
  EXPECT_THROW(make_rpc_local_optimizer(p, negative_alpha), c10::ValueError);
}

TEST(RpcLocalOptimizer, Registry) {
  std::vector<at::Tensor> p{at::zeros({2})};
  const int64_t a =
      ddpx::optim::register_rpc_local_optimizer(make_rpc_local_optimizer(p, sgd_lr_one()));
  const int64_t b =
      ddpx::optim::register_rpc_local_optimizer(make_rpc_local_optimizer(p, sgd_lr_one()));
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
      ddpx::optim::register_rpc_local_optimizer(make_rpc_local_optimizer(p, sgd_lr_one()));
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
