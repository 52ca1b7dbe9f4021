/* envfleet._core._speedups: the few hot loops of the step path in C (DESIGN §3).
 *
 * Optional: envfleet runs the same logic in Python when this module is missing (it failed to
 * build, or ENVFLEET_NO_SPEEDUPS=1 is set). Every function here has a Python twin beside its
 * caller, and the differential tests run both. Nothing here changes what an env sees or what
 * the caller gets; it only removes interpreter overhead around the env calls:
 *
 *   write_results   EnvGroup's per-env result lists into its float64/bool buffers, and the
 *                   autoreset flags (_core/envgroup.py)
 *   write_rows      the observations into the group's rows of the observation buffer (same)
 *   serve_steps     the processes worker's loop of plain steps (_backends/processes/worker.py)
 *   step_round      the processes driver's ring, own block and spin of a step
 *                   (_backends/processes/backend.py)
 *   timed_call      StepTimer.call: a group's step timed into its stats row, where a backend
 *                   steps the group itself (serial, threads, Ray actors, the driver's block)
 *
 * The protocol is defined in Python only: the control words' indexes come from set_layout
 * (_backends/processes/worker.py's native_layout), the command and status codes with each
 * call, the spin budget's step from SpinBudget.step_s.
 *
 * Only what measurably pays end to end is here (benchmarks/speedups.py measures each function
 * against its Python twin; the env step loop and the doorbell's post/poll/spin were measured
 * within noise and run in Python only; timed_call pays on the serial no-op round trip,
 * benchmarks/compare_commits.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <math.h>
#include <sched.h>
#include <semaphore.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

/* Calls of each function in this process, for the tests that notice a fast path that stopped
 * running: counters() -> {name: calls}, reset_counters(). write_results and write_rows count
 * only the calls where they wrote (not those handed back to numpy). Updated with the GIL held. */
enum { F_SERVE_STEPS, F_STEP_ROUND, F_TIMED_CALL, F_WRITE_RESULTS, F_WRITE_ROWS, F_COUNT };
static const char *const function_names[F_COUNT] = {
    "serve_steps", "step_round", "timed_call", "write_results", "write_rows",
};
static unsigned long long calls[F_COUNT];

/* The control words' layout, given by Python (set_layout, from _backends/processes/worker.py:
 * CMD, CMD_PAYLOAD, STATUS, REPLY_PAYLOAD), the one place it is defined. -1: not given yet, and
 * serve_steps / step_round refuse to run. */
static Py_ssize_t w_cmd = -1, w_cmd_payload = -1, w_status = -1, w_reply_payload = -1;

/* set_layout(cmd, cmd_payload, status, reply_payload, words): the indexes of the control
 * words in a worker's int64[words] row. */
static PyObject *
sp_set_layout(PyObject *self, PyObject *args)
{
    Py_ssize_t cmd, cmd_payload, status, reply_payload, words;
    if (!PyArg_ParseTuple(args, "nnnnn", &cmd, &cmd_payload, &status, &reply_payload, &words))
        return NULL;
    Py_ssize_t all[4] = {cmd, cmd_payload, status, reply_payload};
    for (int i = 0; i < 4; i++) {
        for (int j = 0; j < i; j++) {
            if (all[i] == all[j]) {
                PyErr_SetString(PyExc_ValueError, "set_layout: two words at one index");
                return NULL;
            }
        }
        if (all[i] < 0 || all[i] >= words) {
            PyErr_Format(PyExc_ValueError, "set_layout: index %zd outside [0, %zd)", all[i],
                         words);
            return NULL;
        }
    }
    w_cmd = cmd;
    w_cmd_payload = cmd_payload;
    w_status = status;
    w_reply_payload = reply_payload;
    Py_RETURN_NONE;
}

static int
layout_set(void)
{
    if (w_cmd >= 0)
        return 1;
    PyErr_SetString(PyExc_RuntimeError, "_speedups: set_layout() was not called");
    return 0;
}

static PyObject *
sp_counters(PyObject *self, PyObject *unused)
{
    PyObject *out = PyDict_New();
    for (int f = 0; out != NULL && f < F_COUNT; f++) {
        PyObject *n = PyLong_FromUnsignedLongLong(calls[f]);
        if (n == NULL || PyDict_SetItemString(out, function_names[f], n) < 0)
            Py_CLEAR(out);
        Py_XDECREF(n);
    }
    return out;
}

