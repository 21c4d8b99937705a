// The functional optimizers (ddpx/optim/functional.h): one step against its closed form, the
// first momentum step, the stateful classes and their torch-layout state, and the errors.
// Parity over 100 steps against torch.optim is in tests/python/test_functional_optim.py.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <ddpx/optim/functional.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

namespace {

using ddpx::optim::AdamOptions;
using ddpx::optim::SGDOptions;

at::Tensor rand_like_seeded(at::IntArrayRef shape, at::ScalarType dtype, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::TensorOptions().dtype(dtype));
}

// An fp64 copy (never an alias, also for an fp64 tensor that the step then updates).
at::Tensor f64(const at::Tensor& t) {
  return t.to(at::kDouble, /*non_blocking=*/false, /*copy=*/true);
}

class FunctionalOptim : public ::testing::TestWithParam<at::ScalarType> {};

// One SGD step with momentum, nesterov and weight decay from a given buffer, in fp64 closed form.
TEST_P(FunctionalOptim, SgdOneStepClosedForm) {
  const auto dt = GetParam();
  at::Tensor p = rand_like_seeded({5, 7}, dt, 1), g = rand_like_seeded({5, 7}, dt, 2);
  at::Tensor b = rand_like_seeded({5, 7}, dt, 3);
  const at::Tensor p0 = f64(p), g0 = f64(g), b0 = f64(b);
  SGDOptions o;
  o.lr = 0.1;
  o.momentum = 0.9;
  o.weight_decay = 0.01;
  o.nesterov = true;
  o.maximize = true;
  std::vector<at::Tensor> bufs{b};
  ddpx::optim::sgd_step({p}, {g}, bufs, o);
  const at::Tensor d = -g0 + 0.01 * p0;
  const at::Tensor b1 = 0.9 * b0 + d;
  const at::Tensor p1 = p0 - 0.1 * (d + 0.9 * b1);
  const double tol = dt == at::kFloat ? 1e-6 : 1e-14;
  EXPECT_TRUE(at::allclose(bufs[0].to(at::kDouble), b1, tol, tol));
  EXPECT_TRUE(at::allclose(p.to(at::kDouble), p1, tol, tol));
  EXPECT_EQ(bufs[0].data_ptr(), b.data_ptr());  // updated in place
}

// The first momentum step: buffer = gradient (after weight decay), dampening not applied.
TEST_P(FunctionalOptim, SgdFirstStepBufferIsGradient) {
  const auto dt = GetParam();
  at::Tensor p = rand_like_seeded({33}, dt, 4), g = rand_like_seeded({33}, dt, 5);
  const at::Tensor p0 = p.clone();
  SGDOptions o;
  o.lr = 0.5;
  o.momentum = 0.9;
  o.dampening = 0.7;
  std::vector<at::Tensor> bufs(1);
  ddpx::optim::sgd_step({p}, {g}, bufs, o);
  ASSERT_TRUE(bufs[0].defined());
  EXPECT_TRUE(at::equal(bufs[0], g));
  EXPECT_NE(bufs[0].data_ptr(), g.data_ptr());
  EXPECT_TRUE(at::allclose(p, p0 - 0.5 * g));
}

// One Adam and one AdamW step from given moments at step 3 (so the bias corrections matter).
TEST_P(FunctionalOptim, AdamOneStepClosedForm) {
  const auto dt = GetParam();
  for (bool decoupled : {false, true}) {
    at::Tensor p = rand_like_seeded({4, 9}, dt, 6), g = rand_like_seeded({4, 9}, dt, 7);
    at::Tensor m = rand_like_seeded({4, 9}, dt, 8), v = rand_like_seeded({4, 9}, dt, 9).abs();
    at::Tensor vmax = v * 1.5;
    const at::Tensor p0 = f64(p), g0 = f64(g), m0 = f64(m), v0 = f64(v), vmax0 = f64(vmax);
    AdamOptions o;
    o.lr = 0.01;
    o.beta1 = 0.8;
    o.beta2 = 0.95;
    o.eps = 1e-6;
    o.weight_decay = 0.1;
    o.amsgrad = true;
    std::vector<at::Tensor> ms{m}, vs{v}, vmaxs{vmax};
    std::vector<int64_t> steps{2};
    ddpx::optim::adam_step({p}, {g}, ms, vs, vmaxs, steps, o, decoupled);
    EXPECT_EQ(steps[0], 3);
    const at::Tensor pd = decoupled ? p0 * (1 - 0.01 * 0.1) : p0;
    const at::Tensor gd = decoupled ? g0 : g0 + 0.1 * p0;
    const at::Tensor m1 = 0.8 * m0 + 0.2 * gd;
    const at::Tensor v1 = 0.95 * v0 + 0.05 * gd * gd;
    const at::Tensor vmax1 = at::maximum(vmax0, v1);
    const double bc1 = 1 - std::pow(0.8, 3), bc2 = 1 - std::pow(0.95, 3);
    const at::Tensor p1 = pd - (0.01 / bc1) * m1 / (vmax1.sqrt() / std::sqrt(bc2) + 1e-6);
    const double tol = dt == at::kFloat ? 1e-5 : 1e-12;
    EXPECT_TRUE(at::allclose(ms[0].to(at::kDouble), m1, tol, tol));
    EXPECT_TRUE(at::allclose(vs[0].to(at::kDouble), v1, tol, tol));
    EXPECT_TRUE(at::allclose(vmaxs[0].to(at::kDouble), vmax1, tol, tol));
    EXPECT_TRUE(at::allclose(p.to(at::kDouble), p1, tol, tol)) << "decoupled " << decoupled;
  }
}

