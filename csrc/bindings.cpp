// Placeholder module body; the prefix tree and packer bindings are added here.
#include <pybind11/pybind11.h>

PYBIND11_MODULE(_core, m) {
    m.doc() = "clawfast C++ core: prefix tree, leaf filter, packer";
}
