/*
 * phase_timer._native: phase-timer's hot spots in C, one file a part under native/, each saying why it is in C
 * and what keeps it in lockstep with its Python twin (every part has one but the driver's and the resolver
 * thread's; where the extension is not built, the twins run, with the same numbers and more host time a step):
 *
 *   native/driver.c        the CUDA driver's entry points, looked up at run time (no link against CUDA)
 *   native/clock.c         Clock: pooled CUDA events, a mark one C call
 *   native/records.c       the C engine's records, ring and window columns (Steps' state)
 *   native/resolver.c      the thread that resolves a threaded engine's records off the training thread
 *   native/steps.c         Steps: the engine's methods
 *   native/arm.c           Arm: DDP's split's hook on the autograd thread
 *   native/fast.c          Fast: the boundaries' usual case
 *   native/loop_hooks.c    LoopHooks: the plain door's hook bodies' usual case
 *   native/event_record.c  one TensorBoard event record, whole
 *   native/window_stats.c  a window column's buckets, sum, median and p90
 *
 * One translation unit: the parts are included here, in this order (each uses what the ones before it define),
 * so that the hot path's calls from one type to another (Fast to Steps, Steps to Clock) stay static and
 * inlinable, as in one file, without link-time optimization; setup.py names the parts as its `depends`.
 *
 * Host-device synchronization: only Clock's wait() (cuEventSynchronize), which the end of training calls
 * through the engine's drain().  record, query and elapsed never wait.
 */
#include "native/driver.c"
#include "native/clock.c"
#include "native/records.c"
#include "native/resolver.c"
#include "native/steps.c"
#include "native/arm.c"
#include "native/fast.c"
#include "native/loop_hooks.c"
#include "native/event_record.c"
#include "native/window_stats.c"

static PyMethodDef module_methods[] = {
    {"masked_crc32c", masked_crc32c, METH_O, "The masked CRC-32C of a TFRecord (TensorBoard event file) record."},
    {"event_record", (PyCFunction)(void (*)(void))event_record, METH_FASTCALL,
     "event_record(wall_time, step, scalars) -> bytes: one TFRecord of a tensorboard Event of scalars."},
    {"bucket_counts", (PyCFunction)(void (*)(void))bucket_counts, METH_FASTCALL,
     "bucket_counts(values, inv_log_growth, zero_key[, into]) -> {bucket: count}, as stats.PhaseTotals buckets them."},
    {"sorted_stats", (PyCFunction)(void (*)(void))sorted_stats, METH_FASTCALL,
     "sorted_stats(values, inv_log_growth, zero_key, into) -> (sum, p50, p90) of sorted values, their buckets into `into`."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "phase-timer's hot spots in C (see _native.c).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    crc_init();
    for (int i = 0; i < N_NAMES; i++)
        if (names[i] == NULL && (names[i] = PyUnicode_InternFromString(interned_names[i])) == NULL) return NULL;
    static int atfork_done;
    if (!atfork_done) {  /* without it a forked child would take the parent's resolver thread for its own */
        if (pthread_atfork(NULL, NULL, on_fork_child) != 0) {
            PyErr_SetString(PyExc_ImportError, "phase_timer._native: pthread_atfork failed");
            return NULL;
        }
        atfork_done = 1;
    }
    if (PyType_Ready(&ClockType) < 0 || PyType_Ready(&StepsType) < 0 || PyType_Ready(&FastType) < 0 ||
        PyType_Ready(&LoopHooksType) < 0 || PyType_Ready(&ArmType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Clock", (PyObject *)&ClockType) < 0 ||
        PyModule_AddObjectRef(m, "Steps", (PyObject *)&StepsType) < 0 ||
        PyModule_AddObjectRef(m, "Fast", (PyObject *)&FastType) < 0 ||
        PyModule_AddObjectRef(m, "LoopHooks", (PyObject *)&LoopHooksType) < 0 ||
        PyModule_AddObjectRef(m, "Arm", (PyObject *)&ArmType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