// The first Adam step creates zero moments and moves each element by about lr (sign of -grad).
TEST_P(FunctionalOptim, AdamFirstStepMovesByLr) {
  const auto dt = GetParam();
  at::Tensor p = rand_like_seeded({1000}, dt, 10), g = rand_like_seeded({1000}, dt, 11);
  const at::Tensor p0 = p.clone();
  std::vector<at::Tensor> ms(1), vs(1), none;
  std::vector<int64_t> steps{0};
  AdamOptions o;
  o.lr = 0.01;
  o.eps = 0;
  ddpx::optim::adam_step({p}, {g}, ms, vs, none, steps, o, false);
  EXPECT_TRUE(at::allclose(p - p0, -0.01 * g.sign(), 1e-5, 1e-7));
  EXPECT_TRUE(at::allclose(ms[0], 0.1 * g));
}

// The classes: skipped parameters, torch's state layout, state reload giving identical steps.
TEST_P(FunctionalOptim, ClassesStateRoundTrip) {
  const auto dt = GetParam();
  std::vector<at::Tensor> params{rand_like_seeded({3, 3}, dt, 12), rand_like_seeded({8}, dt, 13)};
  AdamOptions o = AdamOptions::adamw_defaults();
  EXPECT_EQ(o.weight_decay, 1e-2);
  o.amsgrad = true;
  ddpx::optim::FunctionalAdam a(params, o, /*decoupled_weight_decay=*/true);
  a.step({rand_like_seeded({3, 3}, dt, 14), at::Tensor()});
  auto st = a.state();
  ASSERT_EQ(st.size(), 2u);
  EXPECT_TRUE(st[1].empty());
  ASSERT_EQ(st[0].size(), 4u);
  EXPECT_EQ(st[0].at("step").scalar_type(), at::kFloat);
  EXPECT_EQ(st[0].at("step").item<float>(), 1.0f);

  std::vector<at::Tensor> copies{params[0].clone(), params[1].clone()};
  ddpx::optim::FunctionalAdam b(copies, o, true);
  b.load_state(st);
  const std::vector<at::Tensor> grads{rand_like_seeded({3, 3}, dt, 15),
                                      rand_like_seeded({8}, dt, 16)};
  a.step(grads);
  b.step(grads);
  EXPECT_TRUE(at::equal(params[0], copies[0]));
  EXPECT_TRUE(at::equal(params[1], copies[1]));
  EXPECT_EQ(b.state()[0].at("step").item<float>(), 2.0f);
  EXPECT_EQ(b.state()[1].at("step").item<float>(), 1.0f);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, FunctionalOptim, ::testing::Values(at::kFloat, at::kDouble),
                         [](const auto& info) { return std::string(c10::toString(info.param)); });

// `what` raised by `f`, with its message containing `needle`.
template <typename E, typename F>
void expect_error(F f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing: " << needle;
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(FunctionalOptimErrors, Options) {
  SGDOptions s;
  s.lr = -1;
  expect_error<c10::ValueError>([&] { s.validate(); }, "Invalid learning rate: -1");
  s = SGDOptions();
  s.nesterov = true;
  expect_error<c10::ValueError>([&] { s.validate(); }, "Nesterov momentum requires a momentum");
  AdamOptions a;
  a.beta1 = 1.0;
  expect_error<c10::ValueError>([&] { a.validate(); }, "Invalid beta parameter at index 0: 1");
  a = AdamOptions();
  a.eps = -1;
  expect_error<c10::ValueError>([&] { a.validate(); }, "Invalid epsilon value: -1");
  a = AdamOptions();
  a.lr = std::nan("");
  expect_error<c10::ValueError>([&] { a.validate(); }, "Invalid learning rate");
}

TEST(FunctionalOptimErrors, Tensors) {
  const at::Tensor p = at::zeros({4, 4});
  std::vector<at::Tensor> bufs(1);
  expect_error<c10::ValueError>(
      [&] {
        ddpx::optim::sgd_step({p}, {p, p}, bufs, SGDOptions());
      },
      "grads has 2 entries but params has 1");
  expect_error<c10::Error>([&] { ddpx::optim::sgd_step({p}, {at::zeros({4})}, bufs, {}); },
                           "grads[0] has shape [4] but params[0] has shape [4, 4]");
  expect_error<c10::Error>(
      [&] {
        ddpx::optim::sgd_step({p}, {at::zeros({4, 4}, at::kDouble)}, bufs, {});
      },
      "grads[0] has dtype Double but params[0] has dtype Float");
  expect_error<c10::Error>([&] { ddpx::optim::sgd_step({p.t()}, {p}, bufs, {}); },
                           "params[0] must be contiguous");
  expect_error<c10::Error>(
      [&] { ddpx::optim::sgd_step({p.to(at::kHalf)}, {p.to(at::kHalf)}, bufs, {}); },
      "only float32 and float64 are supported");
  std::vector<at::Tensor> ms{at::zeros({4, 4})}, vs(1), none;
  std::vector<int64_t> steps{1};
  expect_error<c10::ValueError>(
      [&] { ddpx::optim::adam_step({p}, {p}, ms, vs, none, steps, AdamOptions(), false); },
      "part of its state only");
}

}  // namespace
