/* The post-pass kernel's steady-state launch, in C: see te_gqa_fix/c_launch.py.
 *
 * launch(record, t0, ..., t6) launches the kernel a record describes on the seven
 * tensors' device addresses, and returns True; or returns False, having done nothing,
 * when the caller must take Triton's own launch path instead. It does per call what
 * te_gqa_fix.triton_postpass._run does in Python before Triton's C launcher (pointers,
 * their 16-byte alignment, launch hooks, the current device, the current stream) and
 * what that launcher does after (the parameter array, cuLaunchKernel with the GIL
 * released), without building and parsing a tuple of every kernel argument.
 *
 * Built at run time by Triton's own C build helper, as Triton builds its launchers.
 * No CUDA headers: the driver entry points are looked up in the library setup() names.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

typedef int CUresult;
typedef void *CUcontext;
typedef void *CUfunction;
typedef void *CUstream;
typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, unsigned, CUstream, void **, void **);
typedef CUresult (*context_fn)(CUcontext *);

#define N_TENSORS 7
#define MAX_PARAMS 128

/* One launch plan's kernel, as te_gqa_fix/c_launch.py's record() packs it (little-endian,
 * no padding): the function handle, grid, threads per block, dynamic shared memory, the
 * CUDA device, then one 8-byte slot per kernel parameter Triton passes (its signature
 * less the constexprs), slots 0-6 being the seven tensors' addresses, rewritten per call.
 * Triton's launcher appends two scratch pointers (0 here: record() requires no scratch). */
typedef struct {
  uint64_t function;
  uint32_t grid_x, grid_y, grid_z;
  uint32_t block_x;
  uint32_t shared;
  int32_t device;
  uint32_t n_params;
  uint32_t reserved;
  uint64_t slots[];
} record_t;

static launch_fn cu_launch = NULL;
static context_fn cu_context = NULL;
static PyObject *get_device = NULL, *raw_stream = NULL, *knobs = NULL;
static PyObject *data_ptr_name = NULL, *enter_name = NULL, *exit_name = NULL, *calls_name = NULL;
static unsigned long long launched = 0;

/* Py_NewRef is Python 3.10+. */
static PyObject *new_ref(PyObject *o) {
  Py_INCREF(o);
  return o;
}

/* 1: no launch hook of this name (None, or an empty chain: Triton 3.6's HookChain), as
 * te_gqa_fix.triton_postpass._hooks_clear; 0: one is set (or no knobs); -1: error. */
static int hook_clear(PyObject *name) {
  if (knobs == Py_None) return 0;
  PyObject *hook = PyObject_GetAttr(knobs, name);
  if (!hook) return -1;
  if (hook == Py_None) {
    Py_DECREF(hook);
    return 1;
  }
  PyObject *calls = PyObject_GetAttr(hook, calls_name);
  Py_DECREF(hook);
  if (!calls) { /* a hook that is no chain: set */
    PyErr_Clear();
    return 0;
  }
  int truth = PyObject_IsTrue(calls);
  Py_DECREF(calls);
  return truth < 0 ? -1 : truth == 0;
}