static PyObject *
sp_reset_counters(PyObject *self, PyObject *unused)
{
    memset(calls, 0, sizeof calls);
    Py_RETURN_NONE;
}

/* numpy's scalar types whose conversion is done here exactly as numpy does it; registered by
 * envfleet/_native.py at import (this module does not import numpy). */
static PyTypeObject *np_bool_type = NULL;
static PyTypeObject *np_float32_type = NULL;

static int
as_address(PyObject *obj, void **out)
{
    void *p = PyLong_AsVoidPtr(obj);
    if (p == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "null address");
        return 0;
    }
    *out = p;
    return 1;
}

static double
monotonic_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* -- spinning on a semaphore --------------------------------------------------------------- */

/* Take the semaphore, polling for at most spin_s seconds: back to back for the first tight_s,
 * then yielding the core between polls. 1 when taken, 0 when the budget ran out. Called
 * without the GIL. */
static int
spin_take(sem_t *sem, double tight_s, double spin_s)
{
    if (sem_trywait(sem) == 0)
        return 1;
    if (spin_s <= 0)
        return 0;
    double start = monotonic_s();
    double tight_until = start + (tight_s < spin_s ? tight_s : spin_s);
    double spin_until = start + spin_s;
    int yielding = 0;
    for (;;) {
        for (int k = 0; k < 16; k++) {
            if (sem_trywait(sem) == 0)
                return 1;
            if (yielding)
                sched_yield();
            else
                CPU_RELAX();
        }
        double now = monotonic_s();
        if (now >= spin_until)
            return 0;
        yielding = now >= tight_until;
    }
}

/* -- step times (StepTimer.record, _backends/supervisor.py) ----------------------------------------- */

/* StepTimer.record: count, total seconds, and the quarter-octave histogram bucket (bucket 0
 * holds everything up to 1 µs) of a float64 stats row. */
static void
record_time(double *words, double seconds, int per_octave, int num_buckets)
{
    words[0] += 1.0;
    words[1] += seconds;
    double us = seconds * 1e6;
    int b = 0;
    if (us > 1.0) {
        double f = per_octave * log2(us);
        b = f >= num_buckets - 1 ? num_buckets - 1 : (int)f;
    }
    words[2 + b] += 1.0;
}

/* timed_call(words, per_octave, num_buckets, fn) -> fn(): StepTimer.call (_core/stats.py), for the
 * groups stepped by run_command (serial, threads, Ray actors, the processes driver's block);
 * the time of a call that returns is recorded in the stats row at address ``words``. */
static PyObject *
sp_timed_call(PyObject *self, PyObject *args)
{
    PyObject *wa, *fn;
    int per_octave, num_buckets;
    void *words;
    if (!PyArg_ParseTuple(args, "OiiO", &wa, &per_octave, &num_buckets, &fn))
        return NULL;
    if (!as_address(wa, &words))
        return NULL;
    calls[F_TIMED_CALL]++;
    double t0 = monotonic_s();
    PyObject *result = PyObject_CallNoArgs(fn);
    if (result != NULL)
        record_time((double *)words, monotonic_s() - t0, per_octave, num_buckets);
    return result;
}

/* -- the processes worker's loop ----------------------------------------------------------- */

static double
get_double(PyObject *obj, const char *name, int *ok)
{
    PyObject *v = PyObject_GetAttrString(obj, name);
    if (v == NULL) {
        *ok = 0;
        return 0;
    }
    double d = PyFloat_AsDouble(v);
    Py_DECREF(v);
    if (d == -1.0 && PyErr_Occurred())
        *ok = 0;
    return d;
}

/* serve_steps(request, done, any_done, control, step, timer_words, budget, tight_s,
 *             step_code, ok_code, buckets_per_octave, num_buckets) -> (reason, spun_s, result)
 *
 * _Worker.serve's loop for plain steps. Repeatedly: take the request semaphore (spinning, as
 * Doorbell.wait does, within the SpinBudget ``budget``, whose budget_s it adapts as
 * SpinBudget.caught does); when the command word is a step without payload, call ``step()``
 * (EnvGroup.step), record its time in the StepTimer words (count, total seconds, quarter-octave
 * histogram), and when it returned no events, reply OK with no payload: status word, payload
 * word 0, post ``done`` (and ``any_done`` unless 0). Returns to the caller:
 *   (0, spun_s, None)    the wait spun out after spun_s seconds; nothing taken: block on it
 *   (1, 0.0, None)       a request other than a plain step was taken: dispatch it
 *   (2, 0.0, events)     a step returned events: reply OK with them
 * An exception from step() propagates (nothing recorded, no reply sent). Control words are
 * int64, at the indexes set_layout gave (command, command has payload, status, reply
 * payload). */
