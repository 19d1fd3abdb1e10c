/*
 * native/resolver.c: a part of phase_timer._native, included by ../_native.c (one translation unit: see there).
 *
 * The resolver thread of a threaded engine: it asks the device whether the oldest records are done and reads
 * their spans without the GIL, so poll() on the training thread only takes what it resolved. No Python twin
 * (the Python engine resolves inline); tests/test_gpu.py runs the threaded
 * engine on a device (an engine on the host clock has no thread).
 */
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
