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
 * serve(record, expected, out, cu_q, cu_kv, pad_q, pad_kv) is the wrapper's fast lane
 * after TE's call: TE's return value checked as the lane checks it in Python (a list or
 * tuple of at least three; dQ (when fixed), dK and dV plain tensors whose shape, strides,
 * dtype and device index equal te_gqa_fix.triton_postpass.output_key's ``expected``), no
 * bad offsets pending in the record's host words, then launch(). False: the lane's
 * Python path decides, as before.
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
  uint64_t words; /* address of the device's two int32 host error words, 0: none */
  uint64_t slots[];
} record_t;

static launch_fn cu_launch = NULL;
static context_fn cu_context = NULL;
static PyObject *get_device = NULL, *raw_stream = NULL, *knobs = NULL;
static PyObject *tensor_type = NULL, *parameter_type = NULL;
static PyObject *data_ptr_name = NULL, *enter_name = NULL, *exit_name = NULL, *calls_name = NULL;
static PyObject *shape_name = NULL, *stride_name = NULL, *dtype_name = NULL, *get_device_name = NULL;
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

/* The record in ``obj``, checked; NULL (an exception set) when malformed. */
static const record_t *get_record(PyObject *obj) {
  if (!cu_launch) {
    PyErr_SetString(PyExc_RuntimeError, "te_gqa_fix c_launch: setup() was not called");
    return NULL;
  }
  if (!PyBytes_CheckExact(obj)) {
    PyErr_SetString(PyExc_TypeError, "te_gqa_fix c_launch: the record must be bytes");
    return NULL;
  }
  const record_t *rec = (const record_t *)PyBytes_AS_STRING(obj);
  Py_ssize_t size = PyBytes_GET_SIZE(obj);
  if (size < (Py_ssize_t)sizeof(record_t) || rec->n_params < N_TENSORS ||
      rec->n_params > MAX_PARAMS ||
      size != (Py_ssize_t)(sizeof(record_t) + 8 * (size_t)rec->n_params)) {
    PyErr_SetString(PyExc_ValueError, "te_gqa_fix c_launch: malformed launch record");
    return NULL;
  }
  return rec;
}

/* Launch ``rec``'s kernel on the seven tensors: 1 launched, 0 declined (nothing done:
 * Triton's path must run), -1 error (an exception set). */
static int do_launch(const record_t *rec, PyObject *const *tensors) {
  uint64_t slots[MAX_PARAMS];
  memcpy(slots, rec->slots, 8 * (size_t)rec->n_params);
  uint64_t any = 0;
  for (int i = 0; i < N_TENSORS; i++) {
    PyObject *ptr = PyObject_CallMethodNoArgs(tensors[i], data_ptr_name);
    if (!ptr) return -1;
    uint64_t value = PyLong_AsUnsignedLongLong(ptr);
    Py_DECREF(ptr);
    if (value == (uint64_t)-1 && PyErr_Occurred()) return -1;
    slots[i] = value;
    any |= value;
  }
  /* Triton specializes pointers on 16-byte alignment: the record's kernel is the one
   * compiled for all seven aligned. */
  if (any & 15) return 0;
  int clear = hook_clear(enter_name);
  if (clear <= 0) return clear;
  clear = hook_clear(exit_name);
  if (clear <= 0) return clear;
  PyObject *dev = PyObject_CallNoArgs(get_device);
  if (!dev) return -1;
  long device = PyLong_AsLong(dev);
  Py_DECREF(dev);
  if (device == -1 && PyErr_Occurred()) return -1;
  if (device != rec->device) return 0;
  /* No current context on this thread: Triton's launcher makes one current first. */
  CUcontext context = NULL;
  if (cu_context(&context) != 0 || context == NULL) return 0;
  PyObject *index = PyLong_FromLong(device);
  if (!index) return -1;
  PyObject *handle = PyObject_CallOneArg(raw_stream, index);
  Py_DECREF(index);
  if (!handle) return -1;
  uint64_t stream = PyLong_AsUnsignedLongLong(handle);
  Py_DECREF(handle);
  if (stream == (uint64_t)-1 && PyErr_Occurred()) return -1;
  if ((uint64_t)rec->grid_x * rec->grid_y * rec->grid_z == 0) return 1;
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
    return -1;
  }
  launched++;
  return 1;
}

static PyObject *result(int outcome) {
  if (outcome < 0) return NULL;
  return new_ref(outcome ? Py_True : Py_False);
}

static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 1 + N_TENSORS) {
    PyErr_SetString(PyExc_TypeError, "launch(record, t0, ..., t6)");
    return NULL;
  }
  const record_t *rec = get_record(args[0]);
  if (!rec) return NULL;
  return result(do_launch(rec, args + 1));
}

/* 1: ``value`` equals ``want`` (==, as Python compares the lane's output key); 0: not;
 * -1: error. Steals the reference to ``value``. */
static int equal(PyObject *value, PyObject *want) {
  if (!value) return -1;
  int eq = value == want ? 1 : PyObject_RichCompareBool(value, want, Py_EQ);
  Py_DECREF(value);
  return eq;
}

