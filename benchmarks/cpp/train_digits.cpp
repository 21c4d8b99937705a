// The ddpx C++ main job: benchmarks/train_digits.py's training in a libtorch program. The same
// digits MLP, initial weights, data split, batches, SGD and schedule, trained data-parallel with
// ddpx::ddp::DistributedDataParallel once per configuration (DDP's default allreduce, torch's
// built-in C++ hooks, ddpx's hooks, post-local SGD with ddpx's PostLocalSGDOptimizer, ddpx's
// ZeroRedundancyOptimizer), launched by torchrun like any job:
//
//   python benchmarks/train_digits.py --export-cpp-data out/digits_cpp.pt     # once, no download
//   torchrun --standalone --nproc_per_node=2 --no-python build/benchmarks/cpp/train_digits \
//       --data out/digits_cpp.pt --out out/ [--compare out/final_weights.pt]
//
// The data file holds the training and test sets, the initial weights and the Python job's
// settings (epochs, batch size, learning rate, seeds, PowerSGD and post-local SGD schedules), so
// both jobs train the same thing. With --compare (the Python job's --save-final-weights file),
// each row whose Python counterpart ran is checked against it: the same Reducer, hooks and
// optimizer maths on the same data must end with bit-identical weights (--require-identical makes
// any difference an error). Prints the results table and writes <out>/results_cpp.md.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ddpx/ddp.h>
#include <ddpx/hooks.h>
#include <ddpx/optim/averagers.h>
#include <ddpx/optim/post_localsgd_optimizer.h>
#include <ddpx/optim/zero.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using ddpx::ProcessGroupPtr;

// ---- arguments --------------------------------------------------------------------------------
struct Args {
  std::string data = "out/digits_cpp.pt";
  std::string out = "out";
  std::string compare;  // the Python job's final weights (train_digits.py --save-final-weights)
  bool require_identical = false;
  std::string only;  // comma-separated substrings of row names (the first row always runs)
  // Overrides of the data file's settings (<= 0: the file's value).
  int64_t epochs = 0;
  double lr = 0;
  // Intra-op threads per rank (<= 0: the machine's cores shared among the node's ranks). Runs
  // compared bit for bit across launch layouts (one machine, several) fix it: the kernels'
  // reductions may split differently with another thread count.
  int64_t threads = 0;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "train_digits: %s\nusage: train_digits [--data FILE] [--out DIR] [--compare FILE "
               "[--require-identical]] [--only a,b] [--epochs N] [--lr X] [--threads N]\n",
               why.c_str());
  std::exit(2);
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string key = argv[i];
    if (key == "--require-identical") {
      a.require_identical = true;
      continue;
    }
    if (i + 1 >= argc) usage(key + " needs a value");
    const std::string value = argv[++i];
    try {
      if (key == "--data") {
        a.data = value;
      } else if (key == "--out") {
        a.out = value;
      } else if (key == "--compare") {
        a.compare = value;
      } else if (key == "--only") {
        a.only = value;
      } else if (key == "--epochs") {
        a.epochs = std::stoll(value);
      } else if (key == "--lr") {
        a.lr = std::stod(value);
      } else if (key == "--threads") {
        a.threads = std::stoll(value);
      } else {
        usage("unknown argument " + key);
      }
    } catch (const std::logic_error&) {
      usage(key + " " + value + ": not a number");
    }
  }
  if (a.require_identical && a.compare.empty()) usage("--require-identical needs --compare");
  return a;
}

// ---- the data file (train_digits.py --export-cpp-data) ---------------------------------------
c10::impl::GenericDict load_dict(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw std::runtime_error(
        std::string("cannot open ") + what + " " + path +
        " (make it with: python benchmarks/train_digits.py " +
        (std::string(what) == "data file" ? "--export-cpp-data " : "--save-final-weights ... ") +
        path + ")");
  }
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return torch::jit::pickle_load(bytes).toGenericDict();
}

struct Settings {
  int64_t epochs, batch_size, seed, warmup_steps, localsgd_period, localsgd_subgroup;
  int64_t powersgd_start = -1, localsgd_start = -1;  // -1: the Python job's defaults
  double lr;
};

