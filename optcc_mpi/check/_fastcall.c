/* The compiled call path of a short AllReduce (optcc_mpi.check.fastcall).
 *
 * One function, fold(), does in C what optcc_mpi.collectives does in Python for the
 * commonest short call (two NumPy arrays, default arguments): take both buffers, check
 * them, write the 96-byte header into the check's block, call MPI_Allgather and compare
 * every rank's header with its own. Up to the communicator's gather limit
 * (optcc_mpi.check.crossover) the data travels in the block and the gathered rows are reduced
 * in rank order; above it the library's MPI_Allreduce follows the check, in place as on
 * the Python path (copy first, then MPI_IN_PLACE), with the canonical NaN after a float
 * sum or product. The header is byte for byte the one the Python path writes, and the
 * collectives are the same, so ranks on either path agree with each other.
 *
 * It never links MPI: the caller passes the address of the MPI_Allgather that mpi4py
 * itself calls and the size of the MPI library's handles (4 bytes for MPICH's integers,
 * 8 for the pointers of Open MPI and of the standard ABI). Anything the function does not
 * handle (another kind of buffer, a type or op outside its table, a size whose check room
 * would change) is answered with FALLBACK before anything is written or sent, and the
 * Python path then runs the whole call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define HEADER_FIELDS 12
#define HEADER_BYTES (HEADER_FIELDS * 8)
#define MAX_FORMATS 32

/* fold()'s answers (the Python side names them). */
#define FALLBACK -1
#define DONE 0
#define GATHERED 1 /* agreed and gathered; the caller reduces */
#define MISMATCH 2 /* the headers differ: every rank raises */
#define LIBRARY 3  /* done by the check and the library's AllReduce */
/* An MPI error code e from MPI_Allgather is answered as -1000 - e. */

/* How the gathered rows are reduced here (0: by the caller). */
enum { RED_NONE = 0, RED_F32, RED_F64, RED_I32, RED_I64 };

typedef int (*allgather_int)(const void *, int, int, void *, int, int, int);
typedef int (*allgather_ptr)(const void *, int, void *, void *, int, void *, void *);
typedef int (*allreduce_int)(const void *, void *, int, int, int, int);
typedef int (*allreduce_ptr)(const void *, void *, int, void *, void *, void *);

#define MAX_OPS 32

/* The library's AllReduce of one (type, op): its handles, and the float width whose NaNs
 * are made canonical afterwards (0: none). */
typedef struct {
    int on;
    intptr_t datatype, op;
    int nan_width;
} library_entry;

typedef struct {
    char format[8];
    int64_t code;     /* the dtype's code in the header */
    Py_ssize_t itemsize;
    uint32_t ops;     /* bit i: op i is defined on this type */
    int reduce_sum;   /* RED_* for op 0 (sum), or RED_NONE */
} fmt_entry;

typedef struct {
    void *allgather, *allreduce, *in_place;
    int handle_size;
    intptr_t comm, byte_type;
    int p;
    /* The room of these buffers; the message sizes lo < n <= hi it serves (computed by
     * optcc_mpi.check.state.served: this file holds no copy of the sizing rule); the least
     * room; the gather limit. */
    Py_ssize_t capacity, lo, hi, least, limit;
    Py_buffer block, gathered;
    int64_t header[HEADER_FIELDS];
    int n_formats;
    fmt_entry formats[MAX_FORMATS];
    library_entry library[MAX_FORMATS][MAX_OPS];
} context;

static const char *CAPSULE = "optcc_mpi.check._fastcall.context";

static void context_free(PyObject *capsule)
{
    context *ctx = PyCapsule_GetPointer(capsule, CAPSULE);
    if (ctx == NULL)
        return;
    PyBuffer_Release(&ctx->block);
    PyBuffer_Release(&ctx->gathered);
    PyMem_Free(ctx);
}

/* make(allgather, handle_size, comm, byte_type, p, capacity, lo, hi, least, limit, block,
 *      gathered, header, formats, allreduce, in_place, library) -> context
 * header: the 12 header fields with those of the call (count, dtype, op, bytes, room)
 * zero; formats: (buffer format, dtype code, itemsize, op mask, sum kind) per type;
 * library: (format index, op code, datatype handle, op handle, NaN width) per pair the
 * library's AllReduce may take above the limit (none: every such call falls back). */
