/* The board: an allgather of small blocks among the processes of one machine, through a
 * shared mapping (optcc_mpi/transports/board.py holds the protocol in words).
 *
 * A plain C library loaded with ctypes (no Python C API): ctypes releases the GIL around
 * each call, so a rank waiting here never holds up the process's other threads.
 *
 * Layout of the mapping (every offset a multiple of 64, one cache line per writer):
 *   [0, 64)              the control line: uint32 epoch (the futex word), int32 sleepers,
 *                        int64 mark at 8 (0, or why the board is broken: board.py encodes
 *                        the reason, the rank that saw it and the rank at fault), int64
 *                        woken at 16 (the last block whose completion woke the sleepers)
 *   [64 + 64 r, +8)      rank r's int64 sequence number: the last block it posted
 *   data(b, r)           rank r's slot of parity b = seq & 1, `slot` bytes each, at
 *                        data + (b * size + r) * slot
 *
 * The slots need not follow the control line: `data` is passed with every call. A board
 * starts with its slots in the same mapping, just after the sequence numbers, and may move
 * them to a larger mapping of their own (board.py: a board grows) while its control line
 * stays where it was, so that the sequence numbers run on and a mark made before the move
 * is seen after it.
 *
 * Why two parities suffice: a rank posts block n + 2 into the slot that held block n only
 * after its wait for block n + 1 returned, which needs every rank to have posted n + 1,
 * which each does only after it copied block n out. So no slot is overwritten while a
 * rank may still read it.
 *
 * Ordering: the data are stored before the sequence number with release order, and read
 * after it with acquire order, so a reader that sees seq >= n sees block n's bytes on any
 * architecture. The sleep is a futex on the epoch (Linux; elsewhere a short nanosleep).
 * Every rank waits for the same thing (every rank's block n), so only the post that
 * completes block n can end a wait: that poster, the one that finds every rank posted
 * (after its own store, so that of two ranks posting at once at least one sees the
 * other's), claims the block's wake-up (a compare-and-swap on `woken`, so that one rank
 * alone issues it), increments the epoch and wakes the sleepers: one wake-up per
 * exchange, not one per post (p posts, each waking p - 1 sleepers that mostly go back to
 * sleep). A sleeper counts itself among the sleepers and rechecks before sleeping, and
 * the futex refuses to sleep if the epoch moved, so no wake-up is lost (every access here
 * is sequentially consistent where it matters: the sleeper's count and the completing
 * poster's read of it).
 *
 * The mark: a hard mark (a rank aborted, timed out, found a peer gone, or left an
 * exchange by an exception, so that its sequence numbers may be out of step) makes every
 * wait return -2, even one whose ranks all posted: a rank out of step marks the board
 * before it can post again, so a reader that sees such a post sees the mark. A soft mark
 * (SOFT: a rank destroyed the group, and posts nothing more) ends only the waits that
 * cannot complete; a rank's last exchanges before its peer's destroy still complete. A
 * hard mark replaces a soft one, never the other way round.
 */
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sched.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define LINE 64
/* A mark that ends only the waits that cannot complete (above). */
#define SOFT ((int64_t)1 << 62)

/* FUTEX_WAKE calls made by this process (the tests count them). */
static int64_t wakes;

static inline uint32_t *epoch_of(char *mem) { return (uint32_t *)mem; }
static inline int32_t *sleepers_of(char *mem) { return (int32_t *)(mem + 4); }
static inline int64_t *mark_of(char *mem) { return (int64_t *)(mem + 8); }
static inline int64_t *woken_of(char *mem) { return (int64_t *)(mem + 16); }
static inline int64_t *seq_of(char *mem, int32_t r) { return (int64_t *)(mem + LINE + (int64_t)LINE * r); }

