/*
 * native/steps.c: a part of phase_timer._native, included by ../_native.c (one translation unit: see there).
 *
 * Steps' methods: open, switch, end, close, poll, drain, flush, and the questions (behind, in_flight,
 * newest_done). The Python twin and its test: records.c's note.
 */
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
