/*
 * phase_timer._native: the two hot spots of phase-timer's host time, in C.
 *
 * 1. Clock: timing events on the CUDA driver API, without Python objects per event.
 * 2. masked_crc32c: the checksum of a TensorBoard event record (tensorboard's own
 *    is pure Python, ~80 us per 1 KB record; this is ~1 us).
 *
 * Why: torch.cuda.Event.record() costs ~1.8 us of host time on an H200 host
 * (argument parsing, a device guard, a GIL release), elapsed_time() ~0.8 us, and
 * the Python around them more.  A training step takes 5 marks and resolves 4
 * spans, so that was ~60% of phase-timer's host time per step.  Here a mark is one
 * C call: pop a pooled CUevent, read the current stream's raw handle through the
 * callable torch gives us, cuEventRecord.  A mark is a small int (the event's slot).
 *
 * Nothing is linked against CUDA: libcuda.so.1 (already loaded by torch) is opened
 * with dlopen and the few entry points are looked up by name, so this builds with
 * nothing but a C compiler and Python's headers, and imports on machines with no
 * GPU (where Clock() raises and phase-timer uses torch's events).
 *
 * Host-device synchronization: only wait() (cuEventSynchronize), which the end of
 * training calls through Resolver.drain().  record, query and elapsed never wait.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUevent_st *CUevent;
typedef struct CUstream_st *CUstream;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_READY 600
#define CU_EVENT_DEFAULT 0 /* timing enabled */

static struct {
    int loaded;
    CUresult (*Init)(unsigned int);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*PrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*PrimaryCtxRelease)(CUdevice);
    CUresult (*CtxGetCurrent)(CUcontext *);
    CUresult (*CtxPushCurrent)(CUcontext);
    CUresult (*CtxPopCurrent)(CUcontext *);
    CUresult (*EventCreate)(CUevent *, unsigned int);
    CUresult (*EventDestroy)(CUevent);
    CUresult (*EventRecord)(CUevent, CUstream);
    CUresult (*EventQuery)(CUevent);
    CUresult (*EventSynchronize)(CUevent);
    CUresult (*EventElapsedTime)(float *, CUevent, CUevent);
    CUresult (*GetErrorName)(CUresult, const char **);
} cu;

static void *lookup(void *lib, const char *name, const char *fallback) {
    void *f = dlsym(lib, name);
    if (f == NULL && fallback != NULL) f = dlsym(lib, fallback);
    return f;
}

/* 0 on success; -1 with a Python exception set. */
static int load_driver(void) {
    if (cu.loaded) return 0;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        PyErr_Format(PyExc_OSError, "libcuda.so.1 could not be loaded: %s", dlerror());
        return -1;
    }
    struct { void **slot; const char *name; const char *fallback; } want[] = {
        {(void **)&cu.Init, "cuInit", NULL},
        {(void **)&cu.DeviceGet, "cuDeviceGet", NULL},
        {(void **)&cu.PrimaryCtxRetain, "cuDevicePrimaryCtxRetain", NULL},
        {(void **)&cu.PrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"},
        {(void **)&cu.CtxGetCurrent, "cuCtxGetCurrent", NULL},
        {(void **)&cu.CtxPushCurrent, "cuCtxPushCurrent_v2", "cuCtxPushCurrent"},
        {(void **)&cu.CtxPopCurrent, "cuCtxPopCurrent_v2", "cuCtxPopCurrent"},
        {(void **)&cu.EventCreate, "cuEventCreate", NULL},
        {(void **)&cu.EventDestroy, "cuEventDestroy_v2", "cuEventDestroy"},
        {(void **)&cu.EventRecord, "cuEventRecord", NULL},
        {(void **)&cu.EventQuery, "cuEventQuery", NULL},
        {(void **)&cu.EventSynchronize, "cuEventSynchronize", NULL},
        {(void **)&cu.EventElapsedTime, "cuEventElapsedTime", NULL},
        {(void **)&cu.GetErrorName, "cuGetErrorName", NULL},
    };
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        *want[i].slot = lookup(lib, want[i].name, want[i].fallback);
        if (*want[i].slot == NULL) {
            PyErr_Format(PyExc_OSError, "libcuda.so.1 has no %s", want[i].name);
            return -1;
        }
    }
    cu.loaded = 1;
    return 0;
}

