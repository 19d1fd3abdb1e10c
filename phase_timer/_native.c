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
#include <structmember.h>
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

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
    CUresult (*CtxSetCurrent)(CUcontext);
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
        {(void **)&cu.CtxSetCurrent, "cuCtxSetCurrent", NULL},
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

/* An event recorded now on the device's current stream: its slot, or -1 with an exception set. */
static Py_ssize_t mark_slot(Clock *self) {
    if (!self->has_ctx || self->raw_stream == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Clock not initialized");
        return -1;
    }
    PyObject *h = PyObject_CallOneArg(self->raw_stream, self->index);  /* ~0.1 us: an int, no stream object */
    if (h == NULL) return -1;
    uintptr_t stream = (uintptr_t)PyLong_AsVoidPtr(h);
    Py_DECREF(h);
    if (stream == 0 && PyErr_Occurred()) return -1;
    if (stream != self->stream) {
        self->stream = stream;
        self->stream_epoch++;
    }
    Py_ssize_t slot;
    if (self->n_free > 0) {
        slot = self->free[--self->n_free];
        self->pooled[slot] = 0;
    } else if ((slot = new_event(self)) < 0) {
        return -1;
    }
    CUevent ev = self->events[slot];  /* read under the GIL: another thread may grow the array */
    /* The stream handle 0 (torch's default stream) means the current context's
     * legacy stream, hence the context check.  The GIL is held through the record,
     * as through torch's own kernel launches: it only writes a command for the device
     * (it can block while the driver's command queue is full, and so does every launch
     * of the step), and no release and re-take of the GIL, six times a step. */
    int pushed;
    if (push_ctx(self, &pushed) < 0) { put_back(self, slot); return -1; }
    CUresult r = cu.EventRecord(ev, (CUstream)stream);
    pop_ctx(pushed);
    if (r != CUDA_SUCCESS) {
        put_back(self, slot);
        cuda_error(r, "cuEventRecord");
        return -1;
    }
    return slot;
}

/* mark() -> int: an event recorded now on the device's current stream. */
static PyObject *Clock_mark(Clock *self, PyObject *Py_UNUSED(ignored)) {
    Py_ssize_t slot = mark_slot(self);
    return slot < 0 ? NULL : PyLong_FromSsize_t(slot);
}

/* 1 when the device has passed the slot's event, 0 when not yet, -1 on an error.  Never waits. */
static int query_slot(Clock *self, Py_ssize_t slot) {
    int pushed;
    if (push_ctx(self, &pushed) < 0) return -1;
    CUresult r = cu.EventQuery(self->events[slot]);
    pop_ctx(pushed);
    if (r == CUDA_SUCCESS) return 1;
    if (r == CUDA_ERROR_NOT_READY) return 0;
    cuda_error(r, "cuEventQuery");
    return -1;
}

/* done(mark) -> bool, never waits. */
static PyObject *Clock_done(Clock *self, PyObject *mark) {
    Py_ssize_t slot;
    if (slot_of(self, mark, &slot) < 0) return NULL;
    int done = query_slot(self, slot);
    if (done < 0) return NULL;
    return PyBool_FromLong(done);
}

/* HOST-DEVICE SYNC: blocks until the device reaches the slot's event.  Only the
 * end-of-training drain calls it (Resolver.drain / Steps.drain). */
static int wait_slot(Clock *self, Py_ssize_t slot) {
    int pushed;
    if (push_ctx(self, &pushed) < 0) return -1;
    CUevent ev = self->events[slot];  /* read under the GIL */
    CUresult r;
    Py_BEGIN_ALLOW_THREADS
    r = cu.EventSynchronize(ev);
    Py_END_ALLOW_THREADS
    pop_ctx(pushed);
    if (r != CUDA_SUCCESS) { cuda_error(r, "cuEventSynchronize"); return -1; }
    return 0;
}

/* wait(mark): HOST-DEVICE SYNC, see wait_slot. */
static PyObject *Clock_wait(Clock *self, PyObject *mark) {
    Py_ssize_t slot;
    if (slot_of(self, mark, &slot) < 0 || wait_slot(self, slot) < 0) return NULL;
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

/* Milliseconds between consecutive slots (all done): out[i] = slots[i] -> slots[i+1]. */
static int spans_slots(Clock *self, const int64_t *slots, Py_ssize_t n, double *out) {
    int pushed;
    if (push_ctx(self, &pushed) < 0) return -1;
    for (Py_ssize_t i = 1; i < n; i++) {
        float ms;
        if (elapsed(self, (Py_ssize_t)slots[i - 1], (Py_ssize_t)slots[i], &ms) < 0) { pop_ctx(pushed); return -1; }
        out[i - 1] = ms;
    }
    pop_ctx(pushed);
    return 0;
}

/* Slots the engine owns back to the pool (they came from mark_slot, each once). */
static void release_slots(Clock *self, const int64_t *slots, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) put_back(self, (Py_ssize_t)slots[i]);
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

/*
 * Steps: phase-timer's per-step engine in C -- the open record, the FIFO of closed
 * records waiting for the device, their resolution, and the logging window's
 * columns -- so that a training step costs Python nothing but the few calls the
 * hooks make (open, switch, close, poll).  Same semantics as the Python engine
 * (phase_timer/timing/engine.py: Recorder + Resolver + Window), which tests compare it to.
 *
 * Marks are int64: event slots of a native Clock, or host nanoseconds from a
 * callable (time.perf_counter_ns; tests pass a fake).  Phase names are interned
 * to small ids.  Python sees results only when it has something to do with them:
 * poll() returns None until a window is complete (or, with per_step, a step is).
 *
 * Host-device synchronization: only drain() waits (wait_slot), at the end of training.
 */
typedef struct {
    int64_t step;
    Py_ssize_t n, cap;      /* marks: n; labels: n - 1 */
    Py_ssize_t end;         /* the step's device part ends at marks[end]; later spans are between steps (-1: none) */
    int64_t *marks;
    int32_t *labels;
    Py_ssize_t nh, hcap;    /* host-clock phases, already in ms */
    int32_t *hid;
    double *hms;
    int single;             /* every mark on one stream: the last done means all are */
    Py_ssize_t epoch;       /* the clock's stream epoch at the open: equal in two single records, one stream */
    CUevent *ev;            /* threaded: the marks' events, copied at the close (the pool's array may move) */
    double *span;           /* threaded: the n - 1 spans, as the resolver thread read them */
    int64_t seq;            /* its number, in the order records close (from 1) */
    int64_t prev;           /* the seq of the record closed just before it opened, nothing untimed between (-1: none) */
    double gap;             /* threaded: ms from that record's last mark to its first, as the thread read it (-1: none) */
} Rec;

#define ID_CACHE 8

typedef struct {
    PyObject_HEAD
    Clock *clock;           /* device marks, or NULL: host marks from now() */
    PyObject *now;
    PyObject *ids;          /* phase name -> id */
    PyObject *names;        /* id -> phase name */
    int32_t step_id, period_id;
    int32_t between_id, paused_id;  /* what an end() runs into by default; `paused` spans are dropped */
    int32_t fetch_id;       /* a micro-batch's fetch: no phase's, not the step's, the period's (-1: none) */
    PyObject *after_end;    /* name -> the name its spans take after the step's end (phases.after_end), or NULL */
    int32_t *after;         /* per id: the id its spans take after the step's end (itself without after_end) */
    PyObject *part_of;      /* name -> the phase it is part of, or None (phases.part_of), or NULL */
    int32_t *parent;        /* per id: the phase its spans in the step also count to ("of which": -1 none) */
    int32_t pre_end;        /* the label that ran into the last end(): a second end() continues it */
    int64_t seq, last;      /* records closed; the seq of the last one while nothing untimed came after it (-1) */
    int has_held;           /* the last resolved record's last mark is kept: the next one's period starts there */
    int64_t held, held_seq; /* that mark, and its record's seq */
    Py_ssize_t held_epoch;  /* and its stream epoch (-1: the record was not on one stream) */
    Rec cur;
    int open;
    int32_t current;
    Py_ssize_t epoch;
    Rec *ring;              /* pending records, oldest at head */
    Py_ssize_t ring_cap, head, count;
    Py_ssize_t max_pending, lag, max_per_poll;
    int blocked;            /* the last poll stopped at a record the device had not finished */
    int per_step;
    int64_t window;
    /* the window being filled */
    int has_win;
    int64_t win_key, win_last, win_steps;
    Py_ssize_t ncols;       /* ids with column storage */
    double **col;
    Py_ssize_t *col_n, *col_cap;
    int32_t *col_order;     /* ids in first-seen order this window */
    Py_ssize_t n_order;
    unsigned char *in_win;
    /* one step's resolution */
    double *acc, *spans;
    Py_ssize_t spans_cap;
    unsigned char *seen;
    int32_t *touched;
    PyObject *out;          /* results for Python, or NULL */
    /* threaded (device clock): a thread of its own, which never takes the GIL, asks the device whether the
     * oldest records are done and reads their spans; poll() then only takes what it resolved.  Under `mu`:
     * `head`, `count` and `resolved` (records at the head whose spans are read), `stop`, `thread_err`. */
    int threaded;
    int running;            /* the thread is started (in this process) */
    int sync_made;          /* mu and wake are made (a threaded engine's, kept after a fall back to inline) */
    unsigned owner;         /* fork_gen + 1 where it was started (0: never): a forked child never joins it */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t wake;    /* signalled by a close that finds a backlog of `wake_at` or more (a very short step) */
    Py_ssize_t wake_at;
    int stop;
    Py_ssize_t resolved;
    CUresult thread_err;    /* a driver error in the thread (it stops): raised by the next poll() */
    const char *thread_err_what;
    PyObject *id_key[ID_CACHE];  /* known_id's cache: names (borrowed from `names`) and their ids */
    int32_t id_val[ID_CACHE];
    int n_cached;
} Steps;

static int grow(void **p, Py_ssize_t *cap, Py_ssize_t need, size_t size) {
    if (need <= *cap) return 0;
    Py_ssize_t c = *cap ? *cap : 8;
    while (c < need) c *= 2;
    void *q = PyMem_Realloc(*p, c * size);
    if (q == NULL) { PyErr_NoMemory(); return -1; }
    *p = q;
    *cap = c;
    return 0;
}

static int rec_reserve(Rec *r, Py_ssize_t n) {
    if (n <= r->cap) return 0;
    Py_ssize_t cap = r->cap;
    if (grow((void **)&r->marks, &cap, n, sizeof(int64_t)) < 0) return -1;
    cap = r->cap;
    if (grow((void **)&r->labels, &cap, n, sizeof(int32_t)) < 0) return -1;
    cap = r->cap;
    if (grow((void **)&r->ev, &cap, n, sizeof(CUevent)) < 0) return -1;
    cap = r->cap;
    if (grow((void **)&r->span, &cap, n, sizeof(double)) < 0) return -1;
    r->cap = cap;
    return 0;
}

static void rec_free(Rec *r) {
    PyMem_Free(r->marks);
    PyMem_Free(r->labels);
    PyMem_Free(r->ev);
    PyMem_Free(r->span);
    PyMem_Free(r->hid);
    PyMem_Free(r->hms);
}

/* Column and scratch storage for ids < n. */
static int ensure_ids(Steps *self, Py_ssize_t n) {
    if (n <= self->ncols) return 0;
    Py_ssize_t c = self->ncols ? self->ncols : 16;
    while (c < n) c *= 2;
    void *p;
#define GROW(field, type)                                                         \
    p = PyMem_Realloc(self->field, c * sizeof(type));                             \
    if (p == NULL) { PyErr_NoMemory(); return -1; }                               \
    self->field = p;
    GROW(col, double *) GROW(col_n, Py_ssize_t) GROW(col_cap, Py_ssize_t) GROW(col_order, int32_t)
    GROW(in_win, unsigned char) GROW(acc, double) GROW(seen, unsigned char) GROW(touched, int32_t)
    GROW(after, int32_t) GROW(parent, int32_t)
#undef GROW
    for (Py_ssize_t i = self->ncols; i < c; i++) {
        self->col[i] = NULL;
        self->col_n[i] = self->col_cap[i] = 0;
        self->in_win[i] = self->seen[i] = 0;
        self->after[i] = (int32_t)i;
        self->parent[i] = -1;
        self->acc[i] = 0.0;
    }
    self->ncols = c;
    return 0;
}

/* The id of a name known already (the dict's; -1 with an exception set, or -2 when unknown); the object itself,
 * when it is the dict's key (the boundaries' built-in phases always are), cached by identity: no dict lookup
 * at the next call, several a step.  The key is held by `names`. */
static int32_t known_id(Steps *self, PyObject *name) {
    for (int k = 0; k < self->n_cached; k++)
        if (self->id_key[k] == name) return self->id_val[k];
    PyObject *v = PyDict_GetItemWithError(self->ids, name);
    if (v == NULL) return PyErr_Occurred() ? -1 : -2;
    int32_t id = (int32_t)PyLong_AsLong(v);
    if (self->n_cached < ID_CACHE && PyList_GET_ITEM(self->names, id) == name) {
        self->id_key[self->n_cached] = name;
        self->id_val[self->n_cached++] = id;
    }
    return id;
}

/* A new id for `name` (not known yet), its spans after the end its own; -1 with an exception set. */
static int32_t new_id(Steps *self, PyObject *name) {
    Py_ssize_t id = PyList_GET_SIZE(self->names);
    if (ensure_ids(self, id + 1) < 0) return -1;
    PyObject *i = PyLong_FromSsize_t(id);
    if (i == NULL) return -1;
    int bad = PyDict_SetItem(self->ids, name, i) < 0 || PyList_Append(self->names, name) < 0;
    Py_DECREF(i);
    return bad ? -1 : (int32_t)id;
}

/* The id of a phase name (a str), interned on first sight; -1 with an exception set.  A new name asks
 * `after_end` (once) what its spans after the step's end are called, and interns that too: the rule is
 * Python's, the one PyEngine applies at each span, so the two engines cannot name them apart. */
static int32_t phase_id(Steps *self, PyObject *name) {
    int32_t known = known_id(self, name);
    if (known != -2) return known;
    if (!PyUnicode_Check(name)) {
        PyErr_Format(PyExc_TypeError, "a phase name must be a str, got %R", name);
        return -1;
    }
    PyObject *later = NULL;
    if (self->after_end != NULL) {  /* asked first: a failure leaves no name half made */
        later = PyObject_CallOneArg(self->after_end, name);
        if (later == NULL) return -1;
        if (!PyUnicode_Check(later)) {
            PyErr_Format(PyExc_TypeError, "after_end(%R) must return a str, got %R", name, later);
            Py_DECREF(later);
            return -1;
        }
    }
    int32_t id = new_id(self, name), lid = id;
    if (id >= 0 && later != NULL) {
        int same = PyUnicode_Compare(later, name);
        if (same == -1 && PyErr_Occurred()) lid = -1;
        else if (same != 0) {
            PyObject *v = PyDict_GetItemWithError(self->ids, later);
            lid = v != NULL ? (int32_t)PyLong_AsLong(v) : PyErr_Occurred() ? -1 : new_id(self, later);
        }
    }
    Py_XDECREF(later);
    if (id < 0 || lid < 0) return -1;
    self->after[id] = lid;
    if (self->part_of != NULL) {  /* "backward.comm_wait": its spans inside the step are backward's too */
        PyObject *whole = PyObject_CallOneArg(self->part_of, name);
        if (whole == NULL) return -1;
        int32_t pid = -1;
        if (whole != Py_None) {
            if (!PyUnicode_Check(whole)) {
                PyErr_Format(PyExc_TypeError, "part_of(%R) must return a str or None, got %R", name, whole);
                Py_DECREF(whole);
                return -1;
            }
            pid = phase_id(self, whole);  /* a whole phase, interned with its own rules (no part of a part) */
            if (pid < 0) pid = -2;
        }
        Py_DECREF(whole);
        if (pid < -1) return -1;
        self->parent[id] = pid;
    }
    return id;
}

/* The ids of two phase names, taken as new references (either may be NULL: an error already set). */
static int two_ids(Steps *self, PyObject *a, PyObject *b, int32_t *ia, int32_t *ib) {
    if (a == NULL || b == NULL) { Py_XDECREF(a); Py_XDECREF(b); return -1; }
    *ia = phase_id(self, a);
    *ib = phase_id(self, b);
    Py_DECREF(a);
    Py_DECREF(b);
    return *ia < 0 || *ib < 0 ? -1 : 0;
}

/* A mark now: an event slot, or host nanoseconds.  0 on success. */
static int take_mark(Steps *self, int64_t *mark) {
    if (self->clock != NULL) {
        Py_ssize_t slot = mark_slot(self->clock);
        if (slot < 0) return -1;
        *mark = slot;
        return 0;
    }
    PyObject *t = PyObject_CallNoArgs(self->now);
    if (t == NULL) return -1;
    long long ns = PyLong_AsLongLong(t);
    Py_DECREF(t);
    if (ns == -1 && PyErr_Occurred()) return -1;
    *mark = ns;
    return 0;
}

static void give_back(Steps *self, Rec *r) {
    if (self->clock != NULL) release_slots(self->clock, r->marks, r->n);
    r->n = 0;
}

/* The mark kept for the next record's period back to the pool (none follows, or the next one has its own). */
static void drop_held(Steps *self) {
    if (self->has_held && self->clock != NULL) release_slots(self->clock, &self->held, 1);
    self->has_held = 0;
}

static Py_ssize_t clock_epoch(Steps *self) { return self->clock != NULL ? self->clock->stream_epoch : 0; }

/* -- the resolver thread (threaded engines) ------------------------------------------------------------
 * It never takes the GIL and touches no Python object: only the ring's records, whose events were copied
 * at their close, and `head`, `count`, `resolved` under `mu`.  It works in bursts: once THREAD_BATCH
 * records it may ask are waiting (never the newest `lag`), or the oldest has waited THREAD_WAIT_US, it asks
 * the newest of them (on one stream, that answers for all; else each, oldest first, up to the first not
 * done) and reads their spans back to back.  A driver call from this thread makes the training thread's next
 * ones slower (they share the driver's state: measured, docs/benchmarks.md), so it makes them rarely and
 * together.  Between bursts it sleeps (THREAD_NAP_US, or until a close finds a backlog of half the bound: a hot
 * loop's steps of a few µs).  No wait on the device anywhere: cuEventQuery and cuEventElapsedTime
 * return at once. */
#define THREAD_BATCH 8
#define THREAD_NAP_US 1000
#define THREAD_WAIT_US 20000

/* The thread's mutex and condition (the condition on the monotonic clock): 0, or -1 with an exception set. */
static int thread_sync_init(Steps *self) {
    pthread_condattr_t attr;
    int bad = pthread_mutex_init(&self->mu, NULL) != 0 || pthread_condattr_init(&attr) != 0;
    if (!bad) {
        bad = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) != 0 || pthread_cond_init(&self->wake, &attr) != 0;
        pthread_condattr_destroy(&attr);
    }
    if (bad) PyErr_SetString(PyExc_RuntimeError, "phase-timer: the resolver thread's mutex could not be made");
    else self->sync_made = 1;
    return bad ? -1 : 0;
}

