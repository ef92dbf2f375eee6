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
 * lane(state, args, kwargs) is the whole fast lane of te_gqa_fix.wrapper (see _Lane there)
 * for one call: the same checks before TE's call, in the same order, on the same
 * objects; TE's call; then serve(). It returns TE's result when it served the call (the
 * kernel launched, or the fixed-cuDNN pass-through), the state's MISS marker when it did
 * nothing at all (the wrapper's Python then runs as if the C lane did not exist), or,
 * having called TE, an AFTER(out, key, entry, exception, cu_q, cu_kv, pad_q, pad_kv)
 * when serve() declined or failed: the wrapper finishes that call in Python. On the H200
 * the wrapper's Python before TE's call cost more after TE's C++ than back to back
 * (benchmarks/wake_split.py); here it is C calls on the same getters.
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
static PyObject *is_cuda_name = NULL, *is_contiguous_name = NULL, *c_name = NULL;
static PyObject *fast_ok_name = NULL, *broken_name = NULL, *device_index_name = NULL;
static PyObject *cudnn_fixed_name = NULL, *counts_name = NULL, *decisions_name = NULL;
static PyObject *fixed_name = NULL;
static PyObject *one = NULL;
static unsigned long long launched = 0, served = 0;

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
  if (!calls) { /* a hook that is no chain: set (getattr(hook, "calls", True)) */
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
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

/* serve() on borrowed arguments: 1 launched, 0 declined, -1 error in the launch, -2
 * error reading TE's outputs (the Python lane's output_key, outside its ``try``). */
static int serve_checked(PyObject *record, PyObject *expected, PyObject *out,
                         PyObject *const *offsets) {
  const record_t *rec = get_record(record);
  if (!rec) return -1;
  if (!PyTuple_CheckExact(expected)) {
    PyErr_SetString(PyExc_TypeError, "te_gqa_fix c_launch: expected must be a tuple");
    return -1;
  }
  /* output_key(dq, dk, dv): 12 facts, or None and 8 when dQ is not fixed. */
  Py_ssize_t n_expected = PyTuple_GET_SIZE(expected);
  if (n_expected != 12 && (n_expected != 9 || PyTuple_GET_ITEM(expected, 0) != Py_None)) {
    PyErr_SetString(PyExc_ValueError, "te_gqa_fix c_launch: expected must be an output key");
    return -1;
  }
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
    return 0;
  }
  /* Borrowed from ``out``: hold them while Python code (tensor attributes) runs. */
  PyObject *tensors[N_TENSORS] = {n_expected == 12 ? dq : dk, dk, dv,
                                  offsets[0], offsets[1], offsets[2], offsets[3]};
  for (int i = 0; i < 3; i++) Py_INCREF(tensors[i]);
  PyObject *const *want = &PyTuple_GET_ITEM(expected, n_expected == 12 ? 0 : 1);
  int outcome = 1;
  if (n_expected == 12) outcome = same_facts(dq, want);
  if (outcome == 1) outcome = same_facts(dk, want + (n_expected == 12 ? 4 : 0));
  if (outcome == 1) outcome = same_facts(dv, want + (n_expected == 12 ? 8 : 4));
  if (outcome < 0) outcome = -2;
  if (outcome == 1) {
    /* Bad offsets an earlier call recorded (the kernel stores here): the lane raises.
     * A record without the words' address cannot tell: the lane decides. */
    volatile const int32_t *words = (volatile const int32_t *)(uintptr_t)rec->words;
    if (!words || (words[0] | words[1])) outcome = 0;
  }
  if (outcome == 1) outcome = do_launch(rec, tensors);
  for (int i = 0; i < 3; i++) Py_DECREF(tensors[i]);
  return outcome;
}

static PyObject *serve(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 7) {
    PyErr_SetString(PyExc_TypeError,
                    "serve(record, expected: tuple, out, cu_q, cu_kv, pad_q, pad_kv)");
    return NULL;
  }
  return result(serve_checked(args[0], args[1], args[2], args + 3));
}

/* ----------------------------------------------------------------- the whole lane */

/* What lane() reads, in te_gqa_fix.wrapper._Lane.c_state's order. Module globals that the
 * Python lane reads by name on every call (_counts, _guard_decisions, guard._fixed,
 * _device_index, cudnn_fixed, _fast_ok, _broken) are read here by name too, from the
 * modules' dicts, so that a rebinding (a test's monkeypatch) is seen by both lanes. */