static PyObject *cuda_error(CUresult r, const char *what) {
    const char *name = NULL;
    if (cu.GetErrorName == NULL || cu.GetErrorName(r, &name) != CUDA_SUCCESS || name == NULL) name = "unknown error";
    PyErr_Format(PyExc_RuntimeError, "phase-timer: %s failed: %s (%d)", what, name, r);
    return NULL;
}

typedef struct {
    PyObject_HEAD
    CUdevice device;
    int has_ctx;
    CUcontext ctx;          /* the device's primary context: the one the CUDA runtime (torch) uses */
    CUevent *events;        /* every event created; a mark is an index into this */
    Py_ssize_t n_events, cap;
    Py_ssize_t *free;       /* slots of events back in the pool */
    Py_ssize_t n_free;
    unsigned char *pooled;  /* per slot: 1 while in the pool (catches a double release) */
    PyObject *raw_stream;   /* torch._C._cuda_getCurrentRawStream */
    PyObject *index;        /* its argument: the device index */
    uintptr_t stream;       /* the stream the last mark went to */
    Py_ssize_t stream_epoch;
} Clock;

/* Make the primary context current on this thread if it is not (a thread the
 * runtime never touched).  *pushed says whether pop_ctx must undo it. */
static int push_ctx(Clock *self, int *pushed) {
    CUcontext cur = NULL;
    *pushed = 0;
    CUresult r = cu.CtxGetCurrent(&cur);
    if (r != CUDA_SUCCESS) { cuda_error(r, "cuCtxGetCurrent"); return -1; }
    if (cur == self->ctx) return 0;
    r = cu.CtxPushCurrent(self->ctx);
    if (r != CUDA_SUCCESS) { cuda_error(r, "cuCtxPushCurrent"); return -1; }
    *pushed = 1;
    return 0;
}

static void pop_ctx(int pushed) {
    CUcontext ignored;
    if (pushed) cu.CtxPopCurrent(&ignored);
}

static int Clock_init(Clock *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"device_index", "raw_stream", NULL};
    int index;
    PyObject *raw_stream;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iO", kwlist, &index, &raw_stream)) return -1;
    if (!PyCallable_Check(raw_stream)) {
        PyErr_SetString(PyExc_TypeError, "raw_stream must be callable (device index -> stream handle)");
        return -1;
    }
    if (self->has_ctx) {
        PyErr_SetString(PyExc_RuntimeError, "Clock.__init__ called twice");
        return -1;
    }
    if (load_driver() < 0) return -1;
    CUresult r = cu.Init(0);
    if (r != CUDA_SUCCESS) { cuda_error(r, "cuInit"); return -1; }
    r = cu.DeviceGet(&self->device, index);
    if (r != CUDA_SUCCESS) { cuda_error(r, "cuDeviceGet"); return -1; }
    r = cu.PrimaryCtxRetain(&self->ctx, self->device);
    if (r != CUDA_SUCCESS) { cuda_error(r, "cuDevicePrimaryCtxRetain"); return -1; }
    self->has_ctx = 1;
    self->index = PyLong_FromLong(index);
    if (self->index == NULL) return -1;
    Py_INCREF(raw_stream);
    self->raw_stream = raw_stream;
    PyObject *h = PyObject_CallOneArg(raw_stream, self->index);
    if (h == NULL) return -1;
    self->stream = (uintptr_t)PyLong_AsVoidPtr(h);
    Py_DECREF(h);
    if (PyErr_Occurred()) return -1;
    return 0;
}

