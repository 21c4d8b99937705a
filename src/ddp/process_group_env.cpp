#include <c10/util/Exception.h>
#include <ddpx/common/compat.h>
#include <ddpx/ddp/process_group_env.h>

#include <cerrno>
#include <cstdlib>
#include <string>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace ddpx {
namespace {

constexpr const char* kTorchrunVars =
    "torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR "
    "and MASTER_PORT";

std::string env_string(const char* name) {
  const char* value = std::getenv(name);
  TORCH_CHECK_VALUE(value != nullptr && *value != '\0', "init_process_group_from_env: ", name,
                    " is not set (", kTorchrunVars, "; launch with torchrun or set them)");
  return value;
}

int64_t env_int(const char* name) {
  const std::string text = env_string(name);
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  TORCH_CHECK_VALUE(errno == 0 && end != text.c_str() && *end == '\0',
                    "init_process_group_from_env: ", name, "='", text, "' is not an integer");
  return value;
}

}  // namespace

ProcessGroupPtr init_process_group(const std::string& backend, int rank, int world_size,
                                   const std::string& master_addr, int master_port,
                                   std::chrono::milliseconds timeout, bool use_agent_store) {
  TORCH_CHECK_VALUE(world_size > 0, "init_process_group: world size must be positive, got ",
                    world_size);
  TORCH_CHECK_VALUE(rank >= 0 && rank < world_size, "init_process_group: rank ", rank,
                    " is outside [0, ", world_size, ")");
  TORCH_CHECK_VALUE(master_port > 0 && master_port < 65536, "init_process_group: port ",
                    master_port, " is outside 1-65535");
  TORCH_CHECK_VALUE(!master_addr.empty(), "init_process_group: the master address is empty");
  TORCH_CHECK_VALUE(timeout.count() > 0, "init_process_group: the timeout must be positive");
  TORCH_CHECK_VALUE(backend == "gloo", "init_process_group: backend '", backend,
                    "' is not supported by ddpx's C++ process groups yet; use \"gloo\"");
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(master_port);
  opts.isServer = !use_agent_store && rank == 0;
  if (!use_agent_store) opts.numWorkers = static_cast<size_t>(world_size);
  opts.waitWorkers = false;
  opts.timeout = timeout;
  auto tcp = c10::make_intrusive<c10d::TCPStore>(master_addr, opts);
  // A namespace of its own in a store torchrun may share with other users.
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::PrefixStore>("ddpx_pg", tcp);
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  return compat::make_gloo_group(store, rank, world_size, options);
}

ProcessGroupPtr init_process_group_from_env(const std::string& backend,
                                            std::chrono::milliseconds timeout) {
  const int64_t world = env_int("WORLD_SIZE");
  const int64_t rank = env_int("RANK");
  TORCH_CHECK_VALUE(world > 0, "init_process_group_from_env: WORLD_SIZE=", world,
                    " must be positive");
  TORCH_CHECK_VALUE(rank >= 0 && rank < world, "init_process_group_from_env: RANK=", rank,
                    " is outside [0, WORLD_SIZE=", world, ")");
  const std::string addr = env_string("MASTER_ADDR");
  const int64_t port = env_int("MASTER_PORT");
  TORCH_CHECK_VALUE(port > 0 && port < 65536, "init_process_group_from_env: MASTER_PORT=", port,
                    " is outside 1-65535");
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  const bool use_agent_store = agent != nullptr && std::string(agent) == "True";
  return init_process_group(backend, static_cast<int>(rank), static_cast<int>(world), addr,
                            static_cast<int>(port), timeout, use_agent_store);
}

}  // namespace ddpx