struct Digits {
  at::Tensor x_train, y_train, x_test, y_test;
  std::vector<std::pair<std::string, at::Tensor>> init;  // "0.weight", ... in module order
  Settings settings;
};

Digits load_digits(const std::string& path) {
  auto dict = load_dict(path, "data file");
  auto get = [&](const std::string& key) {
    auto it = dict.find(key);
    if (it == dict.end()) throw std::runtime_error(path + ": no '" + key + "' entry");
    return it->value();
  };
  Digits d;
  d.x_train = get("x_train").toTensor();
  d.y_train = get("y_train").toTensor();
  d.x_test = get("x_test").toTensor();
  d.y_test = get("y_test").toTensor();
  for (const auto& name : get("param_names").toListRef()) {
    d.init.emplace_back(name.toStringRef(), get("param." + name.toStringRef()).toTensor());
  }
  Settings& s = d.settings;
  s.epochs = get("epochs").toInt();
  s.batch_size = get("batch_size").toInt();
  s.seed = get("seed").toInt();
  s.warmup_steps = get("warmup_steps").toInt();
  s.localsgd_period = get("localsgd_period").toInt();
  s.localsgd_subgroup = get("localsgd_subgroup").toInt();
  s.lr = get("lr").toDouble();
  if (!get("powersgd_start").isNone()) s.powersgd_start = get("powersgd_start").toInt();
  if (!get("localsgd_start").isNone()) s.localsgd_start = get("localsgd_start").toInt();
  return d;
}

// The MLP of make_mlp() in train_digits.py, shaped by the exported weights: Linear, ReLU, ...,
// Linear; the weights copied in (the same names as Python's nn.Sequential).
torch::nn::Sequential make_mlp(const Digits& d) {
  torch::nn::Sequential net;
  for (size_t i = 0; i + 1 < d.init.size(); i += 2) {
    const at::Tensor& w = d.init[i].second;
    if (i > 0) net->push_back(torch::nn::ReLU());
    net->push_back(torch::nn::Linear(w.size(1), w.size(0)));
  }
  at::NoGradGuard no_grad;
  auto params = net->named_parameters(/*recurse=*/true);
  for (const auto& [name, value] : d.init) {
    at::Tensor* p = params.find(name);
    if (p == nullptr || !p->sizes().equals(value.sizes())) {
      throw std::runtime_error("the data file's parameter " + name + " does not fit the MLP");
    }
    p->copy_(value);
  }
  return net;
}

// ---- configurations ---------------------------------------------------------------------------
// What a row trains with: the hook registered on its DDP, and its optimizer (one step() per
// training step; zero_grad is done by the loop).
struct RunParts {
  std::function<void()> step;
  std::shared_ptr<ddpx::hooks::PowerSGDState> powersgd;  // for compression_stats()
};

struct Context {
  ProcessGroupPtr pg;
  Settings s;
  ProcessGroupPtr localsgd_subgroup;
};

using Setup = std::function<RunParts(ddpx::ddp::DistributedDataParallel&, const Context&)>;

struct Config {
  std::string name;
  std::string python_row;  // the train_digits.py row it must equal ("" for none)
  Setup setup;
  std::optional<double> compression = 1.0;  // payload vs fp32 allreduce (PowerSGD: x stats)
  bool synchronises = true;
};

std::function<void()> sgd_step(ddpx::ddp::DistributedDataParallel& ddp, const Context& c) {
  auto sgd = std::make_shared<torch::optim::SGD>(ddp.module().parameters(),
                                                 torch::optim::SGDOptions(c.s.lr).momentum(0.9));
  return [sgd] { sgd->step(); };
}

Config hook_row(const std::string& name, const std::string& python_row,
                std::function<ddpx::hooks::CommHookPtr(const Context&)> make_hook,
                double compression = 1.0) {
  return {name, python_row,
          [make_hook](ddpx::ddp::DistributedDataParallel& ddp, const Context& c) {
            ddp.register_comm_hook(make_hook(c));
            return RunParts{sgd_step(ddp, c), nullptr};
          },
          compression};
}