/* 1: tensor ``t`` is a plain tensor with the four facts ``want[0..3]`` (shape, strides,
 * dtype, device index: te_gqa_fix.triton_postpass.output_key's); 0: not; -1: error. */
static int same_facts(PyObject *t, PyObject *const *want) {
  if ((PyObject *)Py_TYPE(t) != tensor_type && (PyObject *)Py_TYPE(t) != parameter_type)
    return 0;
  int eq = equal(PyObject_GetAttr(t, shape_name), want[0]);
  if (eq == 1) eq = equal(PyObject_CallMethodNoArgs(t, stride_name), want[1]);
  if (eq == 1) eq = equal(PyObject_GetAttr(t, dtype_name), want[2]);
  if (eq == 1) eq = equal(PyObject_CallMethodNoArgs(t, get_device_name), want[3]);
  return eq;
}

static PyObject *serve(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 7 || !PyTuple_CheckExact(args[1])) {
    PyErr_SetString(PyExc_TypeError,
                    "serve(record, expected: tuple, out, cu_q, cu_kv, pad_q, pad_kv)");
    return NULL;
  }
  const record_t *rec = get_record(args[0]);
  if (!rec) return NULL;
  /* output_key(dq, dk, dv): 12 facts, or None and 8 when dQ is not fixed. */
  PyObject *expected = args[1];
  Py_ssize_t n_expected = PyTuple_GET_SIZE(expected);
  if (n_expected != 12 && (n_expected != 9 || PyTuple_GET_ITEM(expected, 0) != Py_None)) {
    PyErr_SetString(PyExc_ValueError, "te_gqa_fix c_launch: expected must be an output key");
    return NULL;
  }
  PyObject *out = args[2];
  PyObject *dq, *dk, *dv;
  if (PyList_CheckExact(out) && PyList_GET_SIZE(out) > 2) {
    dq = PyList_GET_ITEM(out, 0);
    dk = PyList_GET_ITEM(out, 1);
    dv = PyList_GET_ITEM(out, 2);
  } else if (PyTuple_CheckExact(out) && PyTuple_GET_SIZE(out) > 2) {
    dq = PyTuple_GET_ITEM(out, 0);
    dk = PyTuple_GET_ITEM(out, 1);
    dv = PyTuple_GET_ITEM(out, 2);
  } else {
    Py_RETURN_FALSE;
  }
  /* Borrowed from ``out``: hold them while Python code (tensor attributes) runs. */
  PyObject *tensors[N_TENSORS] = {n_expected == 12 ? dq : dk, dk, dv,
                                  args[3], args[4], args[5], args[6]};
  for (int i = 0; i < 3; i++) Py_INCREF(tensors[i]);
  PyObject *const *want = &PyTuple_GET_ITEM(expected, n_expected == 12 ? 0 : 1);
  int outcome = 1;
  if (n_expected == 12) outcome = same_facts(dq, want);
  if (outcome == 1) outcome = same_facts(dk, want + (n_expected == 12 ? 4 : 0));
  if (outcome == 1) outcome = same_facts(dv, want + (n_expected == 12 ? 8 : 4));
  if (outcome == 1) {
    /* Bad offsets an earlier call recorded (the kernel stores here): the lane raises.
     * A record without the words' address cannot tell: the lane decides. */
    volatile const int32_t *words = (volatile const int32_t *)(uintptr_t)rec->words;
    if (!words || (words[0] | words[1])) outcome = 0;
  }
  if (outcome == 1) outcome = do_launch(rec, tensors);
  for (int i = 0; i < 3; i++) Py_DECREF(tensors[i]);
  return result(outcome);
}

static PyObject *setup(PyObject *self, PyObject *args) {
  (void)self;
  const char *library;
  PyObject *device_fn, *stream_fn, *runtime_knobs, *tensor, *parameter;
  if (!PyArg_ParseTuple(args, "sOOOOO", &library, &device_fn, &stream_fn, &runtime_knobs,
                        &tensor, &parameter))
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
  Py_XSETREF(tensor_type, new_ref(tensor));
  Py_XSETREF(parameter_type, new_ref(parameter));
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
    {"serve", (PyCFunction)(void (*)(void))serve, METH_FASTCALL,
     "serve(record, expected, out, cu_q, cu_kv, pad_q, pad_kv) -> bool: TE's outputs "
     "checked, then launch()"},
    {"setup", setup, METH_VARARGS,
     "setup(libcuda, get_device, raw_stream, runtime_knobs, Tensor, Parameter): the "
     "driver, torch's calls and the plain tensor types"},
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
  shape_name = PyUnicode_InternFromString("shape");
  stride_name = PyUnicode_InternFromString("stride");
  dtype_name = PyUnicode_InternFromString("dtype");
  get_device_name = PyUnicode_InternFromString("get_device");
  if (!data_ptr_name || !enter_name || !exit_name || !calls_name || !shape_name ||
      !stride_name || !dtype_name || !get_device_name)
    return NULL;
  return PyModule_Create(&module);
}
