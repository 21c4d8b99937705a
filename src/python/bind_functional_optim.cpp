// Bindings of the functional optimizers (ddpx/optim/functional.h): the multi-tensor steps
// sgd_step / adam_step and the stateful FunctionalSGD / FunctionalAdam, and for every
// elementwise optimizer its options, <kind>_step and Functional<Name> from its traits. Tensor
// lists come and go as Python
// lists with None for an undefined tensor (a state not created yet, a missing gradient); the
// steps return the state lists they filled in.
#include <ddpx/optim/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bind_utils.h"

namespace ddpx {
namespace python {
namespace {

// ---- the options structs, bound generically over their for_each_field ---------------------

// The options of an elementwise optimizer (ddpx/optim/elementwise/all.h) name their traits.
template <typename O, typename = void>
struct is_elementwise : std::false_type {};
template <typename O>
struct is_elementwise<O, std::void_t<typename O::Traits>> : std::true_type {};

template <typename O>
const char* options_name() {
  if constexpr (std::is_same_v<O, optim::SGDOptions>) return "SGDOptions";
  if constexpr (std::is_same_v<O, optim::AdamOptions>) return "AdamOptions";
  if constexpr (is_elementwise<O>::value) return O::Traits::kOptionsName;
}

template <typename O>
void validate(const O& o) {
  if constexpr (is_elementwise<O>::value) {
    optim::validate_elementwise(o);
  } else {
    o.validate();
  }
}

// torch's pair arguments, each as two fields of the structs that have it.
struct Pair {
  const char* name;
  const char* first;
  const char* second;
};
constexpr Pair kPairs[] = {{"betas", "beta1", "beta2"},
                           {"etas", "etaminus", "etaplus"},
                           {"step_sizes", "step_size_min", "step_size_max"}};

// Whether O has a field of this name.
template <typename O>
bool has_field(const char* field) {
  bool yes = false;
  O o;
  o.for_each_field([&](const char* name, auto&) { yes = yes || std::string(name) == field; });
  return yes;
}

// The fields as a dict, named as torch's constructor arguments (Adam's betas as beta1, beta2).
template <typename O>
py::dict options_fields(O o) {
  py::dict d;
  o.for_each_field([&](const char* name, auto& field) { d[name] = field; });
  return d;
}

// Options from keyword arguments named as the fields (or torch's pairs: betas, etas, ...), over
// `o`; an unknown name or a value of the wrong type is torch's TypeError, a value out of range
// its ValueError (validate()). What is built is valid: the structs are immutable in Python.
template <typename O>
O options_from(O o, const py::dict& kwargs) {
  py::dict left(kwargs);
  for (const Pair& pair : kPairs) {
    if (!has_field<O>(pair.first) || !left.contains(pair.name)) continue;
    const auto values = left[pair.name].cast<std::pair<double, double>>();
    o.for_each_field([&](const char* name, auto& field) {
      if constexpr (std::is_same_v<std::decay_t<decltype(field)>, double>) {
        if (std::string(name) == pair.first) field = values.first;
        if (std::string(name) == pair.second) field = values.second;
      }
    });
    PyDict_DelItemString(left.ptr(), pair.name);
  }
  o.for_each_field([&](const char* name, auto& field) {
    if (!left.contains(name)) return;
    const py::object value = left[name];
    try {
      field = value.cast<std::decay_t<decltype(field)>>();
    } catch (const py::cast_error&) {
      throw py::type_error(
          std::string(options_name<O>()) + ": " + name + " must be a " +
          (std::is_same_v<std::decay_t<decltype(field)>, bool> ? "bool" : "number") + ", got " +
          Py_TYPE(value.ptr())->tp_name);
    }
    PyDict_DelItemString(left.ptr(), name);
  });
  if (!left.empty()) {
    throw py::type_error(std::string(options_name<O>()) +
                         "() got an unexpected keyword argument '" +
                         std::string(py::str(left.begin()->first)) + "'");
  }
  validate(o);
  return o;
}

// A step's or constructor's options: `options=<O>` alone, or the fields as keywords.
template <typename O>
O options_arg(const py::kwargs& kwargs) {
  if (kwargs.contains("options")) {
    if (kwargs.size() != 1) {
      throw py::type_error("give options= or the options' fields as keywords, not both");
    }
    const py::object options = kwargs["options"];
    if (!py::isinstance<O>(options)) {
      throw py::type_error(std::string("options must be a ") + options_name<O>() + ", got " +
                           Py_TYPE(options.ptr())->tp_name);
    }
    return options.cast<O>();
  }
  return options_from(O(), kwargs);
}

template <typename O>
py::class_<O> bind_options(py::module& m, const char* doc) {
  py::class_<O> cls(m, options_name<O>(), doc);
  cls.def(py::init([](const py::kwargs& kwargs) { return options_from(O(), kwargs); }))
      .def("_asdict", &options_fields<O>, "The fields as a dict.")
      .def("__eq__",
           [](const O& a, const O& b) { return options_fields(a).equal(options_fields(b)); })
      .def("__repr__",
           [](const O& o) {
             std::string out = std::string(options_name<O>()) + "(";
             bool first = true;
             for (const auto& kv : options_fields(o)) {
               out += std::string(first ? "" : ", ") + std::string(py::str(kv.first)) + "=" +
                      std::string(py::repr(kv.second));
               first = false;
             }
             return out + ")";
           })
      .def(py::pickle([](const O& o) { return options_fields(o); },
                      [](const py::dict& d) { return options_from(O(), d); }));
  // One read-only property per field: options are validated once, when built.
  O defaults;
  defaults.for_each_field([&](const char* name, auto&) {
    const std::string key = name;
    cls.def_property_readonly(name, [key](const O& o) -> py::object {
      return options_fields(o)[key.c_str()];  // a new reference, not an accessor into a temporary
    });
  });
  for (const Pair& pair : kPairs) {
    if (!has_field<O>(pair.first)) continue;
    cls.def_property_readonly(
        pair.name,
        [pair](const O& o) {
          const py::dict d = options_fields(o);
          return py::make_tuple(d[pair.first], d[pair.second]);
        },
        (std::string("torch's ") + pair.name + ": (" + pair.first + ", " + pair.second + ").")
            .c_str());
  }
  return cls;
}

// Per-parameter state dicts from Python: tensor values as they are, a number (torch 1.13's
// RMSprop keeps "step" as a Python int) as a 0-dim float32 tensor, as torch's own __setstate__
// turns an old number step into a tensor.
std::vector<optim::ParamState> param_states(const py::handle& seq) {
  if (!py::isinstance<py::sequence>(seq)) {
    throw py::type_error("state must be a list of dicts");
  }
  std::vector<optim::ParamState> out;
  for (const py::handle& item : py::reinterpret_borrow<py::sequence>(seq)) {
    if (!py::isinstance<py::dict>(item)) {
      throw py::type_error(std::string("state must hold dicts, got ") +
                           Py_TYPE(item.ptr())->tp_name);
    }
    optim::ParamState st;
    for (const auto& kv : py::reinterpret_borrow<py::dict>(item)) {
      const std::string key = py::cast<std::string>(kv.first);
      const py::handle value = kv.second;
      if (THPVariable_Check(value.ptr())) {
        st[key] = THPVariable_Unpack(value.ptr());
      } else if ((PyLong_Check(value.ptr()) || PyFloat_Check(value.ptr())) &&
                 !PyBool_Check(value.ptr())) {
        st[key] = at::scalar_tensor(py::cast<double>(value), at::kFloat);
      } else {
        throw py::type_error("state[\"" + key + "\"] must be a tensor or a number, got " +
                             Py_TYPE(value.ptr())->tp_name);
      }
    }
    out.push_back(std::move(st));
  }
  return out;
}

// Binds the step(grads) / state() of a functional optimizer class.
template <typename F>
void bind_functional(py::class_<F>& cls) {
  cls.def(
         "step",
         [](F& self, const py::object& grads) {
           const auto g = tensor_list(grads, "grads");
           py::gil_scoped_release no_gil;
           self.step(g);
         },
         py::arg("grads"), "Steps the parameters whose gradient is not None.")
      .def_property_readonly("options", &F::options);
}

// An elementwise optimizer's options class, its <kind>_step function and its Functional<Name>
// class, all from its traits.
template <typename Traits>
void bind_elementwise(py::module& m) {
  using O = typename Traits::Options;
  using F = optim::FunctionalElementwise<Traits>;
  const std::string name = Traits::kName;
  std::string fields;
  {
    O defaults;
    defaults.for_each_field([&](const char* field, auto& value) {
      fields += (fields.empty() ? "" : ", ") + std::string(field) + "=" +
                std::string(py::repr(py::cast(value)));
    });
  }
  py::class_<O> options_class = bind_options<O>(
      m, ("torch.optim." + name + "'s hyper-parameters: " + Traits::kOptionsName + "(" + fields +
          "). Validated when built (torch's ValueErrors); immutable; picklable.")
             .c_str());
  std::string state_names;
  for (const char* s : Traits::kStateNames) {
    state_names += std::string(state_names.empty() ? "" : ", ") + s;
  }
  // What ZeRO's step needs to run this optimizer on torch's state: the per-element state's keys
  // that these options keep (torch's names, in the step function's order) and the step
  // function's name.
  options_class.def_property_readonly(
      "state_names",
      [](const O& o) {
        py::list names;
        for (int k = 0; k < Traits::kStates; ++k) {
          if (optim::elementwise::keeps_state<Traits>(k, o)) names.append(Traits::kStateNames[k]);
        }
        return py::tuple(names);
      },
      "The per-parameter state these options keep besides step (torch's keys, in the step "
      "function's order).");
  options_class.attr("step_function") = py::str(std::string(Traits::kKind) + "_step");
  // The step's arguments from Python: params, grads, the state lists in kStateNames' order (an
  // empty list for a state the options do not keep).
  struct Args {
    std::vector<at::Tensor> params, grads;
    std::vector<std::vector<at::Tensor>> states;
    O options;
  };
  auto args_of = [](const py::object& params, const py::object& grads, const py::dict& state,
                    const py::kwargs& kwargs) {
    Args a{tensor_list(params, "params"), tensor_list(grads, "grads"), {}, options_arg<O>(kwargs)};
    size_t kept = 0;
    for (int k = 0; k < Traits::kStates; ++k) {
      const char* s = Traits::kStateNames[k];
      if (!optim::elementwise::keeps_state<Traits>(k, a.options)) {
        a.states.emplace_back();
        continue;
      }
      if (!state.contains(s)) throw py::value_error(std::string("state needs \"") + s + "\"");
      a.states.push_back(tensor_list(state[s], s));
      ++kept;
    }
    if (state.size() != kept) {
      throw py::value_error(std::string("state holds other keys than those ") + Traits::kName +
                            " keeps with these options");
    }
    return a;
  };
  m.def((std::string(Traits::kKind) + "_step").c_str(),
        [args_of](const py::object& params, const py::object& grads, const py::dict& state,
                  std::vector<int64_t> steps, const py::kwargs& kwargs) {
          Args a = args_of(params, grads, state, kwargs);
          {
            py::gil_scoped_release no_gil;
            optim::elementwise_step<Traits>(a.params, a.grads, a.states, steps, a.options);
          }
          py::dict out;
          for (int k = 0; k < Traits::kStates; ++k) {
            if (optim::elementwise::keeps_state<Traits>(k, a.options)) {
              out[Traits::kStateNames[k]] = to_py(a.states[k]);
            }
          }
          return py::make_tuple(out, steps);
        },
        py::arg("params"), py::arg("grads"), py::arg("state"), py::arg("steps"),
        (std::string(Traits::kKind) + "_step(params, grads, state, steps, **" +
         Traits::kOptionsName + " fields or options=" + Traits::kOptionsName + "): one fused " +
         name + " step of every parameter (torch.optim." + name +
         "'s formulas, dense gradients). state: {" + state_names +
         "} (those the options keep: options.state_names), each a list with one entry per "
         "parameter, None before its first step; "
         "steps: per-parameter step counts. Returns (state, steps) after the step.")
            .c_str());
  m.def((std::string(Traits::kKind) + "_step_refusal").c_str(),
        [args_of](const py::object& params, const py::object& grads, const py::dict& state,
                  const std::vector<int64_t>& steps, const py::kwargs& kwargs) -> py::object {
          Args a = args_of(params, grads, state, kwargs);
          try {
            optim::elementwise_check<Traits>(a.params, a.grads, a.states, steps, a.options);
          } catch (const c10::Error& e) {
            return py::str(e.what_without_backtrace());
          }
          return py::none();
        },
        py::arg("params"), py::arg("grads"), py::arg("state"), py::arg("steps"),
        (std::string(Traits::kKind) +
         "_step_refusal(params, grads, state, steps, ...): " + Traits::kKind +
         "_step's checks alone, on the same arguments: None where it would step, else the "
         "message it would raise (nothing is changed)")
            .c_str());
  py::class_<F> cls(m, ("Functional" + name).c_str(),
                    ("Functional" + name + "(params, **" + Traits::kOptionsName +
                     " fields or options=" + Traits::kOptionsName + "): " + name +
                     " over a fixed list of parameters, holding their state.")
                        .c_str());
  cls.def(py::init([](const py::object& params, const py::kwargs& kwargs) {
            return F(tensor_list(params, "params"), options_arg<O>(kwargs));
          }),
          py::arg("params"))
      .def("state", &F::state,
           ("Per-parameter state in torch.optim." + name + "'s layout (step and those of " +
            state_names + " that the options keep; {} before a parameter's first step, unless " +
            "torch's constructor makes it).")
               .c_str())
      .def(
          "load_state",
          [](F& self, const py::object& state) { self.load_state(param_states(state)); },
          py::arg("state"));
  bind_functional(cls);
}

}  // namespace

void bind_functional_optim(py::module& m) {
  bind_options<optim::SGDOptions>(
      m,
      "torch.optim.SGD's hyper-parameters: SGDOptions(lr=1e-3, momentum=0, dampening=0, "
      "weight_decay=0, nesterov=False, maximize=False). Validated when built (torch's "
      "ValueErrors); immutable; picklable.");
  bind_options<optim::AdamOptions>(
      m,
      "torch.optim.Adam's hyper-parameters, AdamW's with decoupled_weight_decay=True: "
      "AdamOptions(lr=1e-3, betas=(0.9, 0.999) or beta1=, beta2=, eps=1e-8, weight_decay=0, "
      "amsgrad=False, maximize=False, decoupled_weight_decay=False). Validated when built "
      "(torch's ValueErrors); immutable; picklable.");
  m.def(
      "sgd_step",
      [](const py::object& params, const py::object& grads, const py::object& momentum_buffers,
         const py::kwargs& kwargs) {
        const auto p = tensor_list(params, "params");
        const auto g = tensor_list(grads, "grads");
        auto bufs = tensor_list(momentum_buffers, "momentum_buffers");
        const auto opts = options_arg<optim::SGDOptions>(kwargs);
        {
          py::gil_scoped_release no_gil;
          optim::sgd_step(p, g, bufs, opts);
        }
        return to_py(bufs);
      },
      py::arg("params"), py::arg("grads"), py::arg("momentum_buffers"),
      "sgd_step(params, grads, momentum_buffers, **SGDOptions fields or options=SGDOptions): one "
      "fused SGD step of every parameter (torch.optim.SGD's formulas). momentum_buffers: one "
      "entry per parameter, None before its first step. Returns the momentum buffers.");
  m.def(
      "adam_step",
      [](const py::object& params, const py::object& grads, const py::object& exp_avgs,
         const py::object& exp_avg_sqs, const py::object& max_exp_avg_sqs,
         std::vector<int64_t> steps, const py::kwargs& kwargs) {
        const auto p = tensor_list(params, "params");
        const auto g = tensor_list(grads, "grads");
        auto m1 = tensor_list(exp_avgs, "exp_avgs");
        auto m2 = tensor_list(exp_avg_sqs, "exp_avg_sqs");
        auto mx = tensor_list(max_exp_avg_sqs, "max_exp_avg_sqs");
        const auto opts = options_arg<optim::AdamOptions>(kwargs);
        {
          py::gil_scoped_release no_gil;
          optim::adam_step(p, g, m1, m2, mx, steps, opts);
        }
        return py::make_tuple(to_py(m1), to_py(m2), to_py(mx), steps);
      },
      py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
      py::arg("max_exp_avg_sqs"), py::arg("steps"),
      "adam_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, **AdamOptions "
      "fields or options=AdamOptions): one fused Adam step (AdamW's with "
      "decoupled_weight_decay=True) of every parameter (torch.optim.Adam's formulas). State "
      "lists: one entry per parameter, None before its first step (max_exp_avg_sqs may be [] "
      "without amsgrad); steps: per-parameter step counts. Returns (exp_avgs, exp_avg_sqs, "
      "max_exp_avg_sqs, steps) after the step.");
  py::class_<optim::FunctionalSGD> sgd(
      m, "FunctionalSGD",
      "FunctionalSGD(params, **SGDOptions fields or options=SGDOptions): SGD over a fixed list "
      "of parameters, holding their state.");
  sgd.def(py::init([](const py::object& params, const py::kwargs& kwargs) {
            return optim::FunctionalSGD(tensor_list(params, "params"),
                                        options_arg<optim::SGDOptions>(kwargs));
          }),
          py::arg("params"))
      .def("state", &optim::FunctionalSGD::state,
           "Per-parameter state in torch.optim.SGD's layout ({'momentum_buffer': t} or {}).")
      .def("load_state", &optim::FunctionalSGD::load_state, py::arg("state"));
  bind_functional(sgd);

  py::class_<optim::FunctionalAdam> adam(
      m, "FunctionalAdam",
      "FunctionalAdam(params, **AdamOptions fields or options=AdamOptions): Adam (AdamW with "
      "decoupled_weight_decay=True) over a fixed list of parameters, holding their state.");
  adam.def(py::init([](const py::object& params, const py::kwargs& kwargs) {
             return optim::FunctionalAdam(tensor_list(params, "params"),
                                          options_arg<optim::AdamOptions>(kwargs));
           }),
           py::arg("params"))
      .def("state", &optim::FunctionalAdam::state,
           "Per-parameter state in torch.optim.Adam's layout (step, exp_avg, exp_avg_sq, "
           "max_exp_avg_sq with amsgrad; {} before a parameter's first step).")
      .def("load_state", &optim::FunctionalAdam::load_state, py::arg("state"));
  bind_functional(adam);

#define DDPX_BIND(Name) bind_elementwise<optim::elementwise::Name>(m);
  DDPX_ELEMENTWISE_OPTIMIZERS(DDPX_BIND)
#undef DDPX_BIND
}

}  // namespace python
}  // namespace ddpx