Config builtin_row(const std::string& name, const std::string& python_row,
                   c10d::BuiltinCommHookType type, double compression) {
  return {name, python_row,
          [type](ddpx::ddp::DistributedDataParallel& ddp, const Context& c) {
            ddp.register_builtin_comm_hook(type);
            return RunParts{sgd_step(ddp, c), nullptr};
          },
          compression};
}

Config powersgd_row(const std::string& name, int64_t rank, bool batched, bool fp16 = false) {
  const std::string full = name + " r=" + std::to_string(rank);
  return {full, full + " (native)",
          [rank, batched, fp16](ddpx::ddp::DistributedDataParallel& ddp, const Context& c) {
            ddpx::hooks::PowerSGDOptions o;
            o.matrix_approximation_rank = rank;
            o.start_powerSGD_iter = c.s.powersgd_start;
            o.random_seed = 0;
            auto state =
                std::make_shared<ddpx::hooks::PowerSGDState>(c.pg, o, [](const std::string&) {});
            auto hook = batched ? ddpx::hooks::batched_powerSGD_hook(state)
                                : ddpx::hooks::powerSGD_hook(state);
            ddp.register_comm_hook(fp16 ? ddpx::hooks::fp16_compress_wrapper(hook) : hook);
            return RunParts{sgd_step(ddp, c), state};
          },
          fp16 ? 2.0 : 1.0};
}

Config local_sgd_row() {
  const std::string name = "ddpx post_localSGD_hook + PostLocalSGDOptimizer";
  return {name, name + " (native)",
          [](ddpx::ddp::DistributedDataParallel& ddp, const Context& c) {
            auto state = std::make_shared<ddpx::hooks::PostLocalSGDState>(
                c.pg, c.localsgd_subgroup, c.s.localsgd_start,
                /*post_local_gradient_allreduce=*/true, [](const std::string&) {});
            ddp.register_comm_hook(ddpx::hooks::post_localSGD_hook(state));
            auto opt = std::make_shared<ddpx::optim::PostLocalSGDOptimizer>(
                std::make_shared<torch::optim::SGD>(ddp.module().parameters(),
                                                    torch::optim::SGDOptions(c.s.lr).momentum(0.9)),
                std::make_shared<ddpx::optim::PeriodicModelAverager>(c.s.localsgd_period,
                                                                     c.s.localsgd_start, c.pg));
            return RunParts{[opt, state] { opt->step(); }, nullptr};
          },
          std::nullopt};
}

Config zero_row(const std::string& name, ddpx::optim::ZeroPartition partition) {
  return {name, name + " (DDP default)",
          [partition](ddpx::ddp::DistributedDataParallel& ddp, const Context& c) {
            ddpx::optim::ZeroOptions o;
            o.partition = partition;
            const double lr = c.s.lr;
            auto zero = std::make_shared<ddpx::optim::ZeroRedundancyOptimizer>(
                std::vector<torch::optim::OptimizerParamGroup>{
                    torch::optim::OptimizerParamGroup(ddp.module().parameters())},
                [lr](std::vector<torch::optim::OptimizerParamGroup> groups) {
                  return std::make_shared<torch::optim::SGD>(
                      std::move(groups), torch::optim::SGDOptions(lr).momentum(0.9));
                },
                c.pg, o);
            return RunParts{[zero] { zero->step(); }, nullptr};
          }};
}