/* Sleep up to `us` (mu held), or less when a close signals a backlog. */
static void nap_or_wake(Steps *self, long us) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_nsec += (us % 1000000) * 1000;
    ts.tv_sec += us / 1000000 + ts.tv_nsec / 1000000000;
    ts.tv_nsec %= 1000000000;
    pthread_cond_timedwait(&self->wake, &self->mu, &ts);
}

static void nap(long us) {
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

/* 1 when the event is done, 0 if not, or a driver error (negated CUresult) */
static int ev_done(CUevent ev) {
    CUresult q = cu.EventQuery(ev);
    return q == CUDA_SUCCESS ? 1 : q == CUDA_ERROR_NOT_READY ? 0 : -(int)q;
}

/* 1 when the record's events are done, 0 if not, or a driver error (negated CUresult) */
static int rec_done_ev(Rec *r) {
    for (Py_ssize_t i = r->single ? r->n - 1 : 0; i < r->n; i++) {
        int d = ev_done(r->ev[i]);
        if (d != 1) return d;
    }
    return 1;
}

/* The ring's records [from, from + n), n >= 2: the newest of them when all are on one stream (one stream
 * completes in order: its last mark done, all are), else NULL.  No driver call; the resolver thread's too. */
static Rec *one_stream(Steps *self, Py_ssize_t from, Py_ssize_t n) {
    if (n < 2) return NULL;
    Rec *newest = &self->ring[(from + n - 1) % self->ring_cap];
    for (Py_ssize_t k = 0; k < n; k++) {
        Rec *r = &self->ring[(from + k) % self->ring_cap];
        if (!r->single || r->epoch != newest->epoch) return NULL;
    }
    return newest;
}

static void *resolver_main(void *arg) {
    Steps *self = arg;
    long waited = 0;
    CUevent prev_ev = NULL;  /* the last record it read: its last event, seq and epoch (the next one's gap) */
    int64_t prev_seq = -1;
    Py_ssize_t prev_epoch = -1;
    CUresult err = cu.CtxSetCurrent(self->clock->ctx);
    const char *what = "cuCtxSetCurrent";
    while (err == CUDA_SUCCESS) {
        pthread_mutex_lock(&self->mu);
        int stop = self->stop;
        Py_ssize_t first = self->resolved, waiting = self->count - self->lag - self->resolved;
        Py_ssize_t head = self->head;
        int idle = !stop && (waiting <= 0 || (waiting < THREAD_BATCH && waited < THREAD_WAIT_US));
        if (idle) nap_or_wake(self, THREAD_NAP_US);
        pthread_mutex_unlock(&self->mu);
        if (stop) break;
        if (idle) {
            waited = waiting > 0 ? waited + THREAD_NAP_US : 0;
            continue;
        }
        /* The records [first, first + waiting) stay where they are until poll() takes them, after `resolved`
         * says their spans are in; poll() moves `head` only past resolved ones. */
#define AT(k) (&self->ring[(head + first + (k)) % self->ring_cap])
        Rec *newest = one_stream(self, head + first, waiting);
        Py_ssize_t known = 0, k;
        if (newest != NULL) {
            int d = ev_done(newest->ev[newest->n - 1]);
            if (d < 0) { err = (CUresult)(-d); what = "cuEventQuery"; break; }
            if (d) known = waiting;
        }
        Py_ssize_t done = 0;
        for (k = 0; k < waiting; k++) {
            Rec *r = AT(k);
            if (k >= known) {
                int d = rec_done_ev(r);
                if (d < 0) { err = (CUresult)(-d); what = "cuEventQuery"; break; }
                if (!d) break;
            }
            for (Py_ssize_t i = 1; i < r->n && err == CUDA_SUCCESS; i++) {
                float ms;
                err = cu.EventElapsedTime(&ms, r->ev[i - 1], r->ev[i]);
                r->span[i - 1] = ms;
            }
            /* The gap from the record it follows (its last event stays out of the pool until this record is
             * resolved: resolve() keeps it), when both are on one stream. */
            r->gap = -1.0;
            if (err == CUDA_SUCCESS && prev_ev != NULL && r->prev >= 0 && r->prev == prev_seq && r->single &&
                prev_epoch == r->epoch) {
                float ms;
                err = cu.EventElapsedTime(&ms, prev_ev, r->ev[0]);
                r->gap = ms;
            }
            if (err != CUDA_SUCCESS) { what = "cuEventElapsedTime"; break; }
            prev_ev = r->ev[r->n - 1];
            prev_seq = r->seq;
            prev_epoch = r->single ? r->epoch : -1;
            done++;
        }
#undef AT
        if (done) {
            pthread_mutex_lock(&self->mu);
            self->resolved += done;
            pthread_mutex_unlock(&self->mu);
        }
        waited = 0;
        if (done < waiting) nap(THREAD_NAP_US);  /* the device is behind: the rest later */
    }
    if (err != CUDA_SUCCESS) {
        pthread_mutex_lock(&self->mu);
        self->thread_err = err;
        self->thread_err_what = what;
        pthread_mutex_unlock(&self->mu);
    }
    return NULL;
}

/* Forks seen by this process (a pthread_atfork child handler): a plain load, where getpid() is a system call
 * at every close.  A forked child has a generation of its own; the thread and its mutex stay the parent's. */
static volatile unsigned fork_gen;
static void on_fork_child(void) { fork_gen++; }
#define HERE (fork_gen + 1u)

/* Start the thread if it is not running (0, or -1 with an exception set). */
static int thread_start(Steps *self) {
    if (self->running && self->owner == HERE) return 0;
    if (self->owner != 0 && self->owner != HERE && thread_sync_init(self) < 0) return -1;  /* a forked child's own */
    self->stop = 0;
    self->resolved = 0;
    self->thread_err = CUDA_SUCCESS;
    int rc = pthread_create(&self->thread, NULL, resolver_main, self);
    if (rc != 0) {
        PyErr_Format(PyExc_RuntimeError, "phase-timer: could not start the resolver thread (error %d)", rc);
        return -1;
    }
    self->running = 1;
    self->owner = HERE;
    return 0;
}

/* Stop and join the thread (the GIL released while it finishes its call).  In a forked child the thread
 * does not exist and its mutex may be held forever: nothing is touched there. */
static void thread_stop(Steps *self) {
    if (!self->running || self->owner != HERE) return;
    pthread_mutex_lock(&self->mu);
    self->stop = 1;
    pthread_cond_signal(&self->wake);
    pthread_mutex_unlock(&self->mu);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(self->thread, NULL);
    Py_END_ALLOW_THREADS
    self->running = 0;
    self->resolved = 0;  /* the records stay; drain() resolves them itself */
}

static void lock(Steps *self) { if (self->threaded) pthread_mutex_lock(&self->mu); }
static void unlock(Steps *self) { if (self->threaded) pthread_mutex_unlock(&self->mu); }

static int Steps_init(Steps *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"clock", "window", "max_pending", "lag", "max_per_poll", "per_step", "between", "paused",
                             "after_end", "threaded", "part_of", "fetch", NULL};
    PyObject *clock, *between = NULL, *paused = NULL, *after_end = NULL, *part_of = NULL, *fetch = NULL;
    long long window;
    Py_ssize_t max_pending, lag = 2, max_per_poll = 4;
    int per_step = 0, threaded = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OLn|nnpUUOpOU", kwlist, &clock, &window, &max_pending, &lag, &max_per_poll,
                                     &per_step, &between, &paused, &after_end, &threaded, &part_of, &fetch))
        return -1;
    if (self->ids != NULL) { PyErr_SetString(PyExc_RuntimeError, "Steps.__init__ called twice"); return -1; }
    if (window < 1 || max_pending < 1 || lag < 0 || max_per_poll < 1) {
        PyErr_SetString(PyExc_ValueError, "Steps: window, max_pending and max_per_poll must be >= 1, lag >= 0");
        return -1;
    }
    if (PyObject_TypeCheck(clock, &ClockType)) {
        Py_INCREF(clock);
        self->clock = (Clock *)clock;
    } else if (PyCallable_Check(clock)) {
        Py_INCREF(clock);
        self->now = clock;
    } else {
        PyErr_SetString(PyExc_TypeError, "Steps(clock): a native Clock, or a callable returning host nanoseconds");
        return -1;
    }
    self->window = window;
    self->max_pending = max_pending;
    self->lag = lag < max_pending - 1 ? lag : max_pending - 1;  /* as Resolver: min(lag, max_pending - 1) */
    self->max_per_poll = max_per_poll;
    self->per_step = per_step;
    self->ids = PyDict_New();
    self->names = PyList_New(0);
    if (self->ids == NULL || self->names == NULL) return -1;
    if (two_ids(self, PyUnicode_InternFromString("step"), PyUnicode_InternFromString("period"),
                &self->step_id, &self->period_id) < 0) return -1;
    if (after_end == Py_None) after_end = NULL;
    if (after_end != NULL && !PyCallable_Check(after_end)) {
        PyErr_SetString(PyExc_TypeError, "Steps(after_end): a callable, name -> the name of its spans after the step's end");
        return -1;
    }
    /* A module-level function (phases.after_end): Steps is no GC type, so it must not hold what holds it. */
    self->after_end = after_end;
    Py_XINCREF(after_end);
    if (part_of == Py_None) part_of = NULL;
    if (part_of != NULL && !PyCallable_Check(part_of)) {
        PyErr_SetString(PyExc_TypeError, "Steps(part_of): a callable, name -> the phase it is part of, or None");
        return -1;
    }
    self->part_of = part_of;  /* a module-level function too (phases.part_of) */
    Py_XINCREF(part_of);
    if (two_ids(self, between != NULL ? (Py_INCREF(between), between) : PyUnicode_InternFromString("between_steps"),
                paused != NULL ? (Py_INCREF(paused), paused) : PyUnicode_InternFromString("paused"),
                &self->between_id, &self->paused_id) < 0) return -1;
    self->pre_end = self->between_id;
    self->fetch_id = -1;
    if (fetch != NULL && (self->fetch_id = phase_id(self, fetch)) < 0) return -1;
    self->cur.end = -1;
    self->last = -1;
    self->ring_cap = max_pending;
    self->ring = PyMem_Calloc(max_pending, sizeof(Rec));
    if (self->ring == NULL) { PyErr_NoMemory(); return -1; }
    if (threaded && self->clock == NULL) {
        PyErr_SetString(PyExc_ValueError, "Steps: threaded needs a native Clock (host marks resolve at once)");
        return -1;
    }
    if (threaded && thread_sync_init(self) < 0) return -1;
    /* Half the bound: a step so short that the backlog reaches it within a nap (a hot loop's few µs) wakes the
     * thread; a real training step never does, and the signal (no waiter) costs nothing then. */
    self->wake_at = max_pending / 2 > THREAD_BATCH ? max_pending / 2 : THREAD_BATCH;
    self->threaded = threaded;
    return 0;
}

