// py_module.h: an empty Python module init, so `import sharpdraft_ext._C` (or `._cuda`,
// `._cpu_runtime`) loads the shared library and runs its torch.library registrations. The ops
// live in torch.ops.sharpdraft (attention) and torch.ops.sharpdraft_cpu_runtime (the runtime's).
#pragma once

#include <Python.h>

#define SHARPDRAFT_PY_MODULE(name)                                                         \
  extern "C" PyMODINIT_FUNC PyInit_##name(void) {                                          \
    static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, #name, nullptr, -1, nullptr};  \
    return PyModule_Create(&def);                                                          \
  }
