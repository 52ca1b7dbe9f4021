/* envfleet._core._speedups: the few hot loops of the step path in C.
 *
 * Optional: envfleet runs the same logic in Python when this module is missing (it failed to
 * build, or ENVFLEET_NO_SPEEDUPS=1 is set). Every function here but the round bell's (bell_ring,
 * bell_sleep, bell_arrive, gather_sleep, bell_alarm: without C, rounds signal through the
 * doorbell's semaphores instead) has a Python twin beside its caller, and the differential
 * tests run both. Nothing here changes what an env sees or what the caller gets; it only
 * removes interpreter overhead around the env calls:
 *
 *   write_results   EnvGroup's per-env result lists into its float64/bool buffers, and the
 *                   autoreset flags (_core/envgroup.py)
 *   write_rows      the observations into a group's rows of one observation slab, or the
 *                   slab's numpy write called when they do not fit (_core/rows.py)
 *   serve_steps     the processes worker's loop of plain steps (_backends/processes/worker.py)
 *   full_round      the processes driver's ring, own block and spin of a step, given the
 *                   round_plan its transport built once (_backends/processes/backend.py)
 *   timed_call      StepTimer.call: a group's step timed into its stats row, where a backend
 *                   steps the group itself (serial, threads, Ray actors, the driver's block)
 *   pcg64_raw       env_state.pcg64_bytes: a PCG64 generator's state as bytes, for the
 *                   replay record's episode start at every autoreset (_core/env_state.py)
 *   log_row         ActionLog.record of a group's action rows: the replay record's copy at
 *                   every step (_core/action_log.py)
 *   bell_ring, bell_sleep, bell_arrive, gather_sleep, bell_alarm
 *                   the processes backend's round bell on Linux futexes (RoundBell,
 *                   _backends/processes/doorbell.py): one ring and one count of arrivals per
 *                   full step round, whatever the worker count
 *   crash_note      the learner's note of the sub-environment it steps itself (processes'
 *                   driver_envs), and a fatal-signal handler that writes it to stderr before
 *                   chaining to faulthandler's (_core/crash_note.py): not a step-path
 *                   function, so not counted
 *
 * A worker's control row is one struct here (control_t), mirrored by the word indexes of
 * _backends/processes/worker.py (CMD ... SLEEP), which check_control_row holds equal at the
 * first bind; the command and status codes come with each call; a SpinBudget's numbers are
 * read and adapted in place (spin_budget_t, at the SpinBudget's address).
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
#include <pthread.h>
#include <sched.h>
#include <semaphore.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include <limits.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#define HAVE_FUTEX 1
#else
#define HAVE_FUTEX 0
#endif
#include <unistd.h>

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
enum {
    F_SERVE_STEPS,
    F_FULL_ROUND,
    F_TIMED_CALL,
    F_WRITE_RESULTS,
    F_WRITE_ROWS,
    F_BELL_RING,
    F_BELL_SLEEP,
    F_BELL_ARRIVE,
    F_GATHER_SLEEP,
    F_BELL_ALARM,
    F_PCG64_RAW,
    F_LOG_ROW,
    S_FUTEX_WAKE, /* not functions: the futex system calls this process's C code issued */
    S_FUTEX_WAIT,
    F_COUNT
};
static const char *const function_names[F_COUNT] = {
    "serve_steps", "full_round", "timed_call", "write_results", "write_rows",
    "bell_ring",   "bell_sleep", "bell_arrive",  "gather_sleep", "bell_alarm",
    "pcg64_raw",   "log_row",    "futex_wake",   "futex_wait",
};
static unsigned long long calls[F_COUNT];

/* A worker's control row (_backends/processes/doorbell.py R1; int64 words, on cache lines of its
 * own): its one C definition. worker.py's CMD ... SLEEP are its Python mirror, the words' indexes
 * in this order; control_row() answers them and worker.check_control_row compares. */
typedef struct {
    int64_t cmd, cmd_payload, status, reply_payload, reply_bytes, req, gather, ack, sleep;
} control_t;

/* control_row() -> dict: each control_t field's index in int64 words, by worker.py's name. */
static PyObject *
sp_control_row(PyObject *self, PyObject *unused)
{
#define WORD(field) (Py_ssize_t)(offsetof(control_t, field) / sizeof(int64_t))
    return Py_BuildValue("{snsnsnsnsnsnsnsnsnsn}", "CMD", WORD(cmd), "CMD_PAYLOAD",
                         WORD(cmd_payload), "STATUS", WORD(status), "REPLY_PAYLOAD",
                         WORD(reply_payload), "REPLY_BYTES", WORD(reply_bytes), "REQ", WORD(req),
                         "GATHER", WORD(gather), "ACK", WORD(ack), "SLEEP", WORD(sleep), "USED",
                         (Py_ssize_t)(sizeof(control_t) / sizeof(int64_t)));
#undef WORD
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
 * envfleet/_core/native.py at import (this module does not import numpy). */
static PyTypeObject *np_bool_type = NULL;
static PyTypeObject *np_float32_type = NULL;

/* An address (a nonzero int) into the void * at ``out``: 1, or 0 with the error set. Also
 * PyArg_ParseTuple's "O&" converter; as_address_or_none's None gives NULL. */
static int
as_address(PyObject *obj, void *out)
{
    void *p = PyLong_AsVoidPtr(obj);
    if (p == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "null address");
    *(void **)out = p;
    return p != NULL;
}

static int
as_address_or_none(PyObject *obj, void *out)
{
    *(void **)out = NULL;
    return obj == Py_None || as_address(obj, out);
}

static double
monotonic_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* -- the arguments of the functions called every step -------------------------------------- */

/* full_round, timed_call, write_results and write_rows take METH_FASTCALL arguments, checked
 * here as PyArg_ParseTuple would (the same TypeError): parsing its format string cost each call
 * more instructions than a write_rows' own work. */
static int
arg_count(const char *fname, Py_ssize_t nargs, Py_ssize_t least, Py_ssize_t most)
{
    if (nargs >= least && nargs <= most)
        return 1;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd to %zd arguments (%zd given)", fname, least,
                 most, nargs);
    return 0;
}

static int
arg_of_type(const char *fname, PyObject *const *args, Py_ssize_t i, PyTypeObject *type)
{
    if (PyObject_TypeCheck(args[i], type))
        return 1;
    PyErr_Format(PyExc_TypeError, "%s() argument %zd must be %s, not %.50s", fname, i + 1,
                 type->tp_name, Py_TYPE(args[i])->tp_name);
    return 0;
}

static int
arg_int(PyObject *arg, int *out)
{
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred())
        return 0;
    if (v < INT_MIN || v > INT_MAX) {
        PyErr_SetString(PyExc_OverflowError, "signed integer is out of the range of a C int");
        return 0;
    }
    *out = (int)v;
    return 1;
}

/* -- spinning (on a semaphore, a worker's control words, a round's arrivals) --------------- */