std::vector<Config> all_configs() {
  namespace H = ddpx::hooks;
  std::vector<Config> configs;
  configs.push_back({"no hook", "no hook (DDP default)",
                     [](ddpx::ddp::DistributedDataParallel& ddp, const Context& c) {
                       return RunParts{sgd_step(ddp, c), nullptr};
                     }});
  configs.push_back(builtin_row("c10d built-in ALLREDUCE", "no hook (DDP default)",
                                c10d::BuiltinCommHookType::ALLREDUCE, 1.0));
  configs.push_back(builtin_row("c10d built-in FP16_COMPRESS", "torch fp16_compress_hook (drop-in)",
                                c10d::BuiltinCommHookType::FP16_COMPRESS, 2.0));
  configs.push_back(hook_row("ddpx allreduce_hook", "ddpx allreduce_hook (native)",
                             [](const Context& c) { return H::allreduce_hook(c.pg); }));
  configs.push_back(hook_row(
      "ddpx fp16_compress_hook", "ddpx fp16_compress_hook (native)",
      [](const Context& c) { return H::fp16_compress_hook(c.pg); }, 2.0));
  configs.push_back(hook_row(
      "ddpx bf16_compress_hook", "ddpx bf16_compress_hook (native)",
      [](const Context& c) { return H::bf16_compress_hook(c.pg); }, 2.0));
  configs.push_back(hook_row(
      "ddpx fp16_compress_wrapper(allreduce_hook)",
      "ddpx fp16_compress_wrapper(allreduce_hook) (native)",
      [](const Context& c) { return H::fp16_compress_wrapper(H::allreduce_hook(c.pg)); }, 2.0));
  for (int64_t r : {1, 2, 4}) configs.push_back(powersgd_row("ddpx powerSGD_hook", r, false));
  configs.push_back(powersgd_row("ddpx batched_powerSGD_hook", 1, true));
  configs.push_back(
      powersgd_row("ddpx fp16_compress_wrapper(powerSGD_hook)", 2, false, /*fp16=*/true));
  configs.push_back(local_sgd_row());
  configs.push_back(
      zero_row("ddpx ZeroRedundancyOptimizer", ddpx::optim::ZeroPartition::kSortedGreedy));
  configs.push_back(
      zero_row("ddpx ZeroRedundancyOptimizer, balanced", ddpx::optim::ZeroPartition::kBalanced));
  Config noop = hook_row("ddpx noop_hook", "ddpx noop_hook (native)",
                         [](const Context&) { return H::noop_hook(); });
  noop.compression = std::nullopt;
  noop.synchronises = false;
  configs.push_back(noop);
  return configs;
}

// ---- training -----------------------------------------------------------------------------------
struct Run {
  Config cfg;
  torch::nn::Sequential net;
  std::unique_ptr<ddpx::ddp::DistributedDataParallel> ddp;
  RunParts parts;
  std::vector<double> step_ms;
  std::vector<double> epoch_loss;
  double loss_sum = 0;
  int64_t batches = 0;
  std::string error;
};

void all_reduce(at::Tensor& t, const ProcessGroupPtr& pg, c10d::ReduceOp op = c10d::ReduceOp::SUM) {
  std::vector<at::Tensor> v{t};
  c10d::AllreduceOptions o;
  o.reduceOp = op;
  pg->allreduce(v, o)->wait();
}