static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 1 + N_TENSORS || !PyBytes_CheckExact(args[0])) {
    PyErr_SetString(PyExc_TypeError, "launch(record: bytes, t0, ..., t6)");
    return NULL;
  }
  if (!cu_launch) {
    PyErr_SetString(PyExc_RuntimeError, "te_gqa_fix c_launch: setup() was not called");
    return NULL;
  }
  const record_t *rec = (const record_t *)PyBytes_AS_STRING(args[0]);
  Py_ssize_t size = PyBytes_GET_SIZE(args[0]);
  if (size < (Py_ssize_t)sizeof(record_t) || rec->n_params < N_TENSORS ||
      rec->n_params > MAX_PARAMS ||
      size != (Py_ssize_t)(sizeof(record_t) + 8 * (size_t)rec->n_params)) {
    PyErr_SetString(PyExc_ValueError, "te_gqa_fix c_launch: malformed launch record");
    return NULL;
  }
  uint64_t slots[MAX_PARAMS];
  memcpy(slots, rec->slots, 8 * (size_t)rec->n_params);
  uint64_t any = 0;
  for (int i = 0; i < N_TENSORS; i++) {
    PyObject *ptr = PyObject_CallMethodNoArgs(args[1 + i], data_ptr_name);
    if (!ptr) return NULL;
    uint64_t value = PyLong_AsUnsignedLongLong(ptr);
    Py_DECREF(ptr);
    if (value == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    slots[i] = value;
    any |= value;
  }
  /* Triton specializes pointers on 16-byte alignment: the record's kernel is the one
   * compiled for all seven aligned. */
  if (any & 15) Py_RETURN_FALSE;
  int clear = hook_clear(enter_name);
  if (clear <= 0) return clear < 0 ? NULL : new_ref(Py_False);
  clear = hook_clear(exit_name);
  if (clear <= 0) return clear < 0 ? NULL : new_ref(Py_False);
  PyObject *dev = PyObject_CallNoArgs(get_device);
  if (!dev) return NULL;
  long device = PyLong_AsLong(dev);
  Py_DECREF(dev);
  if (device == -1 && PyErr_Occurred()) return NULL;
  if (device != rec->device) Py_RETURN_FALSE;
  /* No current context on this thread: Triton's launcher makes one current first. */
  CUcontext context = NULL;
  if (cu_context(&context) != 0 || context == NULL) Py_RETURN_FALSE;
  PyObject *index = PyLong_FromLong(device);
  if (!index) return NULL;
  PyObject *handle = PyObject_CallOneArg(raw_stream, index);
  Py_DECREF(index);
  if (!handle) return NULL;
  uint64_t stream = PyLong_AsUnsignedLongLong(handle);
  Py_DECREF(handle);
  if (stream == (uint64_t)-1 && PyErr_Occurred()) return NULL;
  if ((uint64_t)rec->grid_x * rec->grid_y * rec->grid_z == 0) Py_RETURN_TRUE;
  uint64_t scratch[2] = {0, 0};
  void *params[MAX_PARAMS + 2];
  for (uint32_t i = 0; i < rec->n_params; i++) params[i] = &slots[i];
  params[rec->n_params] = &scratch[0];
  params[rec->n_params + 1] = &scratch[1];
  CUresult status;
  Py_BEGIN_ALLOW_THREADS;
  status = cu_launch((CUfunction)(uintptr_t)rec->function, rec->grid_x, rec->grid_y,
                     rec->grid_z, rec->block_x, 1, 1, rec->shared,
                     (CUstream)(uintptr_t)stream, params, NULL);
  Py_END_ALLOW_THREADS;
  if (status != 0) {
    PyErr_Format(PyExc_RuntimeError, "te_gqa_fix c_launch: cuLaunchKernel returned %d",
                 status);
    return NULL;
  }
  launched++;
  Py_RETURN_TRUE;
}

static PyObject *setup(PyObject *self, PyObject *args) {
  (void)self;
  const char *library;
  PyObject *device_fn, *stream_fn, *runtime_knobs;
  if (!PyArg_ParseTuple(args, "sOOO", &library, &device_fn, &stream_fn, &runtime_knobs))
    return NULL;
  void *lib = dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    PyErr_Format(PyExc_OSError, "te_gqa_fix c_launch: cannot open %s", library);
    return NULL;
  }
  launch_fn launch_entry = (launch_fn)dlsym(lib, "cuLaunchKernel");
  context_fn context_entry = (context_fn)dlsym(lib, "cuCtxGetCurrent");
  if (!launch_entry || !context_entry) {
    PyErr_Format(PyExc_OSError, "te_gqa_fix c_launch: %s has no cuLaunchKernel", library);
    return NULL;
  }
  Py_XSETREF(get_device, new_ref(device_fn));
  Py_XSETREF(raw_stream, new_ref(stream_fn));
  Py_XSETREF(knobs, new_ref(runtime_knobs));
  cu_launch = launch_entry;
  cu_context = context_entry;
  Py_RETURN_NONE;
}

static PyObject *launches(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  return PyLong_FromUnsignedLongLong(launched);
}

static PyObject *header_size(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  return PyLong_FromSize_t(sizeof(record_t));
}

static PyMethodDef methods[] = {
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "launch(record, t0, ..., t6) -> bool: launched, or declined (use Triton's path)"},
    {"setup", setup, METH_VARARGS,
     "setup(libcuda, get_device, raw_stream, runtime_knobs): the driver and torch's calls"},
    {"launches", launches, METH_NOARGS, "kernels launched through launch() so far"},
    {"header_size", header_size, METH_NOARGS, "bytes of a record before its slots"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "te_gqa_fix_c_launch", NULL, -1,
                                    methods};

PyMODINIT_FUNC PyInit_te_gqa_fix_c_launch(void) {
  data_ptr_name = PyUnicode_InternFromString("data_ptr");
  enter_name = PyUnicode_InternFromString("launch_enter_hook");
  exit_name = PyUnicode_InternFromString("launch_exit_hook");
  calls_name = PyUnicode_InternFromString("calls");
  if (!data_ptr_name || !enter_name || !exit_name || !calls_name) return NULL;
  return PyModule_Create(&module);
}
