// A C++ autograd node for flash_triton's eager CUDA path (core/kernels/flash_native.py builds it).
//
// Why: at short sequences an eager forward+backward is bound by host time, and a Python autograd.Function
// (its node, the Python backward on autograd's device thread, the Python launch path) costs more host time
// than SDPA's whole C++ path. This node replays, from C++, the allocations
// and Triton launches that flash_triton's Python implementation made for the same input signature:
// flash_native.py records them once per signature (sizes, strides, dtype, 16-byte alignment, causal, device)
// and hands the plan over here. A signature without a plan, or one whose Python path does more than
// allocate and launch through flash_triton._run, stays on the Python path.
//
// No CUDA headers: the driver's cuLaunchKernel is looked up in libcuda at run time, and streams come from
// c10's device-guard interface, so the same source compiles against CPU and CUDA builds of torch.
#include <torch/extension.h>

#include <ATen/autocast_mode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace py = pybind11;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// ---------------------------------------------------------------- the CUDA driver, looked up at run time
using CUresult = int;
using LaunchKernelFn = CUresult (*)(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                    unsigned bz, unsigned shared, void* stream, void** params, void** extra);
using ErrorStringFn = CUresult (*)(CUresult, const char**);
using StreamIsCapturingFn = CUresult (*)(void* stream, int* status);  // status 0: not capturing

struct Driver {
  LaunchKernelFn launch = nullptr;
  ErrorStringFn error_string = nullptr;
  StreamIsCapturingFn is_capturing = nullptr;
  Driver() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);  // loaded already by torch / Triton
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib != nullptr) {
      launch = reinterpret_cast<LaunchKernelFn>(dlsym(lib, "cuLaunchKernel"));
      error_string = reinterpret_cast<ErrorStringFn>(dlsym(lib, "cuGetErrorString"));
      is_capturing = reinterpret_cast<StreamIsCapturingFn>(dlsym(lib, "cuStreamIsCapturing"));
    }
  }
};

Driver& driver() {
  static Driver d;
  return d;
}

// ---------------------------------------------------------------- plans
struct Param {      // one kernel parameter, in the order the compiled kernel takes them
  int32_t slot;     // >= 0: the device pointer of tensor slot `slot`; -1: `bits`, a scalar by value
  uint64_t bits;    // little-endian value; the driver copies the parameter's own size from it
};

struct Launch {
  void* function;   // CUfunction, loaded by Triton for this device
  uint32_t grid[3];
  uint32_t threads;
  uint32_t shared;  // dynamic shared memory in bytes (Triton set the function's limit when it loaded it)
  int64_t scratch_bytes;  // global scratch for device-side tensor descriptors (0: none)
  std::vector<Param> params;
};

struct Alloc {
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
  int64_t arrival_counts;  // > 0: not an allocation but the stream's zeroed int32 arrival counts (this many)
};

void* current_stream(const c10::Device& device) {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device).native_handle();
}

bool capturing(void* stream) {
  int status = 1;  // without the driver entry point, assume a capture (the Python path then runs)
  if (driver().is_capturing != nullptr && driver().is_capturing(stream, &status) != 0) status = 1;
  return status != 0;
}

// flash_triton's split-KV kernel counts the splits that finished per query tile and the last one puts the
// count back to 0, so launches in one stream's order can share a buffer (zeroed once, in that order). As
// flash_triton._ArrivalCounts does for the Python path; captures run the Python path instead (apply()).
at::Tensor arrival_counts(const c10::Device& device, void* stream, int64_t n) {
  static std::mutex mutex;
  static auto* buffers = new std::unordered_map<uint64_t, at::Tensor>();  // leaked, as the cache
  const uint64_t key = reinterpret_cast<uint64_t>(stream) ^ (static_cast<uint64_t>(device.index()) << 56);
  std::lock_guard<std::mutex> lock(mutex);
  at::Tensor& counts = (*buffers)[key];
  if (!counts.defined() || counts.numel() < n) {
    counts = at::zeros({std::max<int64_t>(n, 1024)}, at::TensorOptions().device(device).dtype(at::kInt));
  }
  return counts;
}

