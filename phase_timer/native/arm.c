/*
 * native/arm.c: a part of phase_timer._native, included by ../_native.c (one translation unit: see there).
 *
 * Arm: DDP's split's hook on one parameter's gradient accumulation (phase_timer/measures/comm/ddp.py), which
 * runs every backward on the autograd thread, where a Python frame costs a few us. Its Python twin is the hook
 * ddp.py registers where the C is not built; tests/measures/comm/test_comm_module.py runs the split with both.
 */
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
