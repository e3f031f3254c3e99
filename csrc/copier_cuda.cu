// offload._copier_cuda: gather/scatter of paged KV blocks that live in GPU
// memory, with exactly the page-table semantics of offload._copier.PageTable.
//
// The other side of the copy is usually pinned host memory (addressed
// directly thanks to UVA) but may also be device memory.  Each copy is split
// into pieces of at most kPiece bytes; one thread block moves one piece with
// 16-byte accesses when all addresses allow it.  A kernel beats one
// cudaMemcpyAsync per segment because Mamba/GDN pages are many small
// segments (one per layer per block).
//
// Built by scripts/cuda_build.sh (make setup) with nvcc from the package
// index, also on machines without a GPU (setup.py); no torch headers.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "page_layout.h"

namespace py = pybind11;

namespace {

struct CopyDesc {
  uint64_t src;
  uint64_t dst;
  uint64_t bytes;
};

constexpr uint64_t kPiece = 64 * 1024;
constexpr int kThreads = 256;

__global__ void copy_pieces(const CopyDesc* __restrict__ descs, int64_t n) {
  for (int64_t d = blockIdx.x; d < n; d += gridDim.x) {
    const CopyDesc c = descs[d];
    if (((c.src | c.dst | c.bytes) & 15) == 0) {
      const int4* s = reinterpret_cast<const int4*>(c.src);
      int4* t = reinterpret_cast<int4*>(c.dst);
      const uint64_t n16 = c.bytes >> 4;
      for (uint64_t i = threadIdx.x; i < n16; i += blockDim.x) t[i] = s[i];
    } else {
      const uint8_t* s = reinterpret_cast<const uint8_t*>(c.src);
      uint8_t* t = reinterpret_cast<uint8_t*>(c.dst);
      for (uint64_t i = threadIdx.x; i < c.bytes; i += blockDim.x) t[i] = s[i];
    }
  }
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// Raised (as offload._copier_cuda.NoCudaDevice, a RuntimeError) when the
// module is asked for a device this process cannot use: no GPU, no driver,
// or a driver older than the runtime the module was built with.
struct NoCudaDevice : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Number of usable devices; 0 with the runtime's reason in `why` otherwise.
int device_count(std::string* why) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error so a later call reports afresh
    if (why) *why = cudaGetErrorString(err);
    return 0;
  }
  return n;
}

void require_device(int device) {
  std::string why;
  const int n = device_count(&why);
  if (n == 0)
    throw NoCudaDevice("offload._copier_cuda: no CUDA device" + (why.empty() ? "" : " (" + why + ")") +
                       "; use the CPU copier (offload._copier) or torch's copies");
  if (device < 0 || device >= n)
    throw NoCudaDevice("offload._copier_cuda: no CUDA device " + std::to_string(device) + " (this process sees " +
                       std::to_string(n) + ", ids 0.." + std::to_string(n - 1) + ")");
}

using Layer = kvoffload::PageLayout;

class PageTable {
 public:
  using LayerSpec = kvoffload::LayerSpec;

  // Fails with NoCudaDevice unless `device` is a CUDA device this process can use.
  PageTable(const std::vector<LayerSpec>& specs, int device) {
    if (specs.empty()) throw py::value_error("PageTable needs at least one layer");
    require_device(device);
    for (const auto& s : specs) {
      Layer L = kvoffload::parse_layer_spec(s);
      page_bytes_ += L.page_bytes;
      layers_.push_back(std::move(L));
    }
  }

  ~PageTable() {
    if (dev_descs_) cudaFree(dev_descs_);
  }

  int64_t page_bytes() const { return page_bytes_; }
  size_t num_layers() const { return layers_.size(); }

  // Copies blocks (device, table side) -> dst (layer-major), then waits.
  void gather(const std::vector<int64_t>& ids, uint64_t dst_ptr, int64_t dst_bytes,
              int device, uint64_t stream) {
    kvoffload::check_gather_args(ids, dst_bytes, page_bytes_);
    py::gil_scoped_release nogil;
    std::vector<CopyDesc> descs;
    uint64_t dst = dst_ptr;
    for (const Layer& L : layers_)
      for (int64_t b : ids) {
        const uint64_t blk = L.base + static_cast<uint64_t>(b * L.block_stride);
        for (const auto& r : L.runs) {
          add(descs, blk + r.first, dst, r.second);
          dst += r.second;
        }
      }
    run(descs, device, stream);
  }