static void Steps_dealloc(Steps *self) {
    thread_stop(self);  /* before anything it reads goes (a no-op when none runs here) */
    if (self->sync_made && (self->owner == 0 || self->owner == HERE)) {  /* a forked child leaves the parent's alone */
        pthread_cond_destroy(&self->wake);
        pthread_mutex_destroy(&self->mu);
    }
    if (self->ring != NULL) {
        /* Pending marks go back to the pool (the clock outlives this reference). */
        for (Py_ssize_t k = 0; k < self->count; k++) give_back(self, &self->ring[(self->head + k) % self->ring_cap]);
        for (Py_ssize_t k = 0; k < self->ring_cap; k++) rec_free(&self->ring[k]);
        PyMem_Free(self->ring);
    }
    if (self->open) give_back(self, &self->cur);
    if (self->clock != NULL) drop_held(self);
    rec_free(&self->cur);
    for (Py_ssize_t i = 0; i < self->ncols; i++) PyMem_Free(self->col[i]);
    PyMem_Free(self->col); PyMem_Free(self->col_n); PyMem_Free(self->col_cap); PyMem_Free(self->col_order);
    PyMem_Free(self->in_win); PyMem_Free(self->acc); PyMem_Free(self->seen); PyMem_Free(self->touched);
    PyMem_Free(self->after);
    PyMem_Free(self->parent);
    Py_XDECREF(self->after_end);
    Py_XDECREF(self->part_of);
    PyMem_Free(self->spans);
    Py_XDECREF(self->clock);
    Py_XDECREF(self->now);
    Py_XDECREF(self->ids);
    Py_XDECREF(self->names);
    Py_XDECREF(self->out);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* open(step, phase): start a record whose first span is `phase` (an open one is dropped). */
static PyObject *Steps_open(Steps *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "open(step, phase)"); return NULL; }
    long long step = PyLong_AsLongLong(args[0]);
    if (step == -1 && PyErr_Occurred()) return NULL;
    int32_t id = phase_id(self, args[1]);
    if (id < 0 || rec_reserve(&self->cur, 8) < 0) return NULL;
    if (self->open) {  /* dropped */
        give_back(self, &self->cur);
        self->last = -1;
    }
    self->open = 0;
    if (take_mark(self, &self->cur.marks[0]) < 0) return NULL;
    self->cur.prev = self->last;
    self->cur.n = 1;
    self->cur.nh = 0;
    self->cur.end = -1;
    self->cur.step = step;
    self->current = id;
    self->epoch = clock_epoch(self);
    self->open = 1;
    Py_RETURN_NONE;
}

/* switch(phase): end the running span and start `phase`; free when it is already running. */
static PyObject *Steps_switch(Steps *self, PyObject *phase) {
    if (!self->open) Py_RETURN_NONE;
    int32_t id = phase_id(self, phase);
    if (id < 0) return NULL;
    if (id == self->current) Py_RETURN_NONE;
    Rec *r = &self->cur;
    if (rec_reserve(r, r->n + 1) < 0 || take_mark(self, &r->marks[r->n]) < 0) return NULL;
    r->labels[r->n - 1] = self->current;
    r->n++;
    self->current = id;
    Py_RETURN_NONE;
}

/* end([phase]): the step's device part ends here (a mark); what follows, until close(), is
 * between steps, labelled `phase` (default: between).  A later end() moves the end there.
 * A second end() with nothing switched in between continues the label that ran into the
 * first (a GradScaler's update after the step). */
static PyObject *Steps_end(Steps *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs > 1) { PyErr_SetString(PyExc_TypeError, "end([phase])"); return NULL; }
    if (!self->open) Py_RETURN_NONE;
    int32_t next = self->between_id;
    if (nargs == 1 && (next = phase_id(self, args[0])) < 0) return NULL;
    Rec *r = &self->cur;
    int32_t label = self->current;
    if (label == self->between_id && r->end >= 0) label = self->pre_end;
    if (rec_reserve(r, r->n + 1) < 0 || take_mark(self, &r->marks[r->n]) < 0) return NULL;
    self->pre_end = label;
    r->labels[r->n - 1] = label;
    r->end = r->n;
    r->n++;
    self->current = next;
    Py_RETURN_NONE;
}

/* relabel(phase): rename the running span (no mark). */
static PyObject *Steps_relabel(Steps *self, PyObject *phase) {
    if (!self->open) Py_RETURN_NONE;
    int32_t id = phase_id(self, phase);
    if (id < 0) return NULL;
    self->current = id;
    Py_RETURN_NONE;
}

static int add_host_id(Rec *r, int32_t id, double ms) {
    for (Py_ssize_t i = 0; i < r->nh; i++)
        if (r->hid[i] == id) { r->hms[i] += ms; return 0; }
    Py_ssize_t cap = r->hcap;
    if (grow((void **)&r->hid, &cap, r->nh + 1, sizeof(int32_t)) < 0) return -1;
    cap = r->hcap;
    if (grow((void **)&r->hms, &cap, r->nh + 1, sizeof(double)) < 0) return -1;
    r->hcap = cap;
    r->hid[r->nh] = id;
    r->hms[r->nh++] = ms;
    return 0;
}

/* add_host(phase, ms): a phase measured on the host clock, summed within the record. */
static PyObject *Steps_add_host(Steps *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "add_host(phase, ms)"); return NULL; }
    if (!self->open) Py_RETURN_NONE;
    double ms = PyFloat_AsDouble(args[1]);
    if (ms == -1.0 && PyErr_Occurred()) return NULL;
    int32_t id = phase_id(self, args[0]);
    if (id < 0 || add_host_id(&self->cur, id, ms) < 0) return NULL;
    Py_RETURN_NONE;
}

/* close(period_ms) -> bool: take the last mark and queue the record (period_ms < 0: none).
 * False when no record was open.  The caller checks `full` before opening. */
static PyObject *Steps_close(Steps *self, PyObject *arg) {
    if (!self->open) {  /* a step went untimed: the next record does not follow the last one */
        self->last = -1;
        Py_RETURN_FALSE;
    }
    double period = PyFloat_AsDouble(arg);
    if (period == -1.0 && PyErr_Occurred()) return NULL;
    if (self->count >= self->ring_cap) {
        PyErr_SetString(PyExc_RuntimeError, "Steps.close: max_pending records are pending (check `full` before open)");
        return NULL;
    }
    Rec *r = &self->cur;
    if (rec_reserve(r, r->n + 1) < 0 || take_mark(self, &r->marks[r->n]) < 0) return NULL;
    r->labels[r->n - 1] = self->current;
    r->n++;
    if (period >= 0 && add_host_id(r, self->period_id, period) < 0) { r->n--; return NULL; }
    r->single = clock_epoch(self) == self->epoch;
    r->epoch = self->epoch;
    r->seq = self->seq + 1;
    r->gap = -1.0;
    if (self->threaded) {  /* the events themselves, for the thread: the pool's array may move as it grows */
        for (Py_ssize_t i = 0; i < r->n; i++) r->ev[i] = self->clock->events[r->marks[i]];
        if (thread_start(self) < 0) { r->n--; return NULL; }
    }
    /* Into the ring by swapping buffers: the slot's old buffers become the next record's.  The slot is
     * past `count`: the thread does not read it until the count below says it is there. */
    Rec *slot = &self->ring[(self->head + self->count) % self->ring_cap];
    Rec tmp = *slot;
    *slot = *r;
    *r = tmp;
    r->n = r->nh = 0;
    r->end = -1;
    self->last = ++self->seq;
    lock(self);
    self->count++;
    if (self->threaded && self->count - self->lag - self->resolved >= self->wake_at) pthread_cond_signal(&self->wake);
    unlock(self);
    self->open = 0;
    Py_RETURN_TRUE;
}

/* discard(): drop the open record, its marks back to the pool. */
static PyObject *Steps_discard(Steps *self, PyObject *Py_UNUSED(ignored)) {
    if (self->open) give_back(self, &self->cur);
    self->open = 0;
    self->last = -1;
    Py_RETURN_NONE;
}

/* cut(): time no record holds comes next (a pause outside a record): the next record's period is the host's. */
static PyObject *Steps_cut(Steps *self, PyObject *Py_UNUSED(ignored)) {
    self->last = -1;
    Py_RETURN_NONE;
}

static int out_append(Steps *self, PyObject *item) {
    if (item == NULL) return -1;
    if (self->out == NULL && (self->out = PyList_New(0)) == NULL) { Py_DECREF(item); return -1; }
    int bad = PyList_Append(self->out, item);
    Py_DECREF(item);
    return bad;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The window being filled, as ("window", key, last_step, steps, {phase: [ms, ...]}) for Python,
 * each phase's values sorted (what the statistics and the run totals take: sorted here, Python's
 * sort of them is a linear pass). */
static int emit_window(Steps *self) {
    if (!self->has_win) return 0;
    PyObject *cols = PyDict_New();
    if (cols == NULL) return -1;
    for (Py_ssize_t k = 0; k < self->n_order; k++) {
        int32_t id = self->col_order[k];
        Py_ssize_t n = self->col_n[id];
        qsort(self->col[id], (size_t)n, sizeof(double), cmp_double);
        PyObject *list = PyList_New(n);
        if (list == NULL) goto fail;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *f = PyFloat_FromDouble(self->col[id][i]);
            if (f == NULL) { Py_DECREF(list); goto fail; }
            PyList_SET_ITEM(list, i, f);
        }
        int bad = PyDict_SetItem(cols, PyList_GET_ITEM(self->names, id), list) < 0;
        Py_DECREF(list);
        if (bad) goto fail;
    }
    for (Py_ssize_t k = 0; k < self->n_order; k++) {
        self->col_n[self->col_order[k]] = 0;
        self->in_win[self->col_order[k]] = 0;
    }
    self->n_order = 0;
    self->has_win = 0;
    return out_append(self, Py_BuildValue("(sLLLN)", "window", (long long)self->win_key, (long long)self->win_last,
                                          (long long)self->win_steps, cols));
fail:
    Py_DECREF(cols);
    return -1;
}