enum {
  S_SNAP,          /* [lane on, raw TE_GQA_FIX, raw TE_GQA_FIX_VALIDATE, policy is auto] */
  S_DATA,          /* os.environ's dict, and the two keys read from it */
  S_KEY_POLICY,
  S_KEY_VALIDATE,
  S_AT,            /* the twelve lane arguments' positions (te_gqa_fix.wrapper._LANE_ARGS) */
  S_NEED,          /* positional calls with fewer arguments: pick_by_name */
  S_PICK_BY_NAME,
  S_ENTRIES,       /* key -> (decision, guard key, output key, launch plan) */
  S_GLOBALS,       /* te_gqa_fix.wrapper's globals */
  S_DEVICE_INDEX,  /* wrapper._device_index and wrapper.cudnn_fixed as defined there: */
  S_CUDNN_FIXED,   /* while the globals hold these, their answers are read here */
  S_GUARD_GLOBALS, /* te_gqa_fix.guard's globals: _fixed, device -> cuDNN fixed */
  S_TP_GLOBALS,    /* te_gqa_fix.triton_postpass's globals: _fast_ok, _broken */
  S_ORIGINAL,      /* TE's function */
  S_MISS,
  S_AFTER,
  S_SIZE
};
enum { C_CALLS, C_FIXED, C_SKIPPED, C_PASSTHROUGH, C_FAST_LANE, C_SIZE };
#define N_PICKED 12
#define KEY_SIZE 28

/* counts[i] += 1; -1 on error. The list's length is checked here, on every bump: Python
 * code (TE's call among it) runs between the lane's first look at it and its bumps. */
static int bump(PyObject *counts, int i) {
  if (PyList_GET_SIZE(counts) <= i) {
    PyErr_SetString(PyExc_IndexError, "list index out of range");
    return -1;
  }
  PyObject *old = PyList_GET_ITEM(counts, i);
  Py_INCREF(old);
  PyObject *new_value = PyNumber_Add(old, one);
  Py_DECREF(old);
  if (!new_value) return -1;
  /* Checks the index again (the addition may have run Python code); steals new_value,
   * even on error. */
  return PyList_SetItem(counts, i, new_value);
}

/* The Python lane counts a call before anything can raise: so does lane(), keeping the
 * exception that is on its way out. */
static void count_raising_call(PyObject *counts) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  if (bump(counts, C_CALLS) < 0) PyErr_Clear();
  PyErr_Restore(type, value, tb);
}

/* A getter's or a no-argument method's value (new reference). */
static PyObject *attr(PyObject *o, PyObject *name) { return PyObject_GetAttr(o, name); }
static PyObject *call0(PyObject *o, PyObject *name) { return PyObject_CallMethodNoArgs(o, name); }

/* The key te_gqa_fix.wrapper's fast lane builds, item for item and in its order, stopping
 * at the first getter that raises (new reference). */
static PyObject *lane_key(PyObject *const *p, PyObject *dev) {
  PyObject *q = p[0], *k = p[1], *v = p[2], *cu_q = p[3], *cu_kv = p[4], *pad_q = p[5],
           *pad_kv = p[6];
  PyObject *key = PyTuple_New(KEY_SIZE);
  if (!key) return NULL;
  Py_ssize_t n = 0;
#define PUT(expr)                                                                          \
  do {                                                                                     \
    PyObject *item_ = (expr);                                                              \
    if (!item_) {                                                                          \
      Py_DECREF(key); /* a tuple's unset items are NULL: its dealloc skips them */          \
      return NULL;                                                                         \
    }                                                                                      \
    PyTuple_SET_ITEM(key, n++, item_);                                                     \
  } while (0)
  PUT(new_ref(p[9]));  /* layout */
  PUT(new_ref(p[11])); /* dqkv_layout */
  PUT(new_ref(p[7]));  /* attn_mask_type */
  PUT(new_ref(p[8]));  /* window_size */
  PUT(new_ref(p[10])); /* bottom_right_diagonal */
  PUT(new_ref(dev));
  PUT(attr(q, shape_name));
  PUT(attr(k, shape_name));
  PUT(call0(k, get_device_name));
  PUT(attr(v, shape_name));
  PUT(call0(v, get_device_name));
  PyObject *offsets[3] = {cu_q, cu_kv, pad_q};
  for (int i = 0; i < 3; i++) {
    PUT(attr(offsets[i], dtype_name));
    PUT(attr(offsets[i], shape_name));
    PUT(call0(offsets[i], get_device_name));
    PUT(call0(offsets[i], is_contiguous_name));
  }
  PUT(new_ref(pad_kv == pad_q ? Py_True : Py_False));
  PUT(attr(pad_kv, dtype_name));
  PUT(attr(pad_kv, shape_name));
  PUT(call0(pad_kv, get_device_name));
  PUT(call0(pad_kv, is_contiguous_name));
#undef PUT
  return key;
}