void barrier(const ProcessGroupPtr& pg) {
  // An all-reduce of one element: c10d's barrier on Gloo is one, and works on every torch.
  at::Tensor t = at::zeros({1});
  all_reduce(t, pg);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// torch.utils.data.DistributedSampler(range(n), world, rank, shuffle=True, seed,
// drop_last=True).set_epoch(epoch): a permutation from a generator seeded seed + epoch, cut to
// a multiple of the world size, every world-th index from rank on.
at::Tensor sampler_order(int64_t n, int64_t world, int64_t rank, int64_t seed, int64_t epoch) {
  at::Generator g = at::detail::createCPUGenerator(static_cast<uint64_t>(seed + epoch));
  at::Tensor perm = at::randperm(n, g, at::TensorOptions(at::kLong));
  const int64_t per_rank = n % world ? (n - world + world - 1) / world : n / world;
  return perm.narrow(0, 0, per_rank * world).slice(0, rank, per_rank * world, world);
}

struct RowResult {
  std::string name, python_row, status = "ok", error;
  double test_acc = 0, ms_per_step = 0, final_loss = 0, replica_spread = 0;
  std::optional<double> compression;
  std::optional<double> diff_vs_python;  // max |w - w_python| on rank 0 (nullopt: not compared)
  at::Tensor final_weights;              // rank 0's, flattened
};

RowResult finish(Run& r, const Digits& d, const ProcessGroupPtr& pg, int64_t warmup_steps) {
  RowResult row;
  row.name = r.cfg.name;
  row.python_row = r.cfg.python_row;
  const int64_t rank = pg->getRank(), world = pg->getSize();
  at::Tensor counts;
  {
    at::NoGradGuard no_grad;
    at::Tensor mine = at::arange(rank, d.x_test.size(0), world, at::TensorOptions(at::kLong));
    at::Tensor pred = r.net->forward(d.x_test.index_select(0, mine)).argmax(1);
    counts = at::tensor({pred.eq(d.y_test.index_select(0, mine)).sum().item<double>(),
                         static_cast<double>(mine.numel())},
                        at::TensorOptions(at::kDouble));
  }
  all_reduce(counts, pg);
  row.test_acc = counts[0].item<double>() / counts[1].item<double>();
  std::vector<at::Tensor> flat;
  for (const auto& p : r.net->parameters()) flat.push_back(p.detach().reshape(-1));
  row.final_weights = at::cat(flat);  // rank 0's float32 weights, compared with Python's
  at::Tensor w = row.final_weights.to(at::kDouble);
  std::vector<at::Tensor> ref{w.clone()};
  pg->broadcast(ref)->wait();
  at::Tensor spread = (w - ref[0]).abs().max().reshape({1});
  all_reduce(spread, pg, c10d::ReduceOp::MAX);
  row.replica_spread = spread.item<double>();
  const auto warm = static_cast<size_t>(
      std::min<int64_t>(warmup_steps, static_cast<int64_t>(r.step_ms.size()) - 1));
  at::Tensor med =
      at::tensor({median(std::vector<double>(r.step_ms.begin() + static_cast<std::ptrdiff_t>(warm),
                                             r.step_ms.end()))},
                 at::TensorOptions(at::kDouble));
  all_reduce(med, pg);  // mean over the ranks of each rank's median
  row.ms_per_step = med.item<double>() / static_cast<double>(world);
  row.final_loss = r.epoch_loss.back();
  row.compression = r.cfg.compression;
  if (r.parts.powersgd && row.compression) {
    *row.compression *= std::get<0>(r.parts.powersgd->compression_stats());
  }
  return row;
}

std::vector<RowResult> train_all(std::vector<Config> configs, const Digits& d, const Context& ctx) {
  const ProcessGroupPtr& pg = ctx.pg;
  const int64_t rank = pg->getRank(), world = pg->getSize();
  std::vector<std::unique_ptr<Run>> runs;
  for (auto& cfg : configs) {
    auto run = std::make_unique<Run>();
    run->cfg = std::move(cfg);
    run->net = make_mlp(d);
    try {
      run->ddp = std::make_unique<ddpx::ddp::DistributedDataParallel>(run->net, pg);
      run->parts = run->cfg.setup(*run->ddp, ctx);
    } catch (const std::exception& e) {  // the same on every rank
      run->error = std::string(e.what()).substr(0, std::string(e.what()).find('\n'));
    }
    runs.push_back(std::move(run));
  }
  const int64_t n = d.x_train.size(0);
  const int64_t bs = ctx.s.batch_size;
  int64_t step = 0;
  const auto t_start = std::chrono::steady_clock::now();
  for (int64_t epoch = 0; epoch < ctx.s.epochs; ++epoch) {
    at::Tensor order = sampler_order(n, world, rank, ctx.s.seed, epoch);
    for (int64_t b = 0; b < order.size(0) / bs; ++b) {
      at::Tensor idx = order.narrow(0, b * bs, bs);
      at::Tensor xb = d.x_train.index_select(0, idx), yb = d.y_train.index_select(0, idx);
      std::vector<Run*> live;
      for (auto& r : runs) {
        if (r->error.empty()) live.push_back(r.get());
      }
      // Rotate which configuration goes first, as the Python job does.
      const size_t k = live.empty() ? 0 : static_cast<size_t>(step) % live.size();
      std::rotate(live.begin(), live.begin() + static_cast<std::ptrdiff_t>(k), live.end());
      for (Run* r : live) {
        barrier(pg);  // every timed step starts together on all ranks
        const auto t0 = std::chrono::steady_clock::now();
        for (auto& p : r->net->parameters()) p.mutable_grad() = at::Tensor();
        at::Tensor loss = torch::nn::functional::cross_entropy(r->ddp->forward(xb), yb);
        loss.backward();
        r->parts.step();
        r->step_ms.push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count());
        r->loss_sum += loss.item<double>();
        r->batches += 1;
      }
      ++step;
    }
    std::string losses;
    for (auto& r : runs) {
      if (!r->error.empty()) continue;
      at::Tensor red = at::tensor({r->loss_sum, static_cast<double>(r->batches)},
                                  at::TensorOptions(at::kDouble));
      all_reduce(red, pg);
      r->epoch_loss.push_back(red[0].item<double>() / red[1].item<double>());
      r->loss_sum = 0;
      r->batches = 0;
      char buf[32];
      std::snprintf(buf, sizeof buf, " %.3f", r->epoch_loss.back());
      losses += buf;
    }
    if (rank == 0) {
      std::printf("  epoch %lld/%lld: %.1f s, loss%s\n", static_cast<long long>(epoch + 1),
                  static_cast<long long>(ctx.s.epochs),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count(),
                  losses.c_str());
      std::fflush(stdout);
    }
  }
  std::vector<RowResult> rows;
  for (auto& r : runs) {
    if (!r->error.empty()) {
      RowResult row;
      row.name = r->cfg.name;
      row.python_row = r->cfg.python_row;
      row.status = "error";
      row.error = r->error;
      rows.push_back(row);
      continue;
    }
    rows.push_back(finish(*r, d, pg, ctx.s.warmup_steps));
  }
  return rows;
}

