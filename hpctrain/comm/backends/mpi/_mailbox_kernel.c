/* The mailbox's small all-reduce in C: post, wait briefly, sum every rank's payload in rank order;
 * and the same exchange without the sum (post, check), for the reduce-scatters and all-gathers that ride it.
 *
 * Optional.  hpctrain.comm.mpi.mailbox.Mailbox uses it when it was built and its
 * own Python exchange otherwise; both follow the same protocol on the same
 * shared window (see the module docstring of hpctrain/comm/backends/mpi/mailbox.py), so
 * ranks on either path meet, and both reduce in rank order, so the bits are
 * the same as numpy's:
 *
 *   out = x_0 + x_1 + ... + x_{n-1}   (float32, float64; int32, int64 wrap around)
 *
 * Cost per call for N bytes on L ranks: one copy of N bytes into the own slot,
 * one release store of the flag, polls of L - 1 flags (spinning, then yielding the core), reads of L N bytes,
 * writes of N.  What the C saves is the interpreter: about 4 µs of Python per
 * call at 4 KiB against about 1 µs here.
 *
 * A slot is a 64-byte header of int64 (flag, hash of the call, payload bytes,
 * call bytes), the encoded call, then the payload.  A writer stores the
 * header and payload, then the flag with release order; a reader loads the
 * flag with acquire order, then the rest.  The Python path gets the same
 * order from MPI_Win_sync.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sched.h>
#include <time.h>

enum { FLAG = 0, HASH = 1, BYTES = 2, DESC = 3 };
enum { F32 = 0, F64 = 1, I32 = 2, I64 = 3 };
enum { DONE = 0, MISMATCH = 1, WAIT = 2 };

typedef struct {
    PyObject_HEAD
    Py_ssize_t rank, size, capacity;
    long long spin_ns, yield_ns;
    int64_t **heads;      /* slot s of rank r: heads[s * size + r] */
    char **payloads;
} Kernel;

static void
cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static long long
now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void
Kernel_dealloc(Kernel *self)
{
    PyMem_Free(self->heads);
    PyMem_Free(self->payloads);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Kernel(rank, size, capacity, spin_ns, yield_ns, head_addresses, payload_addresses), slot-major addresses. */
static int
Kernel_init(Kernel *self, PyObject *args, PyObject *kwds)
{
    PyObject *heads, *payloads;
    (void)kwds;
    if (!PyArg_ParseTuple(args, "nnnLLOO", &self->rank, &self->size, &self->capacity, &self->spin_ns,
                          &self->yield_ns, &heads, &payloads))
        return -1;
    Py_ssize_t count = 2 * self->size;
    if (self->size < 1 || self->rank < 0 || self->rank >= self->size || !PySequence_Check(heads)
        || !PySequence_Check(payloads) || PySequence_Size(heads) != count || PySequence_Size(payloads) != count) {
        PyErr_SetString(PyExc_ValueError, "Kernel: expected 0 <= rank < size and 2 * size addresses of each kind");
        return -1;
    }
    PyMem_Free(self->heads);
    PyMem_Free(self->payloads);
    self->heads = PyMem_Calloc(count, sizeof(int64_t *));
    self->payloads = PyMem_Calloc(count, sizeof(char *));
    if (!self->heads || !self->payloads) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *h = PySequence_GetItem(heads, i), *p = PySequence_GetItem(payloads, i);
        if (h && p) {
            self->heads[i] = (int64_t *)PyLong_AsVoidPtr(h);
            self->payloads[i] = (char *)PyLong_AsVoidPtr(p);
        }
        Py_XDECREF(h);
        Py_XDECREF(p);
        if (PyErr_Occurred())
            return -1;
    }
    return 0;
}

static int
all_posted(Kernel *self, int64_t k, Py_ssize_t s)
{
    int64_t **heads = self->heads + s * self->size;
    for (Py_ssize_t r = 0; r < self->size; r++)
        if (r != self->rank && __atomic_load_n(&heads[r][FLAG], __ATOMIC_ACQUIRE) < k)
            return 0;
    return 1;
}