static PyObject *make(PyObject *self, PyObject *args)
{
    /* Handles as mpi4py gives them: unsigned (an MPICH int handle comes sign-extended). */
    unsigned long long allgather, comm, byte_type, allreduce, in_place;
    int handle_size, p;
    Py_ssize_t capacity, lo, hi, least, limit;
    PyObject *block, *gathered, *header, *formats, *library;
    if (!PyArg_ParseTuple(args, "KiKKinnnnnOOO!O!KKO!", &allgather, &handle_size, &comm,
                          &byte_type, &p, &capacity, &lo, &hi, &least, &limit, &block,
                          &gathered,
                          &PyTuple_Type, &header, &PyTuple_Type, &formats, &allreduce,
                          &in_place, &PyTuple_Type, &library))
        return NULL;
    if (handle_size != 4 && handle_size != (int)sizeof(void *)) {
        PyErr_Format(PyExc_ValueError, "unsupported MPI handle size %d", handle_size);
        return NULL;
    }
    if (PyTuple_GET_SIZE(header) != HEADER_FIELDS || PyTuple_GET_SIZE(formats) > MAX_FORMATS) {
        PyErr_SetString(PyExc_ValueError, "bad header or format table");
        return NULL;
    }
    context *ctx = PyMem_Calloc(1, sizeof(context));
    if (ctx == NULL)
        return PyErr_NoMemory();
    ctx->allgather = (void *)(uintptr_t)allgather;
    ctx->allreduce = (void *)(uintptr_t)allreduce;
    ctx->in_place = (void *)(uintptr_t)in_place;
    ctx->handle_size = handle_size;
    ctx->comm = (intptr_t)comm;
    ctx->byte_type = (intptr_t)byte_type;
    ctx->p = p;
    ctx->capacity = capacity;
    ctx->lo = lo;
    ctx->hi = hi;
    ctx->least = least;
    ctx->limit = limit;
    for (int i = 0; i < HEADER_FIELDS; i++) {
        ctx->header[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(header, i));
    }
    ctx->n_formats = (int)PyTuple_GET_SIZE(formats);
    for (int i = 0; i < ctx->n_formats; i++) {
        fmt_entry *f = &ctx->formats[i];
        const char *text;
        long long code;
        unsigned int ops;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(formats, i), "sLnIi", &text, &code,
                              &f->itemsize, &ops, &f->reduce_sum)
            || strlen(text) >= sizeof(f->format)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "format too long");
            PyMem_Free(ctx);
            return NULL;
        }
        strcpy(f->format, text);
        f->code = code;
        f->ops = ops;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(library); i++) {
        int fi, op, width;
        unsigned long long datatype, mpi_op;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(library, i), "iiKKi", &fi, &op, &datatype,
                              &mpi_op, &width)
            || fi < 0 || fi >= ctx->n_formats || op < 0 || op >= MAX_OPS
            || (width != 0 && width != 4 && width != 8) || !allreduce) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "bad library entry");
            PyMem_Free(ctx);
            return NULL;
        }
        library_entry *e = &ctx->library[fi][op];
        e->on = 1;
        e->datatype = (intptr_t)datatype;
        e->op = (intptr_t)mpi_op;
        e->nan_width = width;
    }
    if (PyErr_Occurred()) {
        PyMem_Free(ctx);
        return NULL;
    }
    if (PyObject_GetBuffer(block, &ctx->block, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyMem_Free(ctx);
        return NULL;
    }
    if (PyObject_GetBuffer(gathered, &ctx->gathered, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&ctx->block);
        PyMem_Free(ctx);
        return NULL;
    }
    if (ctx->block.len != HEADER_BYTES + capacity || ctx->gathered.len != p * ctx->block.len) {
        PyBuffer_Release(&ctx->block);
        PyBuffer_Release(&ctx->gathered);
        PyMem_Free(ctx);
        PyErr_SetString(PyExc_ValueError, "block and gathered do not match the capacity");
        return NULL;
    }
    PyObject *capsule = PyCapsule_New(ctx, CAPSULE, context_free);
    if (capsule == NULL) {
        PyBuffer_Release(&ctx->block);
        PyBuffer_Release(&ctx->gathered);
        PyMem_Free(ctx);
    }
    return capsule;
}

/* x + y with the NaN NumPy's np.add(x, y) gives: where both are NaN, x's (quieted), as
 * the hardware's addition returns its first operand's. C's + is commutative, and the
 * compiler may well compute y + x (it did: the later rank's NaN won, issue 44), so where
 * x is a NaN the sum is x + x, the same whatever the order. Integers: never NaN. */
#define ADD_FIRST(x, y) ((x) + ((x) != (x) ? (x) : (y)))

/* out = rows[0] + rows[1] + ... in rank order, in the element type (the integers wrap,
 * as NumPy's do; unsigned arithmetic keeps that defined in C). Each element is one IEEE
 * addition per row whatever the compiler vectorises, and a NaN meeting a NaN keeps the
 * earlier rank's, so these are NumPy's bits (tests/test_reduction_order.py). */