// ---- report (rank 0)
// ------------------------------------------------------------------------------
std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

std::string render(const std::vector<RowResult>& rows, const std::string& header, bool compared) {
  std::ostringstream md;
  md << header << "\n\n";
  md << "| hook | test acc | ms/step | compression | final loss | replicas equal |"
     << (compared ? " vs Python job (max abs weight diff) |" : "") << "\n";
  md << "|---|---:|---:|---:|---:|---|" << (compared ? "---|" : "") << "\n";
  for (const auto& r : rows) {
    if (r.status != "ok") {
      md << "| " << r.name << " | " << r.status << ": " << r.error << " | | | | |"
         << (compared ? " |" : "") << "\n";
      continue;
    }
    md << "| " << r.name << " | " << fmt("%.2f%%", 100 * r.test_acc) << " | "
       << fmt("%.2f", r.ms_per_step) << " | "
       << (r.compression ? fmt("%.1fx", *r.compression) : std::string("-")) << " | "
       << fmt("%.5f", r.final_loss) << " | "
       << (r.replica_spread == 0 ? "yes" : fmt("no (%.3g)", r.replica_spread)) << " |";
    if (compared) {
      if (!r.diff_vs_python) {
        md << " -";
      } else if (*r.diff_vs_python == 0) {
        md << " identical";
      } else {
        md << fmt(" DIFFERS (%.3g)", *r.diff_vs_python);
      }
      md << " (" << (r.python_row.empty() ? "no Python row" : r.python_row) << ") |";
    }
    md << "\n";
  }
  return md.str();
}

