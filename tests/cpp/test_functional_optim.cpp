// The functional optimizers (ddpx/optim/functional.h): one step against its closed form, the
// first momentum step, the stateful classes and their torch-layout state, CUDA against CPU (skipped
// without a GPU), and the errors. Parity over 100 steps against torch.optim is in
// tests/python/test_functional_optim.py.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <ddpx/optim/functional.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

namespace {

using ddpx::optim::AdagradOptions;
using ddpx::optim::AdamOptions;
using ddpx::optim::elementwise_step;
using ddpx::optim::RMSpropOptions;
using ddpx::optim::SGDOptions;
using ddpx::optim::validate_elementwise;
using ddpx::optim::elementwise::Adagrad;
using ddpx::optim::elementwise::RMSprop;
// elementwise_step's state lists: one per state of the traits, in kStateNames' order.
using States = std::vector<std::vector<at::Tensor>>;

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
    o.decoupled_weight_decay = decoupled;
    std::vector<at::Tensor> ms{m}, vs{v}, vmaxs{vmax};
    std::vector<int64_t> steps{2};
    ddpx::optim::adam_step({p}, {g}, ms, vs, vmaxs, steps, o);
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
  ddpx::optim::adam_step({p}, {g}, ms, vs, none, steps, o);
  EXPECT_TRUE(at::allclose(p - p0, -0.01 * g.sign(), 1e-5, 1e-7));
  EXPECT_TRUE(at::allclose(ms[0], 0.1 * g));
}

