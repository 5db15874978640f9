"""What a compiled reader of a tensor's properties would save a recorded row (issue 18, part 3).

`Collector._row` reads about a dozen properties of each tensor it records (address, storage
offset, element size, shape, strides, dtype, byte size, version, the contiguity, conjugation and
negation flags), each a Python attribute read or method call into torch. This compares those reads
in Python with one call into a small C++ function that reads the same from the TensorImpl
(built here with torch.utils.cpp_extension.load_inline; nothing of bitguard uses it), called
through pybind11 and through a raw CPython entry point, in two
settings: warm (the same tensor in a tight loop) and cold (after a large matmul that evicts the
caches, as a recorded hook finds them between a model's kernels). Both read the same values; the
benchmark checks that they agree.

    python benchmarks/bench_row_props.py [--rounds 2000] [--json]

Needs a C++ compiler (the first run builds the extension: about a minute on two cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SOURCE = r"""
#include <torch/extension.h>

py::tuple props(const at::Tensor& t) {
    const auto itemsize = static_cast<int64_t>(t.element_size());
    const auto address = reinterpret_cast<int64_t>(t.data_ptr());
    const auto storage = address - t.storage_offset() * itemsize;
    py::tuple shape(t.dim()), strides(t.dim());
    for (int64_t i = 0; i < t.dim(); ++i) {
        shape[i] = t.size(i);
        strides[i] = t.stride(i);
    }
    const bool in_place = t.is_cpu() && t.is_contiguous() && !t.is_quantized() && !t.is_conj() && !t.is_neg();
    return py::make_tuple(address, storage, shape, strides, static_cast<int>(t.scalar_type()),
                          static_cast<int64_t>(t.nbytes()), static_cast<int64_t>(t._version()), in_place);
}

// The same reads behind a raw CPython entry point (METH_O): no pybind11 argument conversion and
// the result built with the C API, which is what a row reader would have to be to pay.
static PyObject* props_raw(PyObject*, PyObject* obj) {
    if (!THPVariable_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "a tensor");
        return nullptr;
    }
    const at::Tensor& t = THPVariable_Unpack(obj);
    const int64_t dim = t.dim();
    PyObject* shape = PyTuple_New(dim);
    PyObject* strides = PyTuple_New(dim);
    for (int64_t i = 0; i < dim; ++i) {
        PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(t.size(i)));
        PyTuple_SET_ITEM(strides, i, PyLong_FromLongLong(t.stride(i)));
    }
    const auto itemsize = static_cast<int64_t>(t.element_size());
    const auto address = reinterpret_cast<int64_t>(t.data_ptr());
    const bool in_place = t.is_cpu() && t.is_contiguous() && !t.is_quantized() && !t.is_conj() && !t.is_neg();
    return Py_BuildValue("(LLNNiLLO)", (long long)address, (long long)(address - t.storage_offset() * itemsize),
                         shape, strides, static_cast<int>(t.scalar_type()), (long long)t.nbytes(),
                         (long long)t._version(), in_place ? Py_True : Py_False);
}

static PyMethodDef raw_methods[] = {{"props_raw", props_raw, METH_O, "props, through the C API"}, {nullptr}};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("props", &props);
    PyModule_AddFunctions(m.ptr(), raw_methods);
}
"""


def python_props(t: torch.Tensor) -> tuple:
    """What `Collector._row` reads, as it reads it."""
    address = t.data_ptr()
    offset = t.storage_offset()
    storage = address - offset * t.element_size() if offset else address
    shape, strides = t.shape, t.stride()
    in_place = t.is_cpu and t.is_contiguous() and not t.is_quantized and not t.is_conj() and not t.is_neg()
    return address, storage, tuple(shape), strides, t.dtype, t.nbytes, t._version, in_place


def _timed(fn, t, rounds: int, evict) -> float:
    times = []
    for _ in range(rounds):
        if evict is not None:
            evict()
        s = time.perf_counter_ns()
        fn(t)
        times.append(time.perf_counter_ns() - s)
    return statistics.median(times) / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from torch.utils.cpp_extension import load_inline

    started = time.perf_counter()
    ext = load_inline("bitguard_row_props_bench2", cpp_sources=SOURCE, verbose=False)
    built = time.perf_counter() - started
    t = torch.randn(8, 128, 256)
    want = python_props(t)
    for got in (ext.props(t), ext.props_raw(t)):
        if got[:4] != (want[0], want[1], want[2], want[3]) or got[5:] != want[5:]:
            raise SystemExit(f"the readers disagree: {got} against {want}")
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    big = torch.empty(8 << 20, dtype=torch.uint8)

    def evict():  # a matmul and a pass over 8 MiB: what the kernels between two hooks do to the caches
        torch.mm(a, b)
        big.fill_(1)

    doc = {"build_s": built, "rounds": args.rounds}
    for setting, ev in (("warm", None), ("cold", evict)):
        for name, fn in (("python", python_props), ("compiled", ext.props), ("raw", ext.props_raw)):
            doc[f"{setting}_{name}_us"] = _timed(fn, t, args.rounds, ev)
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print(f"extension built (or loaded) in {built:.1f} s; medians of {args.rounds} calls")
    for setting in ("warm", "cold"):
        py, c, raw = doc[f"{setting}_python_us"], doc[f"{setting}_compiled_us"], doc[f"{setting}_raw_us"]
        print(f"  {setting}: Python reads {py:.2f} us; one compiled call {c:.2f} us through pybind11 ({py / c:.1f}x), "
              f"{raw:.2f} us through the C API ({py / raw:.1f}x)")


if __name__ == "__main__":
    main()