static int64_t floordiv(int64_t a, int64_t b) {
    int64_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

/* A record whose marks are all done: its phases' ms into the window (and a per-step
 * result when asked), its marks back to the pool.  `given`: its spans, read already (the thread). */
static int resolve(Steps *self, Rec *r, const double *given) {
    Py_ssize_t nspans = r->n - 1, nt = 0;
    if (grow((void **)&self->spans, &self->spans_cap, nspans > 0 ? nspans : 1, sizeof(double)) < 0) return -1;
    if (given != NULL) {
        memcpy(self->spans, given, (nspans > 0 ? nspans : 0) * sizeof(double));
    } else if (self->clock != NULL) {
        if (spans_slots(self->clock, r->marks, r->n, self->spans) < 0) return -1;
    } else {
        for (Py_ssize_t i = 0; i < nspans; i++) self->spans[i] = (double)(r->marks[i + 1] - r->marks[i]) / 1e6;
    }
    /* `period` on the marks' clock when the record follows the one resolved before it (on one stream): from that
     * one's last mark, kept for this, to this one's last, less the paused spans.  No step is then longer than its
     * period.  Else the host's, as the core gave it, or the record's own time where that is longer. */
    double gap = -1.0;
    int follows = self->has_held && r->prev >= 0 && r->prev == self->held_seq && r->single && self->held_epoch == r->epoch;
    if (given != NULL) {
        gap = follows ? r->gap : -1.0;
    } else if (follows && self->clock != NULL) {
        int64_t two[2] = {self->held, r->marks[0]};
        if (spans_slots(self->clock, two, 2, &gap) < 0) return -1;
    } else if (follows) {
        gap = (double)(r->marks[0] - self->held) / 1e6;
    }
    /* ms per phase, summed as the Python engine does: host phases, then device spans, then the step.
     * Spans before the end are the step's; later ones are between steps, named by `after` (built-in
     * phases fold into `between`, a custom one is `between_steps.<name>`); paused spans are nobody's. */
    double total = 0.0;
    Py_ssize_t end = r->end >= 0 ? r->end : nspans;
#define TOUCH(id, v)                                          \
    do {                                                      \
        int32_t id_ = (id);                                   \
        if (!self->seen[id_]) {                               \
            self->seen[id_] = 1;                              \
            self->acc[id_] = 0.0;                             \
            self->touched[nt++] = id_;                        \
        }                                                     \
        self->acc[id_] += (v);                                \
    } while (0)
    for (Py_ssize_t i = 0; i < r->nh; i++)  /* (a host period in its place, as the Python engine's dict has it) */
        TOUCH(r->hid[i], gap >= 0 && r->hid[i] == self->period_id ? 0.0 : r->hms[i]);
    double held = 0.0;  /* every span but the paused ones */
    for (Py_ssize_t i = 0; i < nspans; i++) {
        int32_t label = r->labels[i];
        if (label == self->paused_id) continue;
        held += self->spans[i];
        if (label == self->fetch_id) continue;
        if (i < end) {
            total += self->spans[i];
            if (self->parent[label] >= 0) TOUCH(self->parent[label], self->spans[i]);
        } else {
            label = self->after[label];
        }
        TOUCH(label, self->spans[i]);
    }
    if (self->seen[self->step_id]) self->acc[self->step_id] = 0.0;  /* "step" is set, not summed */
    TOUCH(self->step_id, total);
    if (gap >= 0) {
        if (self->seen[self->period_id]) self->acc[self->period_id] = 0.0;  /* a span named "period" cannot be */
        TOUCH(self->period_id, gap + held);
    } else if (self->seen[self->period_id] && self->acc[self->period_id] < held) {
        self->acc[self->period_id] = held;  /* the host's is short of the record's own time: at least that */
    }
#undef TOUCH
    /* Its marks back to the pool but the last, kept for the next record's period (and the one kept before,
     * which this record's gap has read, back now). */
    drop_held(self);
    if (r->n > 0) {
        if (self->clock != NULL) release_slots(self->clock, r->marks, r->n - 1);
        self->held = r->marks[r->n - 1];
        self->held_seq = r->seq;
        self->held_epoch = r->single ? r->epoch : -1;
        self->has_held = 1;
    }
    r->n = 0;
    int rc = 0;
    if (self->per_step) {
        PyObject *ms = PyDict_New();
        if (ms == NULL) rc = -1;
        for (Py_ssize_t k = 0; rc == 0 && k < nt; k++) {
            PyObject *f = PyFloat_FromDouble(self->acc[self->touched[k]]);
            if (f == NULL || PyDict_SetItem(ms, PyList_GET_ITEM(self->names, self->touched[k]), f) < 0) rc = -1;
            Py_XDECREF(f);
        }
        if (rc == 0) rc = out_append(self, Py_BuildValue("(sLN)", "step", (long long)r->step, ms));
        else Py_XDECREF(ms);
    }
    int64_t key = floordiv(r->step, self->window);
    if (rc == 0 && self->has_win && key != self->win_key) rc = emit_window(self);
    if (rc == 0 && !self->has_win) {
        self->has_win = 1;
        self->win_key = key;
        self->win_last = -1;
        self->win_steps = 0;
    }
    for (Py_ssize_t k = 0; k < nt; k++) {
        int32_t id = self->touched[k];
        self->seen[id] = 0;
        if (rc != 0) continue;
        if (grow((void **)&self->col[id], &self->col_cap[id], self->col_n[id] + 1, sizeof(double)) < 0) { rc = -1; continue; }
        self->col[id][self->col_n[id]++] = self->acc[id];
        if (!self->in_win[id]) {
            self->in_win[id] = 1;
            self->col_order[self->n_order++] = id;
        }
    }
    if (rc == 0) {
        if (r->step > self->win_last) self->win_last = r->step;
        self->win_steps++;
    }
    return rc;
}

static PyObject *take_out(Steps *self) {
    PyObject *out = self->out;
    self->out = NULL;
    if (out == NULL) Py_RETURN_NONE;
    return out;
}

/* 1 when every mark of the record is done (the last one, on one stream), 0 if not, -1 on error. */
static int rec_done(Steps *self, Rec *r) {
    if (self->clock == NULL) return 1;
    if (r->single) return query_slot(self->clock, (Py_ssize_t)r->marks[r->n - 1]);
    for (Py_ssize_t i = 0; i < r->n; i++) {
        int d = query_slot(self->clock, (Py_ssize_t)r->marks[i]);
        if (d != 1) return d;
    }
    return 1;
}

/* The records before the newest `lag` (`eligible` of them) are all on one stream and the newest of
 * them is done: then all are (one stream completes in order), known from one query.  1, 0, or -1. */
static int batch_done(Steps *self, Py_ssize_t eligible) {
    Rec *newest = self->clock != NULL ? one_stream(self, self->head, eligible) : NULL;
    if (newest == NULL) return 0;
    return query_slot(self->clock, (Py_ssize_t)newest->marks[newest->n - 1]);
}

static PyObject *Steps_poll(Steps *self, PyObject *Py_UNUSED(ignored));

/* poll(), threaded: take what the thread resolved; raise what it failed on.  No driver call, but for one
 * query when a close has found a backlog the thread was woken for (below). */
static PyObject *poll_threaded(Steps *self) {
    pthread_mutex_lock(&self->mu);
    Py_ssize_t ready = self->resolved, backlog = self->count - self->lag - self->resolved;
    CUresult err = self->thread_err;
    const char *what = self->thread_err_what;
    pthread_mutex_unlock(&self->mu);
    if (err == CUDA_SUCCESS && backlog >= self->wake_at) {
        /* A backlog the thread was woken for: if the device has finished it (one query, of its newest), the
         * thread is what is behind -- steps of a few µs, a hot loop's, whose records it cannot read as fast
         * as the host makes them -- and the rest of the run resolves inline, at the poll, as without a
         * thread.  The thread is joined: a wait for its burst at most, once, never for the device. */
        int d = rec_done(self, &self->ring[(self->head + self->count - self->lag - 1) % self->ring_cap]);
        if (d < 0) return NULL;
        if (d) {
            thread_stop(self);
            self->threaded = 0;
            return Steps_poll(self, NULL);
        }
    }
    if (ready > self->max_per_poll) ready = self->max_per_poll;
    Py_ssize_t done = 0;
    int bad = 0;
    while (done < ready && !bad) {
        Rec *r = &self->ring[(self->head + done) % self->ring_cap];
        bad = resolve(self, r, r->span) < 0;
        done++;
    }
    pthread_mutex_lock(&self->mu);
    self->head = (self->head + done) % self->ring_cap;
    self->count -= done;
    self->resolved -= done;
    pthread_mutex_unlock(&self->mu);
    if (bad) return NULL;
    if (err != CUDA_SUCCESS) {
        thread_stop(self);  /* it has stopped; join it, so that a later close starts it afresh */
        return cuda_error(err, what);
    }
    return take_out(self);
}

/* poll() -> list | None: resolve what the device has finished, oldest first, never waiting.
 * The newest `lag` records are not asked (querying an event just recorded makes the
 * driver flush the stream's batched launches); at most max_per_poll per call.  The caller
 * polls every few closes, so that a poll finds several records done: one query of the newest
 * of them answers for all when they are on one stream, and their resolution runs in one go
 * (a driver call costs several times less right after another than alone between kernel launches). */
static PyObject *Steps_poll(Steps *self, PyObject *Py_UNUSED(ignored)) {
    Py_ssize_t done = 0, known = 0;
    self->blocked = 0;
    if (self->threaded) return poll_threaded(self);
    if (self->count > self->lag) {
        int all = batch_done(self, self->count - self->lag);
        if (all < 0) return NULL;
        if (all) known = self->count - self->lag;
    }
    while (self->count > self->lag && done < self->max_per_poll) {
        Rec *r = &self->ring[self->head];
        int ready = done < known ? 1 : rec_done(self, r);
        if (ready < 0) return NULL;
        if (!ready) {
            self->blocked = 1;
            break;
        }
        int bad = resolve(self, r, NULL);
        self->head = (self->head + 1) % self->ring_cap;
        self->count--;
        done++;
        if (bad) return NULL;
    }
    return take_out(self);
}

/* in_flight() -> int: the closed records before the newest that the device has not finished.
 * Never waits.  After a poll that stopped at an unfinished record, every younger one is
 * unfinished too (one stream completes in order): no query at all.  Else a binary search,
 * at most log2(pending) queries, never of the newest record (querying an event just
 * recorded makes the driver flush the stream's batched launches). */
static PyObject *Steps_in_flight(Steps *self, PyObject *Py_UNUSED(ignored)) {
    Py_ssize_t n = self->count - 1;
    if (n <= 0) return PyLong_FromLong(0);
    if (self->blocked) return PyLong_FromSsize_t(n);
    Py_ssize_t lo = 0, hi = n;  /* the first unfinished record is in [lo, hi] */
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        int d = rec_done(self, &self->ring[(self->head + mid) % self->ring_cap]);
        if (d < 0) return NULL;
        if (d) lo = mid + 1; else hi = mid;
    }
    return PyLong_FromSsize_t(n - lo);
}

/* newest_done() -> bool | None: whether the device has finished the newest record's step (its end
 * mark, or its last without one).  Never waits; one query.  Only asked when every older
 * record is done, on a sampled close. */
static PyObject *Steps_newest_done(Steps *self, PyObject *Py_UNUSED(ignored)) {
    if (self->count == 0) Py_RETURN_NONE;
    if (self->clock == NULL) Py_RETURN_TRUE;
    Rec *r = &self->ring[(self->head + self->count - 1) % self->ring_cap];
    Py_ssize_t i = r->end >= 0 ? r->end : r->n - 1;
    int d = query_slot(self->clock, (Py_ssize_t)r->marks[i]);
    if (d < 0) return NULL;
    return PyBool_FromLong(d);
}

/* behind() -> bool | None: whether the device has not yet passed the open record's mark before the
 * newest, i.e. has not begun the span the host has just finished issuing: the device runs more than
 * a phase behind the host inside the step.  One query of a mark a phase old (not the one just
 * recorded), never a wait; asked only at a sampled step's boundaries.  None on the host clock or
 * before the record has two marks. */
static PyObject *Steps_behind(Steps *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->open || self->clock == NULL || self->cur.n < 2) Py_RETURN_NONE;
    int d = query_slot(self->clock, (Py_ssize_t)self->cur.marks[self->cur.n - 2]);
    if (d < 0) return NULL;
    return PyBool_FromLong(!d);
}

/* drain() -> list | None: resolve every pending record, waiting for the device.
 * HOST-DEVICE SYNC (end of training only): wait_slot on each record's marks' streams. */
static PyObject *Steps_drain(Steps *self, PyObject *Py_UNUSED(ignored)) {
    if (self->threaded) thread_stop(self);  /* what it resolved is resolved again here: the same spans */
    while (self->count > 0) {
        Rec *r = &self->ring[self->head];
        if (self->clock != NULL) {
            Py_ssize_t first = r->single ? r->n - 1 : 0;
            for (Py_ssize_t i = first; i < r->n; i++)
                if (wait_slot(self->clock, (Py_ssize_t)r->marks[i]) < 0) return NULL;
        }
        int bad = resolve(self, r, NULL);
        self->head = (self->head + 1) % self->ring_cap;
        self->count--;
        if (bad) return NULL;
    }
    drop_held(self);  /* the end of training: nothing follows */
    return take_out(self);
}

/* flush() -> list | None: the window being filled, even if not complete (end of training). */
static PyObject *Steps_flush(Steps *self, PyObject *Py_UNUSED(ignored)) {
    if (emit_window(self) < 0) return NULL;
    return take_out(self);
}

static PyObject *Steps_is_open(Steps *self, void *closure) { return PyBool_FromLong(self->open); }
static PyObject *Steps_pending(Steps *self, void *closure) { return PyLong_FromSsize_t(self->count); }
static PyObject *Steps_full(Steps *self, void *closure) { return PyBool_FromLong(self->count >= self->max_pending); }
static PyObject *Steps_max_pending(Steps *self, void *closure) { return PyLong_FromSsize_t(self->max_pending); }
static PyObject *Steps_threaded(Steps *self, void *closure) { return PyBool_FromLong(self->threaded); }
static PyObject *Steps_current(Steps *self, void *closure) {
    if (!self->open) Py_RETURN_NONE;
    PyObject *name = PyList_GET_ITEM(self->names, self->current);
    Py_INCREF(name);
    return name;
}

