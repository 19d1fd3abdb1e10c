/*
 * native/loop_hooks.c: a part of phase_timer._native, included by ../_native.c (one translation unit: see there).
 *
 * LoopHooks: the plain door's hook bodies (phase_timer/doors/plain_hooks.py) in one C call each, on the hooks'
 * own slots (PlainHooks.HOOK_SLOTS, Boundaries.HOOK_SLOTS). The Python methods take every other case;
 * tests/doors/test_loop_hooks.py runs the same loops with and without them and compares.
 */
/* -- the plain door's hooks (loop.LoopTimer) --------------------------------------------------------------
 * What torch and the loader wrapper call at each step, in C: each does what its LoopTimer method does in the
 * usual case -- the boundaries it was made with, the loop's thread known and this one, the loader the loop's,
 * grad enabled, no copy -- by calling the boundaries' own `on_*` (Fast's), and in every other case calls the
 * LoopTimer method itself (its class's, bound: `fallback`).  In a real loop a Python hook body costs ~1-2 µs
 * of frames and attribute lookups; this is one call.  The timer's state is read from its slots, so it is
 * always the one the Python methods read. */
/* The hooks' state: PlainHooks.HOOK_SLOTS (phase_timer/doors/plain_hooks.py), and of the boundaries
 * Boundaries.HOOK_SLOTS (phase_timer/run/boundaries.py), each in its enum's order. */
enum { L_BOUNDS, L_THREAD, L_LOADER_ACTIVE, L_END_ON_OPTIMIZER, L_COPY, N_LSLOTS };
enum { B_ON_FETCH, B_ON_BATCH, B_ON_FORWARD, B_ON_BACKWARD_START, B_ON_BACKWARD_END, B_ON_STEP_END, B_IN_BACKWARD,
       N_BSLOTS };
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
    if (fn == NULL) {  /* its name from the class's declaration, read on this error alone */
        PyObject *decl = PyObject_GetAttrString((PyObject *)Py_TYPE(h->bounds), "HOOK_SLOTS");
        PyObject *name = decl != NULL && PyTuple_Check(decl) && i < PyTuple_GET_SIZE(decl) ? PyTuple_GET_ITEM(decl, i)
                                                                                             : NULL;
        PyErr_Clear();
        if (name != NULL)
            PyErr_Format(PyExc_AttributeError, "%s.%U is not set", Py_TYPE(h->bounds)->tp_name, name);
        else
            PyErr_Format(PyExc_AttributeError, "%s.HOOK_SLOTS[%d] is not set", Py_TYPE(h->bounds)->tp_name, i);
        Py_XDECREF(decl);
        return NULL;
    }
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
    if (declared_slots(Py_TYPE(timer), "HOOK_SLOTS", h->loff, N_LSLOTS) < 0 ||
        declared_slots(Py_TYPE(bounds), "HOOK_SLOTS", h->boff, N_BSLOTS) < 0)
        return -1;
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