// The classes: skipped parameters, torch's state layout, state reload giving identical steps.
TEST_P(FunctionalOptim, ClassesStateRoundTrip) {
  const auto dt = GetParam();
  std::vector<at::Tensor> params{rand_like_seeded({3, 3}, dt, 12), rand_like_seeded({8}, dt, 13)};
  AdamOptions o = AdamOptions::adamw_defaults();
  EXPECT_EQ(o.weight_decay, 1e-2);
  EXPECT_TRUE(o.decoupled_weight_decay);
  o.amsgrad = true;
  ddpx::optim::FunctionalAdam a(params, o);
  a.step({rand_like_seeded({3, 3}, dt, 14), at::Tensor()});
  auto st = a.state();
  ASSERT_EQ(st.size(), 2u);
  EXPECT_TRUE(st[1].empty());
  ASSERT_EQ(st[0].size(), 4u);
  EXPECT_EQ(st[0].at("step").scalar_type(), at::kFloat);
  EXPECT_EQ(st[0].at("step").item<float>(), 1.0f);

  std::vector<at::Tensor> copies{params[0].clone(), params[1].clone()};
  ddpx::optim::FunctionalAdam b(copies, o);
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

// One Adagrad step at step 3 (so lr_decay matters) from a given sum, in fp64 closed form.
TEST_P(FunctionalOptim, AdagradOneStepClosedForm) {
  const auto dt = GetParam();
  at::Tensor p = rand_like_seeded({6, 5}, dt, 20), g = rand_like_seeded({6, 5}, dt, 21);
  at::Tensor sum = rand_like_seeded({6, 5}, dt, 22).abs();
  const at::Tensor p0 = f64(p), g0 = f64(g), sum0 = f64(sum);
  AdagradOptions o;
  o.lr = 0.1;
  o.lr_decay = 0.5;
  o.weight_decay = 0.01;
  o.eps = 1e-3;
  o.maximize = true;
  States st{{sum}};
  std::vector<int64_t> steps{2};
  elementwise_step<Adagrad>({p}, {g}, st, steps, o);
  EXPECT_EQ(steps[0], 3);
  const at::Tensor& sums0 = st[0][0];
  EXPECT_EQ(sums0.data_ptr(), sum.data_ptr());  // updated in place
  const at::Tensor d = -g0 + 0.01 * p0;
  const at::Tensor sum1 = sum0 + d * d;
  const double clr = 0.1 / (1 + 2 * 0.5);
  const at::Tensor p1 = p0 - clr * d / (sum1.sqrt() + 1e-3);
  const double tol = dt == at::kFloat ? 1e-6 : 1e-14;
  EXPECT_TRUE(at::allclose(sums0.to(at::kDouble), sum1, tol, tol));
  EXPECT_TRUE(at::allclose(p.to(at::kDouble), p1, tol, tol));
}

// The first Adagrad step creates the sum filled with initial_accumulator_value, as torch does.
TEST_P(FunctionalOptim, AdagradFirstStepCreatesSum) {
  const auto dt = GetParam();
  at::Tensor p = rand_like_seeded({50}, dt, 23), g = rand_like_seeded({50}, dt, 24);
  const at::Tensor p0 = f64(p), g0 = f64(g);
  AdagradOptions o;
  o.initial_accumulator_value = 0.25;
  o.eps = 0;
  States st{std::vector<at::Tensor>(1)};
  std::vector<int64_t> steps{0};
  elementwise_step<Adagrad>({p}, {g}, st, steps, o);
  ASSERT_TRUE(st[0][0].defined());
  EXPECT_EQ(steps[0], 1);
  const at::Tensor sum1 = 0.25 + g0 * g0;
  const double tol = dt == at::kFloat ? 1e-6 : 1e-14;
  EXPECT_TRUE(at::allclose(st[0][0].to(at::kDouble), sum1, tol, tol));
  EXPECT_TRUE(at::allclose(p.to(at::kDouble), p0 - 1e-2 * g0 / sum1.sqrt(), tol, tol));
}

// One RMSprop step from given state, for every combination of centered and momentum, in fp64
// closed form.
TEST_P(FunctionalOptim, RMSpropOneStepClosedForm) {
  const auto dt = GetParam();
  for (bool centered : {false, true}) {
    for (double momentum : {0.0, 0.9}) {
      at::Tensor p = rand_like_seeded({4, 9}, dt, 25), g = rand_like_seeded({4, 9}, dt, 26);
      // square_avg well above grad_avg^2, so the centered variance is positive.
      at::Tensor sq = rand_like_seeded({4, 9}, dt, 27).abs() + 4;
      at::Tensor ga = rand_like_seeded({4, 9}, dt, 28) * 0.25;
      at::Tensor buf = rand_like_seeded({4, 9}, dt, 29);
      const at::Tensor p0 = f64(p), g0 = f64(g), sq0 = f64(sq), ga0 = f64(ga), buf0 = f64(buf);
      RMSpropOptions o;
      o.lr = 0.01;
      o.alpha = 0.9;
      o.eps = 1e-4;
      o.weight_decay = 0.1;
      o.momentum = momentum;
      o.centered = centered;
      // Every list given: the step must read and write only those these options keep.
      States st{{sq}, {buf}, {ga}};
      std::vector<int64_t> steps{4};
      elementwise_step<RMSprop>({p}, {g}, st, steps, o);
      EXPECT_EQ(steps[0], 5);
      const at::Tensor d = g0 + 0.1 * p0;
      const at::Tensor sq1 = 0.9 * sq0 + 0.1 * d * d;
      const at::Tensor ga1 = centered ? 0.9 * ga0 + 0.1 * d : ga0;
      const at::Tensor avg = (centered ? (sq1 - ga1 * ga1).sqrt() : sq1.sqrt()) + 1e-4;
      const at::Tensor buf1 = momentum > 0 ? 0.9 * buf0 + d / avg : buf0;
      const at::Tensor p1 = momentum > 0 ? p0 - 0.01 * buf1 : p0 - 0.01 * d / avg;
      ASSERT_FALSE(p1.isnan().any().item<bool>());
      const double tol = dt == at::kFloat ? 1e-5 : 1e-12;
      const std::string where = std::string("centered ") + (centered ? "1" : "0") + " momentum " +
                                std::to_string(momentum);
      EXPECT_TRUE(at::allclose(sq.to(at::kDouble), sq1, tol, tol)) << where;
      EXPECT_TRUE(at::allclose(ga.to(at::kDouble), ga1, tol, tol)) << where;  // untouched if not
      EXPECT_TRUE(at::allclose(buf.to(at::kDouble), buf1, tol, tol)) << where;
      EXPECT_TRUE(at::allclose(p.to(at::kDouble), p1, tol, tol)) << where;
    }
  }
}

// The first RMSprop step creates zero state (grad_avg and the buffer only when used): with zero
// state, square_avg = (1 - alpha) g^2 and the step is lr * g / (sqrt((1 - alpha) g^2) + eps).
TEST_P(FunctionalOptim, RMSpropFirstStepCreatesState) {
  const auto dt = GetParam();
  at::Tensor p = rand_like_seeded({40}, dt, 30), g = rand_like_seeded({40}, dt, 31);
  const at::Tensor p0 = f64(p), g0 = f64(g);
  RMSpropOptions o;
  o.eps = 0;
  o.alpha = 0.75;
  States st{std::vector<at::Tensor>(1), {}, {}};
  std::vector<int64_t> steps{0};
  elementwise_step<RMSprop>({p}, {g}, st, steps, o);
  ASSERT_TRUE(st[0][0].defined());
  EXPECT_TRUE(st[1].empty() && st[2].empty());  // states not kept are not created
  const double tol = dt == at::kFloat ? 1e-6 : 1e-14;
  EXPECT_TRUE(at::allclose(st[0][0].to(at::kDouble), 0.25 * g0 * g0, tol, tol));
  EXPECT_TRUE(at::allclose(p.to(at::kDouble), p0 - 1e-2 * g0.sign() / 0.5, tol, tol));
}

// The classes: torch's layout (Adagrad's state from the constructor, RMSprop's keys by option),
// skipped parameters, and a state reload giving identical steps.
TEST_P(FunctionalOptim, AdagradRMSpropStateRoundTrip) {
  const auto dt = GetParam();
  const std::vector<at::Tensor> grads{rand_like_seeded({3, 3}, dt, 34),
                                      rand_like_seeded({8}, dt, 35)};
  {
    std::vector<at::Tensor> params{rand_like_seeded({3, 3}, dt, 32), rand_like_seeded({8}, dt, 33)};
    AdagradOptions o;
    o.initial_accumulator_value = 0.5;
    o.lr_decay = 0.1;
    ddpx::optim::FunctionalAdagrad a(params, o);
    auto st = a.state();
    ASSERT_EQ(st.size(), 2u);
    for (const auto& s : st) {
      ASSERT_EQ(s.size(), 2u);
      EXPECT_EQ(s.at("step").scalar_type(), at::kFloat);
      EXPECT_EQ(s.at("step").item<float>(), 0.0f);
      EXPECT_TRUE(at::equal(s.at("sum"), at::full_like(s.at("sum"), 0.5)));
    }
    a.step({grads[0], at::Tensor()});
    st = a.state();
    EXPECT_EQ(st[0].at("step").item<float>(), 1.0f);
    EXPECT_EQ(st[1].at("step").item<float>(), 0.0f);
    std::vector<at::Tensor> copies{params[0].clone(), params[1].clone()};
    ddpx::optim::FunctionalAdagrad b(copies, o);
    b.load_state(st);
    a.step(grads);
    b.step(grads);
    EXPECT_TRUE(at::equal(params[0], copies[0]));
    EXPECT_TRUE(at::equal(params[1], copies[1]));
    EXPECT_EQ(b.state()[0].at("step").item<float>(), 2.0f);
  }
  for (bool centered : {false, true}) {
    std::vector<at::Tensor> params{rand_like_seeded({3, 3}, dt, 32), rand_like_seeded({8}, dt, 33)};
    RMSpropOptions o;
    o.centered = centered;
    o.momentum = centered ? 0.0 : 0.5;
    ddpx::optim::FunctionalRMSprop a(params, o);
    EXPECT_TRUE(a.state()[0].empty());
    a.step({grads[0], at::Tensor()});
    auto st = a.state();
    EXPECT_TRUE(st[1].empty());
    ASSERT_EQ(st[0].size(), 3u);
    EXPECT_EQ(st[0].count("grad_avg"), centered ? 1u : 0u);
    EXPECT_EQ(st[0].count("momentum_buffer"), centered ? 0u : 1u);
    EXPECT_EQ(st[0].at("step").item<float>(), 1.0f);
    std::vector<at::Tensor> copies{params[0].clone(), params[1].clone()};
    ddpx::optim::FunctionalRMSprop b(copies, o);
    b.load_state(st);
    a.step(grads);
    b.step(grads);
    EXPECT_TRUE(at::equal(params[0], copies[0]));
    EXPECT_TRUE(at::equal(params[1], copies[1]));
    EXPECT_EQ(b.state()[0].at("step").item<float>(), 2.0f);
    EXPECT_EQ(b.state()[1].at("step").item<float>(), 1.0f);
  }
}

// CUDA tensors run the CPU's element function: the same results bit for bit.
TEST_P(FunctionalOptim, AdagradRMSpropCudaMatchesCpu) {
#ifndef DDPX_WITH_CUDA
  GTEST_SKIP() << "ddpx was built without CUDA kernels";
#endif
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a CUDA GPU";
  const auto dt = GetParam();
  const std::vector<int64_t> sizes{1, 257, 100003};
  std::vector<at::Tensor> cpu, cuda;
  for (size_t i = 0; i < sizes.size(); ++i) {
    cpu.push_back(rand_like_seeded({sizes[i]}, dt, 40 + i));
    cuda.push_back(cpu.back().to(at::kCUDA));
  }
  AdagradOptions ao;
  ao.lr_decay = 0.01;
  ao.weight_decay = 0.1;
  ao.maximize = true;
  RMSpropOptions ro;
  ro.momentum = 0.9;
  ro.centered = true;
  ro.alpha = 0.3;  // ATen's lerp from grad (torch 2.x)
  ro.weight_decay = 0.1;
  ddpx::optim::FunctionalAdagrad a_cpu(cpu, ao), a_cuda(cuda, ao);
  for (int step = 0; step < 5; ++step) {
    std::vector<at::Tensor> g_cpu, g_cuda;
    for (size_t i = 0; i < sizes.size(); ++i) {
      g_cpu.push_back(rand_like_seeded({sizes[i]}, dt, 100 * step + i));
      g_cuda.push_back(g_cpu.back().to(at::kCUDA));
    }
    a_cpu.step(g_cpu);
    a_cuda.step(g_cuda);
  }
  std::vector<at::Tensor> cpu2, cuda2;
  for (size_t i = 0; i < sizes.size(); ++i) {
    cpu2.push_back(cpu[i].clone());
    cuda2.push_back(cpu[i].to(at::kCUDA));
  }
  ddpx::optim::FunctionalRMSprop r_cpu(cpu2, ro), r_cuda(cuda2, ro);
  for (int step = 0; step < 5; ++step) {
    std::vector<at::Tensor> g_cpu, g_cuda;
    for (size_t i = 0; i < sizes.size(); ++i) {
      g_cpu.push_back(rand_like_seeded({sizes[i]}, dt, 100 * step + i + 7));
      g_cuda.push_back(g_cpu.back().to(at::kCUDA));
    }
    r_cpu.step(g_cpu);
    r_cuda.step(g_cuda);
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_TRUE(at::equal(cuda[i].cpu(), cpu[i])) << "Adagrad tensor " << i;
    EXPECT_TRUE(at::equal(cuda2[i].cpu(), cpu2[i])) << "RMSprop tensor " << i;
    const auto st_cpu = r_cpu.state()[i], st_cuda = r_cuda.state()[i];
    for (const char* key : {"square_avg", "grad_avg", "momentum_buffer"}) {
      EXPECT_TRUE(at::equal(st_cuda.at(key).cpu(), st_cpu.at(key))) << key << " " << i;
    }
  }
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

TEST(FunctionalOptimErrors, AdagradRMSpropOptions) {
  AdagradOptions a;
  a.lr_decay = -1;
  expect_error<c10::ValueError>([&] { validate_elementwise(a); }, "Invalid lr_decay value: -1");
  a = AdagradOptions();
  a.initial_accumulator_value = -0.5;
  expect_error<c10::ValueError>([&] { validate_elementwise(a); },
                                "Invalid initial_accumulator_value value: -0.5");
  a = AdagradOptions();
  a.eps = std::nan("");
  expect_error<c10::ValueError>([&] { validate_elementwise(a); }, "Invalid epsilon value: nan");
  EXPECT_NO_THROW(validate_elementwise(AdagradOptions()));
  RMSpropOptions r;
  r.alpha = -0.1;
  expect_error<c10::ValueError>([&] { validate_elementwise(r); }, "Invalid alpha value: -0.1");
  r = RMSpropOptions();
  r.momentum = -1;
  expect_error<c10::ValueError>([&] { validate_elementwise(r); }, "Invalid momentum value: -1");
  r = RMSpropOptions();
  r.lr = -1;
  r.eps = -1;  // torch checks lr first
  expect_error<c10::ValueError>([&] { validate_elementwise(r); }, "Invalid learning rate: -1");
  EXPECT_NO_THROW(validate_elementwise(RMSpropOptions()));
  // The constructors validate too.
  expect_error<c10::ValueError>([&] { ddpx::optim::FunctionalRMSprop({at::zeros({2})}, r); },
                                "Invalid learning rate");
}

TEST(FunctionalOptimErrors, AdagradRMSpropTensors) {
  const at::Tensor p = at::zeros({4, 4});
  States sums{std::vector<at::Tensor>(1)};
  std::vector<int64_t> steps{0};
  // Dense gradients only: torch's Adagrad would take this sparse one, ddpx refuses it clearly.
  expect_error<c10::Error>(
      [&] {
        elementwise_step<Adagrad>({p}, {at::ones({4, 4}).to_sparse()}, sums, steps, {});
      },
      "grads[0] must be dense, got layout Sparse");
  EXPECT_FALSE(sums[0][0].defined());  // nothing created by a failed call
  EXPECT_EQ(steps[0], 0);
  steps[0] = 3;
  expect_error<c10::ValueError>([&] { elementwise_step<Adagrad>({p}, {p}, sums, steps, {}); },
                                "params[0] has step 3 but no state");
  RMSpropOptions centered;
  centered.centered = true;
  States part{{at::zeros({4, 4})}, {}, std::vector<at::Tensor>(1)};
  expect_error<c10::ValueError>([&] { elementwise_step<RMSprop>({p}, {p}, part, steps, centered); },
                                "part of its state only");
  States no_grad_avg{{at::zeros({4, 4})}, {}, {}};
  expect_error<c10::ValueError>(
      [&] { elementwise_step<RMSprop>({p}, {p}, no_grad_avg, steps, centered); },
      "grad_avg has 0 entries but params has 1");
  States bad{{at::zeros({4})}, {}, {}};
  expect_error<c10::Error>([&] { elementwise_step<RMSprop>({p}, {p}, bad, steps, {}); },
                           "square_avg[0] has shape [4] but params[0] has shape [4, 4]");
  ddpx::optim::FunctionalRMSprop r({p}, RMSpropOptions());
  expect_error<c10::ValueError>(
      [&] {
        r.load_state({{{"square_avg", at::zeros({4, 4})}}});
      },
      "state[0] has no \"step\"");
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
      [&] { ddpx::optim::adam_step({p}, {p}, ms, vs, none, steps, AdamOptions()); },
      "part of its state only");
}

// The elementwise optimizers from C++ (their traits in ddpx/optim/elementwise/): closed forms of
// their first steps, torch's state names, and torch's refusals.
TEST(ElementwiseOptim, FirstStepsClosedForm) {
  // Adamax, step 1: exp_avg = (1 - b1) g, exp_inf = |g| + eps, clr = lr / (1 - b1): the step is
  // lr * g / (|g| + eps), lr * sign(g) up to eps.
  std::vector<at::Tensor> a{at::full({3}, 1.0, at::kDouble)};
  ddpx::optim::AdamaxOptions ao;
  ao.lr = 0.1;
  ao.eps = 0;
  ddpx::optim::FunctionalAdamax adamax(a, ao);
  adamax.step({at::tensor({2.0, -0.5, 4.0}, at::kDouble)});
  EXPECT_TRUE(at::allclose(a[0], at::tensor({0.9, 1.1, 0.9}, at::kDouble), 0, 1e-15));
  auto st = adamax.state();
  EXPECT_EQ(st[0].size(), 3u);
  EXPECT_TRUE(at::allclose(st[0].at("exp_inf"), at::tensor({2.0, 0.5, 4.0}, at::kDouble)));

  // Adadelta, step 1 with rho 0.5: square_avg = g^2 / 2 = 2, std = sqrt(2 + eps), and (acc_delta
  // starting at 0) delta = sqrt(eps) / std * g.
  std::vector<at::Tensor> d{at::ones({2}, at::kDouble)};
  ddpx::optim::AdadeltaOptions dopt;
  dopt.rho = 0.5;
  dopt.eps = 1e-2;
  ddpx::optim::FunctionalAdadelta adadelta(d, dopt);
  adadelta.step({at::full({2}, 2.0, at::kDouble)});
  const double delta = std::sqrt(0.01) / std::sqrt(2.01) * 2;
  EXPECT_NEAR(d[0][0].item<double>(), 1 - delta, 1e-15);

  // Rprop: the first step moves by lr (step_size starts at lr, prev 0: factor 1); a sign change
  // next multiplies the step size by etaminus, zeroes the gradient, and leaves the parameter.
  std::vector<at::Tensor> r{at::zeros({2}, at::kDouble)};
  ddpx::optim::RpropOptions ro;
  ro.lr = 0.1;
  ddpx::optim::FunctionalRprop rprop(r, ro);
  rprop.step({at::tensor({1.0, -1.0}, at::kDouble)});
  EXPECT_TRUE(at::allclose(r[0], at::tensor({-0.1, 0.1}, at::kDouble)));
  rprop.step({at::tensor({-1.0, -1.0}, at::kDouble)});
  EXPECT_TRUE(at::allclose(r[0], at::tensor({-0.1, 0.1 + 0.12}, at::kDouble)));
  auto rs = rprop.state();
  EXPECT_TRUE(at::allclose(rs[0].at("step_size"), at::tensor({0.05, 0.12}, at::kDouble)));
  EXPECT_TRUE(at::equal(rs[0].at("prev"), at::tensor({0.0, -1.0}, at::kDouble)));
}

TEST(ElementwiseOptim, RefusalsAreTorchs) {
  std::vector<at::Tensor> p{at::zeros({2})};
  ddpx::optim::RpropOptions r;
  r.etaminus = 1.5;
  expect_error<c10::ValueError>([&] { ddpx::optim::FunctionalRprop(p, r); },
                                "Invalid eta values: 1.5, 1.2");
  ddpx::optim::AdadeltaOptions d;
  d.rho = 2;
  expect_error<c10::ValueError>([&] { ddpx::optim::FunctionalAdadelta(p, d); },
                                "Invalid rho value: 2");
  // Through OptimizerOptions, as the RPC optimizer takes them.
  const ddpx::optim::OptimizerOptions any = ddpx::optim::AdamaxOptions();
  EXPECT_STREQ(ddpx::optim::optimizer_kind(any), "adamax");
}

}  // namespace