static void Clock_dealloc(Clock *self) {
    if (self->has_ctx && self->n_events > 0) {
        int pushed = 0;
        CUcontext cur = NULL;
        /* At interpreter exit the driver may be gone: errors are ignored. */
        if (cu.CtxGetCurrent(&cur) == CUDA_SUCCESS && cur != self->ctx && cu.CtxPushCurrent(self->ctx) == CUDA_SUCCESS)
            pushed = 1;
        for (Py_ssize_t i = 0; i < self->n_events; i++) cu.EventDestroy(self->events[i]);
        pop_ctx(pushed);
    }
    if (self->has_ctx) cu.PrimaryCtxRelease(self->device);
    PyMem_Free(self->events);
    PyMem_Free(self->free);
    PyMem_Free(self->pooled);
    Py_XDECREF(self->raw_stream);
    Py_XDECREF(self->index);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t new_event(Clock *self) {
    if (self->n_events == self->cap) {
        Py_ssize_t cap = self->cap ? self->cap * 2 : 64;
        CUevent *events = PyMem_Realloc(self->events, cap * sizeof(CUevent));
        if (events == NULL) { PyErr_NoMemory(); return -1; }
        self->events = events;
        Py_ssize_t *free_ = PyMem_Realloc(self->free, cap * sizeof(Py_ssize_t));
        if (free_ == NULL) { PyErr_NoMemory(); return -1; }
        self->free = free_;
        unsigned char *pooled = PyMem_Realloc(self->pooled, cap);
        if (pooled == NULL) { PyErr_NoMemory(); return -1; }
        self->pooled = pooled;
        self->cap = cap;
    }
    int pushed;
    if (push_ctx(self, &pushed) < 0) return -1;
    CUresult r = cu.EventCreate(&self->events[self->n_events], CU_EVENT_DEFAULT);
    pop_ctx(pushed);
    if (r != CUDA_SUCCESS) { cuda_error(r, "cuEventCreate"); return -1; }
    self->pooled[self->n_events] = 0;
    return self->n_events++;
}

static int slot_of(Clock *self, PyObject *mark, Py_ssize_t *slot) {
    Py_ssize_t i = PyLong_AsSsize_t(mark);
    if (i == -1 && PyErr_Occurred()) return -1;
    if (i < 0 || i >= self->n_events) {
        PyErr_Format(PyExc_ValueError, "not a mark of this clock: %zd", i);
        return -1;
    }
    *slot = i;
    return 0;
}

static void put_back(Clock *self, Py_ssize_t slot) {
    self->pooled[slot] = 1;
    self->free[self->n_free++] = slot;
}

/* mark() -> int: an event recorded now on the device's current stream. */
static PyObject *Clock_mark(Clock *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->has_ctx || self->raw_stream == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Clock not initialized");
        return NULL;
    }
    PyObject *h = PyObject_CallOneArg(self->raw_stream, self->index);  /* ~0.1 us: an int, no stream object */
    if (h == NULL) return NULL;
    uintptr_t stream = (uintptr_t)PyLong_AsVoidPtr(h);
    Py_DECREF(h);
    if (stream == 0 && PyErr_Occurred()) return NULL;
    if (stream != self->stream) {
        self->stream = stream;
        self->stream_epoch++;
    }
    Py_ssize_t slot;
    if (self->n_free > 0) {
        slot = self->free[--self->n_free];
        self->pooled[slot] = 0;
    } else if ((slot = new_event(self)) < 0) {
        return NULL;
    }
    CUevent ev = self->events[slot];  /* read under the GIL: another thread may grow the array */
    /* The stream handle 0 (torch's default stream) means the current context's
     * legacy stream, hence the context check.  The GIL is released around the
     * record, as torch does: it only writes a command for the device, but it can
     * block while the driver's command queue is full. */
    int pushed;
    if (push_ctx(self, &pushed) < 0) { put_back(self, slot); return NULL; }
    CUresult r;
    Py_BEGIN_ALLOW_THREADS
    r = cu.EventRecord(ev, (CUstream)stream);
    Py_END_ALLOW_THREADS
    pop_ctx(pushed);
    if (r != CUDA_SUCCESS) {
        put_back(self, slot);
        return cuda_error(r, "cuEventRecord");
    }
    return PyLong_FromSsize_t(slot);
}