/* Poll ``poll(arg)`` until it returns nonzero, for at most spin_s seconds: once with the GIL
 * held (a poll that comes true at once does not release it), then without it, back to back for
 * the first tight_s, then yielding the core between polls. 1 when it came true, 0 when the
 * budget ran out; the seconds spun in ``*spun_s`` unless it is NULL. */
static int
spin_poll(int (*poll)(void *), void *arg, double tight_s, double spin_s, double *spun_s)
{
    int got = poll(arg);
    double start = 0.0, now = 0.0;
    if (!got && spin_s > 0) {
        Py_BEGIN_ALLOW_THREADS
        start = now = monotonic_s();
        double tight_until = start + (tight_s < spin_s ? tight_s : spin_s);
        int yielding = 0;
        while (!got && now < start + spin_s) {
            for (int k = 0; k < 16 && !(got = poll(arg)); k++) {
                if (yielding)
                    sched_yield();
                else
                    CPU_RELAX();
            }
            now = monotonic_s();
            yielding = now >= tight_until;
        }
        Py_END_ALLOW_THREADS
    }
    if (spun_s != NULL)
        *spun_s = now - start;
    return got;
}

/* spin_poll's polls: a semaphore taken; below, a command due (poll_pending) and a full round's
 * arrivals all in (poll_gathered). */
static int
poll_sem(void *sem)
{
    return sem_trywait((sem_t *)sem) == 0;
}

/* -- the round bell (Linux: _backends/processes/doorbell.py's RoundBell) -------------------- */

/* One per vector env, in shared memory. The round protocol's rules (R1-R9) are stated once, in
 * _backends/processes/doorbell.py's module docstring; each function here cites those it keeps.
 * This side keeps R2-R7's orders with atomic instructions (release stores, acquire loads,
 * sequentially consistent read-modify-writes), correct on any CPU (R9). Non-private futex
 * operations: the words are shared between processes. */
typedef struct {
    uint32_t gen;
    int32_t remaining;
    int32_t dwait;
    int32_t dead; /* R8: 1 while a worker's death is not yet answered (the driver's death watch) */
} bell_t;

static void
futex_wake_n(void *addr, int n)
{
#if HAVE_FUTEX
    calls[S_FUTEX_WAKE]++;
    syscall(SYS_futex, addr, FUTEX_WAKE, n, NULL, NULL, 0);
#endif
}

/* FUTEX_WAIT on ``addr`` while it holds ``expected``, at most timeout_s seconds (below 0: no
 * bound; a signal ends it too). Counted by the caller (with the GIL held); called without it. */
static void
futex_wait_s(void *addr, uint32_t expected, double timeout_s)
{
#if HAVE_FUTEX
    struct timespec ts;
    ts.tv_sec = (time_t)timeout_s;
    ts.tv_nsec = (long)((timeout_s - (double)ts.tv_sec) * 1e9);
    syscall(SYS_futex, addr, FUTEX_WAIT, expected, timeout_s < 0 ? NULL : &ts, NULL, 0);
#endif
}

/* The driver's ring (R3), first half: every command word written before it is seen by a
 * worker that sees the new generation. */
static void
bell_bump(bell_t *bell)
{
    __atomic_fetch_add(&bell->gen, 1, __ATOMIC_SEQ_CST);
}

/* A worker's SLEEP word, read after the bump: its bit while it may sleep on ``gen``, else 0. */
static uint32_t
bell_sleeping(volatile control_t *control)
{
    return (uint32_t)__atomic_load_n((int64_t *)&control->sleep, __ATOMIC_SEQ_CST);
}

/* The ring's second half: wake the sleepers among ``bits`` (one system call; none when no
 * worker rung sleeps). Workers beyond 32 share bits: one may wake for another's command,
 * find none due and sleep again. */
static void
bell_wake(bell_t *bell, uint32_t bits)
{
#if HAVE_FUTEX
    if (bits == 0)
        return;
    calls[S_FUTEX_WAKE]++;
    syscall(SYS_futex, &bell->gen, FUTEX_WAKE_BITSET, INT_MAX, NULL, NULL, bits);
#endif
}

/* A worker's command is due: REQ (the driver's count of commands sent) differs from ACK (its
 * own count of replies). */
static int
bell_pending(volatile control_t *control)
{
    return __atomic_load_n((int64_t *)&control->req, __ATOMIC_ACQUIRE) !=
           __atomic_load_n((int64_t *)&control->ack, __ATOMIC_ACQUIRE);
}

/* A full round's arrival: the last one wakes the driver if it sleeps (R7). */
static void
gather_arrive(bell_t *bell)
{
    if (__atomic_sub_fetch(&bell->remaining, 1, __ATOMIC_SEQ_CST) == 0 &&
        __atomic_exchange_n(&bell->dwait, 0, __ATOMIC_SEQ_CST) != 0)
        futex_wake_n(&bell->dwait, 1);
}

/* A worker's reply is written (R6): for a full round's command, its arrival on ``remaining``,
 * then its ACK; else its ACK, then its done semaphore. REQ and GATHER are read first (once the
 * arrival lands the driver may write the next command), and the ACK written is that REQ, so a
 * command the driver sent since stays due. Without a bell (``bell`` NULL) GATHER is never set:
 * the ACK, then the done semaphore, which tells the driver who replied after a Ctrl-C too. */
static void
bell_arrive(bell_t *bell, volatile control_t *control, sem_t *done, sem_t *any_done)
{
    int64_t req = __atomic_load_n((int64_t *)&control->req, __ATOMIC_ACQUIRE);
    int gather = __atomic_load_n((int64_t *)&control->gather, __ATOMIC_RELAXED) != 0;
    if (gather) {
        gather_arrive(bell);
        __atomic_store_n((int64_t *)&control->ack, req, __ATOMIC_RELEASE);
        return;
    }
    __atomic_store_n((int64_t *)&control->ack, req, __ATOMIC_RELEASE);
    sem_post(done);
    if (any_done != NULL)
        sem_post(any_done);
}

/* bell_ring(bell, controls): the driver's ring of the workers whose control rows' addresses
 * are in the tuple ``controls`` (RoundBell.ring). */
static PyObject *
sp_bell_ring(PyObject *self, PyObject *args)
{
    PyObject *controls;
    bell_t *bell;
    if (!PyArg_ParseTuple(args, "O&O!", as_address, &bell, &PyTuple_Type, &controls))
        return NULL;
    calls[F_BELL_RING]++;
    bell_bump(bell);
    uint32_t bits = 0;
    for (Py_ssize_t w = 0; w < PyTuple_GET_SIZE(controls); w++) {
        void *control;
        if (!as_address(PyTuple_GET_ITEM(controls, w), &control))
            return NULL;
        bits |= bell_sleeping((volatile control_t *)control);
    }
    bell_wake(bell, bits);
    Py_RETURN_NONE;
}

/* bell_arrive(bell): a worker's arrival on a full round, its reply written (its ACK comes
 * after: RoundBell.arrive, _Worker.ring_done). */
