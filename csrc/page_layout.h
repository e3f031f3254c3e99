// Page layout of one KV layer and the PageTable argument checks, shared by
// offload._copier (copier.cpp) and offload._copier_cuda (copier_cuda.cu) so
// that both parse the Python layer spec and validate gather/scatter the same
// way (same py::value_error messages).
//
// A layer spec is (base_ptr, block_stride, seg_offsets, seg_bytes): block b of
// the layer starts at base_ptr + b * block_stride and consists of one segment
// of seg_bytes at each offset in seg_offsets (in page order).

#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace kvoffload {

using LayerSpec = std::tuple<uint64_t, int64_t, std::vector<int64_t>, int64_t>;

struct PageLayout {
  uint64_t base;
  int64_t block_stride;
  // Runs of segments that are adjacent in memory, merged: (offset, bytes).
  std::vector<std::pair<int64_t, int64_t>> runs;
  int64_t page_bytes;  // bytes of one block of this layer
};

// Validates one layer spec and builds its layout; throws py::value_error.
inline PageLayout parse_layer_spec(const LayerSpec& s) {
  PageLayout L;
  L.base = std::get<0>(s);
  L.block_stride = std::get<1>(s);
  const auto& offs = std::get<2>(s);
  const int64_t seg = std::get<3>(s);
  if (L.block_stride < 0 || seg < 0)
    throw pybind11::value_error("block_stride and seg_bytes must be >= 0");
  if (offs.empty()) throw pybind11::value_error("a layer needs at least one segment");
  for (int64_t off : offs) {
    if (!L.runs.empty() && L.runs.back().first + L.runs.back().second == off)
      L.runs.back().second += seg;
    else
      L.runs.emplace_back(off, seg);
  }
  L.page_bytes = static_cast<int64_t>(offs.size()) * seg;
  return L;
}

// Argument checks of PageTable.gather: block ids are >= 0 and dst holds
// exactly ids.size() pages of page_bytes (all layers).
inline void check_gather_args(const std::vector<int64_t>& ids, int64_t dst_bytes,
                              int64_t page_bytes) {
  for (int64_t b : ids)
    if (b < 0) throw pybind11::value_error("negative block id " + std::to_string(b));
  const int64_t want = static_cast<int64_t>(ids.size()) * page_bytes;
  if (dst_bytes != want)
    throw pybind11::value_error("gather: dst_bytes=" + std::to_string(dst_bytes) + " but " +
                                std::to_string(ids.size()) + " blocks need " +
                                std::to_string(want));
}

// Argument checks of PageTable.scatter: src holds exactly n_src pages, and
// each (src index, block id) pair is in range.
inline void check_scatter_args(int64_t src_bytes, int64_t n_src,
                               const std::vector<std::pair<int64_t, int64_t>>& pairs,
                               int64_t page_bytes) {
  if (n_src < 0) throw pybind11::value_error("n_src_blocks must be >= 0");
  if (src_bytes != n_src * page_bytes)
    throw pybind11::value_error("scatter: src_bytes=" + std::to_string(src_bytes) + " but " +
                                std::to_string(n_src) + " blocks need " +
                                std::to_string(n_src * page_bytes));
  for (const auto& pr : pairs) {
    if (pr.first < 0 || pr.first >= n_src)
      throw pybind11::value_error("scatter: src index " + std::to_string(pr.first) +
                                  " out of range [0, " + std::to_string(n_src) + ")");
    if (pr.second < 0)
      throw pybind11::value_error("negative block id " + std::to_string(pr.second));
  }
}

}  // namespace kvoffload