#define SUM_ROWS(T)                                                                 \
    do {                                                                            \
        T *restrict o = (T *)out;                                                   \
        const T *restrict a = (const T *)(rows);                                    \
        const T *restrict b = (const T *)(rows + stride);                           \
        for (Py_ssize_t i = 0; i < n; i++)                                          \
            o[i] = ADD_FIRST(a[i], b[i]);                                           \
        for (int r = 2; r < p; r++) {                                               \
            const T *c = (const T *)(rows + (Py_ssize_t)r * stride);                \
            for (Py_ssize_t i = 0; i < n; i++)                                      \
                o[i] = ADD_FIRST(o[i], c[i]);                                       \
        }                                                                           \
    } while (0)

static void reduce_sum(int kind, char *out, const char *rows, Py_ssize_t stride, int p,
                       Py_ssize_t n)
{
    switch (kind) {
    case RED_F32: SUM_ROWS(float); break;
    case RED_F64: SUM_ROWS(double); break;
    case RED_I32: SUM_ROWS(uint32_t); break;
    case RED_I64: SUM_ROWS(uint64_t); break;
    default: break;
    }
}

/* Every NaN of n floats of `width` bytes made the canonical quiet one (as
 * optcc_mpi.reductions.canonical_nans: the library may pick either operand's NaN). A
 * read-only scan first (x != x: vectorised, and NaNs are rare), then the rewrite if any. */
#define CANONICAL_NANS(F, T, MAGNITUDE, INF, NAN_BITS)                              \
    do {                                                                            \
        const F *x = (const F *)buf;                                                \
        int any = 0;                                                                \
        for (Py_ssize_t i = 0; i < n; i++)                                          \
            any |= x[i] != x[i];                                                    \
        if (any) {                                                                  \
            T *u = (T *)buf;                                                        \
            for (Py_ssize_t i = 0; i < n; i++)                                      \
                if ((u[i] & (MAGNITUDE)) > (INF))                                   \
                    u[i] = (NAN_BITS);                                              \
        }                                                                           \
    } while (0)

static __attribute__((noinline)) void canonical_nans(char *buf, Py_ssize_t n, int width)
{
    if (width == 4)
        CANONICAL_NANS(float, uint32_t, 0x7FFFFFFFu, 0x7F800000u, 0x7FC00000u);
    else if (width == 8)
        CANONICAL_NANS(double, uint64_t, 0x7FFFFFFFFFFFFFFFull, 0x7FF0000000000000ull,
                       0x7FF8000000000000ull);
}

/* fold(context, sendbuf, recvbuf, op code, compare) -> FALLBACK, DONE, GATHERED,
 * MISMATCH, LIBRARY, or -1000 - e for an MPI error code e. Without compare (check=False)
 * no check is compared: up to the limit the headers travel with the data but are not
 * read, above it no check travels at all, as on the Python path. */