/* done(mark) -> bool, never waits. */
static PyObject *Clock_done(Clock *self, PyObject *mark) {
    Py_ssize_t slot;
    int pushed;
    if (slot_of(self, mark, &slot) < 0 || push_ctx(self, &pushed) < 0) return NULL;
    CUresult r = cu.EventQuery(self->events[slot]);
    pop_ctx(pushed);
    if (r == CUDA_SUCCESS) Py_RETURN_TRUE;
    if (r == CUDA_ERROR_NOT_READY) Py_RETURN_FALSE;
    return cuda_error(r, "cuEventQuery");
}

/* wait(mark): HOST-DEVICE SYNC.  Only Resolver.drain() calls it, at the end of training. */
static PyObject *Clock_wait(Clock *self, PyObject *mark) {
    Py_ssize_t slot;
    int pushed;
    if (slot_of(self, mark, &slot) < 0 || push_ctx(self, &pushed) < 0) return NULL;
    CUevent ev = self->events[slot];  /* read under the GIL */
    CUresult r;
    Py_BEGIN_ALLOW_THREADS
    r = cu.EventSynchronize(ev);
    Py_END_ALLOW_THREADS
    pop_ctx(pushed);
    if (r != CUDA_SUCCESS) return cuda_error(r, "cuEventSynchronize");
    Py_RETURN_NONE;
}

static int elapsed(Clock *self, Py_ssize_t a, Py_ssize_t b, float *ms) {
    CUresult r = cu.EventElapsedTime(ms, self->events[a], self->events[b]);
    if (r != CUDA_SUCCESS) { cuda_error(r, "cuEventElapsedTime"); return -1; }
    return 0;
}

/* elapsed_ms(start, end) -> float: both marks done (the caller checked). */
static PyObject *Clock_elapsed_ms(Clock *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "elapsed_ms(start, end)"); return NULL; }
    Py_ssize_t a, b;
    float ms;
    int pushed, bad;
    if (slot_of(self, args[0], &a) < 0 || slot_of(self, args[1], &b) < 0 || push_ctx(self, &pushed) < 0) return NULL;
    bad = elapsed(self, a, b, &ms) < 0;
    pop_ctx(pushed);
    return bad ? NULL : PyFloat_FromDouble(ms);
}

/* spans(marks) -> list of floats: marks[i] -> marks[i+1], in one call. */
static PyObject *Clock_spans(Clock *self, PyObject *marks) {
    PyObject *seq = PySequence_Fast(marks, "spans() takes a list of marks");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n > 0 ? n - 1 : 0);
    Py_ssize_t prev, cur;
    int pushed = 0;
    if (out == NULL || (n > 0 && slot_of(self, items[0], &prev) < 0) || push_ctx(self, &pushed) < 0) goto fail;
    for (Py_ssize_t i = 1; i < n; i++) {
        float ms;
        if (slot_of(self, items[i], &cur) < 0 || elapsed(self, prev, cur, &ms) < 0) goto fail;
        PyObject *f = PyFloat_FromDouble(ms);
        if (f == NULL) goto fail;
        PyList_SET_ITEM(out, i - 1, f);
        prev = cur;
    }
    pop_ctx(pushed);
    Py_DECREF(seq);
    return out;
fail:
    pop_ctx(pushed);
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

/* release(marks): their events go back to the pool.  All are checked first:
 * an error (a foreign or twice-released mark) releases none. */