/* Whether every peer's flag in slot s has reached k: polls for spin_ns, then yields the core (without
 * the GIL) until yield_ns more have passed.  A rank with a core of its own spins; oversubscribed ranks
 * (spin_ns = 0) yield at once, so the peer they wait for gets the core. */
static int
arrived(Kernel *self, int64_t k, Py_ssize_t s)
{
    if (all_posted(self, k, s))
        return 1;
    long long start = now_ns();
    for (unsigned polls = 1; self->spin_ns > 0; polls++) {
        cpu_relax();
        if (all_posted(self, k, s))
            return 1;
        if ((polls & 63) == 0 && now_ns() - start >= self->spin_ns)
            break;
    }
    int ok = 0;
    if (self->yield_ns > 0) {
        Py_BEGIN_ALLOW_THREADS
        while (!(ok = all_posted(self, k, s)) && now_ns() - start < self->spin_ns + self->yield_ns)
            sched_yield();
        Py_END_ALLOW_THREADS
    }
    return ok;
}

#define SUM_LOOP(T)                                                             \
    do {                                                                        \
        T *o = (T *)out;                                                        \
        const T *a = (const T *)in[0], *b = (const T *)in[1];                   \
        for (Py_ssize_t i = 0; i < count; i++)                                  \
            o[i] = (T)(a[i] + b[i]);                                            \
        for (Py_ssize_t r = 2; r < size; r++) {                                 \
            const T *c = (const T *)in[r];                                      \
            for (Py_ssize_t i = 0; i < count; i++)                              \
                o[i] = (T)(o[i] + c[i]);                                        \
        }                                                                       \
    } while (0)

/* out = in[0] + in[1] + ... (left to right, as numpy's chain of np.add); integers wrap around. */
static void
sum_into(char *out, char *const *in, Py_ssize_t size, Py_ssize_t nbytes, int code)
{
    if (size == 1) {
        memcpy(out, in[0], nbytes);
        return;
    }
    Py_ssize_t count;
    switch (code) {
    case F32: count = nbytes / 4; SUM_LOOP(float); break;
    case F64: count = nbytes / 8; SUM_LOOP(double); break;
    case I32: count = nbytes / 4; SUM_LOOP(uint32_t); break;
    default:  count = nbytes / 8; SUM_LOOP(uint64_t); break;
    }
}

/* Check every rank's hash in slot s, then sum the payloads into out. */
static int
reduce_slot(Kernel *self, Py_ssize_t s, int64_t key_hash, char *out, Py_ssize_t nbytes, int code)
{
    int64_t **heads = self->heads + s * self->size;
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    for (Py_ssize_t r = 0; r < self->size; r++)
        if (heads[r][HASH] != key_hash)
            return MISMATCH;
    sum_into(out, self->payloads + s * self->size, self->size, nbytes, code);
    return DONE;
}

