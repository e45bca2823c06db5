/* Event loop of optcc_mpi.simulate, compiled on first use (see simulate.py).
 *
 * It is a line-for-line translation of simulate._run_python: the Python version is the
 * specification and the fallback, and the tests check that both give identical times.
 */
#include <stdint.h>
#include <stdlib.h>

enum { SEND = 0, RECV = 1, RECV_REDUCE = 2, COPY = 3, REDUCE = 4, COLL = 5 };

typedef struct {
    double t;
    int64_t seq;  /* tie-break: the send's op id (program order); n + c for collective c */
    int64_t item; /* send op, or -1 - collective index */
} event;

typedef struct {
    event *a;
    int64_t n, cap;
} heap;

static int less(const event *x, const event *y) {
    return x->t < y->t || (x->t == y->t && x->seq < y->seq);
}

static int heap_push(heap *h, event e) {
    if (h->n == h->cap) {
        int64_t cap = h->cap ? 2 * h->cap : 1024;
        event *a = realloc(h->a, (size_t)cap * sizeof(event));
        if (!a) return -1;
        h->a = a;
        h->cap = cap;
    }
    int64_t i = h->n++;
    h->a[i] = e;
    while (i > 0) {
        int64_t up = (i - 1) / 2;
        if (!less(&h->a[i], &h->a[up])) break;
        event tmp = h->a[i];
        h->a[i] = h->a[up];
        h->a[up] = tmp;
        i = up;
    }
    return 0;
}

static event heap_pop(heap *h) {
    event top = h->a[0];
    h->a[0] = h->a[--h->n];
    int64_t i = 0;
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < h->n && less(&h->a[l], &h->a[m])) m = l;
        if (r < h->n && less(&h->a[r], &h->a[m])) m = r;
        if (m == i) break;
        event tmp = h->a[i];
        h->a[i] = h->a[m];
        h->a[m] = tmp;
        i = m;
    }
    return top;
}


typedef struct {
    /* inputs */
    int64_t n, p;
    const int8_t *kind;
    const int32_t *rank;
    const int64_t *partner, *succ_ptr, *lo, *hi;
    const int32_t *qnext, *succ;
    const double *send_rate, *recv_rate;
    double itemsize, latency, red;
    int32_t *waiting;
    /* state */
    double *ready_at, *posted, *finish, *sp, *rp, *send_busy, *recv_busy;
    int64_t *coll_count, *coll_seen, *coll_ops;
    double *coll_post;
    int64_t n_coll;
    int32_t *stack; /* ops ready to post; each is posted at its ready_at */
    int64_t top;
    heap h;
} sim;

static double nbytes(const sim *s, int64_t op) {
    return (double)(s->hi[op] - s->lo[op]) * s->itemsize;
}

static void release(sim *s, int64_t op, double t) {
    if (t > s->ready_at[op]) s->ready_at[op] = t;
    if (--s->waiting[op] == 0) s->stack[s->top++] = (int32_t)op;
}

static void complete(sim *s, int64_t op, double t) {
    int32_t r = s->rank[op];
    if (t > s->finish[r]) s->finish[r] = t;
    for (int64_t i = s->succ_ptr[op]; i < s->succ_ptr[op + 1]; i++) release(s, s->succ[i], t);
}

static int drain(sim *s) {
    while (s->top > 0) {
        int64_t op = s->stack[--s->top];
        double t = s->ready_at[op];
        s->posted[op] = t;
        if (s->qnext[op] >= 0) release(s, s->qnext[op], t);
        int k = s->kind[op];
        if (k == SEND || k == RECV || k == RECV_REDUCE) {
            int64_t other = s->partner[op];
            if (s->posted[other] >= 0.0) {
                int64_t snd = k == SEND ? op : other;
                double when = t > s->posted[other] ? t : s->posted[other];
                event e = {when, snd, snd};
                if (heap_push(&s->h, e)) return -1;
            }
        } else if (k == COPY || k == REDUCE) {
            complete(s, op, t + nbytes(s, op) * s->red);
        } else if (k == COLL) {
            int32_t r = s->rank[op];
            int64_t c = s->coll_count[r]++;
            s->coll_ops[c * s->p + r] = op;
            if (t > s->coll_post[c]) s->coll_post[c] = t;
            if (++s->coll_seen[c] == s->p) {
                event e = {s->coll_post[c], s->n + c, -1 - c};
                if (heap_push(&s->h, e)) return -1;
            }
        }
    }
    return 0;
}

/* Returns the number of messages, or -1 on allocation failure. ``trace`` (may be NULL)
 * receives 10 doubles per message. */