// One pass (forward or backward): allocations appended to the input slots, launches, output slots.
struct Phase {
  std::vector<Alloc> allocs;
  std::vector<Launch> launches;
  std::vector<int32_t> outputs;
  bool uses_arrival_counts = false;

  std::vector<at::Tensor> run(std::vector<at::Tensor>& slots, const c10::Device& device) const {
    auto options = at::TensorOptions().device(device);
    void* stream = current_stream(device);
    for (const auto& a : allocs) {
      slots.push_back(a.arrival_counts > 0 ? arrival_counts(device, stream, a.arrival_counts)
                                           : at::empty_strided(a.sizes, a.strides, options.dtype(a.dtype)));
    }
    LaunchKernelFn launch = driver().launch;
    TORCH_CHECK(launch != nullptr, "flash_node: cuLaunchKernel not found in libcuda.so.1");
    for (const auto& l : launches) {
      const size_t n = l.params.size();
      std::vector<uint64_t> values(n + 2);
      std::vector<void*> pointers(n + 2);
      for (size_t i = 0; i < n; ++i) {
        const Param& p = l.params[i];
        values[i] = p.slot >= 0 ? reinterpret_cast<uint64_t>(slots[p.slot].data_ptr()) : p.bits;
        pointers[i] = &values[i];
      }
      at::Tensor scratch;
      if (l.scratch_bytes > 0) {  // freed after the launch: the caching allocator reuses it in stream order
        scratch = at::empty({l.scratch_bytes}, options.dtype(at::kByte));
        values[n] = reinterpret_cast<uint64_t>(scratch.data_ptr());
      }
      pointers[n] = &values[n];          // global scratch
      pointers[n + 1] = &values[n + 1];  // profile scratch: none
      CUresult rc = launch(l.function, l.grid[0], l.grid[1], l.grid[2], l.threads, 1, 1, l.shared, stream,
                           pointers.data(), nullptr);
      if (rc != 0) {
        const char* text = "unknown error";
        if (driver().error_string != nullptr) driver().error_string(rc, &text);
        TORCH_CHECK(false, "flash_node: kernel launch failed: ", text, " (CUresult ", rc, ")");
      }
    }
    std::vector<at::Tensor> out;
    out.reserve(outputs.size());
    for (int32_t s : outputs) out.push_back(slots[s]);
    return out;
  }
};

using Key = std::vector<int64_t>;
struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t x : k) h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

struct Plan {
  Phase forward;
  std::mutex mutex;  // guards the backward maps: backward runs on autograd's device thread
  std::unordered_map<Key, std::shared_ptr<const Phase>, KeyHash> backward;
  std::unordered_set<Key, KeyHash> backward_never;  // signatures the Python path must keep
};

struct Cache {
  std::mutex mutex;
  std::unordered_map<Key, Plan*, KeyHash> plans;
  std::unordered_set<Key, KeyHash> never;
  // every plan ever made stays alive: nodes hold raw pointers to theirs (plans are a few KiB; clear() is rare)
  std::deque<std::unique_ptr<Plan>> all;
  size_t max_plans = 4096;
};

Cache& cache() {
  static Cache* c = new Cache();  // leaked: no destructor order issues at interpreter exit
  return *c;
}

py::object* backward_fallback = nullptr;  // Python: (do, q, k, v, o, lse, causal, record) -> (dq, dk, dv, spec)

void append_tensor(Key& key, const at::Tensor& t) {
  for (int64_t s : t.sizes()) key.push_back(s);
  for (int64_t s : t.strides()) key.push_back(s);
  key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) & 15));
}