static PyMethodDef Steps_methods[] = {
    {"open", (PyCFunction)(void (*)(void))Steps_open, METH_FASTCALL, "open(step, phase): start a record."},
    {"switch", (PyCFunction)Steps_switch, METH_O, "switch(phase): end the running span, start `phase`."},
    {"relabel", (PyCFunction)Steps_relabel, METH_O, "relabel(phase): rename the running span."},
    {"end", (PyCFunction)(void (*)(void))Steps_end, METH_FASTCALL, "end([phase]): the step's device part ends here; then between steps."},
    {"add_host", (PyCFunction)(void (*)(void))Steps_add_host, METH_FASTCALL, "add_host(phase, ms): a host-clock phase."},
    {"close", (PyCFunction)Steps_close, METH_O, "close(period_ms) -> bool: queue the record (period_ms < 0: none)."},
    {"discard", (PyCFunction)Steps_discard, METH_NOARGS, "Drop the open record."},
    {"cut", (PyCFunction)Steps_cut, METH_NOARGS, "The next record does not follow the last one (its period is the host's)."},
    {"poll", (PyCFunction)Steps_poll, METH_NOARGS, "Resolve finished records without waiting: results or None."},
    {"newest_done", (PyCFunction)Steps_newest_done, METH_NOARGS, "The device finished the newest record's step (one query, never waits)."},
    {"behind", (PyCFunction)Steps_behind, METH_NOARGS, "The device has not begun the open record's last span but one (one query, never waits)."},
    {"in_flight", (PyCFunction)Steps_in_flight, METH_NOARGS, "Closed records before the newest the device has not finished (never waits)."},
    {"drain", (PyCFunction)Steps_drain, METH_NOARGS, "Resolve every record, waiting for the device (end of training)."},
    {"flush", (PyCFunction)Steps_flush, METH_NOARGS, "The window being filled, as a result (end of training)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Steps_getset[] = {
    {"is_open", (getter)Steps_is_open, NULL, "A record is open.", NULL},
    {"current", (getter)Steps_current, NULL, "The running phase, or None outside a record.", NULL},
    {"pending", (getter)Steps_pending, NULL, "Closed records waiting for the device.", NULL},
    {"full", (getter)Steps_full, NULL, "max_pending records are waiting.", NULL},
    {"max_pending", (getter)Steps_max_pending, NULL, "The bound on pending records.", NULL},
    {"threaded", (getter)Steps_threaded, NULL, "Records are resolved on the engine's own thread (False: at the poll; "
                 "a threaded engine turns inline when its thread falls behind the host).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject StepsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "phase_timer._native.Steps",
    .tp_basicsize = sizeof(Steps),
    .tp_dealloc = (destructor)Steps_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "phase-timer's per-step engine: records, their lazy resolution, the window's columns.",
    .tp_methods = Steps_methods,
    .tp_getset = Steps_getset,
    .tp_init = (initproc)Steps_init,
    .tp_new = PyType_GenericNew,
};

/*
 * Arm: a hook that queues `callback` when `engine` runs `phase` and `owner.<flag>` is true.  DDP's
 * exposed-communication split (comm/ddp.py): on one parameter's gradient accumulation, a synced backward timed in
 * `backward` queues the engine's switch to its wait as an autograd final callback.  In C because it runs every
 * backward on the autograd thread, where a Python frame costs a few µs (cold between kernel launches).
 * `sample` (optional) is queued instead on the `due`-th such backward from now (counted down here; 0: never),
 * and sets the next `due` itself: the sampled backwards, in Python.
 */
typedef struct {
    PyObject_HEAD
    PyObject *engine, *phase, *owner, *flag, *queue, *callback, *sample;
    long long due;
} Arm;

static int Arm_traverse(Arm *self, visitproc visit, void *arg) {
    Py_VISIT(self->engine);
    Py_VISIT(self->phase);
    Py_VISIT(self->owner);
    Py_VISIT(self->flag);
    Py_VISIT(self->queue);
    Py_VISIT(self->callback);
    Py_VISIT(self->sample);
    return 0;
}

static int Arm_clear(Arm *self) {
    Py_CLEAR(self->engine);
    Py_CLEAR(self->phase);
    Py_CLEAR(self->owner);
    Py_CLEAR(self->flag);
    Py_CLEAR(self->queue);
    Py_CLEAR(self->callback);
    Py_CLEAR(self->sample);
    return 0;
}

static void Arm_dealloc(Arm *self) {
    PyObject_GC_UnTrack(self);
    Arm_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Arm_init(Arm *self, PyObject *args, PyObject *kw) {
    PyObject *engine, *phase, *owner, *flag, *queue, *callback, *sample = Py_None;
    if (!PyArg_ParseTuple(args, "OUOUOO|O:Arm", &engine, &phase, &owner, &flag, &queue, &callback, &sample))
        return -1;
    Py_XSETREF(self->engine, Py_NewRef(engine));
    Py_XSETREF(self->phase, Py_NewRef(phase));
    Py_XSETREF(self->owner, Py_NewRef(owner));
    Py_XSETREF(self->flag, Py_NewRef(flag));
    Py_XSETREF(self->queue, Py_NewRef(queue));
    Py_XSETREF(self->callback, Py_NewRef(callback));
    Py_XSETREF(self->sample, sample == Py_None ? NULL : Py_NewRef(sample));
    self->due = 0;
    return 0;
}

/* 1: the engine runs `phase`; 0: not (or no record open); -1: an error set. */
static int arm_in_phase(Arm *self) {
    PyObject *cur;
    if (Py_IS_TYPE(self->engine, &StepsType)) {
        Steps *st = (Steps *)self->engine;
        if (!st->open) return 0;
        cur = Py_NewRef(PyList_GET_ITEM(st->names, st->current));
    } else if ((cur = PyObject_GetAttrString(self->engine, "current")) == NULL) {
        return -1;
    }
    int eq = cur == self->phase || (PyUnicode_Check(cur) && PyUnicode_Compare(cur, self->phase) == 0);
    Py_DECREF(cur);
    return eq;
}

/* Never raises: it runs inside the training's backward, which an error here would fail; an engine or owner
 * that cannot say (an error) means no split this backward. */
static PyObject *Arm_call(Arm *self, PyObject *args, PyObject *kw) {
    if (self->engine == NULL) Py_RETURN_NONE;
    int on = arm_in_phase(self);
    if (on > 0) {
        PyObject *flag = PyObject_GetAttr(self->owner, self->flag);
        on = flag == NULL ? -1 : PyObject_IsTrue(flag);
        Py_XDECREF(flag);
    }
    if (on > 0) {
        PyObject *cb = self->callback;
        if (self->sample != NULL && self->due > 0 && --self->due == 0) cb = self->sample;
        PyObject *out = PyObject_CallOneArg(self->queue, cb);
        on = out == NULL ? -1 : 0;
        Py_XDECREF(out);
    }
    if (on < 0) PyErr_Clear();
    Py_RETURN_NONE;
}

static PyMemberDef Arm_members[] = {
    {"due", T_LONGLONG, offsetof(Arm, due), 0, "calls (that queue) until sample is queued instead; 0: never"},
    {NULL},
};

/* callback: what a call queues, set anew between backwards (DDP's split turns a host-paced module's wait start into
 * a Python callback, and back); never deleted. */
static PyObject *Arm_get_callback(Arm *self, void *Py_UNUSED(closure)) {
    return Py_NewRef(self->callback != NULL ? self->callback : Py_None);
}

static int Arm_set_callback(Arm *self, PyObject *value, void *Py_UNUSED(closure)) {
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "Arm.callback cannot be deleted");
        return -1;
    }
    Py_XSETREF(self->callback, Py_NewRef(value));
    return 0;
}

static PyGetSetDef Arm_getset[] = {
    {"callback", (getter)Arm_get_callback, (setter)Arm_set_callback, "what a call queues (settable)", NULL},
    {NULL},
};

static PyTypeObject ArmType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "phase_timer._native.Arm",
    .tp_basicsize = sizeof(Arm),
    .tp_dealloc = (destructor)Arm_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Arm(engine, phase, owner, flag, queue, callback, sample=None): called (with any arguments), "
              "queue(callback) when engine.current == phase and owner.<flag> is true; queue(sample) instead on "
              "the due-th such call (due counts down; 0: never); callback may be set anew.",
    .tp_traverse = (traverseproc)Arm_traverse,
    .tp_members = Arm_members,
    .tp_getset = Arm_getset,
    .tp_clear = (inquiry)Arm_clear,
    .tp_call = (ternaryfunc)Arm_call,
    .tp_init = (initproc)Arm_init,
    .tp_new = PyType_GenericNew,
};

/*
 * Fast: the usual boundaries inside a step in one C call each, on the state of a Python
 * phase_timer.run.boundaries.Boundaries (its slots, read and written where CPython keeps them), with the
 * engine's switch/end/relabel called directly when it is a Steps.  Boundaries stays the one definition of
 * every phase: each method here does what its Python namesake does in the usual case -- a plain (not
 * sampled) step, not paused, no user phase open, no memory read due, nothing to warn about -- and in every
 * other case calls the Python method itself.  Tests drive both with the same calls and compare.  In a real
 * loop a Python boundary costs a few µs (its frames and attributes, cold between kernel launches); this
 * costs one call.
 */
enum { S_OPEN, S_ENDED, S_TRAILING, S_PAUSED, S_IN_BACKWARD, S_AUTO, S_EXPLICIT, S_AFTER_BACKWARD, S_SAW_FORWARD,
       S_SAW_BACKWARD, S_FAILED, S_MEM_ON, S_FETCHED, S_STEPS, S_BEGUN, S_STEP, S_FLIGHT_AT, S_CENSUS_AT, S_SAMPLE_IN,
       S_MEM, S_MEM_DUE, S_CORE, S_MOD_ON, S_MOD_DUE, N_SLOTS };
static const char *slot_names[N_SLOTS] = {"open", "ended", "trailing", "paused", "in_backward", "_auto", "_explicit",
                                          "_after_backward", "_saw_forward", "_saw_backward", "_failed", "_mem_on",
                                          "_fetched", "steps", "begun", "_step", "_flight_at", "_census_at",
                                          "_sample_in", "_mem", "_mem_due", "core", "_mod_on", "_mod_due"};
enum { P_FORWARD, P_BACKWARD, P_OPTIMIZER, P_BETWEEN, P_H2D, N_PHASES };

/* The core's (TimingCore's) slots the usual case reads and writes. */
enum { C_IN_STEP, C_LAST_END, C_POLL_IN, C_BEGUN, C_WARMUP, C_CLOSED, C_TRACE, C_RANKS, C_ENGINE, N_CSLOTS };
static const char *core_slot_names[N_CSLOTS] = {"_in_step", "_last_end", "_poll_in", "steps_begun", "_warmup",
                                                "closed", "trace", "ranks", "_engine"};
/* Names looked up at a call: interned once, so that a lookup makes no string. */
enum { N_PERF_COUNTER_NS, N_CONSUME, N_COUNT_FLIGHT, N_FETCH, N_BATCH, N_FORWARD, N_COPIED, N_BACKWARD_START,
       N_BACKWARD_END, N_OPTIMIZER_START, N_STEP_END, N_FAILED, N_NAMES };
static const char *interned_names[N_NAMES] = {"perf_counter_ns", "_consume", "_count_flight", "fetch", "batch",
                                              "forward", "copied", "backward_start", "backward_end",
                                              "optimizer_start", "step_end", "failed"};
static PyObject *names[N_NAMES];

typedef struct {
    PyObject_HEAD
    PyObject *bounds;       /* the Boundaries instance */
    PyTypeObject *plain;    /* its class: a subclass (a sampled step's) takes the Python path */
    PyObject *engine;       /* a Steps (called in C), or any engine (its methods called) */
    PyObject *core;         /* bounds.core when Fast was made: another one takes the Python path */
    PyObject *phase[N_PHASES + 2];  /* the built-in phases, then "data_wait" and "sync_wait" */
    Py_ssize_t off[N_SLOTS];
    Py_ssize_t coff[N_CSLOTS];
    PyObject *time;         /* the time module: its perf_counter_ns looked up at each use, as Python does */
    PyObject *perf_counter_ns;  /* the one it had when Fast was made (see now_ns) */
    PyObject *flight_gap;   /* boundaries.flight_gap: closes to the next count of steps in flight */
    long long poll_every;   /* engine.POLL_EVERY */
} Fast;

#define SLOT(f, i) (*(PyObject **)((char *)(f)->bounds + (f)->off[i]))
#define CSLOT(f, i) (*(PyObject **)((char *)(f)->core + (f)->coff[i]))

/* A slot's truth (an unset slot is false). */
static int truth(Fast *f, int i) {
    PyObject *v = SLOT(f, i);
    if (v == Py_True) return 1;
    if (v == Py_False || v == NULL || v == Py_None) return 0;
    return PyObject_IsTrue(v) > 0;
}

static void set_slot(Fast *f, int i, PyObject *v) {
    Py_INCREF(v);
    Py_XSETREF(SLOT(f, i), v);
}

static int no_user_phase(Fast *f) {
    PyObject *x = SLOT(f, S_EXPLICIT);
    return x != NULL && PyList_CheckExact(x) && PyList_GET_SIZE(x) == 0;
}

/* The usual case for any boundary: a plain step, not paused, no memory read, no modules' sample, no user phase
 * open. */
static int usual(Fast *f) {
    return Py_TYPE(f->bounds) == f->plain && !truth(f, S_PAUSED) && !truth(f, S_MEM_ON) && !truth(f, S_MOD_ON) &&
           no_user_phase(f);
}

static PyObject *engine_switch(Fast *f, PyObject *phase) {
    if (Py_IS_TYPE(f->engine, &StepsType)) return Steps_switch((Steps *)f->engine, phase);
    return PyObject_CallMethod(f->engine, "switch", "O", phase);
}

static PyObject *engine_relabel(Fast *f, PyObject *phase) {
    if (Py_IS_TYPE(f->engine, &StepsType)) return Steps_relabel((Steps *)f->engine, phase);
    return PyObject_CallMethod(f->engine, "relabel", "O", phase);
}

/* _set(phase) when usual: the built-in phase that runs now, a mark where it changes. */
static PyObject *set_phase(Fast *f, int p) {
    set_slot(f, S_AUTO, f->phase[p]);
    return engine_switch(f, f->phase[p]);
}

static PyObject *python_path(Fast *f, int name) { return PyObject_CallMethodNoArgs(f->bounds, names[name]); }

/* An int slot or attribute as a C integer (-1 with an exception set when it is not one). */
static long long as_ll(PyObject *v) {
    if (v == NULL || !PyLong_CheckExact(v)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "Fast: an int was expected");
        return -1;
    }
    return PyLong_AsLongLong(v);
}

static int set_slot_ll(Fast *f, int i, long long v) {
    PyObject *o = PyLong_FromLongLong(v);
    if (o == NULL) return -1;
    Py_XSETREF(SLOT(f, i), o);
    return 0;
}

/* A core slot as a C integer; -2 (no exception) when it is not a plain int (None: not set yet). */
static long long core_ll(Fast *f, int i) {
    PyObject *v = CSLOT(f, i);
    if (v == NULL || !PyLong_CheckExact(v)) return -2;
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred()) { PyErr_Clear(); return -2; }
    return x;
}

static void core_set(Fast *f, int i, PyObject *v) {
    Py_INCREF(v);
    Py_XSETREF(CSLOT(f, i), v);
}