static PyObject *Clock_release(Clock *self, PyObject *marks) {
    PyObject *seq = PySequence_Fast(marks, "release() takes a list of marks");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t i, slot;
    for (i = 0; i < n; i++) {
        if (slot_of(self, items[i], &slot) < 0) goto fail;
        if (self->pooled[slot] == 2 || self->pooled[slot] == 1) {
            PyErr_Format(PyExc_ValueError, "mark %zd was released twice", slot);
            goto fail;
        }
        self->pooled[slot] = 2;  /* seen in this list */
    }
    for (i = 0; i < n; i++) {
        slot = PyLong_AsSsize_t(items[i]);
        put_back(self, slot);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    for (Py_ssize_t k = 0; k < i; k++) {  /* undo the marks of this list */
        Py_ssize_t s2 = PyLong_AsSsize_t(items[k]);
        if (self->pooled[s2] == 2) self->pooled[s2] = 0;
    }
    Py_DECREF(seq);
    return NULL;
}

static PyObject *Clock_live_marks(Clock *self, void *closure) {
    return PyLong_FromSsize_t(self->n_events - self->n_free);
}

static PyObject *Clock_stream_epoch(Clock *self, void *closure) {
    return PyLong_FromSsize_t(self->stream_epoch);
}

static PyObject *Clock_created(Clock *self, void *closure) {
    return PyLong_FromSsize_t(self->n_events);
}

static PyMethodDef Clock_methods[] = {
    {"mark", (PyCFunction)Clock_mark, METH_NOARGS, "Record an event on the current stream; returns the mark."},
    {"done", (PyCFunction)Clock_done, METH_O, "Whether the device has reached the mark (never waits)."},
    {"wait", (PyCFunction)Clock_wait, METH_O, "Block until the device reaches the mark (end of training only)."},
    {"elapsed_ms", (PyCFunction)(void (*)(void))Clock_elapsed_ms, METH_FASTCALL, "Milliseconds between two done marks."},
    {"spans", (PyCFunction)Clock_spans, METH_O, "Milliseconds between consecutive done marks, as a list."},
    {"release", (PyCFunction)Clock_release, METH_O, "Give marks' events back to the pool."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Clock_getset[] = {
    {"live_marks", (getter)Clock_live_marks, NULL, "Events out of the pool.", NULL},
    {"stream_epoch", (getter)Clock_stream_epoch, NULL, "Bumped when marks start going to another stream.", NULL},
    {"created", (getter)Clock_created, NULL, "Events created so far.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ClockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "phase_timer._native.Clock",
    .tp_basicsize = sizeof(Clock),
    .tp_dealloc = (destructor)Clock_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Timing events of one CUDA device, pooled, on the driver API.",
    .tp_methods = Clock_methods,
    .tp_getset = Clock_getset,
    .tp_init = (initproc)Clock_init,
    .tp_new = PyType_GenericNew,
};

/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as TFRecord files use it. */
static uint32_t crc_table[256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_table[i] = c;
    }
}

/* masked_crc32c(data: bytes-like) -> int, the masking TFRecord applies to stored CRCs. */
static PyObject *masked_crc32c(PyObject *module, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *p = view.buf;
    uint32_t c = 0xFFFFFFFFu;
    for (Py_ssize_t i = 0; i < view.len; i++) c = crc_table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    PyBuffer_Release(&view);
    c ^= 0xFFFFFFFFu;
    c = ((c >> 15) | (c << 17)) + 0xA282EAD8u;
    return PyLong_FromUnsignedLong(c);
}

static PyMethodDef module_methods[] = {
    {"masked_crc32c", masked_crc32c, METH_O, "The masked CRC-32C of a TFRecord (TensorBoard event file) record."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "phase-timer's hot spots in C (see _native.c).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    crc_init();
    if (PyType_Ready(&ClockType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&ClockType);
    if (PyModule_AddObject(m, "Clock", (PyObject *)&ClockType) < 0) {
        Py_DECREF(&ClockType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
