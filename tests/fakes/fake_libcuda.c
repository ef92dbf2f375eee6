/* A stand-in for libcuda, for te_gqa_fix's C launch on CPU machines (tests, host_cpu.py).
 *
 * Exports the two driver entry points te_gqa_fix/c_launch.c looks up. cuLaunchKernel
 * records each launch (handle, grid, block, shared memory, stream, the first n 8-byte
 * parameter values) where configure() asks it to, and returns the configured status;
 * cuCtxGetCurrent reports a current context or none. Built as a Python extension so that
 * the tests read the records and set the behaviour from Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static int status = 0;
static int has_context = 1;
static int n_record = 0; /* parameters to record; -1: count only */
static unsigned long long count = 0;
static PyObject *records = NULL;

int cuCtxGetCurrent(void **context) {
  *context = has_context ? (void *)0x1 : NULL;
  return 0;
}

int cuLaunchKernel(void *function, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                   unsigned by, unsigned bz, unsigned shared, void *stream, void **params,
                   void **extra) {
  count++;
  if (n_record < 0) return status;
  /* Called with the GIL released, as by the real driver. */
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject *values = PyTuple_New(n_record);
  for (int i = 0; values && i < n_record; i++)
    PyTuple_SET_ITEM(values, i, PyLong_FromUnsignedLongLong(*(uint64_t *)params[i]));
  PyObject *launch = values ? Py_BuildValue(
      "(KIIIIIIIKNO)", (unsigned long long)(uintptr_t)function, gx, gy, gz, bx, by, bz,
      shared, (unsigned long long)(uintptr_t)stream, values, extra ? Py_True : Py_False)
                            : NULL;
  if (launch) {
    PyList_Append(records, launch);
    Py_DECREF(launch);
  } else {
    PyErr_Clear();
  }
  PyGILState_Release(gil);
  return status;
}

static PyObject *configure(PyObject *self, PyObject *args) {
  (void)self;
  if (!PyArg_ParseTuple(args, "iii", &n_record, &status, &has_context)) return NULL;
  Py_RETURN_NONE;
}

static PyObject *launches(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  PyObject *out = records;
  records = PyList_New(0);
  return out;
}

static PyObject *launch_count(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  return PyLong_FromUnsignedLongLong(count);
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "configure(n_record, status, has_context)"},
    {"launches", launches, METH_NOARGS, "the recorded launches since the last call"},
    {"launch_count", launch_count, METH_NOARGS, "cuLaunchKernel calls so far"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "te_gqa_fix_fake_libcuda", NULL, -1,
                                    methods};

PyMODINIT_FUNC PyInit_te_gqa_fix_fake_libcuda(void) {
  records = PyList_New(0);
  if (!records) return NULL;
  return PyModule_Create(&module);
}
