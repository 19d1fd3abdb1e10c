/*
 * native/records.c: a part of phase_timer._native, included by ../_native.c (one translation unit: see there).
 *
 * The C engine's state (Steps, below and in steps.c): the open record, the ring of closed ones, the window's
 * columns, and the phase names' ids. Its Python twin is phase_timer/timing/recorder.py + resolver.py + stats.py
 * (PyEngine): tests/timing/test_engine.py drives both with the same calls, random ones included, and compares
 * every result; a change here is one there.
 */
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