int64_t optcc_simulate(int64_t n, int64_t p, const int8_t *kind, const int32_t *rank,
                       const int64_t *partner, const int32_t *qnext, const int64_t *succ_ptr,
                       const int32_t *succ, int32_t *waiting, const int64_t *lo,
                       const int64_t *hi, const double *send_rate, const double *recv_rate,
                       double itemsize, double latency, double red, int64_t n_coll,
                       double *posted, double *finish, double *send_busy, double *recv_busy,
                       double *trace) {
    sim s = {0};
    s.n = n; s.p = p; s.kind = kind; s.rank = rank; s.partner = partner; s.qnext = qnext;
    s.succ_ptr = succ_ptr; s.succ = succ; s.lo = lo; s.hi = hi; s.itemsize = itemsize;
    s.send_rate = send_rate; s.recv_rate = recv_rate; s.latency = latency; s.red = red;
    s.waiting = waiting;
    s.posted = posted; s.finish = finish; s.send_busy = send_busy; s.recv_busy = recv_busy;
    s.n_coll = n_coll;
    s.ready_at = calloc((size_t)n + 1, sizeof(double));
    s.sp = calloc((size_t)p, sizeof(double));
    s.rp = calloc((size_t)p, sizeof(double));
    s.coll_count = calloc((size_t)p, sizeof(int64_t));
    s.coll_seen = calloc((size_t)n_coll + 1, sizeof(int64_t));
    s.coll_post = calloc((size_t)n_coll + 1, sizeof(double));
    s.coll_ops = calloc((size_t)(n_coll + 1) * (size_t)p, sizeof(int64_t));
    s.stack = malloc(((size_t)n + 1) * sizeof(int32_t));
    int64_t messages = -1;
    if (!s.ready_at || !s.sp || !s.rp || !s.coll_count || !s.coll_seen || !s.coll_post ||
        !s.coll_ops || !s.stack)
        goto out;
    for (int64_t op = 0; op < n; op++) posted[op] = -1.0;
    for (int64_t op = n - 1; op >= 0; op--)
        if (waiting[op] == 0) s.stack[s.top++] = (int32_t)op;
    if (drain(&s)) goto out;
    messages = 0;
    while (s.h.n > 0) {
        event e = heap_pop(&s.h);
        double t = e.t;
        if (e.item < 0) {
            int64_t c = -1 - e.item;
            int64_t first = s.coll_ops[c * p];
            double m = nbytes(&s, first);
            double start = t, slow = send_rate[0];
            for (int64_t r = 0; r < p; r++) {
                if (s.sp[r] > start) start = s.sp[r];
                if (s.rp[r] > start) start = s.rp[r];
                if (send_rate[r] < slow) slow = send_rate[r];
                if (recv_rate[r] < slow) slow = recv_rate[r];
            }
            double dur = 2.0 * (double)(p - 1) / (double)p * m / slow;
            int64_t lg = 0;
            while ((1LL << lg) < p) lg++;
            double end = start + dur + 2.0 * (double)lg * latency;
            for (int64_t r = 0; r < p; r++) {
                s.sp[r] = s.rp[r] = start + dur;
                send_busy[r] += dur;
                recv_busy[r] += dur;
            }
            for (int64_t r = 0; r < p; r++) complete(&s, s.coll_ops[c * p + r], end);
            if (drain(&s)) { messages = -1; goto out; }
            continue;
        }
        int64_t snd = e.item, rcv = partner[snd];
        int32_t a = rank[snd], b = rank[rcv];
        double m = nbytes(&s, snd);
        double s_start = t > s.sp[a] ? t : s.sp[a];
        double s_time = m / send_rate[a];
        double s_end = s_start + s_time;
        s.sp[a] = s_end;
        send_busy[a] += s_time;
        double r_start = t > s.rp[b] ? t : s.rp[b];
        double r_time = m / recv_rate[b];
        double r_end = r_start + r_time;
        s.rp[b] = r_end;
        recv_busy[b] += r_time;
        double end = (s_end > r_end ? s_end : r_end) + latency;
        if (trace) {
            double *row = trace + 10 * messages;
            row[0] = (double)snd; row[1] = a; row[2] = b; row[3] = m; row[4] = t;
            row[5] = s_start; row[6] = s_end; row[7] = r_start; row[8] = r_end; row[9] = end;
        }
        messages++;
        complete(&s, snd, end);
        if (kind[rcv] == RECV_REDUCE) end += m * red;
        complete(&s, rcv, end);
        if (drain(&s)) { messages = -1; goto out; }
    }
out:
    free(s.ready_at); free(s.sp); free(s.rp); free(s.coll_count); free(s.coll_seen);
    free(s.coll_post); free(s.coll_ops); free(s.stack); free(s.h.a);
    return messages;
}
