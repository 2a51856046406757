// pybind11 bindings of the scheduler core: `deepinfer_sched._core`.
#include <pybind11/pybind11.h>

#include "deepinfer/block_allocator.hpp"

namespace py = pybind11;

PYBIND11_MODULE(_core, m) {
  m.doc() = "DeepInfer scheduler core (C++17)";

  m.def("build_info", [] {
    py::dict info;
    info["accelerator"] = DEEPINFER_ACCELERATOR_NAME;
    info["cxx_standard"] = __cplusplus;
#ifdef NDEBUG
    info["debug"] = false;
#else
    info["debug"] = true;
#endif
    return info;
  });

  py::class_<deepinfer::BlockAllocator>(m, "BlockAllocator")
      .def(py::init<int32_t>(), py::arg("num_blocks"))
      .def_property_readonly("num_blocks", &deepinfer::BlockAllocator::num_blocks)
      .def_property_readonly("num_free", &deepinfer::BlockAllocator::num_free)
      .def_property_readonly("num_used", &deepinfer::BlockAllocator::num_used)
      .def("allocate", &deepinfer::BlockAllocator::allocate)
      .def("incref", &deepinfer::BlockAllocator::incref, py::arg("block_id"))
      .def("decref", &deepinfer::BlockAllocator::decref, py::arg("block_id"))
      .def("ref_count", &deepinfer::BlockAllocator::ref_count, py::arg("block_id"));
}