static PyObject *
sp_bell_arrive(PyObject *self, PyObject *arg)
{
    bell_t *bell;
    if (!as_address(arg, &bell))
        return NULL;
    calls[F_BELL_ARRIVE]++;
    gather_arrive(bell);
    Py_RETURN_NONE;
}

/* bell_sleep(bell, control, bit, timeout_s) -> bool: a worker's blocking wait for a command
 * (no spinning: the caller spun), its ``bit`` (1 << (group % 32)) in its SLEEP word meanwhile:
 * True when one is due, False when the wait ended without one (a ring for a worker that shares
 * its bit, the timeout). */
static PyObject *
sp_bell_sleep(PyObject *self, PyObject *args)
{
    bell_t *bell;
    volatile control_t *control;
    unsigned int bit;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "O&O&Id", as_address, &bell, as_address, &control, &bit,
                          &timeout_s))
        return NULL;
    if (bit == 0) {
        PyErr_SetString(PyExc_ValueError, "bell_sleep: bit must not be 0");
        return NULL;
    }
    calls[F_BELL_SLEEP]++;
    if (bell_pending(control))
        Py_RETURN_TRUE;
    /* R4: SLEEP, then gen, then REQ (R3's ring: REQ, gen, then SLEEP). */
    __atomic_store_n((int64_t *)&control->sleep, (int64_t)bit, __ATOMIC_SEQ_CST);
    uint32_t gen = __atomic_load_n(&bell->gen, __ATOMIC_SEQ_CST);
    if (!bell_pending(control)) {
        calls[S_FUTEX_WAIT]++;
#if HAVE_FUTEX
        if (timeout_s < 0)
            timeout_s = 0;
        struct timespec until; /* FUTEX_WAIT_BITSET's timeout is absolute, CLOCK_MONOTONIC */
        clock_gettime(CLOCK_MONOTONIC, &until);
        double whole = (double)(time_t)timeout_s;
        until.tv_sec += (time_t)whole;
        until.tv_nsec += (long)((timeout_s - whole) * 1e9);
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec += 1;
            until.tv_nsec -= 1000000000L;
        }
        Py_BEGIN_ALLOW_THREADS
        syscall(SYS_futex, &bell->gen, FUTEX_WAIT_BITSET, gen, &until, NULL, bit);
        Py_END_ALLOW_THREADS
#endif
    }
    __atomic_store_n((int64_t *)&control->sleep, 0, __ATOMIC_RELEASE);
    return PyBool_FromLong(bell_pending(control));
}

/* The driver's one blocking wait for a full round's last arrival (R7; at most timeout_s, below
 * 0: no bound; called with the GIL, which it releases while asleep): 1 when every worker
 * arrived. It does not sleep while a death is unanswered (R8: ``dead``; the death watch stores
 * it, then swaps ``dwait`` as the last arrival does). */
static int
gather_block(bell_t *bell, double timeout_s)
{
    __atomic_store_n(&bell->dwait, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&bell->remaining, __ATOMIC_SEQ_CST) != 0 &&
        __atomic_load_n(&bell->dead, __ATOMIC_SEQ_CST) == 0) {
        calls[S_FUTEX_WAIT]++;
        Py_BEGIN_ALLOW_THREADS
        futex_wait_s(&bell->dwait, 1, timeout_s);
        Py_END_ALLOW_THREADS
    }
    __atomic_store_n(&bell->dwait, 0, __ATOMIC_SEQ_CST);
    return __atomic_load_n(&bell->remaining, __ATOMIC_SEQ_CST) == 0;
}

/* gather_sleep(bell, timeout_s) -> bool: RoundBell.gather_sleep, gather_block for Python (no
 * spinning: the caller spun): True when ``remaining`` is 0. */
static PyObject *
sp_gather_sleep(PyObject *self, PyObject *args)
{
    bell_t *bell;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "O&d", as_address, &bell, &timeout_s))
        return NULL;
    calls[F_GATHER_SLEEP]++;
    return PyBool_FromLong(gather_block(bell, timeout_s));
}

/* bell_alarm(bell, on): RoundBell.alarm, the death watch's side of R8. On: ``dead`` = 1, then
 * the driver woken if it sleeps on a full round (a dead worker never arrives); off (a death
 * answered): ``dead`` = 0. */
static PyObject *
sp_bell_alarm(PyObject *self, PyObject *args)
{
    bell_t *bell;
    int on;
    if (!PyArg_ParseTuple(args, "O&p", as_address, &bell, &on))
        return NULL;
    calls[F_BELL_ALARM]++;
    __atomic_store_n(&bell->dead, on ? 1 : 0, __ATOMIC_SEQ_CST);
    if (on && __atomic_exchange_n(&bell->dwait, 0, __ATOMIC_SEQ_CST) != 0)
        futex_wake_n(&bell->dwait, 1);
    Py_RETURN_NONE;
}

static int
poll_pending(void *control)
{
    return bell_pending((volatile control_t *)control);
}

static int
poll_gathered(void *bell)
{
    return __atomic_load_n(&((bell_t *)bell)->remaining, __ATOMIC_ACQUIRE) == 0;
}

/* -- step times (StepTimer.record, _core/stats.py) ----------------------------------------- */

/* fn(), and StepTimer.record of the time of a call that returns: count, total seconds, and the
 * quarter-octave histogram bucket (bucket 0 holds everything up to 1 µs) of a float64 stats
 * row. */
static PyObject *
call_timed(PyObject *fn, double *words, int per_octave, int num_buckets)
{
    double t0 = monotonic_s();
    PyObject *result = PyObject_CallNoArgs(fn);
    if (result == NULL)
        return NULL;
    double seconds = monotonic_s() - t0;
    words[0] += 1.0;
    words[1] += seconds;
    double us = seconds * 1e6;
    int b = 0;
    if (us > 1.0) {
        double f = per_octave * log2(us);
        b = f >= num_buckets - 1 ? num_buckets - 1 : (int)f;
    }
    words[2 + b] += 1.0;
    return result;
}

/* timed_call(words, per_octave, num_buckets, fn) -> fn(): StepTimer.call (_core/stats.py), for the
 * groups stepped by run_command (serial, threads, Ray actors, the processes driver's block);
 * the time of a call that returns is recorded in the stats row at address ``words``. */
static PyObject *
sp_timed_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int per_octave, num_buckets;
    void *words;
    if (!arg_count("timed_call", nargs, 4, 4) || !arg_int(args[1], &per_octave) ||
        !arg_int(args[2], &num_buckets) || !as_address(args[0], &words))
        return NULL;
    calls[F_TIMED_CALL]++;
    return call_timed(args[3], (double *)words, per_octave, num_buckets);
}

/* -- the processes worker's loop ----------------------------------------------------------- */

/* A SpinBudget's numbers, where doorbell.SpinBudget keeps them (its ``words``, three doubles in
 * this order, at its ``address``): read and adapted here in place, as its Python methods do. */
typedef struct {
    double budget_s, max_s, step_s;
} spin_budget_t;