static int
get_buffers(PyObject *x, PyObject *out, Py_buffer *xv, Py_buffer *ov, Py_ssize_t capacity)
{
    if (x != NULL && PyObject_GetBuffer(x, xv, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (PyObject_GetBuffer(out, ov, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        if (x != NULL)
            PyBuffer_Release(xv);
        return -1;
    }
    if ((x != NULL && xv->len != ov->len) || ov->len > capacity) {
        PyErr_Format(PyExc_ValueError, "Kernel: input and output must have the same bytes, at most %zd", capacity);
        if (x != NULL)
            PyBuffer_Release(xv);
        PyBuffer_Release(ov);
        return -1;
    }
    return 0;
}

static int
parse_code(PyObject *obj, int *code)
{
    long c = PyLong_AsLong(obj);
    if (c == -1 && PyErr_Occurred())
        return -1;
    if (c < F32 || c > I64) {
        PyErr_SetString(PyExc_ValueError, "Kernel: unknown dtype code");
        return -1;
    }
    *code = (int)c;
    return 0;
}

/* allreduce(k, key_hash, desc_bytes, x, out, code) -> 0 done, 1 calls differ, 2 peers not yet here (then reduce()). */
static PyObject *
Kernel_allreduce(Kernel *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "allreduce(k, key_hash, desc_bytes, x, out, code)");
        return NULL;
    }
    int64_t k = PyLong_AsLongLong(args[0]), key_hash = PyLong_AsLongLong(args[1]);
    int64_t desc = PyLong_AsLongLong(args[2]);
    int code;
    if (PyErr_Occurred() || parse_code(args[5], &code) < 0)
        return NULL;
    Py_buffer xv, ov;
    if (get_buffers(args[3], args[4], &xv, &ov, self->capacity) < 0)
        return NULL;
    Py_ssize_t s = k & 1;
    int64_t *head = self->heads[s * self->size + self->rank];
    memcpy(self->payloads[s * self->size + self->rank], xv.buf, xv.len);
    head[HASH] = key_hash;
    head[BYTES] = xv.len;
    head[DESC] = desc;
    __atomic_store_n(&head[FLAG], k, __ATOMIC_RELEASE);
    int rc = arrived(self, k, s) ? reduce_slot(self, s, key_hash, ov.buf, ov.len, code) : WAIT;
    PyBuffer_Release(&xv);
    PyBuffer_Release(&ov);
    return PyLong_FromLong(rc);
}

/* reduce(k, key_hash, out, code) -> 0 done, 1 calls differ: after every peer posted exchange k. */
static PyObject *
Kernel_reduce(Kernel *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "reduce(k, key_hash, out, code)");
        return NULL;
    }
    int64_t k = PyLong_AsLongLong(args[0]), key_hash = PyLong_AsLongLong(args[1]);
    int code;
    if (PyErr_Occurred() || parse_code(args[3], &code) < 0)
        return NULL;
    Py_buffer ov;
    if (get_buffers(NULL, args[2], NULL, &ov, self->capacity) < 0)
        return NULL;
    int rc = reduce_slot(self, k & 1, key_hash, ov.buf, ov.len, code);
    PyBuffer_Release(&ov);
    return PyLong_FromLong(rc);
}

/* Whether every rank's hash in slot s is key_hash (after every peer posted). */
static int
hashes_match(Kernel *self, Py_ssize_t s, int64_t key_hash)
{
    int64_t **heads = self->heads + s * self->size;
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    for (Py_ssize_t r = 0; r < self->size; r++)
        if (heads[r][HASH] != key_hash)
            return 0;
    return 1;
}

/* post(k, key_hash, desc_bytes, x or None, announce) -> 0 every rank here with this call, 1 calls differ,
 * 2 peers not yet here (then check()).  x's bytes go into the own slot as they are; without x, announce is
 * posted as the payload's bytes. */
static PyObject *
Kernel_post(Kernel *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "post(k, key_hash, desc_bytes, x or None, announce)");
        return NULL;
    }
    int64_t k = PyLong_AsLongLong(args[0]), key_hash = PyLong_AsLongLong(args[1]);
    int64_t desc = PyLong_AsLongLong(args[2]), nbytes = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    Py_ssize_t s = k & 1;
    int64_t *head = self->heads[s * self->size + self->rank];
    if (args[3] != Py_None) {
        Py_buffer xv;
        if (PyObject_GetBuffer(args[3], &xv, PyBUF_C_CONTIGUOUS) < 0)
            return NULL;
        if (xv.len > self->capacity) {
            PyBuffer_Release(&xv);
            PyErr_Format(PyExc_ValueError, "Kernel: a payload of at most %zd bytes", self->capacity);
            return NULL;
        }
        memcpy(self->payloads[s * self->size + self->rank], xv.buf, xv.len);
        nbytes = xv.len;
        PyBuffer_Release(&xv);
    }
    head[HASH] = key_hash;
    head[BYTES] = nbytes;
    head[DESC] = desc;
    __atomic_store_n(&head[FLAG], k, __ATOMIC_RELEASE);
    if (!arrived(self, k, s))
        return PyLong_FromLong(WAIT);
    return PyLong_FromLong(hashes_match(self, s, key_hash) ? DONE : MISMATCH);
}

