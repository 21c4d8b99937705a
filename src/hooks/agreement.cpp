#include "hooks/agreement.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <ddpx/comm/exchange_mode.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <utility>

namespace ddpx {
namespace hooks {
namespace detail {

namespace {
// The record: [kMagic, option count, a hash of the hook's full name, a hash of the options'
// names and kinds, the name (64 bytes, truncated), the options' values..., zeros].
constexpr int64_t kMagic = 0x6464707841475231;  // "ddpxAGR1"
constexpr size_t kNameAt = 4;
constexpr size_t kNameSlots = 8;
constexpr size_t kValuesAt = kNameAt + kNameSlots;

// The wrappers around the hook whose fingerprint this thread makes (WrappedBy), outermost first.
thread_local std::string wrapped_by;

uint64_t fnv1a(const std::string& s, uint64_t h = 0xcbf29ce484222325ULL) {
  for (const unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

std::string name_of(const int64_t* record) {
  char chars[kNameSlots * 8 + 1] = {};
  std::memcpy(chars, record + kNameAt, kNameSlots * 8);
  return std::string(chars);
}
}  // namespace

std::vector<std::string> exchange_mode_names() {
  using comm::ExchangeMode;
  std::vector<std::string> names;
  for (const ExchangeMode m : {ExchangeMode::kAuto, ExchangeMode::kAllreduce,
                               ExchangeMode::kAllgather, ExchangeMode::kReduceScatter}) {
    TORCH_INTERNAL_ASSERT(static_cast<size_t>(m) == names.size());
    names.emplace_back(comm::exchange_mode_name(m));
  }
  return names;
}

Fingerprint::Fingerprint(std::string hook)
    : hook_(wrapped_by.empty() ? std::move(hook) : wrapped_by + hook + ")") {}

WrappedBy::WrappedBy(const std::string& wrapper) : outer_(wrapped_by) {
  wrapped_by = outer_ + wrapper + "(";
}

WrappedBy::~WrappedBy() { wrapped_by = outer_; }

Fingerprint& Fingerprint::add(const char* name, int64_t value) {
  options_.push_back({name, Kind::kInt, value, {}});
  return *this;
}

Fingerprint& Fingerprint::add(const char* name, bool value) {
  options_.push_back({name, Kind::kBool, value ? 1 : 0, {}});
  return *this;
}

Fingerprint& Fingerprint::add(const char* name, double value) {
  int64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  options_.push_back({name, Kind::kDouble, bits, {}});
  return *this;
}

Fingerprint& Fingerprint::add_choice(const char* name, int64_t index,
                                     std::vector<std::string> names) {
  options_.push_back({name, Kind::kChoice, index, std::move(names)});
  return *this;
}

std::vector<int64_t> Fingerprint::record() const {
  TORCH_INTERNAL_ASSERT(options_.size() <= kMaxOptions, hook_, ": ", options_.size(),
                        " options to agree on, at most ", kMaxOptions);
  std::vector<int64_t> r(kRecordSlots, 0);
  r[0] = kMagic;
  r[1] = static_cast<int64_t>(options_.size());
  r[2] = static_cast<int64_t>(fnv1a(hook_));
  uint64_t layout = 0xcbf29ce484222325ULL;
  for (const Option& o : options_) {
    layout = fnv1a(o.name + ":" + std::to_string(static_cast<int>(o.kind)), layout);
  }
  r[3] = static_cast<int64_t>(layout);
  std::memcpy(r.data() + kNameAt, hook_.data(), std::min(hook_.size(), kNameSlots * 8));
  for (size_t i = 0; i < options_.size(); ++i) r[kValuesAt + i] = options_[i].value;
  return r;
}

std::string Fingerprint::show(const Option& o, int64_t value) const {
  switch (o.kind) {
    case Kind::kBool:
      return value ? "True" : "False";
    case Kind::kDouble: {
      double d = 0;
      std::memcpy(&d, &value, sizeof(d));
      std::ostringstream s;
      s << d;
      return s.str();
    }
    case Kind::kChoice:
      if (value >= 0 && static_cast<size_t>(value) < o.names.size()) {
        return "'" + o.names[static_cast<size_t>(value)] + "'";
      }
      return std::to_string(value);
    case Kind::kInt:
      break;
  }
  return std::to_string(value);
}

std::string Fingerprint::describe(const int64_t* a, int64_t ra, const int64_t* b,
                                  int64_t rb) const {
  std::ostringstream s;
  if (a[0] != kMagic || b[0] != kMagic) {
    s << "rank " << (a[0] != kMagic ? ra : rb) << " sent no ddpx hook record (a hook of its own?)";
    return s.str();
  }
  if (a[2] != b[2] || a[3] != b[3] || a[1] != b[1]) {
    s << "rank " << ra << " runs " << name_of(a) << " and rank " << rb << " runs " << name_of(b)
      << (name_of(a) == name_of(b) ? " with another option list (another ddpx version?)" : "");
    return s.str();
  }
  const std::vector<int64_t> mine = record();
  if (mine[2] != a[2] || mine[3] != a[3]) {
    // This rank runs another hook than the two: it cannot name their options.
    s << "ranks " << ra << " and " << rb << " run " << name_of(a) << " with different options";
    return s.str();
  }
  for (size_t i = 0; i < options_.size(); ++i) {
    const int64_t va = a[kValuesAt + i], vb = b[kValuesAt + i];
    if (va == vb) continue;
    s << hook_ << "'s " << options_[i].name << " is " << show(options_[i], va) << " on rank " << ra
      << " and " << show(options_[i], vb) << " on rank " << rb;
    return s.str();
  }
  return "their records differ";  // a slot past the options (not written): unreachable
}

void check_agreement(const ProcessGroupPtr& pg, const Fingerprint& mine,
                     const c10::Device& device) {
  TORCH_INTERNAL_ASSERT(pg);
  const int64_t world = pg->getSize();
  if (world == 1) return;
  const std::vector<int64_t> record = mine.record();
  const auto slots = static_cast<int64_t>(record.size());
  at::Tensor input = at::from_blob(const_cast<int64_t*>(record.data()), {slots}, at::kLong)
                         .to(device, /*non_blocking=*/false, /*copy=*/true);
  std::vector<at::Tensor> inputs{input};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int64_t r = 0; r < world; ++r) outputs[0].push_back(at::empty_like(input));
  pg->allgather(outputs, inputs)->wait();
  std::vector<at::Tensor> host;
  for (const at::Tensor& t : outputs[0]) host.push_back(t.cpu());
  // Every rank compares every record with rank 0's: the same first difference, the same message.
  const int64_t* first = host[0].data_ptr<int64_t>();
  for (int64_t r = 1; r < world; ++r) {
    const int64_t* other = host[static_cast<size_t>(r)].data_ptr<int64_t>();
    if (std::equal(first, first + slots, other)) continue;
    TORCH_CHECK_VALUE(false, "ddpx: the ranks of the process group (", world,
                      " ranks) did not build the same hook: ", mine.describe(first, 0, other, r),
                      ". Every rank must register the same ddpx hook with the same options (and "
                      "resume from the same step); this bucket was not communicated.");
  }
}

}  // namespace detail
}  // namespace hooks
}  // namespace ddpx