/* SpinBudget.caught: a wait ended while spinning; the budget grows by step_s, up to max_s. */
static void
budget_caught(spin_budget_t *b)
{
    b->budget_s = b->budget_s + b->step_s < b->max_s ? b->budget_s + b->step_s : b->max_s;
}

/* SpinBudget.blocked: a wait that spun out and blocked, wait_s seconds in all. */
static void
budget_blocked(spin_budget_t *b, double wait_s)
{
    if (wait_s <= b->max_s / 2) /* a longer spin would have caught it */
        budget_caught(b);
    else
        b->budget_s /= 2;
}

/* budget_adapt(address, wait_s): SpinBudget.caught (wait_s < 0) or .blocked(wait_s), the rule
 * written once: the SpinBudget's numbers at ``address`` adapted in place. */
static PyObject *
sp_budget_adapt(PyObject *self, PyObject *args)
{
    spin_budget_t *budget;
    double wait_s;
    if (!PyArg_ParseTuple(args, "O&d", as_address, &budget, &wait_s))
        return NULL;
    if (wait_s < 0)
        budget_caught(budget);
    else
        budget_blocked(budget, wait_s);
    Py_RETURN_NONE;
}

/* A SpinBudget's numbers: its ``address`` attribute, read once when a function is bound. */
static spin_budget_t *
spin_budget_of(PyObject *budget)
{
    PyObject *address = PyObject_GetAttrString(budget, "address");
    if (address == NULL)
        return NULL;
    void *p = NULL;
    int ok = as_address(address, &p);
    Py_DECREF(address);
    return ok ? (spin_budget_t *)p : NULL;
}

/* serve_steps(request, done, any_done, control, step, timer_words, budget, tight_s,
 *             step_code, ok_code, buckets_per_octave, num_buckets[, bell])
 *     -> (reason, spun_s, result)
 *
 * With ``bell`` (the address of the vector env's round bell, Linux), a request is due when
 * the REQ word differs from the ACK word rather than when the request semaphore is posted, and
 * a reply ends with bell_arrive (ACK, then ``remaining`` or the done semaphore).
 *
 * _Worker.serve's loop for plain steps. Repeatedly: take the request semaphore (spinning, as
 * Doorbell.wait does, within the SpinBudget at the address ``budget``, whose budget_s it
 * adapts as SpinBudget.caught does); when the command word is a step without payload, call
 * ``step()`` (EnvGroup.step), record its time in the StepTimer words (count, total seconds,
 * quarter-octave histogram), and when it returned no events, reply OK with no payload: status
 * word, payload word 0, ACK, post ``done`` (and ``any_done`` unless 0). Returns to the caller:
 *   (0, spun_s, None)    the wait spun out after spun_s seconds; nothing taken: block on it
 *   (1, 0.0, None)       a request other than a plain step was taken: dispatch it
 *   (2, 0.0, events)     a step returned events: reply OK with them
 * An exception from step() propagates (nothing recorded, no reply sent). ``control`` is the
 * worker's control_t row. */