int run(const Args& args) {
  auto pg = ddpx::ddp::init_process_group_from_env("gloo");
  const int64_t rank = pg->getRank(), world = pg->getSize();
  // As the Python job: the ranks share the machine's cores, one share each.
  const char* local_world_env = std::getenv("LOCAL_WORLD_SIZE");
  const int64_t local_world = local_world_env ? std::max(1LL, std::atoll(local_world_env)) : world;
  const auto cores = static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(static_cast<int>(
      args.threads > 0 ? args.threads : std::max<int64_t>(1, cores / local_world)));

  Digits d = load_digits(args.data);
  Settings& s = d.settings;
  if (args.epochs > 0) s.epochs = args.epochs;
  if (args.lr > 0) s.lr = args.lr;
  const int64_t steps = s.epochs * ((d.x_train.size(0) / world) / s.batch_size);
  // train_digits.py's defaults (Python's round() is half-to-even, as nearbyint).
  if (s.powersgd_start < 0) {
    s.powersgd_start = std::max<int64_t>(2, std::llround(std::nearbyint(0.15 * steps)));
  }
  if (s.localsgd_start < 0) {
    const int64_t s0 = std::max<int64_t>(1, std::llround(std::nearbyint(0.2 * steps)));
    s.localsgd_start =
        s0 + (((steps - 1 - s0) % s.localsgd_period) + s.localsgd_period) % s.localsgd_period;
  }
  Context ctx{pg, s, {}};
  ctx.localsgd_subgroup = ddpx::ddp::new_subgroups(pg, static_cast<int>(s.localsgd_subgroup));

  std::vector<Config> configs = all_configs();
  if (!args.only.empty()) {
    std::vector<std::string> keys;
    std::stringstream list(args.only);
    for (std::string k; std::getline(list, k, ',');) {
      if (!k.empty()) keys.push_back(k);
    }
    std::vector<Config> chosen{configs.front()};
    for (size_t i = 1; i < configs.size(); ++i) {
      for (const auto& k : keys) {
        if (configs[i].name.find(k) != std::string::npos) {
          chosen.push_back(configs[i]);
          break;
        }
      }
    }
    configs = std::move(chosen);
  }
  int64_t n_params = 0;
  for (const auto& [name, t] : d.init) n_params += t.numel();
  if (rank == 0) {
    std::printf(
        "train_digits (C++): %lld ranks, backend gloo, device cpu, %lld parameters, %lld train / "
        "%lld test images, %lld steps, %zu configurations\n",
        static_cast<long long>(world), static_cast<long long>(n_params),
        static_cast<long long>(d.x_train.size(0)), static_cast<long long>(d.x_test.size(0)),
        static_cast<long long>(steps), configs.size());
    std::fflush(stdout);
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<RowResult> rows = train_all(std::move(configs), d, ctx);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  int status = 0;
  if (rank == 0) {
    const bool compared = !args.compare.empty();
    int differ = 0, matched = 0;
    if (compared) {
      auto python = load_dict(args.compare, "weights file");
      for (auto& r : rows) {
        if (r.status != "ok" || r.python_row.empty()) continue;
        auto it = python.find(r.python_row);
        if (it == python.end()) continue;
        at::Tensor w = it->value().toTensor();
        r.diff_vs_python = w.sizes().equals(r.final_weights.sizes())
                               ? (w - r.final_weights).abs().max().item<double>()
                               : INFINITY;
        ++matched;
        if (*r.diff_vs_python != 0) ++differ;
      }
    }
    std::ostringstream header;
    header << "ddpx C++ DistributedDataParallel, digits MLP: " << world
           << " ranks (torchrun, Gloo, CPU), " << n_params << " parameters, " << s.epochs
           << " epochs of " << steps / std::max<int64_t>(1, s.epochs) << " steps, batch "
           << s.batch_size << "/rank, SGD lr " << s.lr << " momentum 0.9; PowerSGD from step "
           << s.powersgd_start << "; post-local SGD from step " << s.localsgd_start
           << ", averaging every " << s.localsgd_period << "; ms/step: median after "
           << s.warmup_steps << " steps, mean over ranks; job " << fmt("%.0f", wall) << " s";
    if (compared) {
      header << "; " << matched << " rows compared with the Python job (" << args.compare << "), "
             << differ << " differ";
    }
    const std::string md = render(rows, header.str(), compared);
    std::printf("\n%s", md.c_str());
    std::string dir = args.out;
    if (!dir.empty() && dir.back() != '/') dir += '/';
    if (!dir.empty()) std::filesystem::create_directories(dir);
    std::ofstream report(dir + "results_cpp.md");
    report << md;
    if (!report) {
      std::fprintf(stderr, "train_digits: cannot write %sresults_cpp.md\n", dir.c_str());
      status = 1;
    } else {
      std::printf("wrote %sresults_cpp.md\n", dir.c_str());
    }
    for (const auto& r : rows) {
      if (r.status != "ok") status = 1;
    }
    if (args.require_identical && (differ > 0 || matched == 0)) {
      std::fprintf(stderr, "train_digits: %s\n",
                   matched == 0 ? "no row was compared with the Python job"
                                : "some rows differ from the Python job");
      status = 1;
    }
  }
  barrier(pg);
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  try {
    return run(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_digits: %s\n", e.what());
    return 1;
  }
}
