/*
 * native/fast.c: a part of phase_timer._native, included by ../_native.c (one translation unit: see there).
 *
 * Fast: the boundaries' usual case (a plain step, not paused, no user phase, nothing due) in one C call each,
 * on a Boundaries' own slots (named by Boundaries.FAST_SLOTS and TimingCore.FAST_SLOTS, in this file's enums'
 * order). Boundaries' methods (phase_timer/run/boundaries.py) stay the one definition of every phase and take
 * every other case; tests/run/test_boundaries.py drives both with the same calls and compares. A change to a
 * boundary's usual case is one there and one here.
 */
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
/* The Boundaries slots the usual case reads and writes: their names are the class's own declaration,
 * Boundaries.FAST_SLOTS (phase_timer/run/boundaries.py), in this enum's order; Fast() takes their offsets from it. */
enum { S_OPEN, S_ENDED, S_TRAILING, S_PAUSED, S_IN_BACKWARD, S_AUTO, S_EXPLICIT, S_AFTER_BACKWARD, S_SAW_FORWARD,
       S_SAW_BACKWARD, S_FAILED, S_MEM_ON, S_FETCHED, S_STEPS, S_BEGUN, S_STEP, S_FLIGHT_AT, S_CENSUS_AT, S_SAMPLE_IN,
       S_MEM, S_MEM_DUE, S_CORE, S_MOD_ON, S_MOD_DUE, N_SLOTS };
enum { P_FORWARD, P_BACKWARD, P_OPTIMIZER, P_BETWEEN, P_H2D, N_PHASES };

/* The core's slots the usual case reads and writes: TimingCore.FAST_SLOTS (phase_timer/run/core.py), in this order. */
enum { C_IN_STEP, C_LAST_END, C_POLL_IN, C_BEGUN, C_WARMUP, C_CLOSED, C_TRACE, C_RANKS, C_ENGINE, N_CSLOTS };
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

/* Whether `name` is a writable object slot (__slots__) of type `t`, its offset then in *off.  Leaves no exception set. */
static int slot_offset(PyTypeObject *t, const char *name, Py_ssize_t *off) {
    PyObject *d = PyObject_GetAttrString((PyObject *)t, name);
    if (d == NULL) {
        PyErr_Clear();
        return 0;
    }
    int ok = Py_IS_TYPE(d, &PyMemberDescr_Type) && ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX &&
             !(((PyMemberDescrObject *)d)->d_member->flags & READONLY);
    if (ok) *off = ((PyMemberDescrObject *)d)->d_member->offset;
    Py_DECREF(d);
    return ok;
}

/* The offsets of the slots `t` declares in its class attribute `attr`: a tuple of `n` names, in the order of the
 * caller's enum (the one list of them: the class's).  0, or -1 with a TypeError that names the class, the tuple
 * and the name at fault. */
static int declared_slots(PyTypeObject *t, const char *attr, Py_ssize_t *off, Py_ssize_t n) {
    PyObject *decl = PyObject_GetAttrString((PyObject *)t, attr);
    if (decl == NULL) return -1;
    int rc = 0;
    if (!PyTuple_Check(decl) || PyTuple_GET_SIZE(decl) != n) {
        PyErr_Format(PyExc_TypeError, "phase_timer._native: %s.%s is not a tuple of %zd slot names", t->tp_name, attr,
                     n);
        rc = -1;
    }
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(decl, i);
        const char *s = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
        if (s == NULL || !slot_offset(t, s, &off[i])) {
            PyErr_Clear();  /* a non-str's */
            PyErr_Format(PyExc_TypeError, "phase_timer._native: %s.%s[%zd] (%R) is not a writable slot of %s",
                         t->tp_name, attr, i, name, t->tp_name);
            rc = -1;
        }
    }
    Py_DECREF(decl);
    return rc;
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
    if (declared_slots(plain, "FAST_SLOTS", f->off, N_SLOTS) < 0) return -1;
    PyObject *core = *(PyObject **)((char *)bounds + f->off[S_CORE]);
    if (core == NULL) { PyErr_SetString(PyExc_TypeError, "Fast: the boundaries have no core"); return -1; }
    if (declared_slots(Py_TYPE(core), "FAST_SLOTS", f->coff, N_CSLOTS) < 0) return -1;
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