/* Truth of module global ``name`` in dict ``g`` (absent: an AttributeError, as Python's
 * module attribute read); -1 on error. */
static int global_true(PyObject *g, PyObject *name) {
  PyObject *v = PyDict_GetItemWithError(g, name);
  if (!v) {
    if (!PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, name);
    return -1;
  }
  Py_INCREF(v);
  int truth = PyObject_IsTrue(v);
  Py_DECREF(v);
  return truth;
}

/* After TE's call: serve(), or an AFTER for the wrapper's Python. */
static PyObject *after_te(PyObject *const *st, PyObject *counts, PyObject *out, PyObject *key,
                          PyObject *entry, PyObject *const *picked) {
  PyObject *exc = NULL;
  PyObject *launch_plan = PyTuple_GET_ITEM(entry, 3);
  PyObject *record = attr(launch_plan, c_name);
  if (!record) return NULL;
  int outcome = 0;
  if (record != Py_None) {
    /* c is not None and _tp._fast_ok and not _tp._broken: outside the lane's try. */
    int ok = global_true(st[S_TP_GLOBALS], fast_ok_name);
    if (ok == 1) {
      int broken = global_true(st[S_TP_GLOBALS], broken_name);
      ok = broken < 0 ? -1 : !broken;
    }
    if (ok < 0) {
      Py_DECREF(record);
      return NULL;
    }
    if (ok) outcome = serve_checked(record, PyTuple_GET_ITEM(entry, 2), out, picked + 3);
  }
  Py_DECREF(record);
  if (outcome == 1) {
    if (bump(counts, C_FIXED) < 0) return NULL;
    served++;
    return new_ref(out);
  }
  if (outcome == -2) return NULL; /* as the Python lane: TE's outputs' getter raised */
  if (outcome < 0) {
    /* As the lane's ``except Exception``: the wrapper gives the direct launch up. */
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
    PyObject *type, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (tb && exc) PyException_SetTraceback(exc, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    if (!exc) return NULL;
  }
  PyObject *items = PyTuple_Pack(8, out, key, entry, exc ? exc : Py_None, picked[3], picked[4],
                                 picked[5], picked[6]);
  Py_XDECREF(exc);
  if (!items) return NULL;
  PyObject *after = PyObject_CallOneArg(st[S_AFTER], items);
  Py_DECREF(items);
  return after;
}

/* Module global ``name`` of dict ``g``, a new reference; NULL with no exception when
 * absent. */
static PyObject *global(PyObject *g, PyObject *name) {
  PyObject *v = PyDict_GetItemWithError(g, name);
  Py_XINCREF(v);
  return v;
}

static PyObject *lane(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 3 || !PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) != S_SIZE ||
      !PyTuple_CheckExact(args[1]) || !PyDict_CheckExact(args[2])) {
    PyErr_SetString(PyExc_TypeError, "lane(state, args: tuple, kwargs: dict)");
    return NULL;
  }
  PyObject *const *st = &PyTuple_GET_ITEM(args[0], 0);
  PyObject *call_args = args[1], *kwargs = args[2];
  PyObject *miss = st[S_MISS];
  PyObject *snap = st[S_SNAP];
  if (!tensor_type || !PyList_CheckExact(snap) || PyList_GET_SIZE(snap) != 4 ||
      !PyDict_CheckExact(st[S_ENTRIES]) || !PyDict_CheckExact(st[S_GLOBALS]) ||
      !PyDict_CheckExact(st[S_GUARD_GLOBALS]) || !PyDict_CheckExact(st[S_TP_GLOBALS]) ||
      !PyTuple_CheckExact(st[S_AT]) || PyTuple_GET_SIZE(st[S_AT]) != N_PICKED) {
    PyErr_SetString(PyExc_TypeError, "te_gqa_fix c_launch: malformed lane state");
    return NULL;
  }
  PyObject *ret = NULL, *counts = NULL, *picked_by_name = NULL, *dev = NULL, *key = NULL;
  PyObject *entry = NULL, *fn = NULL, *table = NULL;
  int counted = 0; /* C_CALLS bumped for this call */
  PyObject *p[N_PICKED];
  counts = global(st[S_GLOBALS], counts_name);
  if (!counts) goto fail_or_miss;
  if (!PyList_CheckExact(counts) || PyList_GET_SIZE(counts) != C_SIZE) goto miss;
  /* The settings, as last read (the lane is on, both raw values the same objects). A
   * mapping other than a plain dict: the Python lane reads it. */
  if (PyList_GET_ITEM(snap, 0) != Py_True || !PyDict_CheckExact(st[S_DATA])) goto miss;
  for (int i = 0; i < 2; i++) {
    PyObject *raw = PyDict_GetItemWithError(st[S_DATA], st[i ? S_KEY_VALIDATE : S_KEY_POLICY]);
    if (!raw && PyErr_Occurred()) goto done;
    if ((raw ? raw : Py_None) != PyList_GET_ITEM(snap, i + 1)) goto miss;
  }
  /* The twelve arguments: by position, or through the binder's picker. */
  Py_ssize_t need = PyLong_AsSsize_t(st[S_NEED]);
  if (need == -1 && PyErr_Occurred()) goto done;
  if (PyDict_GET_SIZE(kwargs) == 0 && PyTuple_GET_SIZE(call_args) >= need) {
    for (int i = 0; i < N_PICKED; i++) {
      Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(st[S_AT], i));
      if (at < 0 || at >= PyTuple_GET_SIZE(call_args)) {
        if (!PyErr_Occurred())
          PyErr_SetString(PyExc_ValueError, "te_gqa_fix c_launch: lane position out of range");
        goto done;
      }
      p[i] = PyTuple_GET_ITEM(call_args, at);
    }
  } else {
    picked_by_name = PyObject_CallFunctionObjArgs(st[S_PICK_BY_NAME], call_args, kwargs, NULL);
    if (!picked_by_name) goto done;
    if (!PyTuple_CheckExact(picked_by_name) || PyTuple_GET_SIZE(picked_by_name) != N_PICKED)
      goto miss;
    for (int i = 0; i < N_PICKED; i++) p[i] = PyTuple_GET_ITEM(picked_by_name, i);
  }
  /* q, k, v and the four offsets: plain tensors. */
  for (int i = 0; i < 7; i++)
    if ((PyObject *)Py_TYPE(p[i]) != tensor_type) goto miss;
  /* q's CUDA device (wrapper._device_index), read here unless replaced there. */
  fn = global(st[S_GLOBALS], device_index_name);
  if (!fn) goto fail_or_miss;
  if (fn == st[S_DEVICE_INDEX]) {
    PyObject *is_cuda = attr(p[0], is_cuda_name);
    if (!is_cuda) goto done;
    int cuda = is_cuda == Py_True;
    Py_DECREF(is_cuda);
    if (!cuda) goto miss;
    dev = call0(p[0], get_device_name);
  } else {
    dev = PyObject_CallOneArg(fn, p[0]);
  }
  Py_CLEAR(fn);
  if (!dev) goto done;
  if (dev == Py_None) goto miss;
  /* The fixed-cuDNN pass-through (policy auto): guard.cudnn_fixed's cached answer. */
  if (PyList_GET_ITEM(snap, 3) == Py_True) {
    int fixed;
    fn = global(st[S_GLOBALS], cudnn_fixed_name);
    if (!fn) goto fail_or_miss;
    if (fn == st[S_CUDNN_FIXED]) {
      table = global(st[S_GUARD_GLOBALS], fixed_name);
      if (!table) goto fail_or_miss;
      if (!PyDict_CheckExact(table)) goto miss;
      PyObject *answer = PyDict_GetItemWithError(table, dev);
      if (!answer) goto fail_or_miss; /* not decided yet: the wrapper's Python decides */
      if (answer == Py_None) goto miss; /* as undecided: guard.cudnn_fixed decides again */
      Py_INCREF(answer);
      fixed = PyObject_IsTrue(answer);
      Py_DECREF(answer);
    } else {
      PyObject *answer = PyObject_CallOneArg(fn, dev);
      if (!answer) goto done;
      fixed = PyObject_IsTrue(answer);
      Py_DECREF(answer);
    }
    Py_CLEAR(fn);
    if (fixed < 0) goto done;
    if (fixed) {
      counted = 1;
      if (bump(counts, C_CALLS) < 0 || bump(counts, C_SKIPPED) < 0 ||
          bump(counts, C_FAST_LANE) < 0)
        goto done;
      ret = PyObject_Call(st[S_ORIGINAL], call_args, kwargs);
      if (ret) served++;
      goto done;
    }
  }
  key = lane_key(p, dev);
  if (!key) goto done;
  entry = PyDict_GetItemWithError(st[S_ENTRIES], key);
  if (!entry) {
    if (PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_TypeError)) PyErr_Clear();
    goto fail_or_miss; /* an unhashable argument, or nothing recorded */
  }
  Py_INCREF(entry); /* TE's call may run any Python, the lane's clear() included */
  if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 4) goto miss;
  /* The head-dim guard decided with nothing to say (wrapper._guard_decisions). */
  PyObject *guard_key = PyTuple_GET_ITEM(entry, 1);
  if (guard_key != Py_None) {
    Py_CLEAR(table);
    table = global(st[S_GLOBALS], decisions_name);
    if (!table) goto fail_or_miss;
    if (!PyDict_CheckExact(table)) goto miss;
    PyObject *said = PyDict_GetItemWithError(table, guard_key);
    if (!said && PyErr_Occurred()) goto done;
    if (said != Py_None) goto miss;
  }
  counted = 1;
  if (bump(counts, C_CALLS) < 0 || bump(counts, C_FAST_LANE) < 0) goto done;
  PyObject *out = PyObject_Call(st[S_ORIGINAL], call_args, kwargs);
  if (!out) goto done;
  ret = after_te(st, counts, out, key, entry, p);
  Py_DECREF(out);
  goto done;
