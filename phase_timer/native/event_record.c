/*
 * native/event_record.c: a part of phase_timer._native, included by ../_native.c (one translation unit: see there).
 *
 * One TensorBoard event record of scalars, whole, in C: the bytes protobuf serializes, ~4.6 us a record of 43
 * tags against ~36 through protobuf's C and ~190 through its Python (benchmarks/results/event_writer_cpu.txt).
 * Its twin is the protobuf path in phase_timer/outputs/sinks.py; tests/timing/test_native.py compares them byte
 * for byte.
 */
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