  // Copies src (layer-major, n_src blocks) -> table blocks, then waits.
  void scatter(uint64_t src_ptr, int64_t src_bytes, int64_t n_src,
               const std::vector<std::pair<int64_t, int64_t>>& pairs, int device,
               uint64_t stream) {
    kvoffload::check_scatter_args(src_bytes, n_src, pairs, page_bytes_);
    py::gil_scoped_release nogil;
    std::vector<CopyDesc> descs;
    uint64_t layer_src = src_ptr;
    for (const Layer& L : layers_) {
      for (const auto& pr : pairs) {
        uint64_t s = layer_src + static_cast<uint64_t>(pr.first * L.page_bytes);
        const uint64_t blk = L.base + static_cast<uint64_t>(pr.second * L.block_stride);
        for (const auto& r : L.runs) {
          add(descs, s, blk + r.first, r.second);
          s += r.second;
        }
      }
      layer_src += static_cast<uint64_t>(n_src * L.page_bytes);
    }
    run(descs, device, stream);
  }

 private:
  static void add(std::vector<CopyDesc>& out, uint64_t src, uint64_t dst, int64_t bytes) {
    for (uint64_t off = 0; off < static_cast<uint64_t>(bytes); off += kPiece)
      out.push_back({src + off, dst + off, std::min<uint64_t>(kPiece, bytes - off)});
  }

  // Synchronous: the descriptor buffer is reused by the next call, and the
  // caller reads/reuses the host buffer as soon as we return.
  void run(const std::vector<CopyDesc>& descs, int device, uint64_t stream_handle) {
    if (descs.empty()) return;
    std::lock_guard<std::mutex> lock(mu_);
    const cudaError_t set = cudaSetDevice(device);
    if (set != cudaSuccess) {
      cudaGetLastError();
      require_device(device);  // no device: says so
      check(set, "cudaSetDevice");
    }
    auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
    const size_t need = descs.size() * sizeof(CopyDesc);
    if (need > dev_cap_ || device != dev_device_) {
      if (dev_descs_) cudaFree(dev_descs_);
      dev_descs_ = nullptr;
      dev_cap_ = 0;
      check(cudaMalloc(&dev_descs_, need), "cudaMalloc");
      dev_cap_ = need;
      dev_device_ = device;
    }
    check(cudaMemcpyAsync(dev_descs_, descs.data(), need, cudaMemcpyHostToDevice, stream),
          "cudaMemcpyAsync");
    const int64_t n = static_cast<int64_t>(descs.size());
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(n, 65535));
    copy_pieces<<<grid, kThreads, 0, stream>>>(static_cast<const CopyDesc*>(dev_descs_), n);
    check(cudaGetLastError(), "copy_pieces launch");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }

  std::vector<Layer> layers_;
  int64_t page_bytes_ = 0;
  std::mutex mu_;
  void* dev_descs_ = nullptr;
  size_t dev_cap_ = 0;
  int dev_device_ = -1;
};

}  // namespace

PYBIND11_MODULE(_copier_cuda, m) {
  m.doc() = "CUDA gather/scatter of paged KV blocks (same semantics as offload._copier)";
  py::register_exception<NoCudaDevice>(m, "NoCudaDevice", PyExc_RuntimeError);
  m.def("device_count", [] { return device_count(nullptr); },
        "CUDA devices this process can use (0 without a GPU or a recent enough driver)");
  m.def("runtime_version", [] {
    int v = 0;
    cudaRuntimeGetVersion(&v);
    return v;
  }, "the CUDA runtime built in (static cudart), e.g. 13050 for 13.5");
  py::class_<PageTable>(m, "PageTable")
      .def(py::init<const std::vector<PageTable::LayerSpec>&, int>(), py::arg("layers"),
           py::arg("device"))
      .def_property_readonly("page_bytes", &PageTable::page_bytes)
      .def_property_readonly("num_layers", &PageTable::num_layers)
      .def("gather", &PageTable::gather, py::arg("block_ids"), py::arg("dst_ptr"),
           py::arg("dst_bytes"), py::arg("device"), py::arg("stream") = 0)
      .def("scatter", &PageTable::scatter, py::arg("src_ptr"), py::arg("src_bytes"),
           py::arg("n_src_blocks"), py::arg("pairs"), py::arg("device"),
           py::arg("stream") = 0);
}