static PyObject *
sp_serve_steps(PyObject *self, PyObject *args)
{
    calls[F_SERVE_STEPS]++;
    PyObject *ra, *da, *aa, *ca, *step, *ta, *budget;
    double tight_s;
    long long step_code, ok_code;
    int per_octave, num_buckets;
    void *rp, *dp, *cp, *tp, *ap = NULL;
    if (!PyArg_ParseTuple(args, "OOOOOOOdLLii", &ra, &da, &aa, &ca, &step, &ta, &budget,
                          &tight_s, &step_code, &ok_code, &per_octave, &num_buckets))
        return NULL;
    if (!as_address(ra, &rp) || !as_address(da, &dp) || !as_address(ca, &cp) ||
        !as_address(ta, &tp))
        return NULL;
    if (aa != Py_None && !as_address(aa, &ap))
        return NULL;
    if (!layout_set())
        return NULL;
    int ok = 1;
    double budget_s = get_double(budget, "budget_s", &ok);
    double max_s = get_double(budget, "max_s", &ok);
    double step_s = get_double(budget, "step_s", &ok); /* SpinBudget's additive step */
    if (!ok)
        return NULL;
    sem_t *request = (sem_t *)rp, *done = (sem_t *)dp, *any_done = (sem_t *)ap;
    volatile int64_t *control = (volatile int64_t *)cp;
    double *words = (double *)tp;
    PyObject *out = NULL;
    for (;;) {
        int taken;
        double t_wait = 0.0;
        if (sem_trywait(request) == 0) {
            taken = 1;
        } else {
            Py_BEGIN_ALLOW_THREADS
            t_wait = monotonic_s();
            taken = spin_take(request, tight_s, budget_s);
            t_wait = monotonic_s() - t_wait;
            Py_END_ALLOW_THREADS
        }
        if (!taken) {
            out = Py_BuildValue("(idO)", 0, t_wait, Py_None);
            break;
        }
        budget_s = budget_s + step_s < max_s ? budget_s + step_s : max_s;
        if (control[w_cmd] != step_code || control[w_cmd_payload] != 0) {
            out = Py_BuildValue("(idO)", 1, 0.0, Py_None);
            break;
        }
        double t0 = monotonic_s();
        PyObject *result = PyObject_CallNoArgs(step);
        if (result == NULL)
            break;
        record_time(words, monotonic_s() - t0, per_octave, num_buckets);
        int events = result == Py_None ? 0 : PyObject_IsTrue(result);
        if (events < 0) {
            Py_DECREF(result);
            break;
        }
        if (events) {
            out = Py_BuildValue("(idN)", 2, 0.0, result);
            break;
        }
        Py_DECREF(result);
        control[w_status] = ok_code;
        control[w_reply_payload] = 0;
        sem_post(done);
        if (any_done != NULL)
            sem_post(any_done);
    }
    /* The adapted budget goes back to the SpinBudget, also when step() raised. */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *b = PyFloat_FromDouble(budget_s);
    int set = b != NULL && PyObject_SetAttrString(budget, "budget_s", b) == 0;
    Py_XDECREF(b);
    if (!set) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        Py_XDECREF(out);
        return NULL;
    }
    PyErr_Restore(type, value, tb);
    return out;
}

/* The exception being raised, as `except <kind> as exc` binds it (with its traceback), or
 * NULL with the error still set when it is not a ``kind`` (for Exception: KeyboardInterrupt,
 * SystemExit propagate, as they do through the Python code). */