static PyObject *fold(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "fold takes 5 arguments");
        return NULL;
    }
    int compare = PyObject_IsTrue(args[4]);
    if (compare < 0)
        return NULL;
    context *ctx = PyCapsule_GetPointer(args[0], CAPSULE);
    if (ctx == NULL)
        return NULL;
    long op = PyLong_AsLong(args[3]);
    if (op == -1 && PyErr_Occurred())
        return NULL;
    if (op < 0 || op >= 32)
        return PyLong_FromLong(FALLBACK);
    Py_buffer sb, rb;
    if (PyObject_GetBuffer(args[1], &sb, PyBUF_ANY_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return PyLong_FromLong(FALLBACK);
    }
    if (PyObject_GetBuffer(args[2], &rb, PyBUF_ANY_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE)
        < 0) {
        PyErr_Clear();
        PyBuffer_Release(&sb);
        return PyLong_FromLong(FALLBACK);
    }
    long answer = FALLBACK;
    const char *format = sb.format ? sb.format : "B";
    const fmt_entry *f = NULL;
    for (int i = 0; i < ctx->n_formats; i++) {
        if (strcmp(ctx->formats[i].format, format) == 0) {
            f = &ctx->formats[i];
            break;
        }
    }
    Py_ssize_t nbytes = sb.len;
    const char *s = sb.buf;
    char *r = rb.buf;
    if (f == NULL || sb.itemsize != f->itemsize || !(f->ops & (1u << op))
        || strcmp(rb.format ? rb.format : "B", format) != 0 || rb.len != nbytes
        || nbytes == 0)
        goto out;
    /* Partly overlapping buffers are an error the Python path words. */
    if (s != r && s < r + nbytes && r < s + nbytes)
        goto out;
    /* Above the gather limit: the check (which then leaves the least room, so this call
     * must find it), then the library's AllReduce, for the pairs whose library reduction
     * C may call (none while the limit is not decided: the Python path decides it). Up to
     * the limit the data travels in a room agreed for this size. */
    int library = nbytes > ctx->limit;
    const library_entry *lib = &ctx->library[f - ctx->formats][op];
    if (library) {
        if (!lib->on || nbytes / f->itemsize > INT32_MAX
            || (compare && ctx->capacity != ctx->least))
            goto out;
    } else if (!(ctx->lo < nbytes && nbytes <= ctx->hi)) {
        goto out; /* a size whose room is not this one */
    }

    Py_ssize_t width = ctx->block.len;
    char *block = ctx->block.buf, *gathered = ctx->gathered.buf;
    int ierr = 0;
    if (compare || !library) {
        int64_t header[HEADER_FIELDS];
        memcpy(header, ctx->header, sizeof(header));
        header[2] = nbytes / f->itemsize;
        header[3] = f->code;
        header[4] = op;
        header[10] = nbytes;
        /* foldable; and whether it folds */
        header[11] = (int64_t)ctx->capacity * 4 + 2 + (library ? 0 : 1);
        memcpy(block, header, HEADER_BYTES);
        if (!library)
            memcpy(block + HEADER_BYTES, s, (size_t)nbytes);
        Py_BEGIN_ALLOW_THREADS
        if (ctx->handle_size == 4)
            ierr = ((allgather_int)ctx->allgather)(block, (int)width, (int)ctx->byte_type,
                                                   gathered, (int)width, (int)ctx->byte_type,
                                                   (int)ctx->comm);
        else
            ierr = ((allgather_ptr)ctx->allgather)(block, (int)width, (void *)ctx->byte_type,
                                                   gathered, (int)width,
                                                   (void *)ctx->byte_type, (void *)ctx->comm);
        Py_END_ALLOW_THREADS
        if (ierr != 0) {
            answer = -1000 - ierr;
            goto out;
        }
        for (int q = 0; compare && q < ctx->p; q++) {
            if (memcmp(gathered + (Py_ssize_t)q * width, block, HEADER_BYTES) != 0) {
                answer = MISMATCH;
                goto out;
            }
        }
    }
    if (library) {
        int count = (int)(nbytes / f->itemsize);
        if (r != s)
            memcpy(r, s, (size_t)nbytes);
        Py_BEGIN_ALLOW_THREADS
        if (ctx->handle_size == 4)
            ierr = ((allreduce_int)ctx->allreduce)(ctx->in_place, r, count, (int)lib->datatype,
                                                   (int)lib->op, (int)ctx->comm);
        else
            ierr = ((allreduce_ptr)ctx->allreduce)(ctx->in_place, r, count,
                                                   (void *)lib->datatype, (void *)lib->op,
                                                   (void *)ctx->comm);
        Py_END_ALLOW_THREADS
        if (ierr != 0) {
            answer = -1000 - ierr;
            goto out;
        }
        if (lib->nan_width)
            canonical_nans(r, nbytes / lib->nan_width, lib->nan_width);
        answer = LIBRARY;
        goto out;
    }
    answer = GATHERED;
    if (op == 0 && f->reduce_sum != RED_NONE) {
        reduce_sum(f->reduce_sum, rb.buf, gathered + HEADER_BYTES, width, ctx->p,
                   nbytes / f->itemsize);
        answer = DONE;
    }
out:
    PyBuffer_Release(&sb);
    PyBuffer_Release(&rb);
    return PyLong_FromLong(answer);
}

/* reduce(kind, out, gathered, offset, stride, p): the same rank-order sum as fold's, for
 * the Python path's gathered rows (so that both paths give the same bits). */
static PyObject *reduce(PyObject *self, PyObject *args)
{
    int kind, p;
    Py_ssize_t offset, stride;
    Py_buffer out, rows;
    if (!PyArg_ParseTuple(args, "iw*y*nni", &kind, &out, &rows, &offset, &stride, &p))
        return NULL;
    Py_ssize_t itemsize = kind == RED_F32 || kind == RED_I32 ? 4 : 8;
    Py_ssize_t n = out.len / itemsize;
    if (kind < RED_F32 || kind > RED_I64 || p < 2 || offset < 0
        || offset + n * itemsize > stride || (Py_ssize_t)p * stride > rows.len) {
        PyBuffer_Release(&out);
        PyBuffer_Release(&rows);
        PyErr_SetString(PyExc_ValueError, "reduce: bad arguments");
        return NULL;
    }
    reduce_sum(kind, out.buf, (const char *)rows.buf + offset, stride, p, n);
    PyBuffer_Release(&out);
    PyBuffer_Release(&rows);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"make", make, METH_VARARGS, "A call context for one communicator and check room."},
    {"fold", (PyCFunction)(void (*)(void))fold, METH_FASTCALL, "One short AllReduce."},
    {"reduce", reduce, METH_VARARGS, "Rank-order sum of gathered rows."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastcall", "The compiled call path of a short AllReduce.", -1,
    methods,
};

#ifndef FASTCALL_SOURCE
#define FASTCALL_SOURCE ""
#endif

PyMODINIT_FUNC PyInit__fastcall(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "SOURCE", FASTCALL_SOURCE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