static PyObject *
sp_serve_steps(PyObject *self, PyObject *args)
{
    calls[F_SERVE_STEPS]++;
    PyObject *step;
    double tight_s;
    long long step_code, ok_code;
    int per_octave, num_buckets;
    sem_t *request, *done, *any_done;
    volatile control_t *control;
    double *words;
    spin_budget_t *budget; /* adapted in place, as SpinBudget.caught */
    bell_t *bell = NULL;
    if (!PyArg_ParseTuple(args, "O&O&O&O&OO&O&dLLii|O&", as_address, &request, as_address, &done,
                          as_address_or_none, &any_done, as_address, &control, &step, as_address,
                          &words, as_address, &budget, &tight_s, &step_code, &ok_code,
                          &per_octave, &num_buckets, as_address_or_none, &bell))
        return NULL;
    int (*poll)(void *) = bell != NULL ? poll_pending : poll_sem;
    void *polled = bell != NULL ? (void *)control : (void *)request;
    PyObject *out = NULL;
    for (;;) {
        double t_wait;
        if (!spin_poll(poll, polled, tight_s, budget->budget_s, &t_wait)) {
            out = Py_BuildValue("(idO)", 0, t_wait, Py_None);
            break;
        }
        budget_caught(budget);
        if (control->cmd != step_code || control->cmd_payload != 0) {
            out = Py_BuildValue("(idO)", 1, 0.0, Py_None);
            break;
        }
        PyObject *result = call_timed(step, words, per_octave, num_buckets);
        if (result == NULL)
            break;
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
        control->status = ok_code;
        control->reply_payload = 0;
        bell_arrive(bell, control, done, any_done); /* GATHER is 0 without a bell */
    }
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

/* -- the processes driver's full step round ------------------------------------------------- */

/* A full round's plan, the one handle full_round takes (round_plan() builds it when the
 * processes transport binds its round): each worker's semaphores and control row, parsed
 * once, and what every round calls or reads. The references are owned. */
typedef struct {
    sem_t *request, *done;
    volatile control_t *control;
    spin_budget_t *budget; /* the worker's SpinBudget (the semaphore round's) */
} round_worker_t;

typedef struct {
    Py_ssize_t n;
    round_worker_t *workers;
    spin_budget_t *round_budget; /* the SpinBudget of a round on the bell */
    PyObject *budget_owners;     /* (the budgets list, the round's SpinBudget): kept alive */
    PyObject *driver_block; /* the driver's own block, timed; None: it has none */
    PyObject *env_failure, *outcome_type;
    double tight_s;
    long long step_code, ok_code;
    bell_t *bell; /* NULL: no round bell */
} round_plan_t;

static const char round_plan_name[] = "envfleet._speedups.round_plan";

static void
round_plan_free(PyObject *capsule)
{
    round_plan_t *plan = PyCapsule_GetPointer(capsule, round_plan_name);
    if (plan == NULL)
        return;
    PyMem_Free(plan->workers);
    Py_XDECREF(plan->budget_owners);
    Py_XDECREF(plan->driver_block);
    Py_XDECREF(plan->env_failure);
    Py_XDECREF(plan->outcome_type);
    PyMem_Free(plan);
}

/* round_plan(requests, dones, controls, budgets, driver_block, env_failure, tight_s, step_code,
 *            ok_code, bell, round_budget, outcome_type) -> plan
 *
 * The tuples hold the addresses of each worker's request and done semaphores and of its
 * control row; ``budgets`` one SpinBudget per worker and ``round_budget`` the round's (the
 * plan keeps them alive and reads their numbers in place); ``bell`` the round bell's address
 * (Linux x86-64) or None; ``outcome_type`` protocol.RoundOutcome (a tuple subclass). */
static PyObject *
sp_round_plan(PyObject *self, PyObject *args)
{
    PyObject *requests, *dones, *controls, *budgets, *driver_block, *env_failure, *bell;
    PyObject *round_budget, *outcome_type;
    double tight_s;
    long long step_code, ok_code;
    if (!PyArg_ParseTuple(args, "O!O!O!O!OOdLLOOO:round_plan", &PyTuple_Type, &requests,
                          &PyTuple_Type, &dones, &PyTuple_Type, &controls, &PyList_Type, &budgets,
                          &driver_block, &env_failure, &tight_s, &step_code, &ok_code, &bell,
                          &round_budget, &outcome_type))
        return NULL;
    if (!PyType_Check(outcome_type) ||
        !PyType_IsSubtype((PyTypeObject *)outcome_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "round_plan: outcome_type must be a tuple subclass");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(requests);
    if (PyTuple_GET_SIZE(dones) != n || PyTuple_GET_SIZE(controls) != n ||
        PyList_GET_SIZE(budgets) != n) {
        PyErr_SetString(PyExc_ValueError, "round_plan: one entry per worker in each");
        return NULL;
    }
    round_plan_t *plan = PyMem_Calloc(1, sizeof(round_plan_t));
    if (plan == NULL)
        return PyErr_NoMemory();
    PyObject *capsule = PyCapsule_New(plan, round_plan_name, round_plan_free);
    if (capsule == NULL) {
        PyMem_Free(plan);
        return NULL;
    }
    /* From here the capsule owns the plan: its destructor frees what was filled in. */
    plan->n = n;
    plan->tight_s = tight_s;
    plan->step_code = step_code;
    plan->ok_code = ok_code;
    plan->driver_block = Py_NewRef(driver_block);
    plan->env_failure = Py_NewRef(env_failure);
    plan->outcome_type = Py_NewRef(outcome_type);
    plan->budget_owners = PyTuple_Pack(2, budgets, round_budget);
    plan->workers = PyMem_Calloc(n ? n : 1, sizeof(round_worker_t));
    if (plan->budget_owners == NULL || plan->workers == NULL) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t w = 0; w < n; w++) {
        round_worker_t *worker = &plan->workers[w];
        if (!as_address(PyTuple_GET_ITEM(requests, w), &worker->request) ||
            !as_address(PyTuple_GET_ITEM(dones, w), &worker->done) ||
            !as_address(PyTuple_GET_ITEM(controls, w), &worker->control) ||
            (worker->budget = spin_budget_of(PyList_GET_ITEM(budgets, w))) == NULL)
            goto fail;
    }
    if (!as_address_or_none(bell, &plan->bell) ||
        (plan->round_budget = spin_budget_of(round_budget)) == NULL)
        goto fail;
    return capsule;
fail:
    Py_DECREF(capsule);
    return NULL;
}

/* The unread list of a full round that took its first ``taken`` workers: the indexes of those
 * whose reply is not "OK, no payload". */
static PyObject *
unread_replies(round_plan_t *plan, Py_ssize_t taken)
{
    PyObject *unread = PyList_New(0);
    for (Py_ssize_t w = 0; unread != NULL && w < taken; w++) {
        volatile control_t *words = plan->workers[w].control;
        if (words->status == plan->ok_code && words->reply_payload == 0)
            continue;
        PyObject *index = PyLong_FromSsize_t(w);
        if (index == NULL || PyList_Append(unread, index) < 0)
            Py_CLEAR(unread);
        Py_XDECREF(index);
    }
    return unread;
}

/* A full round's outcome: None when the round is complete (all the plan's workers taken, none
 * of their replies to read, the driver's own block neither failed nor had an event: the rows
 * are the whole answer, the common case, so it allocates nothing), else an instance of
 * ``outcome_type`` (protocol.RoundOutcome, a NamedTuple: a tuple subclass, allocated and filled
 * here in its fields' order: driver_block_result, driver_block_failure, taken, unread,
 * spun_s). Steals the three references; NULL on error, or when ``unread`` is NULL (its
 * error set). */
static PyObject *
round_outcome(round_plan_t *plan, PyObject *driver_block_result, PyObject *driver_block_failure,
              Py_ssize_t taken, PyObject *unread, double spun_s)
{
    int events = unread == NULL ? -1 : 1; /* 0: complete; -1: unread's or the truth test's error */
    if (unread != NULL && taken == plan->n && PyList_GET_SIZE(unread) == 0 &&
        driver_block_failure == Py_None)
        events = driver_block_result == Py_None ? 0 : PyObject_IsTrue(driver_block_result);
    PyTypeObject *type = (PyTypeObject *)plan->outcome_type;
    PyObject *outcome = events > 0 ? type->tp_alloc(type, 5) : NULL;
    if (outcome == NULL) {
        Py_DECREF(driver_block_result);
        Py_DECREF(driver_block_failure);
        Py_XDECREF(unread);
        return events == 0 ? Py_NewRef(Py_None) : NULL;
    }
    PyTuple_SET_ITEM(outcome, 0, driver_block_result);
    PyTuple_SET_ITEM(outcome, 1, driver_block_failure);
    PyTuple_SET_ITEM(outcome, 2, PyLong_FromSsize_t(taken));
    PyTuple_SET_ITEM(outcome, 3, unread);
    PyTuple_SET_ITEM(outcome, 4, PyFloat_FromDouble(spun_s));
    if (PyTuple_GET_ITEM(outcome, 2) == NULL || PyTuple_GET_ITEM(outcome, 4) == NULL)
        Py_CLEAR(outcome); /* the tuple's dealloc drops the items set */
    return outcome;
}

/* The driver's own block's step (``plan->driver_block``; None: it has none): its result in
 * ``*result``, or the ``env_failure`` instance it raised in ``*failure`` (new references, None
 * where there is nothing); -1 when it raised anything else, which propagates (as from
 * _submit). */
static int
call_driver_block(round_plan_t *plan, PyObject **result, PyObject **failure)
{
    *result = plan->driver_block == Py_None ? Py_NewRef(Py_None)
                                            : PyObject_CallNoArgs(plan->driver_block);
    *failure = *result != NULL ? Py_NewRef(Py_None) : catch_exception(plan->env_failure);
    if (*failure == NULL)
        return -1;
    if (*result == NULL)
        *result = Py_NewRef(Py_None);
    return 0;
}

/* A plain step's command words for a worker, then its REQ counted up (R2: the release store
 * publishes them; the count the worker's ACK copies). */
static void
send_step(round_plan_t *plan, volatile control_t *words)
{
    words->cmd = plan->step_code;
    words->cmd_payload = 0;
    int64_t req = __atomic_load_n((int64_t *)&words->req, __ATOMIC_RELAXED);
    __atomic_store_n((int64_t *)&words->req, req + 1, __ATOMIC_RELEASE);
}

/* full_round's round on the round bell (Linux): ``remaining`` = the worker count (R5), every
 * worker's command words, then its REQ (R2), one ring (R3); the driver's own block; then a spin
 * within the round's SpinBudget until ``remaining`` is 0, and the round's one blocking wait
 * (R7) until the first of: every arrival, a death (R8's ``dead``), ``wait_s`` seconds (below 0:
 * no bound) or a signal whose handler raised (a Ctrl-C: NULL, the KeyboardInterrupt set).
 * Taken: all the workers, or none (the caller then answers the death or the time:
 * RoundBell.gather_sleep). */
static PyObject *
gather_round(round_plan_t *plan, double wait_s)
{
    bell_t *bell = plan->bell;
    Py_ssize_t n = plan->n;
    /* Before any REQ: a worker arrives once it sees its REQ. */
    __atomic_store_n(&bell->remaining, (int32_t)n, __ATOMIC_SEQ_CST);
    for (Py_ssize_t w = 0; w < n; w++) {
        plan->workers[w].control->gather = 1;
        send_step(plan, plan->workers[w].control);
    }
    bell_bump(bell);
    uint32_t bits = 0;
    for (Py_ssize_t w = 0; w < n; w++)
        bits |= bell_sleeping(plan->workers[w].control);
    bell_wake(bell, bits);
    PyObject *driver_block_result, *driver_block_failure;
    if (call_driver_block(plan, &driver_block_result, &driver_block_failure) < 0)
        return NULL;
    double budget_s = plan->round_budget->budget_s;
    int got = spin_poll(poll_gathered, bell, plan->tight_s, budget_s, NULL);
    double slept_s = -1.0;
    if (!got && wait_s != 0) {
        double start = monotonic_s(), left = wait_s;
        while (!(got = gather_block(bell, left)) &&
               !__atomic_load_n(&bell->dead, __ATOMIC_SEQ_CST)) {
            /* Woken early: a signal (its Python handler runs here), or a spurious wake-up. */
            if (PyErr_CheckSignals() < 0) {
                Py_DECREF(driver_block_result);
                Py_DECREF(driver_block_failure);
                return NULL;
            }
            if (wait_s > 0 && (left = wait_s - (monotonic_s() - start)) <= 0)
                break;
        }
        slept_s = monotonic_s() - start;
    }
    if (!got)
        return round_outcome(plan, driver_block_result, driver_block_failure, 0, PyList_New(0),
                             budget_s + (slept_s > 0 ? slept_s : 0.0));
    if (slept_s < 0)
        budget_caught(plan->round_budget);
    else
        budget_blocked(plan->round_budget, budget_s + slept_s);
    return round_outcome(plan, driver_block_result, driver_block_failure, n,
                         unread_replies(plan, n), 0.0);
}

/* full_round(plan, ring, wait_s)
 *     -> None (the round complete) or outcome_type(driver_block_result, driver_block_failure,
 *        taken, unread, spun_s)
 *
 * The processes transport's full_round (``plan``: its round_plan): the round driver's send and
 * wait of a plain step, up to reading the replies. With the plan's round bell (Linux x86-64)
 * and ``ring``, the round is gather_round's: one ring and one count of arrivals for all the
 * workers (spinning within the round's SpinBudget, then one blocking wait until every arrival,
 * a death or ``wait_s`` seconds: 0, none; below 0, no bound) instead of one semaphore each;
 * ``taken`` is then all or none, and ``spun_s`` the seconds spun and slept.
 *
 * Else, for each worker: command word = step_code, payload word = 0, post its request (unless
 * ``ring`` is 0: step_async already did, and step_wait finishes the round). Then the driver's
 * own block (call_driver_block). Then take each worker's done semaphore in order, spinning
 * within its SpinBudget (adapted as SpinBudget.caught does): ``taken`` workers were, and
 * ``unread`` lists the indexes of those whose reply is not "OK, no payload" (the caller reads
 * those). When a spin runs out the round stops there: the caller waits for workers ``taken``
 * on, blocking at once for the first (it already spun ``spun_s`` seconds). */
static PyObject *
sp_full_round(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    calls[F_FULL_ROUND]++;
    int ring;
    if (!arg_count("full_round", nargs, 3, 3))
        return NULL;
    double wait_s = PyFloat_AsDouble(args[2]);
    if (wait_s == -1.0 && PyErr_Occurred())
        return NULL;
    round_plan_t *plan = PyCapsule_GetPointer(args[0], round_plan_name);
    if (plan == NULL || (ring = PyObject_IsTrue(args[1])) < 0)
        return NULL;
    if (ring && plan->bell != NULL)
        return gather_round(plan, wait_s);
    Py_ssize_t n = plan->n;
    for (Py_ssize_t w = 0; ring && w < n; w++) {
        send_step(plan, plan->workers[w].control);
        if (sem_post(plan->workers[w].request) != 0)
            return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *driver_block_result, *driver_block_failure;
    if (call_driver_block(plan, &driver_block_result, &driver_block_failure) < 0)
        return NULL;
    Py_ssize_t taken = 0;
    double spun_s = 0.0;
    for (; taken < n; taken++) {
        round_worker_t *worker = &plan->workers[taken];
        double budget_s = worker->budget->budget_s;
        if (!spin_poll(poll_sem, worker->done, plan->tight_s, budget_s, NULL)) {
            spun_s = budget_s;
            break;
        }
        budget_caught(worker->budget);
        if (bell_pending(worker->control))
            break; /* ACK behind REQ: the death watch's token (R8); the caller finds it dead */
    }
    return round_outcome(plan, driver_block_result, driver_block_failure, taken,
                         unread_replies(plan, taken), spun_s);
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
    int is_long = PyLong_Check(r); /* int and bool */
    if (!is_long && (np_float32_type == NULL || !Py_IS_TYPE(r, np_float32_type)))
        return 0;
    *out = is_long ? PyLong_AsDouble(r) : PyFloat_AsDouble(r);
    if (*out == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 1;
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
sp_write_results(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *rp, *tp, *up;
    const char *fname = "write_results";
    if (!arg_count(fname, nargs, 7, 7) || !arg_of_type(fname, args, 0, &PyList_Type) ||
        !arg_of_type(fname, args, 1, &PyList_Type) || !arg_of_type(fname, args, 2, &PyList_Type) ||
        !arg_of_type(fname, args, 6, &PyList_Type))
        return NULL;
    if (!as_address(args[3], &rp) || !as_address(args[4], &tp) || !as_address(args[5], &up))
        return NULL;
    PyObject *rewards = args[0], *terms = args[1], *truncs = args[2], *autoreset = args[6];
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

/* write_rows(env_obs, ndarray, dtype, shape, address, row_bytes, fallback) -> None
 *
 * Copy each observation's bytes to row j at address + j * row_bytes, when every one is an
 * exact ``ndarray`` instance (the type passed in), C-contiguous, of exactly ``shape`` and
 * whose dtype is ``dtype`` (the same object, as ``obs.dtype is dtype``): then the copy is
 * exactly numpy's, which copies same-typed elements byte for byte. When some observation is
 * not like that, nothing is written here and ``fallback()`` writes them (numpy), its result
 * or error returned: one call writes the rows either way (rows.RowWriter). */
static PyObject *
sp_write_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *dest;
    const char *fname = "write_rows";
    if (!arg_count(fname, nargs, 7, 7) || !arg_of_type(fname, args, 0, &PyList_Type) ||
        !arg_of_type(fname, args, 1, &PyType_Type) || !arg_of_type(fname, args, 3, &PyTuple_Type))
        return NULL;
    Py_ssize_t row_bytes = PyLong_AsSsize_t(args[5]);
    if ((row_bytes == -1 && PyErr_Occurred()) || !as_address(args[4], &dest))
        return NULL;
    PyObject *env_obs = args[0], *ndarray = args[1], *dtype = args[2], *shape = args[3];
    Py_ssize_t n = PyList_GET_SIZE(env_obs), ndim = PyTuple_GET_SIZE(shape);
    Py_ssize_t dims[32];
    if (ndim > 32)
        goto decline;
    for (Py_ssize_t d = 0; d < ndim; d++) {
        dims[d] = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, d));
        if (dims[d] == -1 && PyErr_Occurred())
            return NULL;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *obs = PyList_GET_ITEM(env_obs, j);
        if (!Py_IS_TYPE(obs, (PyTypeObject *)ndarray))
            goto decline;
        ndarray_head *a = (ndarray_head *)obs;
        if (a->descr != dtype || a->nd != ndim || !(a->flags & NDARRAY_C_CONTIGUOUS))
            goto decline;
        for (Py_ssize_t d = 0; d < ndim; d++) {
            if (a->dimensions[d] != dims[d])
                goto decline;
        }
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        ndarray_head *a = (ndarray_head *)PyList_GET_ITEM(env_obs, j);
        memcpy((char *)dest + j * row_bytes, a->data, (size_t)row_bytes);
    }
    calls[F_WRITE_ROWS]++;
    Py_RETURN_NONE;
decline:
    return PyObject_CallNoArgs(args[6]);
}

static PyObject *
sp_register_types(PyObject *self, PyObject *args)
{
    PyObject *b, *f;
    if (!PyArg_ParseTuple(args, "O!O!", &PyType_Type, &b, &PyType_Type, &f))
        return NULL;
    Py_XSETREF(np_bool_type, (PyTypeObject *)Py_NewRef(b));
    Py_XSETREF(np_float32_type, (PyTypeObject *)Py_NewRef(f));
    Py_RETURN_NONE;
}

/* -- the replay record's episode start (env_state.StartReader.packed) --------------------- */

/* numpy's pcg64_state (numpy/random/src/pcg64/pcg64.h), what a PCG64 bit generator's
 * ``ctypes.state_address`` points at: its 32-byte pcg64_random_t (the 128-bit state, then the
 * increment), and the buffered 32-bit half of a draw. Not a public layout: env_state.py checks
 * this copy against bit_generator.state once per process, and uses its Python twin if they
 * differ. */
typedef struct {
    const void *pcg_state;
    int has_uint32;
    uint32_t uinteger;
} pcg64_state_view;

/* pcg64_raw(state_address) -> bytes: the 40 bytes of env_state.pcg64_bytes (state, increment,
 * has_uint32, uinteger, as they lie in memory), read without building the state dict. */
static PyObject *
sp_pcg64_raw(PyObject *self, PyObject *arg)
{
    void *a;
    if (!as_address(arg, &a))
        return NULL;
    calls[F_PCG64_RAW]++;
    const pcg64_state_view *view = (const pcg64_state_view *)a;
    char raw[40];
    memcpy(raw, view->pcg_state, 32);
    memcpy(raw + 32, &view->has_uint32, 4);
    memcpy(raw + 36, &view->uinteger, 4);
    return PyBytes_FromStringAndSize(raw, 40);
}

/* log_row(header, ring, source, row_bytes, capacity): ActionLog.record (action_log.py) of a group's
 * action rows: the row_bytes at ``source`` copied to row header[0] % capacity of the ring at
 * ``ring``, then header[0] (the rows written so far, an int64) counted up. */
static PyObject *
sp_log_row(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *header, *ring, *source;
    if (!arg_count("log_row", nargs, 5, 5) || !as_address(args[0], &header) ||
        !as_address(args[1], &ring) || !as_address(args[2], &source))
        return NULL;
    Py_ssize_t row_bytes = PyLong_AsSsize_t(args[3]);
    if (row_bytes == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t capacity = PyLong_AsSsize_t(args[4]);
    if (capacity == -1 && PyErr_Occurred())
        return NULL;
    if (capacity <= 0 || row_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "log_row: capacity must be > 0, row_bytes >= 0");
        return NULL;
    }
    int64_t *n = (int64_t *)header;
    if (*n < 0) {
        PyErr_SetString(PyExc_ValueError, "log_row: the log's step count is negative");
        return NULL;
    }
    memcpy((char *)ring + (*n % capacity) * row_bytes, source, (size_t)row_bytes);
    *n += 1;
    calls[F_LOG_ROW]++;
    Py_RETURN_NONE;
}

/* -- the learner's crash note (processes' driver_envs: _core/crash_note.py) ---------------- */

/* What the learner's process is stepping: (driver_envs << 32) + the global index of the env,
 * written by EnvGroup.step / reset before each env of the driver's own block and -1 after (a
 * plain int64 store from Python, through a memoryview of this word); -1 otherwise. Read only
 * by fatal_handler. A forked child starts at -1 (fatal_forget, pthread_atfork). */
static volatile int64_t crash_note = -1;

static const int fatal_signals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
static const char *const fatal_names[] = {"SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT"};
#define FATAL_COUNT ((int)(sizeof fatal_signals / sizeof fatal_signals[0]))
/* The handler each signal had before ours (faulthandler's, when it is enabled): chained to. */
static struct sigaction fatal_previous[FATAL_COUNT];
static int atfork_registered = 0;

static void
fatal_forget(void)
{
    crash_note = -1;
}

/* Append the decimal digits of v (>= 0) at p; returns the end. Async-signal-safe. */
static char *
put_decimal(char *p, int64_t v)
{
    char digits[24];
    int n = 0;
    do {
        digits[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v > 0 && n < 24);
    while (n > 0)
        *p++ = digits[--n];
    return p;
}

static char *
put_text(char *p, const char *text)
{
    while (*text)
        *p++ = *text++;
    return p;
}

/* The fatal-signal handler: one line to stderr naming the env the learner's process was
 * stepping (when it was stepping one), then the previous handler, as faulthandler chains:
 * that one is restored first, then called (with this signal's siginfo), or, the default
 * action, raised again (SA_NODEFER: delivered at once, the process dies of the signal).
 * Only async-signal-safe calls: write(2), sigaction(2), raise(3). */
static void
fatal_handler(int sig, siginfo_t *info, void *context)
{
    int saved_errno = errno;
    int k = 0;
    while (k < FATAL_COUNT && fatal_signals[k] != sig)
        k++;
    int64_t note = crash_note;
    if (note >= 0 && k < FATAL_COUNT) {
        char line[200];
        char *p = line;
        p = put_text(p, "envfleet: fatal signal ");
        p = put_text(p, fatal_names[k]);
        p = put_text(p, " while the learner's process was stepping sub-environment ");
        p = put_decimal(p, note & 0xFFFFFFFF);
        p = put_text(p, " (driver_envs=");
        p = put_decimal(p, note >> 32);
        p = put_text(p, ")\n");
        const char *q = line;
        size_t left = (size_t)(p - line);
        while (left > 0) {
            ssize_t n = write(STDERR_FILENO, q, left);
            if (n < 0 && errno == EINTR)
                continue;
            if (n <= 0)
                break;
            q += n;
            left -= (size_t)n;
        }
    }
    if (k == FATAL_COUNT) { /* not one of ours: cannot happen */
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    struct sigaction previous = fatal_previous[k];
    sigaction(sig, &previous, NULL);
    errno = saved_errno;
    if (previous.sa_handler == SIG_DFL || previous.sa_handler == SIG_IGN) {
        raise(sig); /* the default action; ignored, a fault recurs on return and kills */
        return;
    }
    if (previous.sa_flags & SA_SIGINFO)
        previous.sa_sigaction(sig, info, context);
    else
        previous.sa_handler(sig);
}

/* crash_note() -> int: install fatal_handler for SIGSEGV, SIGBUS, SIGFPE, SIGILL and SIGABRT
 * over the handlers there now (kept, and chained to: install faulthandler's first), unless it
 * is installed already; return the address of the int64 crash note. */
static PyObject *
sp_crash_note(PyObject *self, PyObject *unused)
{
    if (!atfork_registered) {
        if (pthread_atfork(NULL, NULL, fatal_forget) != 0) {
            PyErr_SetString(PyExc_OSError, "crash_note: pthread_atfork failed");
            return NULL;
        }
        atfork_registered = 1;
    }
    for (int k = 0; k < FATAL_COUNT; k++) {
        struct sigaction current;
        if (sigaction(fatal_signals[k], NULL, &current) != 0)
            return PyErr_SetFromErrno(PyExc_OSError);
        if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == fatal_handler)
            continue; /* ours already (another vector env installed it) */
        fatal_previous[k] = current;
        struct sigaction action;
        memset(&action, 0, sizeof action);
        action.sa_sigaction = fatal_handler;
        sigemptyset(&action.sa_mask);
        /* faulthandler's flags: on its alternate stack (a stack overflow), and the signal
         * not blocked while handled, so that raising it again from here takes effect. */
        action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
        if (sigaction(fatal_signals[k], &action, NULL) != 0)
            return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromVoidPtr((void *)&crash_note);
}

/* -- a host process's fatal-signal note (several one-env groups, one thread each) ------------ */

/* Per thread, the group its serving thread serves (-1: none); the host's fault word, where the
 * handler writes the group of the thread a fatal signal was delivered to, so that the driver
 * names the env that faulted, not every env of the process (_backends/processes/worker.py's
 * host_main). */
static __thread int64_t thread_group = -1;
static volatile int64_t *fault_word = NULL;

static void
host_fault_handler(int sig)
{
    if (fault_word != NULL)
        *fault_word = thread_group;
    signal(sig, SIG_DFL);
    raise(sig); /* SA_NODEFER: the default action at once; a fault recurs on return */
}

/* watch_faults(address): install host_fault_handler for SIGSEGV, SIGBUS, SIGFPE, SIGILL and
 * SIGABRT (before faulthandler, which chains to it, and which faulthandler.disable() puts
 * back); the int64 at ``address`` gets the faulting thread's group. */
static PyObject *
sp_watch_faults(PyObject *self, PyObject *arg)
{
    void *address;
    if (!as_address(arg, &address))
        return NULL;
    fault_word = (volatile int64_t *)address;
    for (int k = 0; k < FATAL_COUNT; k++) {
        struct sigaction action;
        memset(&action, 0, sizeof action);
        action.sa_handler = host_fault_handler;
        sigemptyset(&action.sa_mask);
        action.sa_flags = SA_NODEFER;
        if (sigaction(fatal_signals[k], &action, NULL) != 0)
            return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

/* fault_group(g): the calling thread serves group g (what host_fault_handler writes). */
static PyObject *
sp_fault_group(PyObject *self, PyObject *arg)
{
    long long g = PyLong_AsLongLong(arg);
    if (g == -1 && PyErr_Occurred())
        return NULL;
    thread_group = (int64_t)g;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"watch_faults", sp_watch_faults, METH_O,
     "watch_faults(address): a host's fatal-signal handler, noting the faulting thread's group."},
    {"fault_group", sp_fault_group, METH_O, "fault_group(g): this thread serves group g."},

    {"write_results", (PyCFunction)(void (*)(void))sp_write_results, METH_FASTCALL, "EnvGroup._write_results."},
    {"write_rows", (PyCFunction)(void (*)(void))sp_write_rows, METH_FASTCALL, "An observation slab's rows, memcpy'd (or its fallback called)."},
    {"serve_steps", sp_serve_steps, METH_VARARGS, "_Worker.serve's loop for plain steps."},
    {"round_plan", sp_round_plan, METH_VARARGS,
     "round_plan(requests, dones, controls, budgets, driver_block, env_failure, tight_s, "
     "step_code, ok_code, bell, round_budget, outcome_type) -> plan: full_round's handle."},
    {"full_round", (PyCFunction)(void (*)(void))sp_full_round, METH_FASTCALL,
     "full_round(plan, ring, wait_s): the processes transport's full step round."},
    {"timed_call", (PyCFunction)(void (*)(void))sp_timed_call, METH_FASTCALL, "StepTimer.call."},
    {"budget_adapt", sp_budget_adapt, METH_VARARGS,
     "budget_adapt(address, wait_s): SpinBudget.caught (wait_s < 0) or SpinBudget.blocked."},
    {"bell_ring", sp_bell_ring, METH_VARARGS, "bell_ring(bell, controls): RoundBell.ring."},
    {"pcg64_raw", sp_pcg64_raw, METH_O,
     "pcg64_raw(state_address) -> bytes: env_state.pcg64_bytes of a PCG64 bit generator."},
    {"log_row", (PyCFunction)(void (*)(void))sp_log_row, METH_FASTCALL,
     "log_row(header, ring, source, row_bytes, capacity): ActionLog.record's row copy."},
    {"bell_arrive", sp_bell_arrive, METH_O, "bell_arrive(bell): RoundBell.arrive."},
    {"bell_sleep", sp_bell_sleep, METH_VARARGS,
     "bell_sleep(bell, control, bit, timeout_s) -> bool: RoundBell.sleep."},
    {"gather_sleep", sp_gather_sleep, METH_VARARGS,
     "gather_sleep(bell, timeout_s) -> bool: RoundBell.gather_sleep."},
    {"bell_alarm", sp_bell_alarm, METH_VARARGS, "bell_alarm(bell, on): RoundBell.alarm."},
    {"control_row", sp_control_row, METH_NOARGS,
     "control_row() -> {word name: index}: control_t's fields (USED: its size in words)."},
    {"crash_note", sp_crash_note, METH_NOARGS,
     "crash_note() -> address: the learner's crash note, its fatal-signal handler installed."},
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