static inline char *slot_of(char *data, int32_t size, int64_t slot, int64_t seq, int32_t r)
{
    return data + ((seq & 1) * size + r) * slot;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void wake(char *mem)
{
    __atomic_fetch_add(epoch_of(mem), 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(sleepers_of(mem), __ATOMIC_SEQ_CST) > 0) {
        __atomic_fetch_add(&wakes, 1, __ATOMIC_RELAXED);
#ifdef __linux__
        syscall(SYS_futex, epoch_of(mem), FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
#endif
    }
}

static void sleep_on(char *mem, uint32_t seen, double seconds)
{
    if (seconds <= 0)
        return;
    struct timespec ts;
    ts.tv_sec = (time_t)seconds;
    ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
#ifdef __linux__
    syscall(SYS_futex, epoch_of(mem), FUTEX_WAIT, seen, &ts, NULL, 0);
#else
    (void)seen;
    if (ts.tv_sec > 0 || ts.tv_nsec > 200000) {
        ts.tv_sec = 0;
        ts.tv_nsec = 200000;
    }
    nanosleep(&ts, NULL);
#endif
}

/* The first rank that has not posted block `seq`, or -1 when all have. */
static int32_t first_missing(char *mem, int32_t size, int64_t seq)
{
    for (int32_t r = 0; r < size; r++)
        if (__atomic_load_n(seq_of(mem, r), __ATOMIC_ACQUIRE) < seq)
            return r;
    return -1;
}

/* Post this rank's block `seq` (n bytes from src, into its slot among `data`; n <= slot). */
void optcc_board_post(char *mem, char *data, int32_t size, int32_t rank, int64_t slot,
                      int64_t seq, const char *src, int64_t n)
{
    if (n > 0)
        memcpy(slot_of(data, size, slot, seq, rank), src, (size_t)n);
    __atomic_store_n(seq_of(mem, rank), seq, __ATOMIC_SEQ_CST);
    if (first_missing(mem, size, seq) >= 0)
        return; /* a later post completes the block, and wakes */
    int64_t woken = __atomic_load_n(woken_of(mem), __ATOMIC_SEQ_CST);
    while (woken < seq)
        if (__atomic_compare_exchange_n(woken_of(mem), &woken, seq, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST)) {
            wake(mem);
            return;
        }
}

/* Whether a wait with `missing` (-1: none) must end for the mark (above). */
static int ended(int64_t mark, int32_t missing)
{
    return mark != 0 && (missing >= 0 || !(mark & SOFT));
}

/* Wait up to `seconds` for every rank's block `seq`; spin (yielding the CPU) for the first
 * `spin` seconds, then sleep. Returns -1 when every rank posted it (then each rank's first
 * n bytes are copied to out + r * n), -2 if the mark ends the wait (optcc_board_mark says
 * why), else the first rank still missing. */
int32_t optcc_board_wait(char *mem, char *data, int32_t size, int64_t slot, int64_t seq,
                         char *out, int64_t n, double seconds, double spin)
{
    double start = now();
    for (;;) {
        /* The sequence numbers before the mark: a post seen here was made after any hard
         * mark of its poster (above), which this load then sees. */
        int32_t missing = first_missing(mem, size, seq);
        if (ended(__atomic_load_n(mark_of(mem), __ATOMIC_SEQ_CST), missing))
            return -2;
        if (missing < 0)
            break;
        double spent = now() - start;
        if (spent >= seconds)
            return missing;
        if (spent < spin) {
            sched_yield();
        } else {
            uint32_t seen = __atomic_load_n(epoch_of(mem), __ATOMIC_SEQ_CST);
            __atomic_fetch_add(sleepers_of(mem), 1, __ATOMIC_SEQ_CST);
            missing = first_missing(mem, size, seq);
            if (missing >= 0 && !ended(__atomic_load_n(mark_of(mem), __ATOMIC_SEQ_CST), missing))
                sleep_on(mem, seen, seconds - spent);
            __atomic_fetch_sub(sleepers_of(mem), 1, __ATOMIC_SEQ_CST);
        }
    }
    if (n > 0)
        for (int32_t r = 0; r < size; r++)
            memcpy(out + (int64_t)r * n, slot_of(data, size, slot, seq, r), (size_t)n);
    return -1;
}

/* Mark the board broken (`mark`: nonzero, SOFT or hard, above) and wake every sleeper.
 * The first mark stays, but a hard one replaces a soft one. */
void optcc_board_break(char *mem, int64_t mark)
{
    int64_t was = __atomic_load_n(mark_of(mem), __ATOMIC_SEQ_CST);
    while (was == 0 || ((was & SOFT) && !(mark & SOFT)))
        if (__atomic_compare_exchange_n(mark_of(mem), &was, mark, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST))
            break;
    wake(mem);
}

/* Why the board is broken (0: it is not). */
int64_t optcc_board_mark(char *mem) { return __atomic_load_n(mark_of(mem), __ATOMIC_SEQ_CST); }

/* FUTEX_WAKE calls this process made so far, on every board. */
int64_t optcc_board_wakes(void) { return __atomic_load_n(&wakes, __ATOMIC_RELAXED); }