/* check(k, key_hash) -> 0 every rank posted key_hash in exchange k, 1 not: after every peer posted it. */
static PyObject *
Kernel_check(Kernel *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "check(k, key_hash)");
        return NULL;
    }
    int64_t k = PyLong_AsLongLong(args[0]), key_hash = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromLong(hashes_match(self, k & 1, key_hash) ? DONE : MISMATCH);
}

/* gather(k) -> bytearray of every rank's payload of exchange k in rank order, or None when a rank posted
 * none (its announced bytes exceed the capacity): after every peer posted it. */
static PyObject *
Kernel_gather(Kernel *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "gather(k)");
        return NULL;
    }
    int64_t k = PyLong_AsLongLong(args[0]);
    if (PyErr_Occurred())
        return NULL;
    Py_ssize_t s = k & 1, total = 0;
    int64_t **heads = self->heads + s * self->size;
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    for (Py_ssize_t r = 0; r < self->size; r++) {
        if (heads[r][BYTES] < 0 || heads[r][BYTES] > self->capacity)
            Py_RETURN_NONE;
        total += (Py_ssize_t)heads[r][BYTES];
    }
    PyObject *out = PyByteArray_FromStringAndSize(NULL, total);
    if (out == NULL)
        return NULL;
    char *dst = PyByteArray_AS_STRING(out);
    for (Py_ssize_t r = 0; r < self->size; r++) {
        memcpy(dst, self->payloads[s * self->size + r], (size_t)heads[r][BYTES]);
        dst += heads[r][BYTES];
    }
    return out;
}

static PyMethodDef Kernel_methods[] = {
    {"allreduce", (PyCFunction)(void (*)(void))Kernel_allreduce, METH_FASTCALL,
     "allreduce(k, key_hash, desc_bytes, x, out, code) -> 0 done, 1 calls differ, 2 wait, then reduce()"},
    {"reduce", (PyCFunction)(void (*)(void))Kernel_reduce, METH_FASTCALL,
     "reduce(k, key_hash, out, code) -> 0 done, 1 calls differ"},
    {"post", (PyCFunction)(void (*)(void))Kernel_post, METH_FASTCALL,
     "post(k, key_hash, desc_bytes, x or None, announce) -> 0 all here, 1 calls differ, 2 wait, then check()"},
    {"gather", (PyCFunction)(void (*)(void))Kernel_gather, METH_FASTCALL,
     "gather(k) -> bytearray of every rank's payload in rank order, or None if one did not travel"},
    {"check", (PyCFunction)(void (*)(void))Kernel_check, METH_FASTCALL,
     "check(k, key_hash) -> 0 all posted key_hash, 1 not"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject KernelType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hpctrain.comm._mailbox_kernel.Kernel",
    .tp_doc = "The mailbox's small all-reduce over one shared window (see hpctrain/comm/backends/mpi/mailbox.py).",
    .tp_basicsize = sizeof(Kernel),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Kernel_init,
    .tp_dealloc = (destructor)Kernel_dealloc,
    .tp_methods = Kernel_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_mailbox_kernel",
    "The mailbox's small all-reduce in C (optional; see hpctrain/comm/backends/mpi/mailbox.py).", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__mailbox_kernel(void)
{
    if (PyType_Ready(&KernelType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&KernelType);
    if (PyModule_AddObject(m, "Kernel", (PyObject *)&KernelType) < 0) {
        Py_DECREF(&KernelType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
