// Reading a hook state's checkpoint dict (private to the hooks).
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <unordered_map>

namespace ddpx {
namespace hooks {
namespace detail {

template <typename Key>
Key key_of(const c10::IValue& v);
template <>
inline int64_t key_of<int64_t>(const c10::IValue& v) {
  return v.toInt();
}
template <>
inline std::string key_of<std::string>(const c10::IValue& v) {
  return v.toStringRef();
}

// The values of a checkpoint dict, type-checked: a wrong type is a c10::TypeError naming the key
// (IValue's own accessors would fail an internal assert that blames PyTorch).
class CheckpointReader {
 public:
  CheckpointReader(const c10::impl::GenericDict& d, const char* who) : d_(d), who_(who) {}

  bool has(const char* key) const { return d_.find(std::string(key)) != d_.end(); }
  c10::IValue get(const char* key) const {
    auto it = d_.find(std::string(key));
    TORCH_CHECK_VALUE(it != d_.end(), who_, ": missing key '", key, "'");
    return it->value();
  }
  int64_t get_int(const char* key) const {
    const c10::IValue v = get(key);
    TORCH_CHECK_TYPE(v.isInt(), who_, ": '", key, "' must be an int, got ", v.tagKind());
    return v.toInt();
  }
  double get_double(const char* key) const {
    const c10::IValue v = get(key);
    TORCH_CHECK_TYPE(v.isDouble() || v.isInt(), who_, ": '", key, "' must be a number, got ",
                     v.tagKind());
    return v.isInt() ? static_cast<double>(v.toInt()) : v.toDouble();
  }
  bool get_bool(const char* key) const {
    const c10::IValue v = get(key);
    TORCH_CHECK_TYPE(v.isBool(), who_, ": '", key, "' must be a bool, got ", v.tagKind());
    return v.toBool();
  }
  std::string get_string(const char* key) const {
    const c10::IValue v = get(key);
    TORCH_CHECK_TYPE(v.isString(), who_, ": '", key, "' must be a str, got ", v.tagKind());
    return v.toStringRef();
  }
  // A dict of tensors keyed by Key (int parameter keys, or str bucket keys).
  template <typename Key>
  std::unordered_map<Key, at::Tensor> get_tensors(const char* key) const {
    const c10::IValue v = get(key);
    TORCH_CHECK_TYPE(v.isGenericDict(), who_, ": '", key, "' must be a dict of tensors, got ",
                     v.tagKind());
    std::unordered_map<Key, at::Tensor> out;
    for (const auto& kv : v.toGenericDict()) {
      const bool key_ok =
          std::is_same<Key, int64_t>::value ? kv.key().isInt() : kv.key().isString();
      TORCH_CHECK_TYPE(key_ok && kv.value().isTensor(), who_, ": '", key, "' must map ",
                       std::is_same<Key, int64_t>::value ? "ints" : "strs", " to tensors, got a ",
                       kv.key().tagKind(), " -> ", kv.value().tagKind(), " entry");
      out[key_of<Key>(kv.key())] = kv.value().toTensor();
    }
    return out;
  }

 private:
  const c10::impl::GenericDict& d_;
  const char* who_;
};

}  // namespace detail
}  // namespace hooks
}  // namespace ddpx
