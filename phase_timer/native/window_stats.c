/*
 * native/window_stats.c: a part of phase_timer._native, included by ../_native.c (one translation unit: see there).
 *
 * A window's column statistics: each value's log bucket and the sorted column's sum, median and p90 in one
 * call. Its Python twin is phase_timer/timing/stats.py (_bucket_counts_py, _sorted_stats_py);
 * tests/run/test_core.py compares them.
 */
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