static PyObject *
catch_exception(PyObject *kind)
{
    if (!PyErr_ExceptionMatches(kind))
        return NULL;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

/* -- the processes driver's step round -------------------------------------------------------- */

/* A SpinBudget's ``caught``, given its budget_s: that grows by its step_s, up to max_s. */
static int
budget_caught(PyObject *budget, double budget_s)
{
    int ok = 1;
    double max_s = get_double(budget, "max_s", &ok);
    double step_s = get_double(budget, "step_s", &ok);
    if (!ok)
        return -1;
    if (budget_s >= max_s)
        return 0;
    budget_s = budget_s + step_s < max_s ? budget_s + step_s : max_s;
    PyObject *b = PyFloat_FromDouble(budget_s);
    if (b == NULL)
        return -1;
    int rc = PyObject_SetAttrString(budget, "budget_s", b);
    Py_DECREF(b);
    return rc;
}

/* step_round(requests, dones, controls, budgets, local, env_failure, tight_s, step_code,
 *            ok_code[, ring]) -> (local_result, local_failure, taken, unread, spun_s)
 *
 * The processes transport's step_all: the round driver's send and gather of a plain step, up
 * to reading the replies. For each worker w (the tuples hold the addresses of its request and done semaphores and of its int64
 * control words): command word = step_code, payload word = 0, post its request (unless
 * ``ring`` is 0: step_async already did, and step_wait finishes the round). Then call
 * ``local()`` (the driver's own block, timed; None when it has none): its result, or the
 * ``env_failure`` instance it raised (any other exception propagates at once, as from _submit).
 * Then take each worker's done semaphore in order, spinning within its SpinBudget (adapted as
 * SpinBudget.caught does): ``taken`` workers were, and ``unread`` lists the indexes (into the
 * tuples) of those whose reply is not "OK, no payload" (the caller reads those). When a spin
 * runs out the round stops there: the caller waits for workers ``taken`` on, blocking at once
 * for the first (it already spun ``spun_s`` seconds). */
static PyObject *
sp_step_round(PyObject *self, PyObject *args)
{
    calls[F_STEP_ROUND]++;
    PyObject *requests, *dones, *controls, *budgets, *local, *env_failure;
    double tight_s;
    long long step_code, ok_code;
    int ring = 1;
    if (!PyArg_ParseTuple(args, "O!O!O!O!OOdLL|p", &PyTuple_Type, &requests, &PyTuple_Type,
                          &dones, &PyTuple_Type, &controls, &PyList_Type, &budgets, &local,
                          &env_failure, &tight_s, &step_code, &ok_code, &ring))
        return NULL;
    if (!layout_set())
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(requests);
    if (PyTuple_GET_SIZE(dones) != n || PyTuple_GET_SIZE(controls) != n ||
        PyList_GET_SIZE(budgets) != n) {
        PyErr_SetString(PyExc_ValueError, "step_round: one entry per worker in each");
        return NULL;
    }
    for (Py_ssize_t w = 0; ring && w < n; w++) {
        void *request, *control;
        if (!as_address(PyTuple_GET_ITEM(requests, w), &request) ||
            !as_address(PyTuple_GET_ITEM(controls, w), &control))
            return NULL;
        ((volatile int64_t *)control)[w_cmd] = step_code;
        ((volatile int64_t *)control)[w_cmd_payload] = 0;
        if (sem_post((sem_t *)request) != 0)
            return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *local_result = Py_None, *local_failure = Py_None;
    Py_INCREF(local_result);
    Py_INCREF(local_failure);
    if (local != Py_None) {
        PyObject *result = PyObject_CallNoArgs(local);
        if (result == NULL) {
            PyObject *failure = catch_exception(env_failure);
            if (failure == NULL)
                goto fail;
            Py_SETREF(local_failure, failure);
        } else {
            Py_SETREF(local_result, result);
        }
    }
    PyObject *unread = PyList_New(0);
    if (unread == NULL)
        goto fail;
    Py_ssize_t taken = 0;
    double spun_s = 0.0;
    for (; taken < n; taken++) {
        void *done, *control;
        if (!as_address(PyTuple_GET_ITEM(dones, taken), &done) ||
            !as_address(PyTuple_GET_ITEM(controls, taken), &control))
            goto fail_unread;
        PyObject *budget = PyList_GET_ITEM(budgets, taken);
        int ok = 1;
        double budget_s = get_double(budget, "budget_s", &ok);
        if (!ok)
            goto fail_unread;
        int got = sem_trywait((sem_t *)done) == 0;
        if (!got) {
            Py_BEGIN_ALLOW_THREADS
            got = spin_take((sem_t *)done, tight_s, budget_s);
            Py_END_ALLOW_THREADS
        }
        if (!got) {
            spun_s = budget_s;
            break;
        }
        if (budget_caught(budget, budget_s) < 0)
            goto fail_unread;
        volatile int64_t *words = (volatile int64_t *)control;
        if (words[w_status] != ok_code || words[w_reply_payload] != 0) {
            PyObject *index = PyLong_FromSsize_t(taken);
            if (index == NULL || PyList_Append(unread, index) < 0) {
                Py_XDECREF(index);
                goto fail_unread;
            }
            Py_DECREF(index);
        }
    }
    return Py_BuildValue("(NNnNd)", local_result, local_failure, taken, unread, spun_s);
fail_unread:
    Py_DECREF(unread);
fail:
    Py_DECREF(local_result);
    Py_DECREF(local_failure);
    return NULL;
}

/* -- EnvGroup's result and observation writes ------------------------------------------- */

static int
set_item(PyObject *list, Py_ssize_t j, PyObject *item)
{
    Py_INCREF(item);
    return PyList_SetItem(list, j, item); /* steals the new reference, drops the old item */
}

/* One reward as numpy writes it into a float64 buffer, for the types where that is plain C
 * conversion: float (and numpy.float64, a float subclass), int, bool, numpy.float32. */
static int
reward_value(PyObject *r, double *out)
{
    if (PyFloat_Check(r)) {
        *out = PyFloat_AS_DOUBLE(r);
        return 1;
    }
    if (PyLong_Check(r)) { /* int and bool */
        double d = PyLong_AsDouble(r);
        if (d == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        *out = d;
        return 1;
    }
    if (np_float32_type != NULL && Py_IS_TYPE(r, np_float32_type)) {
        double d = PyFloat_AsDouble(r);
        if (d == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        *out = d;
        return 1;
    }
    return 0;
}

/* One done flag as numpy writes it into a bool buffer, for bool and numpy.bool_. */
static int
flag_value(PyObject *f, char *out)
{
    if (f == Py_True || f == Py_False) {
        *out = f == Py_True;
        return 1;
    }
    if (np_bool_type != NULL && Py_IS_TYPE(f, np_bool_type)) {
        int t = PyObject_IsTrue(f);
        if (t < 0) {
            PyErr_Clear();
            return 0;
        }
        *out = (char)t;
        return 1;
    }
    return 0;
}

/* write_results(rewards, terms, truncs, rewards_address, terms_address, truncs_address,
 *               autoreset) -> bool
 *
 * Write the group's per-env results into its float64 rewards and bool done-flag rows, and set
 * autoreset[j] = terminated or truncated. False, with the buffers partly written, when some
 * value is of a type numpy's conversion is not mirrored for here: the caller then writes them
 * all with numpy. */
static PyObject *
sp_write_results(PyObject *self, PyObject *args)
{
    PyObject *rewards, *terms, *truncs, *ra, *ta, *ua, *autoreset;
    void *rp, *tp, *up;
    if (!PyArg_ParseTuple(args, "O!O!O!OOOO!", &PyList_Type, &rewards, &PyList_Type, &terms,
                          &PyList_Type, &truncs, &ra, &ta, &ua, &PyList_Type, &autoreset))
        return NULL;
    if (!as_address(ra, &rp) || !as_address(ta, &tp) || !as_address(ua, &up))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(rewards);
    if (PyList_GET_SIZE(terms) != n || PyList_GET_SIZE(truncs) != n ||
        PyList_GET_SIZE(autoreset) != n) {
        PyErr_SetString(PyExc_ValueError, "write_results: lists of different lengths");
        return NULL;
    }
    double *rbuf = (double *)rp;
    char *tbuf = (char *)tp, *ubuf = (char *)up;
    for (Py_ssize_t j = 0; j < n; j++) {
        double r;
        char t, u;
        if (!reward_value(PyList_GET_ITEM(rewards, j), &r) ||
            !flag_value(PyList_GET_ITEM(terms, j), &t) ||
            !flag_value(PyList_GET_ITEM(truncs, j), &u))
            Py_RETURN_FALSE;
        rbuf[j] = r;
        tbuf[j] = t;
        ubuf[j] = u;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        if (set_item(autoreset, j, (tbuf[j] || ubuf[j]) ? Py_True : Py_False) < 0)
            return NULL;
    }
    calls[F_WRITE_RESULTS]++;
    Py_RETURN_TRUE;
}

/* The head of numpy's ndarray object: numpy's public PyArrayObject_fields (ndarraytypes.h),
 * unchanged from numpy 1.7 through 2.x. Read only for instances whose type is exactly
 * numpy.ndarray, so that nothing here needs numpy's headers at build time. */
typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_ssize_t *dimensions;
    Py_ssize_t *strides;
    PyObject *base;
    PyObject *descr;
    int flags;
} ndarray_head;
#define NDARRAY_C_CONTIGUOUS 0x0001 /* NPY_ARRAY_C_CONTIGUOUS */

/* write_rows(env_obs, ndarray, dtype, shape, address, row_bytes) -> bool
 *
 * Copy each observation's bytes to row j at address + j * row_bytes, when every one is an
 * exact ``ndarray`` instance (the type passed in), C-contiguous, of exactly ``shape`` and
 * whose dtype is ``dtype`` (the same object, as ``obs.dtype is dtype``): then the copy is
 * exactly numpy's, which copies same-typed elements byte for byte. False, with nothing
 * written, when some observation is not like that; the caller then writes them with numpy. */
static PyObject *
sp_write_rows(PyObject *self, PyObject *args)
{
    PyObject *env_obs, *ndarray, *dtype, *shape, *address;
    Py_ssize_t row_bytes;
    void *dest;
    if (!PyArg_ParseTuple(args, "O!O!OO!On", &PyList_Type, &env_obs, &PyType_Type, &ndarray,
                          &dtype, &PyTuple_Type, &shape, &address, &row_bytes))
        return NULL;
    if (!as_address(address, &dest))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(env_obs), ndim = PyTuple_GET_SIZE(shape);
    Py_ssize_t dims[32];
    if (ndim > 32)
        Py_RETURN_FALSE;
    for (Py_ssize_t d = 0; d < ndim; d++) {
        dims[d] = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, d));
        if (dims[d] == -1 && PyErr_Occurred())
            return NULL;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *obs = PyList_GET_ITEM(env_obs, j);
        if (!Py_IS_TYPE(obs, (PyTypeObject *)ndarray))
            Py_RETURN_FALSE;
        ndarray_head *a = (ndarray_head *)obs;
        if (a->descr != dtype || a->nd != ndim || !(a->flags & NDARRAY_C_CONTIGUOUS))
            Py_RETURN_FALSE;
        for (Py_ssize_t d = 0; d < ndim; d++) {
            if (a->dimensions[d] != dims[d])
                Py_RETURN_FALSE;
        }
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        ndarray_head *a = (ndarray_head *)PyList_GET_ITEM(env_obs, j);
        memcpy((char *)dest + j * row_bytes, a->data, (size_t)row_bytes);
    }
    calls[F_WRITE_ROWS]++;
    Py_RETURN_TRUE;
}

static PyObject *
sp_register_types(PyObject *self, PyObject *args)
{
    PyObject *b, *f;
    if (!PyArg_ParseTuple(args, "O!O!", &PyType_Type, &b, &PyType_Type, &f))
        return NULL;
    Py_INCREF(b);
    Py_INCREF(f);
    Py_XSETREF(np_bool_type, (PyTypeObject *)b);
    Py_XSETREF(np_float32_type, (PyTypeObject *)f);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"write_results", sp_write_results, METH_VARARGS, "EnvGroup._write_results."},
    {"write_rows", sp_write_rows, METH_VARARGS, "EnvGroup's observation rows, memcpy'd."},
    {"serve_steps", sp_serve_steps, METH_VARARGS, "_Worker.serve's loop for plain steps."},
    {"step_round", sp_step_round, METH_VARARGS, "The processes transport's step round (step_all)."},
    {"timed_call", sp_timed_call, METH_VARARGS, "StepTimer.call."},
    {"set_layout", sp_set_layout, METH_VARARGS,
     "set_layout(cmd, cmd_payload, status, reply_payload, words): the control words."},
    {"counters", sp_counters, METH_NOARGS, "counters() -> {name: calls in this process}."},
    {"reset_counters", sp_reset_counters, METH_NOARGS, "reset_counters(): zero them."},
    {"register_types", sp_register_types, METH_VARARGS,
     "register_types(numpy.bool_, numpy.float32)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_speedups", "envfleet's optional C step path.", -1, methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return PyModule_Create(&module);
}
