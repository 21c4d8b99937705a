#include <c10/util/Exception.h>
#include <ddpx/common/compat.h>
#include <ddpx/ddp/process_group_env.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <string>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#ifdef DDPX_WITH_NCCL
#include "ddp/nccl_group.h"
#endif
#include <unordered_map>

namespace ddpx {
namespace ddp {
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

// What new_group needs of a world group made here: its store and how many groups it has named.
struct WorldEntry {
  c10::weak_intrusive_ptr<c10d::ProcessGroup> group;
  c10::intrusive_ptr<c10d::Store> store;
  std::string backend;
  int64_t groups_made = 0;
};

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

std::unordered_map<const c10d::ProcessGroup*, WorldEntry>& registry() {
  static std::unordered_map<const c10d::ProcessGroup*, WorldEntry> worlds;
  return worlds;
}

// The backends this build has: "gloo", and the NCCL names when built with torch's CUDA and NCCL
// (nccl_group.h; "nccl2" and "nccl-lazy" on a torch that has them).
bool backend_available(const std::string& backend) {
#ifdef DDPX_WITH_NCCL
  if (backend == "nccl" || backend == "nccl-legacy") return true;
  if (backend == "nccl2" || backend == "nccl-lazy") return detail::nccl2_available();
#endif
  return backend == "gloo";  // make_group says so where Gloo's headers were missing
}

ProcessGroupPtr make_group(const std::string& backend, const c10::intrusive_ptr<c10d::Store>& store,
                           int rank, int size, std::chrono::milliseconds timeout) {
#ifdef DDPX_WITH_NCCL
  if (detail::is_nccl_backend_name(backend)) {
    return detail::make_nccl_group(backend, store, rank, size, timeout);
  }
#endif
  TORCH_CHECK_VALUE(backend == "gloo", "init_process_group: backend '", backend,
                    "' is not available");
#if DDPX_HAS_GLOO_GROUP
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  return compat::make_gloo_group(store, rank, size, options);
#else
  (void)store, (void)rank, (void)size, (void)timeout;
  C10_THROW_ERROR(ValueError,
                  "init_process_group: this build of ddpx has no Gloo backend: Gloo's headers "
                  "were not found when it was compiled (torch's pip wheels do not ship them; on "
                  "Debian/Ubuntu install libgloo-dev and rebuild)");
#endif
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
  TORCH_CHECK_VALUE(
      backend_available(backend), "init_process_group: backend '", backend,
      "' is not available in this build of ddpx: \"gloo\"",
#ifdef DDPX_WITH_NCCL
      ", \"nccl\" or \"nccl-legacy\" (and \"nccl2\", \"nccl-lazy\" where torch has them)"
#else
      " only (\"nccl\" needs a build against a CUDA torch with NCCL's header)"
#endif
  );
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(master_port);
  opts.isServer = !use_agent_store && rank == 0;
  if (!use_agent_store) opts.numWorkers = static_cast<size_t>(world_size);
  opts.waitWorkers = false;
  opts.timeout = timeout;
  auto tcp = c10::make_intrusive<c10d::TCPStore>(master_addr, opts);
  // A namespace of its own in a store torchrun may share with other users.
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::PrefixStore>("ddpx_pg", tcp);
  ProcessGroupPtr pg = make_group(backend, store, rank, world_size, timeout);
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& worlds = registry();
  for (auto it = worlds.begin(); it != worlds.end();) {  // forget groups that are gone
    it = it->second.group.expired() ? worlds.erase(it) : std::next(it);
  }
  worlds.erase(pg.get());
  worlds.emplace(pg.get(),
                 WorldEntry{c10::weak_intrusive_ptr<c10d::ProcessGroup>(pg), tcp, backend, 0});
  return pg;
}

ProcessGroupPtr new_group(const ProcessGroupPtr& world, std::vector<int> ranks,
                          std::chrono::milliseconds timeout) {
  TORCH_CHECK_VALUE(world, "new_group: the world group is null");
  const int size = static_cast<int>(world->getSize());
  TORCH_CHECK_VALUE(!ranks.empty(), "new_group: the list of ranks is empty");
  std::sort(ranks.begin(), ranks.end());
  for (size_t i = 0; i < ranks.size(); ++i) {
    TORCH_CHECK_VALUE(ranks[i] >= 0 && ranks[i] < size, "new_group: rank ", ranks[i],
                      " is outside the world group's [0, ", size, ")");
    TORCH_CHECK_VALUE(i == 0 || ranks[i] != ranks[i - 1], "new_group: rank ", ranks[i],
                      " is listed twice");
  }
  TORCH_CHECK_VALUE(timeout.count() > 0, "new_group: the timeout must be positive");
  c10::intrusive_ptr<c10d::Store> store;
  std::string backend;
  int64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto it = registry().find(world.get());
    TORCH_CHECK_VALUE(it != registry().end() && it->second.group.lock() == world,
                      "new_group: the world group was not made by ddpx::ddp::init_process_group or "
                      "init_process_group_from_env (its store is needed to build the new group)");
    store = it->second.store;
    backend = it->second.backend;
    id = it->second.groups_made++;
  }
  const auto me = std::find(ranks.begin(), ranks.end(), static_cast<int>(world->getRank()));
  if (me == ranks.end()) return {};
  auto group_store =
      c10::make_intrusive<c10d::PrefixStore>("ddpx_group_" + std::to_string(id), store);
  return make_group(backend, group_store, static_cast<int>(me - ranks.begin()),
                    static_cast<int>(ranks.size()), timeout);
}

ProcessGroupPtr new_subgroups(const ProcessGroupPtr& world, int group_size,
                              std::chrono::milliseconds timeout) {
  TORCH_CHECK_VALUE(world, "new_subgroups: the world group is null");
  const int size = static_cast<int>(world->getSize());
  TORCH_CHECK_VALUE(group_size > 0 && size % group_size == 0, "new_subgroups: group_size ",
                    group_size, " must be positive and divide the world size ", size);
  ProcessGroupPtr mine;
  for (int first = 0; first < size; first += group_size) {
    std::vector<int> ranks(static_cast<size_t>(group_size));
    for (int i = 0; i < group_size; ++i) ranks[static_cast<size_t>(i)] = first + i;
    auto group = new_group(world, ranks, timeout);
    if (group) mine = group;
  }
  return mine;
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
#ifdef DDPX_WITH_NCCL
  // NCCL: one GPU per process, the LOCAL_RANK-th (torchrun's), current before the group exists.
  if (detail::is_nccl_backend_name(backend) && std::getenv("LOCAL_RANK") != nullptr) {
    const int64_t local_rank = env_int("LOCAL_RANK");
    const int devices = detail::cuda_device_count();
    TORCH_CHECK_VALUE(local_rank >= 0 && local_rank < devices, "init_process_group_from_env(\"",
                      backend, "\"): LOCAL_RANK=", local_rank, " but this process sees ", devices,
                      " CUDA device(s); NCCL needs one GPU per process");
    detail::set_cuda_device(static_cast<int>(local_rank));
  }
#endif
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  const bool use_agent_store = agent != nullptr && std::string(agent) == "True";
  return init_process_group(backend, static_cast<int>(rank), static_cast<int>(world), addr,
                            static_cast<int>(port), timeout, use_agent_store);
}

}  // namespace ddp
}  // namespace ddpx