static int core_set_ll(Fast *f, int i, long long x) {
    PyObject *v = PyLong_FromLongLong(x);
    if (v == NULL) return -1;
    Py_XSETREF(CSLOT(f, i), v);
    return 0;
}

/* The time module's own perf_counter_ns (a new reference), read directly by read_now; NULL (no error) when it
 * was replaced already (a test's clock: always called).  0, or -1 with an exception set. */
static int own_perf_counter(PyObject *time, PyObject **own) {
    PyObject *pcn = PyObject_GetAttr(time, names[N_PERF_COUNTER_NS]);
    if (pcn == NULL) return -1;
    if (!PyCFunction_Check(pcn) || PyCFunction_GET_SELF(pcn) != time ||
        strcmp(((PyCFunctionObject *)pcn)->m_ml->ml_name, "perf_counter_ns") != 0)
        Py_CLEAR(pcn);
    *own = pcn;
    return 0;
}

/* time.perf_counter_ns(), looked up at each call as Python does (a test may replace it); when it is the one
 * Fast was made with, its clock read here (CLOCK_MONOTONIC, as CPython's on Linux): no call, no int object. */
static long long read_now(PyObject *time, PyObject *own) {
    PyObject *fn = PyObject_GetAttr(time, names[N_PERF_COUNTER_NS]);
    if (fn == NULL) return -1;
    if (fn == own) {
        Py_DECREF(fn);
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    }
    PyObject *t = PyObject_CallNoArgs(fn);
    Py_DECREF(fn);
    if (t == NULL) return -1;
    long long now = PyLong_AsLongLong(t);
    Py_DECREF(t);
    return now;
}

static long long now_ns(Fast *f) { return read_now(f->time, f->perf_counter_ns); }

/* The engine's poll (results to the core's _consume), and at a counting close the steps in flight
 * (TimingCore.close, past its close of the record). */