fail_or_miss:
  if (PyErr_Occurred()) goto done;
miss:
  ret = new_ref(miss);
done:
  if (!ret && counts && !counted && PyList_CheckExact(counts) &&
      PyList_GET_SIZE(counts) == C_SIZE)
    count_raising_call(counts);
  Py_XDECREF(table);
  Py_XDECREF(fn);
  Py_XDECREF(entry);
  Py_XDECREF(key);
  Py_XDECREF(dev);
  Py_XDECREF(picked_by_name);
  Py_XDECREF(counts);
  return ret;
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

static PyObject *lanes(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  return PyLong_FromUnsignedLongLong(served);
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
    {"lane", (PyCFunction)(void (*)(void))lane, METH_FASTCALL,
     "lane(state, args, kwargs): the wrapper's fast lane for one call: TE's result, the "
     "state's MISS (nothing done), or an AFTER (TE called, the rest for Python)"},
    {"launches", launches, METH_NOARGS, "kernels launched through launch() so far"},
    {"lanes", lanes, METH_NOARGS, "calls lane() served (launched, or passed through)"},
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
  is_cuda_name = PyUnicode_InternFromString("is_cuda");
  is_contiguous_name = PyUnicode_InternFromString("is_contiguous");
  c_name = PyUnicode_InternFromString("c");
  fast_ok_name = PyUnicode_InternFromString("_fast_ok");
  broken_name = PyUnicode_InternFromString("_broken");
  device_index_name = PyUnicode_InternFromString("_device_index");
  cudnn_fixed_name = PyUnicode_InternFromString("cudnn_fixed");
  counts_name = PyUnicode_InternFromString("_counts");
  decisions_name = PyUnicode_InternFromString("_guard_decisions");
  fixed_name = PyUnicode_InternFromString("_fixed");
  one = PyLong_FromLong(1);
  if (!data_ptr_name || !enter_name || !exit_name || !calls_name || !shape_name ||
      !stride_name || !dtype_name || !get_device_name || !is_cuda_name ||
      !is_contiguous_name || !c_name || !fast_ok_name || !broken_name ||
      !device_index_name || !cudnn_fixed_name || !counts_name || !decisions_name ||
      !fixed_name || !one)
    return NULL;
  return PyModule_Create(&module);
}
