// py_module.h: an empty Python module init, so `import sharpdraft_ext._C` (or `._cuda`) loads the
// shared library and runs its torch.library registrations. The ops live in torch.ops.sharpdraft.
#pragma once

#include <Python.h>

#define SHARPDRAFT_PY_MODULE(name)                                                         \
  extern "C" PyMODINIT_FUNC PyInit_##name(void) {                                          \
    static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, #name, nullptr, -1, nullptr};  \
    return PyModule_Create(&def);                                                          \
  }