static int core_poll(Fast *f, int flight) {
    PyObject *results = Py_IS_TYPE(f->engine, &StepsType) ? Steps_poll((Steps *)f->engine, NULL)
                                                          : PyObject_CallMethod(f->engine, "poll", NULL);
    if (results == NULL) return -1;
    PyObject *r = flight ? PyObject_CallMethodNoArgs(f->core, names[N_COUNT_FLIGHT]) : (Py_INCREF(Py_None), Py_None);
    if (r != NULL && results != Py_None) {
        Py_DECREF(r);
        r = PyObject_CallMethodOneArg(f->core, names[N_CONSUME], results);
    }
    Py_DECREF(results);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* fetch(): the loop asks for the next batch; an ended step closes (Boundaries.fetch, _close and
 * TimingCore.close) -- in the usual case: the close starts no census or sampled step and reads no memory, and
 * the core exchanges nothing with other ranks.  Its poll (one close in POLL_EVERY) and its count of the steps
 * in flight (one in FLIGHT_EVERY) are here too: Python runs only where they hand it something (a window's
 * results to _consume, the count to _count_flight). */
static PyObject *Fast_fetch(Fast *f, PyObject *Py_UNUSED(ignored)) {
    if (!usual(f) || truth(f, S_FETCHED) || !truth(f, S_ENDED) || SLOT(f, S_CORE) != f->core)
        return python_path(f, N_FETCH);
    long long steps = as_ll(SLOT(f, S_STEPS)), flight_at = as_ll(SLOT(f, S_FLIGHT_AT));
    long long census_at = as_ll(SLOT(f, S_CENSUS_AT)), sample_in = as_ll(SLOT(f, S_SAMPLE_IN));
    if (PyErr_Occurred()) return NULL;
    long long last = core_ll(f, C_LAST_END), poll_in = core_ll(f, C_POLL_IN), warmup = core_ll(f, C_WARMUP);
    if (steps + 1 == census_at || sample_in <= 1 || last < 0 || poll_in < 0 || warmup < 0 ||
        CSLOT(f, C_IN_STEP) != Py_True || CSLOT(f, C_RANKS) != Py_None || CSLOT(f, C_ENGINE) != f->engine)
        return python_path(f, N_FETCH);
    long long now = now_ns(f);
    if (now == -1 && PyErr_Occurred()) return NULL;
    set_slot(f, S_FETCHED, Py_True);
    if (set_slot_ll(f, S_STEPS, steps + 1) < 0) return NULL;
    int flight = steps + 1 == flight_at;
    if (flight) {
        PyObject *gap = PyObject_CallFunction(f->flight_gap, "L", steps + 1 - warmup);
        long long g = as_ll(gap);
        Py_XDECREF(gap);
        if (PyErr_Occurred() || set_slot_ll(f, S_FLIGHT_AT, flight_at + g) < 0) return NULL;
    }
    /* TimingCore.close */
    core_set(f, C_IN_STEP, Py_False);
    if (core_set_ll(f, C_LAST_END, now) < 0) return NULL;
    PyObject *period = PyFloat_FromDouble((double)(now - last) / 1e6);
    if (period == NULL) return NULL;
    PyObject *r = Py_IS_TYPE(f->engine, &StepsType) ? Steps_close((Steps *)f->engine, period)
                                                     : PyObject_CallMethod(f->engine, "close", "O", period);
    Py_DECREF(period);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    int poll = poll_in <= 1 || flight;
    if (core_set_ll(f, C_POLL_IN, poll ? f->poll_every : poll_in - 1) < 0) return NULL;
    if (poll && core_poll(f, flight) < 0) return NULL;
    /* the rest of Boundaries._close */
    set_slot(f, S_OPEN, Py_False);
    set_slot(f, S_ENDED, Py_False);
    set_slot(f, S_TRAILING, Py_False);
    set_slot(f, S_AUTO, f->phase[P_H2D]);
    if (set_slot_ll(f, S_SAMPLE_IN, sample_in - 1) < 0) return NULL;
    Py_RETURN_NONE;
}

/* batch(step, data_wait_ms[, sync_wait_ms]): a batch was handed over and a step begins with h2d
 * (Boundaries.batch, _begin and TimingCore.begin_step) -- in the usual case: fetched, no step open, no memory
 * step due, past the warm-up, room for it, no trace.  `step` None: the steps closed so far; `data_wait_ms`
 * None: not measured. */
static PyObject *Fast_batch(Fast *f, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 && nargs != 3) { PyErr_SetString(PyExc_TypeError, "batch(step, data_wait_ms[, sync_wait_ms])"); return NULL; }
    PyObject *step = args[0], *wait = args[1], *sync = nargs == 3 ? args[2] : NULL;
    PyObject *core = SLOT(f, S_CORE);
    long long begun = as_ll(SLOT(f, S_BEGUN));
    if (PyErr_Occurred()) return NULL;
    PyObject *mem = SLOT(f, S_MEM);
    int mem_due = 0;
    if (mem != NULL && mem != Py_None) {
        long long due = as_ll(SLOT(f, S_MEM_DUE));
        if (PyErr_Occurred()) return NULL;
        mem_due = begun + 1 >= due;
    }
    /* a modules' sample due (measures/modules/): the same hand-off, one comparison */
    long long mod_due = as_ll(SLOT(f, S_MOD_DUE));
    if (PyErr_Occurred()) return NULL;
    mem_due = mem_due || begun + 1 >= mod_due;
    int ours = core == f->core;
    long long begun_core = ours ? core_ll(f, C_BEGUN) : -2, warmup = ours ? core_ll(f, C_WARMUP) : -2;
    if (!usual(f) || !truth(f, S_FETCHED) || truth(f, S_OPEN) || mem_due || begun_core < 0 || warmup < 0 ||
        begun_core + 1 <= warmup || CSLOT(f, C_CLOSED) != Py_False || CSLOT(f, C_TRACE) != Py_None ||
        CSLOT(f, C_ENGINE) != f->engine || !Py_IS_TYPE(f->engine, &StepsType) ||
        ((Steps *)f->engine)->count >= ((Steps *)f->engine)->max_pending) {
        PyObject *meth = PyObject_GetAttr(f->bounds, names[N_BATCH]);
        if (meth == NULL) return NULL;
        PyObject *r = PyObject_CallFunctionObjArgs(meth, step, wait, sync, NULL);
        Py_DECREF(meth);
        return r;
    }
    if (step == Py_None) step = SLOT(f, S_STEPS);
    Py_INCREF(step);  /* held: the slot it may come from is not written below, but the engine's call runs code */
    set_slot(f, S_FETCHED, Py_False);
    int bad = set_slot_ll(f, S_BEGUN, begun + 1) < 0;
    if (!bad) set_slot(f, S_STEP, step);
    /* TimingCore.begin_step */
    if (!bad) core_set(f, C_IN_STEP, Py_True);
    bad = bad || core_set_ll(f, C_BEGUN, begun_core + 1) < 0;
    PyObject *oa[2] = {step, f->phase[P_H2D]};
    PyObject *r = bad ? NULL : Steps_open((Steps *)f->engine, oa, 2);
    Py_DECREF(step);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    set_slot(f, S_OPEN, Py_True);
    set_slot(f, S_ENDED, Py_False);
    set_slot(f, S_TRAILING, Py_False);
    set_slot(f, S_AUTO, f->phase[P_H2D]);
    set_slot(f, S_AFTER_BACKWARD, Py_False);
    set_slot(f, S_SAW_FORWARD, Py_False);
    set_slot(f, S_SAW_BACKWARD, Py_False);
    set_slot(f, S_FAILED, Py_False);
    if (wait != Py_None) {
        PyObject *ha[2] = {f->phase[N_PHASES], wait};  /* "data_wait" */
        r = Steps_add_host((Steps *)f->engine, ha, 2);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    int add_sync = sync != NULL ? PyObject_IsTrue(sync) : 0;
    if (add_sync < 0) return NULL;
    if (add_sync) {
        PyObject *ha[2] = {f->phase[N_PHASES + 1], sync};  /* "sync_wait" */
        r = Steps_add_host((Steps *)f->engine, ha, 2);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
}

/* forward(): the training forward starts (a loop with a loader: it does not begin the step). */
static PyObject *Fast_forward(Fast *f, PyObject *Py_UNUSED(ignored)) {
    if (!usual(f) || truth(f, S_TRAILING)) return python_path(f, N_FORWARD);
    if (truth(f, S_IN_BACKWARD) || !truth(f, S_OPEN)) Py_RETURN_NONE;
    set_slot(f, S_SAW_FORWARD, Py_True);
    set_slot(f, S_AFTER_BACKWARD, Py_False);
    return set_phase(f, P_FORWARD);
}

/* copied(): the batch is on the device. */
static PyObject *Fast_copied(Fast *f, PyObject *Py_UNUSED(ignored)) {
    if (!usual(f)) return python_path(f, N_COPIED);
    if (!truth(f, S_OPEN)) Py_RETURN_NONE;
    set_slot(f, S_SAW_FORWARD, Py_True);
    return set_phase(f, P_FORWARD);
}

/* backward_start(): the loop called backward(). */
static PyObject *Fast_backward_start(Fast *f, PyObject *Py_UNUSED(ignored)) {
    if (!truth(f, S_OPEN) || truth(f, S_IN_BACKWARD)) {
        if (Py_TYPE(f->bounds) == f->plain) Py_RETURN_NONE;
        return python_path(f, N_BACKWARD_START);  /* a sampled step times even a call that does nothing */
    }
    if (!usual(f) || truth(f, S_TRAILING) || !truth(f, S_SAW_FORWARD)) return python_path(f, N_BACKWARD_START);
    if (truth(f, S_AFTER_BACKWARD)) {  /* a second backward: what ran since the first was loss math */
        PyObject *r = engine_relabel(f, f->phase[P_FORWARD]);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    set_slot(f, S_AFTER_BACKWARD, Py_False);
    set_slot(f, S_SAW_BACKWARD, Py_True);
    set_slot(f, S_IN_BACKWARD, Py_True);
    return set_phase(f, P_BACKWARD);
}

/* backward_end(failed): backward() returned (or raised). */
static PyObject *Fast_backward_end(Fast *f, PyObject *failed) {
    if (!usual(f)) {
        PyObject *meth = PyObject_GetAttr(f->bounds, names[N_BACKWARD_END]);
        if (meth == NULL) return NULL;
        PyObject *args = PyTuple_New(0), *kw = Py_BuildValue("{OO}", names[N_FAILED], failed);
        PyObject *r = args != NULL && kw != NULL ? PyObject_Call(meth, args, kw) : NULL;
        Py_DECREF(meth);
        Py_XDECREF(args);
        Py_XDECREF(kw);
        return r;
    }
    if (!truth(f, S_IN_BACKWARD)) Py_RETURN_NONE;
    set_slot(f, S_IN_BACKWARD, Py_False);
    set_slot(f, S_FAILED, PyObject_IsTrue(failed) > 0 ? Py_True : Py_False);
    set_slot(f, S_AFTER_BACKWARD, Py_True);
    return set_phase(f, P_OPTIMIZER);
}

/* optimizer_start(): an optimizer step begins. */
static PyObject *Fast_optimizer_start(Fast *f, PyObject *Py_UNUSED(ignored)) {
    if (!usual(f) || truth(f, S_TRAILING) || (truth(f, S_SAW_FORWARD) && !truth(f, S_SAW_BACKWARD)))
        return python_path(f, N_OPTIMIZER_START);
    if (!truth(f, S_OPEN)) Py_RETURN_NONE;
    set_slot(f, S_AFTER_BACKWARD, Py_False);
    return set_phase(f, P_OPTIMIZER);
}

/* step_end(): an optimizer step ended: the step's device part ends here, unless the batch goes on. */
static PyObject *Fast_step_end(Fast *f, PyObject *Py_UNUSED(ignored)) {
    if (!usual(f)) return python_path(f, N_STEP_END);
    if (!truth(f, S_OPEN)) Py_RETURN_NONE;
    PyObject *r = Py_IS_TYPE(f->engine, &StepsType) ? Steps_end((Steps *)f->engine, NULL, 0)
                                                     : PyObject_CallMethod(f->engine, "end", NULL);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    set_slot(f, S_ENDED, Py_True);
    set_slot(f, S_TRAILING, Py_True);
    set_slot(f, S_AFTER_BACKWARD, Py_False);
    set_slot(f, S_AUTO, f->phase[P_BETWEEN]);
    Py_RETURN_NONE;
}

/* Where CPython keeps instances' `name` of type `t`: a writable object slot (__slots__), or -1 with a TypeError. */
static int slot_offset(PyTypeObject *t, const char *name, Py_ssize_t *off) {
    PyObject *d = PyObject_GetAttrString((PyObject *)t, name);
    if (d == NULL) return -1;
    int ok = Py_IS_TYPE(d, &PyMemberDescr_Type) && ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX &&
             !(((PyMemberDescrObject *)d)->d_member->flags & READONLY);
    if (ok) *off = ((PyMemberDescrObject *)d)->d_member->offset;
    Py_DECREF(d);
    if (!ok) PyErr_Format(PyExc_TypeError, "Fast: %s.%s is not a writable slot", t->tp_name, name);
    return ok ? 0 : -1;
}

/* Fast(bounds, engine, (forward, backward, optimizer, between, h2d, data_wait, sync_wait), time_module,
 *      flight_gap, poll_every) */
static int Fast_init(Fast *f, PyObject *args, PyObject *kwds) {
    PyObject *bounds, *engine, *phases, *time, *flight_gap;
    long long poll_every;
    if (!PyArg_ParseTuple(args, "OOO!OOL", &bounds, &engine, &PyTuple_Type, &phases, &time, &flight_gap, &poll_every))
        return -1;
    if (PyTuple_GET_SIZE(phases) != N_PHASES + 2) {
        PyErr_SetString(PyExc_ValueError,
                        "Fast: phases are (forward, backward, optimizer, between, h2d, data_wait, sync_wait)");
        return -1;
    }
    if (poll_every < 1) { PyErr_SetString(PyExc_ValueError, "Fast: poll_every must be >= 1"); return -1; }
    PyTypeObject *plain = Py_TYPE(bounds);
    for (int i = 0; i < N_SLOTS; i++)
        if (slot_offset(plain, slot_names[i], &f->off[i]) < 0) return -1;
    PyObject *core = *(PyObject **)((char *)bounds + f->off[S_CORE]);
    if (core == NULL) { PyErr_SetString(PyExc_TypeError, "Fast: the boundaries have no core"); return -1; }
    for (int i = 0; i < N_CSLOTS; i++)
        if (slot_offset(Py_TYPE(core), core_slot_names[i], &f->coff[i]) < 0) return -1;
    Py_INCREF(bounds);
    Py_XSETREF(f->bounds, bounds);
    Py_INCREF(plain);
    Py_XSETREF(f->plain, plain);
    Py_INCREF(engine);
    Py_XSETREF(f->engine, engine);
    Py_INCREF(core);
    Py_XSETREF(f->core, core);
    for (int i = 0; i < N_PHASES + 2; i++) {
        PyObject *p = PyTuple_GET_ITEM(phases, i);
        Py_INCREF(p);
        Py_XSETREF(f->phase[i], p);
    }
    PyObject *pcn;
    if (own_perf_counter(time, &pcn) < 0) return -1;
    Py_XSETREF(f->perf_counter_ns, pcn);
    Py_INCREF(time);
    Py_XSETREF(f->time, time);
    Py_INCREF(flight_gap);
    Py_XSETREF(f->flight_gap, flight_gap);
    f->poll_every = poll_every;
    return 0;
}

static int Fast_traverse(Fast *f, visitproc visit, void *arg) {
    Py_VISIT(f->bounds);
    Py_VISIT(f->plain);
    Py_VISIT(f->engine);
    Py_VISIT(f->core);
    Py_VISIT(f->time);
    Py_VISIT(f->perf_counter_ns);
    Py_VISIT(f->flight_gap);
    return 0;
}

static int Fast_clear(Fast *f) {
    Py_CLEAR(f->bounds);
    Py_CLEAR(f->plain);
    Py_CLEAR(f->engine);
    Py_CLEAR(f->core);
    Py_CLEAR(f->time);
    Py_CLEAR(f->perf_counter_ns);
    Py_CLEAR(f->flight_gap);
    for (int i = 0; i < N_PHASES + 2; i++) Py_CLEAR(f->phase[i]);
    return 0;
}

static void Fast_dealloc(Fast *f) {
    PyObject_GC_UnTrack(f);
    Fast_clear(f);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

static PyMethodDef Fast_methods[] = {
    {"forward", (PyCFunction)Fast_forward, METH_NOARGS, "Boundaries.forward() (a loop with a loader)."},
    {"copied", (PyCFunction)Fast_copied, METH_NOARGS, "Boundaries.copied()."},
    {"backward_start", (PyCFunction)Fast_backward_start, METH_NOARGS, "Boundaries.backward_start()."},
    {"backward_end", (PyCFunction)Fast_backward_end, METH_O, "Boundaries.backward_end(failed=failed)."},
    {"optimizer_start", (PyCFunction)Fast_optimizer_start, METH_NOARGS, "Boundaries.optimizer_start()."},
    {"step_end", (PyCFunction)Fast_step_end, METH_NOARGS, "Boundaries.step_end()."},
    {"fetch", (PyCFunction)Fast_fetch, METH_NOARGS, "Boundaries.fetch()."},
    {"batch", (PyCFunction)(void (*)(void))Fast_batch, METH_FASTCALL, "Boundaries.batch(step, data_wait_ms[, sync_wait_ms])."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FastType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "phase_timer._native.Fast",
    .tp_basicsize = sizeof(Fast),
    .tp_dealloc = (destructor)Fast_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The usual boundaries inside a step, one C call each, on a Boundaries' own state.",
    .tp_traverse = (traverseproc)Fast_traverse,
    .tp_clear = (inquiry)Fast_clear,
    .tp_methods = Fast_methods,
    .tp_init = (initproc)Fast_init,
    .tp_new = PyType_GenericNew,
};

/* -- the plain door's hooks (loop.LoopTimer) --------------------------------------------------------------
 * What torch and the loader wrapper call at each step, in C: each does what its LoopTimer method does in the
 * usual case -- the boundaries it was made with, the loop's thread known and this one, the loader the loop's,
 * grad enabled, no copy -- by calling the boundaries' own `on_*` (Fast's), and in every other case calls the
 * LoopTimer method itself (its class's, bound: `fallback`).  In a real loop a Python hook body costs ~1-2 µs
 * of frames and attribute lookups; this is one call.  The timer's state is read from its slots, so it is
 * always the one the Python methods read. */
enum { L_BOUNDS, L_THREAD, L_LOADER_ACTIVE, L_END_ON_OPTIMIZER, L_COPY, N_LSLOTS };
static const char *loop_slot_names[N_LSLOTS] = {"_bounds", "_thread", "_loader_active", "_end_on_optimizer", "_copy"};
enum { B_ON_FETCH, B_ON_BATCH, B_ON_FORWARD, B_ON_BACKWARD_START, B_ON_BACKWARD_END, B_ON_STEP_END, B_IN_BACKWARD,
       N_BSLOTS };
static const char *bounds_slot_names[N_BSLOTS] = {"on_fetch", "on_batch", "on_forward", "on_backward_start",
                                                  "on_backward_end", "on_step_end", "in_backward"};
enum { F_FETCH, F_ON_BATCH, F_FORWARD, F_BACKWARD_BEGAN, F_BACKWARD_ENDED, F_OPTIMIZER_END, N_FALLBACKS };

typedef struct {
    PyObject_HEAD
    PyObject *timer;        /* the LoopTimer */
    PyObject *bounds;       /* its Boundaries when these were made: another one (or none) takes the Python path */
    PyObject *grad_enabled; /* torch.is_grad_enabled */
    PyObject *time, *perf_counter_ns;  /* as Fast's (read_now) */
    PyObject *fallback[N_FALLBACKS];
    Py_ssize_t loff[N_LSLOTS], boff[N_BSLOTS];
} LoopHooks;

#define LSLOT(h, i) (*(PyObject **)((char *)(h)->timer + (h)->loff[i]))
#define BSLOT(h, i) (*(PyObject **)((char *)(h)->bounds + (h)->boff[i]))

/* The usual case's common part: the boundaries are the ones these were made with, the loop's thread is known
 * and is this one, and the loader is the loop's. */
static int loop_usual(LoopHooks *h) {
    if (LSLOT(h, L_BOUNDS) != h->bounds || LSLOT(h, L_LOADER_ACTIVE) != Py_True) return 0;
    PyObject *t = LSLOT(h, L_THREAD);
    if (t == NULL || !PyLong_CheckExact(t)) return 0;
    unsigned long ident = PyLong_AsUnsignedLong(t);
    if (ident == (unsigned long)-1 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
    return ident == PyThread_get_thread_ident();
}

static PyObject *call_slot(LoopHooks *h, int i, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *fn = BSLOT(h, i);
    if (fn == NULL) return PyErr_Format(PyExc_AttributeError, "Boundaries.%s is not set", bounds_slot_names[i]);
    return PyObject_Vectorcall(fn, args, nargs, NULL);
}

static PyObject *fallback(LoopHooks *h, int i, PyObject *const *args, Py_ssize_t nargs) {
    return PyObject_Vectorcall(h->fallback[i], args, nargs, NULL);
}

/* fetch(): LoopTimer._fetch */
static PyObject *LoopHooks_fetch(LoopHooks *h, PyObject *Py_UNUSED(ignored)) {
    if (!loop_usual(h)) return fallback(h, F_FETCH, NULL, 0);
    return call_slot(h, B_ON_FETCH, NULL, 0);
}

/* on_batch(batch, t0) -> batch: LoopTimer._on_batch (t0: perf_counter_ns before the loader's next()) */
static PyObject *LoopHooks_on_batch(LoopHooks *h, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "on_batch(batch, t0)"); return NULL; }
    if (!loop_usual(h) || LSLOT(h, L_COPY) != Py_False || !PyLong_CheckExact(args[1]))
        return fallback(h, F_ON_BATCH, args, nargs);
    long long t0 = PyLong_AsLongLong(args[1]);
    if (t0 == -1 && PyErr_Occurred()) return NULL;
    long long now = read_now(h->time, h->perf_counter_ns);
    if (now == -1 && PyErr_Occurred()) return NULL;
    PyObject *ms = PyFloat_FromDouble((double)(now - t0) / 1e6);  /* as Python's (now - t0) / 1e6 */
    if (ms == NULL) return NULL;
    PyObject *ba[2] = {Py_None, ms};
    PyObject *r = call_slot(h, B_ON_BATCH, ba, 2);
    Py_DECREF(ms);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    Py_INCREF(args[0]);
    return args[0];
}

/* forward(module, args): LoopTimer._on_forward, the model's forward pre-hook */
static PyObject *LoopHooks_forward(LoopHooks *h, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *bounds = LSLOT(h, L_BOUNDS);
    if (bounds == Py_None) Py_RETURN_NONE;
    if (bounds == h->bounds && BSLOT(h, B_IN_BACKWARD) == Py_True) Py_RETURN_NONE;  /* recomputation: backward's */
    if (!loop_usual(h) || BSLOT(h, B_IN_BACKWARD) != Py_False) return fallback(h, F_FORWARD, args, nargs);
    PyObject *grad = PyObject_CallNoArgs(h->grad_enabled);
    if (grad == NULL) return NULL;
    Py_DECREF(grad);  /* a bool: its identity is what counts */
    if (grad != Py_True) return fallback(h, F_FORWARD, args, nargs);  /* evaluation, maybe: the Python rule */
    PyObject *r = call_slot(h, B_ON_FORWARD, NULL, 0);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

/* backward_began() -> bool: LoopTimer._backward_began (a backward_calls listener) */
static PyObject *LoopHooks_backward_began(LoopHooks *h, PyObject *Py_UNUSED(ignored)) {
    if (LSLOT(h, L_BOUNDS) == Py_None) Py_RETURN_FALSE;
    if (!loop_usual(h)) return fallback(h, F_BACKWARD_BEGAN, NULL, 0);
    PyObject *r = call_slot(h, B_ON_BACKWARD_START, NULL, 0);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    PyObject *in_backward = BSLOT(h, B_IN_BACKWARD);
    if (in_backward == NULL) return PyErr_Format(PyExc_AttributeError, "Boundaries.in_backward is not set");
    Py_INCREF(in_backward);
    return in_backward;
}

/* backward_ended(failed): LoopTimer._backward_ended */
static PyObject *LoopHooks_backward_ended(LoopHooks *h, PyObject *failed) {
    PyObject *bounds = LSLOT(h, L_BOUNDS);
    if (bounds == Py_None) Py_RETURN_NONE;
    if (bounds != h->bounds) return fallback(h, F_BACKWARD_ENDED, &failed, 1);
    return call_slot(h, B_ON_BACKWARD_END, &failed, 1);
}

/* optimizer_end(opt): LoopTimer._on_optimizer_end (an optimizer's step post-hook) */
static PyObject *LoopHooks_optimizer_end(LoopHooks *h, PyObject *opt) {
    if (LSLOT(h, L_END_ON_OPTIMIZER) != Py_True || LSLOT(h, L_BOUNDS) != h->bounds ||
        LSLOT(h, L_LOADER_ACTIVE) != Py_True)
        return fallback(h, F_OPTIMIZER_END, &opt, 1);
    return call_slot(h, B_ON_STEP_END, NULL, 0);
}

/* LoopHooks(timer, bounds, grad_enabled, time_module, (fetch, on_batch, forward, backward_began,
 *           backward_ended, optimizer_end)): the last, the LoopTimer's own methods (its class's, bound). */
static int LoopHooks_init(LoopHooks *h, PyObject *args, PyObject *kwds) {
    PyObject *timer, *bounds, *grad, *time, *fallbacks;
    if (!PyArg_ParseTuple(args, "OOOOO!", &timer, &bounds, &grad, &time, &PyTuple_Type, &fallbacks)) return -1;
    if (PyTuple_GET_SIZE(fallbacks) != N_FALLBACKS) {
        PyErr_SetString(PyExc_ValueError, "LoopHooks: six fallbacks (fetch, on_batch, forward, backward_began, "
                                          "backward_ended, optimizer_end)");
        return -1;
    }
    for (int i = 0; i < N_LSLOTS; i++)
        if (slot_offset(Py_TYPE(timer), loop_slot_names[i], &h->loff[i]) < 0) return -1;
    for (int i = 0; i < N_BSLOTS; i++)
        if (slot_offset(Py_TYPE(bounds), bounds_slot_names[i], &h->boff[i]) < 0) return -1;
    PyObject *pcn;
    if (own_perf_counter(time, &pcn) < 0) return -1;
    Py_XSETREF(h->perf_counter_ns, pcn);
    Py_INCREF(timer); Py_XSETREF(h->timer, timer);
    Py_INCREF(bounds); Py_XSETREF(h->bounds, bounds);
    Py_INCREF(grad); Py_XSETREF(h->grad_enabled, grad);
    Py_INCREF(time); Py_XSETREF(h->time, time);
    for (int i = 0; i < N_FALLBACKS; i++) {
        PyObject *fn = PyTuple_GET_ITEM(fallbacks, i);
        Py_INCREF(fn);
        Py_XSETREF(h->fallback[i], fn);
    }
    return 0;
}

static int LoopHooks_traverse(LoopHooks *h, visitproc visit, void *arg) {
    Py_VISIT(h->timer);
    Py_VISIT(h->bounds);
    Py_VISIT(h->grad_enabled);
    Py_VISIT(h->time);
    Py_VISIT(h->perf_counter_ns);
    for (int i = 0; i < N_FALLBACKS; i++) Py_VISIT(h->fallback[i]);
    return 0;
}

static int LoopHooks_clear(LoopHooks *h) {
    Py_CLEAR(h->timer);
    Py_CLEAR(h->bounds);
    Py_CLEAR(h->grad_enabled);
    Py_CLEAR(h->time);
    Py_CLEAR(h->perf_counter_ns);
    for (int i = 0; i < N_FALLBACKS; i++) Py_CLEAR(h->fallback[i]);
    return 0;
}

static void LoopHooks_dealloc(LoopHooks *h) {
    PyObject_GC_UnTrack(h);
    LoopHooks_clear(h);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static PyMethodDef LoopHooks_methods[] = {
    {"fetch", (PyCFunction)LoopHooks_fetch, METH_NOARGS, "LoopTimer._fetch()."},
    {"on_batch", (PyCFunction)(void (*)(void))LoopHooks_on_batch, METH_FASTCALL, "LoopTimer._on_batch(batch, t0)."},
    {"forward", (PyCFunction)(void (*)(void))LoopHooks_forward, METH_FASTCALL, "LoopTimer._on_forward(module, args)."},
    {"backward_began", (PyCFunction)LoopHooks_backward_began, METH_NOARGS, "LoopTimer._backward_began()."},
    {"backward_ended", (PyCFunction)LoopHooks_backward_ended, METH_O, "LoopTimer._backward_ended(failed)."},
    {"optimizer_end", (PyCFunction)LoopHooks_optimizer_end, METH_O, "LoopTimer._on_optimizer_end(opt)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LoopHooksType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "phase_timer._native.LoopHooks",
    .tp_basicsize = sizeof(LoopHooks),
    .tp_dealloc = (destructor)LoopHooks_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The plain door's usual hooks, one C call each, on a LoopTimer's own state.",
    .tp_traverse = (traverseproc)LoopHooks_traverse,
    .tp_clear = (inquiry)LoopHooks_clear,
    .tp_methods = LoopHooks_methods,
    .tp_init = (initproc)LoopHooks_init,
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

static uint32_t masked_crc(const unsigned char *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) c = crc_table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    c ^= 0xFFFFFFFFu;
    return ((c >> 15) | (c << 17)) + 0xA282EAD8u;
}

/* masked_crc32c(data: bytes-like) -> int, the masking TFRecord applies to stored CRCs. */
static PyObject *masked_crc32c(PyObject *module, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    uint32_t c = masked_crc(view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(c);
}

static size_t varint_len(uint64_t v) {
    size_t n = 1;
    while (v >= 0x80) { v >>= 7; n++; }
    return n;
}

static unsigned char *put_varint(unsigned char *p, uint64_t v) {
    while (v >= 0x80) { *p++ = (unsigned char)(v | 0x80); v >>= 7; }
    *p++ = (unsigned char)v;
    return p;
}

static unsigned char *put_le(unsigned char *p, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) *p++ = (unsigned char)(v >> (8 * i));
    return p;
}

/* event_record(wall_time, step, scalars: {tag: float}) -> bytes: one TFRecord (length, its masked CRC-32C, the data,
 * its masked CRC) of the tensorboard `Event` proto {wall_time: 1, step: 2, summary: 5 {value: 1 [{tag: 1,
 * simple_value: 2 (float)}]}}, written as protobuf's own serializer writes it (proto3: a zero step and an empty
 * tag are left out; a oneof member, the summary and simple_value, never is).  What EventFileSink.write records,
 * without ~35 protobuf objects a window (its writer thread holds the GIL ~10x less). */
static PyObject *event_record(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyDict_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "event_record(wall_time, step, scalars: dict)");
        return NULL;
    }
    double wall = PyFloat_AsDouble(args[0]);
    if (wall == -1.0 && PyErr_Occurred()) return NULL;
    long long step = PyLong_AsLongLong(args[1]);
    if (step == -1 && PyErr_Occurred()) return NULL;
    /* The items, held (a value's __float__ could change the dict); first pass: the lengths (tags as UTF-8, kept
     * by the str objects themselves). */
    PyObject *items = PyDict_Items(args[2]);
    if (items == NULL) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(items), k = 0;
    size_t summary_len = 0;
    const char **tags = PyMem_Malloc((n ? n : 1) * sizeof(char *));
    Py_ssize_t *tag_len = PyMem_Malloc((n ? n : 1) * sizeof(Py_ssize_t));
    float *vals = PyMem_Malloc((n ? n : 1) * sizeof(float));
    PyObject *out = NULL;
    if (tags == NULL || tag_len == NULL || vals == NULL) { PyErr_NoMemory(); goto done; }
    for (k = 0; k < n; k++) {
        PyObject *item = PyList_GET_ITEM(items, k), *key = PyTuple_GET_ITEM(item, 0), *value = PyTuple_GET_ITEM(item, 1);
        if (!PyUnicode_Check(key)) { PyErr_Format(PyExc_TypeError, "event_record: a tag must be a str, got %R", key); goto done; }
        tags[k] = PyUnicode_AsUTF8AndSize(key, &tag_len[k]);
        if (tags[k] == NULL) goto done;
        double v = PyFloat_AsDouble(value);
        if (v == -1.0 && PyErr_Occurred()) goto done;
        vals[k] = (float)v;
        size_t value_len = (tag_len[k] ? 1 + varint_len((uint64_t)tag_len[k]) + (size_t)tag_len[k] : 0) + 5;
        summary_len += 1 + varint_len(value_len) + value_len;
    }
    uint64_t wall_bits;
    memcpy(&wall_bits, &wall, 8);
    /* proto3: a field at its default (all-zero bits: 0.0, not -0.0; step 0) is not written */
    size_t data_len = (wall_bits ? 9 : 0) + (step ? 1 + varint_len((uint64_t)step) : 0) + 1 + varint_len(summary_len) +
                      summary_len;
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(8 + 4 + data_len + 4));
    if (out == NULL) goto done;
    unsigned char *rec = (unsigned char *)PyBytes_AS_STRING(out), *p = rec + 12, *data = p;
    put_le(rec, data_len, 8);
    put_le(rec + 8, masked_crc(rec, 8), 4);
    if (wall_bits) {
        *p++ = 0x09;
        p = put_le(p, wall_bits, 8);
    }
    if (step) {
        *p++ = 0x10;
        p = put_varint(p, (uint64_t)step);
    }
    *p++ = 0x2A;
    p = put_varint(p, summary_len);
    for (Py_ssize_t i = 0; i < k; i++) {
        size_t value_len = (tag_len[i] ? 1 + varint_len((uint64_t)tag_len[i]) + (size_t)tag_len[i] : 0) + 5;
        *p++ = 0x0A;
        p = put_varint(p, value_len);
        if (tag_len[i]) {
            *p++ = 0x0A;
            p = put_varint(p, (uint64_t)tag_len[i]);
            memcpy(p, tags[i], (size_t)tag_len[i]);
            p += tag_len[i];
        }
        uint32_t bits;
        memcpy(&bits, &vals[i], 4);
        *p++ = 0x15;
        p = put_le(p, bits, 4);
    }
    put_le(p, masked_crc(data, data_len), 4);
done:
    Py_DECREF(items);
    PyMem_Free(tags);
    PyMem_Free(tag_len);
    PyMem_Free(vals);
    if (PyErr_Occurred()) Py_CLEAR(out);
    return out;
}

/* Add n to counts[key] (a dict of ints). */
static int count_add(PyObject *counts, double key, Py_ssize_t n) {
    PyObject *k = PyLong_FromDouble(key);
    if (k == NULL) return -1;
    PyObject *old = PyDict_GetItemWithError(counts, k);
    Py_ssize_t have = 0;
    if (old == NULL && PyErr_Occurred()) { Py_DECREF(k); return -1; }
    if (old != NULL && (have = PyLong_AsSsize_t(old)) == -1 && PyErr_Occurred()) { Py_DECREF(k); return -1; }
    PyObject *v = PyLong_FromSsize_t(have + n);
    int bad = v == NULL || PyDict_SetItem(counts, k, v) < 0;
    Py_XDECREF(v);
    Py_DECREF(k);
    return bad ? -1 : 0;
}

/* Count the values' buckets into `counts`, adding them up into *sum (left to right): 0, or -1 with an exception. */
static int count_buckets(PyObject *const *items, Py_ssize_t n, double inv, double zero, PyObject *counts, double *sum) {
    Py_ssize_t run = 0;
    double key = 0.0, total = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double v = PyFloat_AsDouble(items[i]);
        if (v == -1.0 && PyErr_Occurred()) return -1;
        double k;
        if (v <= 0.0) {
            k = zero;
        } else if (isfinite(v)) {
            k = floor(log(v) * inv);
        } else {
            PyErr_Format(isnan(v) ? PyExc_ValueError : PyExc_OverflowError, "bucket_counts: a duration of %R", items[i]);
            return -1;
        }
        total += v;
        if (run && k != key) {
            if (count_add(counts, key, run) < 0) return -1;
            run = 0;
        }
        key = k;
        run++;
    }
    if (run && count_add(counts, key, run) < 0) return -1;
    *sum = total;
    return 0;
}

static int bucket_args(PyObject *const *args, Py_ssize_t nargs, const char *usage, double *inv, double *zero) {
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    if (nargs == 4 && !PyDict_Check(args[3])) {
        PyErr_Format(PyExc_TypeError, "%s: `into` must be a dict", usage);
        return -1;
    }
    *inv = PyFloat_AsDouble(args[1]);
    if (*inv == -1.0 && PyErr_Occurred()) return -1;
    *zero = PyFloat_AsDouble(args[2]);  /* an int, exactly representable */
    return *zero == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* bucket_counts(values, inv_log_growth, zero_key[, into]) -> {bucket: count}: each value's bucket,
 * floor(log(v) * inv_log_growth) as Python's math.floor(math.log(v) * inv) computes it (the same libm
 * log), and values <= 0 in zero_key; counted into `into` (a dict, or a Counter: its own items, not
 * __missing__) when given, else a new dict.  What stats.PhaseTotals counts, in one pass; runs of one
 * bucket (sorted values) cost one dict update. */
static PyObject *bucket_counts(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    double inv, zero, sum;
    if (bucket_args(args, nargs, "bucket_counts(values, inv_log_growth, zero_key[, into])", &inv, &zero) < 0) return NULL;
    PyObject *seq = PySequence_Fast(args[0], "bucket_counts() takes a list of floats");
    if (seq == NULL) return NULL;
    PyObject *counts = nargs == 4 ? (Py_INCREF(args[3]), args[3]) : PyDict_New();
    int bad = counts == NULL ||
              count_buckets(PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq), inv, zero, counts, &sum) < 0;
    Py_DECREF(seq);
    if (bad) Py_CLEAR(counts);
    return counts;
}

/* The q-th percentile (0-100) of sorted floats by linear interpolation, as stats.percentile computes it. */
static double sorted_percentile(PyObject *const *items, Py_ssize_t n, double q) {
    double pos = (double)(n - 1) * q / 100.0;
    double lo = floor(pos);
    Py_ssize_t i = (Py_ssize_t)lo, j = i + 1 < n ? i + 1 : n - 1;
    double a = PyFloat_AsDouble(items[i]), b = PyFloat_AsDouble(items[j]);
    return a + (b - a) * (pos - lo);
}

/* sorted_stats(values, inv_log_growth, zero_key, into) -> (sum, p50, p90): a window's sorted column in one
 * pass -- its buckets counted into `into` (as bucket_counts), its sum (left to right), its median and 90th
 * percentile (as stats.percentile).  What stats.PhaseTotals.add_sorted needs. */
static PyObject *sorted_stats(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    double inv, zero, sum;
    const char *usage = "sorted_stats(values, inv_log_growth, zero_key, into)";
    if (nargs != 4) { PyErr_SetString(PyExc_TypeError, usage); return NULL; }
    if (bucket_args(args, nargs, usage, &inv, &zero) < 0) return NULL;
    if (!PyList_CheckExact(args[0]) || PyList_GET_SIZE(args[0]) == 0) {
        PyErr_SetString(PyExc_TypeError, "sorted_stats() takes a non-empty list of floats");
        return NULL;
    }
    PyObject *const *items = ((PyListObject *)args[0])->ob_item;
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    if (count_buckets(items, n, inv, zero, args[3], &sum) < 0) return NULL;
    return Py_BuildValue("(ddd)", sum, sorted_percentile(items, n, 50.0), sorted_percentile(items, n, 90.0));
}

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
