/*
 * native/clock.c: a part of phase_timer._native, included by ../_native.c (one translation unit: see there).
 *
 * Clock: pooled timing events of one device on the driver API, a mark one C call (torch.cuda.Event.record costs
 * ~1.8 us of host time on an H200 host, elapsed_time ~0.8 us). Its Python twin is phase_timer/timing/clock.py's
 * CudaClock, on torch's events (the same methods: mark, done, wait, elapsed_ms, spans, release): a method here is
 * one there; tests/test_gpu.py runs the engines on both.
 */
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
