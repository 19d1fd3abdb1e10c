/*
 * native/driver.c: a part of phase_timer._native, included by ../_native.c (one translation unit: see there).
 *
 * The CUDA driver's entry points, looked up by name in libcuda.so.1 (already loaded by torch) at the first
 * Clock: nothing is linked against CUDA, so the extension builds with a C compiler and Python's headers alone
 * and imports on a machine with no GPU (where Clock() raises and phase-timer uses torch's events). No Python
 * twin: nothing to keep in lockstep.
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