bool applicable(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  if (!q.is_cuda() || q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return false;
  if (k.device() != q.device() || v.device() != q.device()) return false;
  if (k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type()) return false;
  if (q.stride(3) != 1 || k.stride(3) != 1 || v.stride(3) != 1) return false;
  if (q.numel() == 0 || k.numel() == 0 || v.numel() == 0) return false;
  if (at::autocast::is_autocast_enabled(at::kCUDA)) return false;  // the Python path casts first
  // launches go to the current device's stream, with kernels loaded there (as JITFunction.run does)
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice() == q.device();
}

Key forward_key(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  Key key;
  key.reserve(32);
  key.push_back(q.get_device());
  key.push_back(static_cast<int64_t>(q.scalar_type()));
  key.push_back(causal);
  key.push_back(at::globalContext().deterministicAlgorithms());
  append_tensor(key, q);
  append_tensor(key, k);
  append_tensor(key, v);
  // the same tensor passed twice is one slot in a recording: aliasing is part of the signature
  key.push_back((q.data_ptr() == k.data_ptr()) | (q.data_ptr() == v.data_ptr()) << 1 |
                (k.data_ptr() == v.data_ptr()) << 2);
  return key;
}

std::vector<Param> parse_params(const py::list& items) {
  std::vector<Param> params;
  for (const auto& item : items) {
    auto t = item.cast<py::tuple>();
    params.push_back(Param{t[0].cast<int32_t>(), t[1].cast<uint64_t>()});
  }
  return params;
}

// spec: (allocs [(sizes, strides, dtype, arrival counts)], launches [(function, (gx, gy, gz), threads, shared, scratch_bytes,
// [(slot, bits)])], outputs [slot])
Phase parse_phase(const py::tuple& spec) {
  Phase phase;
  for (const auto& item : spec[0].cast<py::list>()) {
    auto t = item.cast<py::tuple>();
    phase.allocs.push_back(Alloc{t[0].cast<std::vector<int64_t>>(), t[1].cast<std::vector<int64_t>>(),
                                 t[2].cast<at::ScalarType>(), t[3].cast<int64_t>()});
    phase.uses_arrival_counts |= phase.allocs.back().arrival_counts > 0;
  }
  for (const auto& item : spec[1].cast<py::list>()) {
    auto t = item.cast<py::tuple>();
    auto grid = t[1].cast<std::vector<uint32_t>>();
    TORCH_CHECK(grid.size() == 3, "flash_node: a grid has 3 dimensions");
    Launch l;
    l.function = reinterpret_cast<void*>(t[0].cast<uint64_t>());
    l.grid[0] = grid[0];
    l.grid[1] = grid[1];
    l.grid[2] = grid[2];
    l.threads = t[2].cast<uint32_t>();
    l.shared = t[3].cast<uint32_t>();
    l.scratch_bytes = t[4].cast<int64_t>();
    l.params = parse_params(t[5].cast<py::list>());
    phase.launches.push_back(std::move(l));
  }
  phase.outputs = spec[2].cast<std::vector<int32_t>>();
  return phase;
}

// ---------------------------------------------------------------- the autograd function
struct FlashFunction : public torch::autograd::Function<FlashFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            bool causal, int64_t plan_address) {
    const Plan* plan = reinterpret_cast<const Plan*>(plan_address);
    std::vector<at::Tensor> slots{q, k, v};
    auto out = plan->forward.run(slots, q.device());  // (o, lse)
    ctx->save_for_backward({q, k, v, out[0], out[1]});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["plan"] = plan_address;
    return out[0];
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &o = saved[3], &lse = saved[4];
    const bool causal = ctx->saved_data["causal"].toBool();
    Plan* plan = reinterpret_cast<Plan*>(ctx->saved_data["plan"].toInt());
    at::Tensor d_o = grads[0];
    if (d_o.scalar_type() != q.scalar_type()) d_o = d_o.to(q.scalar_type());
    if (d_o.stride(3) != 1) d_o = d_o.contiguous();
    Key key;
    key.push_back(at::globalContext().deterministicAlgorithms());
    append_tensor(key, d_o);
    std::shared_ptr<const Phase> phase;
    bool never = false;
    {
      std::lock_guard<std::mutex> lock(plan->mutex);
      auto it = plan->backward.find(key);
      if (it != plan->backward.end()) phase = it->second;
      else never = plan->backward_never.count(key) > 0;
    }
    if (phase) {
      std::vector<at::Tensor> slots{d_o, q, k, v, o, lse};
      auto out = phase->run(slots, q.device());
      return {out[0], out[1], out[2], at::Tensor(), at::Tensor()};
    }
    // no plan for this gradient's signature: the Python backward runs, and records one unless it never can
    py::gil_scoped_acquire gil;
    TORCH_CHECK(backward_fallback != nullptr, "flash_node: no Python backward registered");
    py::tuple result = (*backward_fallback)(d_o, q, k, v, o, lse, causal, !never).cast<py::tuple>();
    {
      std::lock_guard<std::mutex> lock(plan->mutex);
      if (!result[3].is_none()) {
        plan->backward[key] = std::make_shared<const Phase>(parse_phase(result[3].cast<py::tuple>()));
      } else if (!never && result[4].cast<bool>()) {
        plan->backward_never.insert(key);
      }
    }
    return {result[0].cast<at::Tensor>(), result[1].cast<at::Tensor>(), result[2].cast<at::Tensor>(),
            at::Tensor(), at::Tensor()};
  }
};

// ---------------------------------------------------------------- Python entry points
constexpr int kRecord = 0;       // no plan for this signature yet: the Python path should record one
constexpr int kPythonPath = 1;   // not for this node (or never replayable): the Python path, without recording

py::object apply(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  if (!applicable(q, k, v)) return py::int_(kPythonPath);
  Key key = forward_key(q, k, v, causal);
  Plan* plan = nullptr;
  {
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    auto it = c.plans.find(key);
    if (it == c.plans.end()) {
      const bool full = c.plans.size() + c.never.size() >= c.max_plans;
      return py::int_(c.never.count(key) || full ? kPythonPath : kRecord);
    }
    plan = it->second;
  }
  // a CUDA graph needs arrival counts of its own, which the Python path gives it
  if (plan->forward.uses_arrival_counts && capturing(current_stream(q.device()))) return py::int_(kPythonPath);
  return py::cast(FlashFunction::apply(q, k, v, causal, reinterpret_cast<int64_t>(plan)));
}

// spec: a forward phase spec, or None when this signature must stay on the Python path
void store(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, const py::object& spec) {
  if (!applicable(q, k, v)) return;
  Key key = forward_key(q, k, v, causal);
  Cache& c = cache();
  if (spec.is_none()) {
    std::lock_guard<std::mutex> lock(c.mutex);
    c.never.insert(std::move(key));
    return;
  }
  auto plan = std::make_unique<Plan>();
  plan->forward = parse_phase(spec.cast<py::tuple>());
  std::lock_guard<std::mutex> lock(c.mutex);
  c.plans[key] = plan.get();
  c.all.push_back(std::move(plan));
}

void clear() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.plans.clear();
  c.never.clear();
}

void set_backward_fallback(py::object fn) {
  if (backward_fallback == nullptr) backward_fallback = new py::object();  // leaked, as the cache
  *backward_fallback = std::move(fn);
}

py::tuple stats() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  size_t backward = 0;
  for (const auto& kv : c.plans) {
    std::lock_guard<std::mutex> plan_lock(kv.second->mutex);
    backward += kv.second->backward.size();
  }
  return py::make_tuple(c.plans.size(), c.never.size(), backward);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash_triton's C++ autograd node: replays recorded Triton launches (see flash_native.py)";
  m.def("apply", &apply, "the node's output, or 0 (record a plan) / 1 (use the Python path)");
  m.def("store", &store, "store the forward plan (or None: keep the Python path) for this input signature");
  m.def("clear", &clear, "forget every plan (kernel knobs changed)");
  m.def("set_backward_fallback", &set_backward_fallback, "the Python backward for signatures without a plan");
  m.def("stats", &stats, "(forward plans, signatures kept on the Python path, backward plans)");
  m.attr("RECORD") = kRecord;
  m.attr("PYTHON_PATH") = kPythonPath;
}
