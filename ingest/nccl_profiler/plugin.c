/*
 * stragglerscope's NCCL profiler plugin: each peer's share of every collective, for the link diagnosis.
 *
 * NCCL (2.23 and later) loads the library NCCL_PROFILER_PLUGIN names and looks up ncclProfiler_v5, then
 * v4 ... v1 with dlsym. We export all five, each over the same core, because a training image carries
 * whichever NCCL its PyTorch wheel pinned. What we keep, per communicator (NCCL's init), collective and
 * point-to-point call (Coll/P2p events) and proxy operation (ProxyOp, one per channel and peer, with its
 * ProxyStep children), ends as fixed-size records of ingest/nccl_peers.py's RECORD layout in
 * $STRAGGLERSCOPE_NCCL_PEERS_DIR/nccl-peers-<pid>.bin.
 *
 * NCCL's threads must never wait on us: callbacks only touch memory the plugin owns, and a finished
 * record goes into a bounded lock-free ring that a writer thread of ours drains to the file. A full ring
 * drops the record and counts it (the count reaches the file as a KIND_DROPS record).
 *
 * Event handles are not pointers: they encode (kind, slot, generation) in the 64 bits NCCL stores for us,
 * so a stale, repeated or made-up handle is recognised and ignored instead of dereferenced. NCCL never
 * looks inside a handle; it only hands it back to us (and uses NULL as "not profiled").
 *
 * The declarations of NCCL's interface below are our own, written from NCCL's profiler plugin
 * documentation; only their layout has to agree with NCCL's.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

_Static_assert(sizeof(void*) == 8, "handles are packed into 64 bits");

/* ---- NCCL's interface, as documented (only the parts whose layout matters to us are named) ---- */

typedef int nccl_result;  /* ncclResult_t: an int-sized enum, 0 = success */
typedef void (*nccl_logger)(int level, unsigned long flags, const char* file, int line, const char* fmt, ...);

enum {  /* event type bits */
  EV_GROUP = 1 << 0, EV_COLL = 1 << 1, EV_P2P = 1 << 2, EV_PROXY_OP = 1 << 3, EV_PROXY_STEP = 1 << 4,
};

enum {  /* event states we act on; the others are ignored */
  ST_OP_SEND_TRANSMITTED = 2, ST_OP_SEND_DONE = 3, ST_OP_RECV_RECEIVED = 5, ST_OP_RECV_DONE = 7,  /* v1-v3 */
  ST_STEP_SEND_GPU_WAIT = 8, ST_STEP_SEND_WAIT = 9, ST_STEP_RECV_WAIT = 10, ST_STEP_RECV_FLUSH_WAIT = 11,
  ST_STEP_RECV_GPU_WAIT = 12, ST_STEP_SEND_PEER_WAIT = 20,  /* the last from v4 on */
};

/* The proxy-op and proxy-step descriptors are alike in every version. */
struct proxy_op_descr { pid_t pid; uint8_t channel; int peer; int n_steps; int chunk_size; int is_send; };
struct proxy_step_descr { int step; };

/* v1 (NCCL 2.23): enums for function and datatype, the communicator in each call. */
struct descr_v1 {
  uint8_t type; void* parent; int rank;
  union {
    struct { const char* comm_name; uint64_t comm_hash; uint64_t seq; uint8_t func; const void* sendbuf;
             void* recvbuf; size_t count; int root; uint8_t dtype; uint32_t op; size_t traffic; uint8_t channels;
             uint8_t warps; uint8_t algo; uint8_t proto; int collnet; int nvls; } coll;
    struct { const char* comm_name; uint64_t comm_hash; uint8_t func; void* buf; uint8_t dtype; size_t count;
             int peer; } p2p;
    struct proxy_op_descr proxy_op;
    struct proxy_step_descr proxy_step;
  };
};
/* v2 (2.24): names as strings; v3 (2.25-2.26): no traffic bytes, kernel-channel and net events added. */
struct descr_v2 {
  uint8_t type; void* parent; int rank;
  union {
    struct { const char* comm_name; uint64_t comm_hash; uint64_t seq; const char* func; const void* sendbuf;
             void* recvbuf; size_t count; int root; const char* dtype; size_t traffic; uint8_t channels;
             uint8_t warps; const char* algo; const char* proto; } coll;
    struct { const char* comm_name; uint64_t comm_hash; const char* func; void* buf; const char* dtype;
             size_t count; int peer; } p2p;
    struct proxy_op_descr proxy_op;
    struct proxy_step_descr proxy_step;
  };
};
struct descr_v3 {
  uint8_t type; void* parent; int rank;
  union {
    struct { const char* comm_name; uint64_t comm_hash; uint64_t seq; const char* func; const void* sendbuf;
             void* recvbuf; size_t count; int root; const char* dtype; uint8_t channels; uint8_t warps;
             const char* algo; const char* proto; } coll;
    struct { const char* comm_name; uint64_t comm_hash; const char* func; void* buf; const char* dtype;
             size_t count; int peer; } p2p;
    struct proxy_op_descr proxy_op;
    struct proxy_step_descr proxy_step;
    struct { uint8_t channel; } kernel_ch;
    struct { int64_t id; void* data; } net;
  };
};
/* v4 (2.27): the communicator moved to init; v5 (2.28+): a 64-bit type and API-level events. */
struct descr_v4 {
  uint8_t type; void* parent; int rank;
  union {
    struct { uint64_t seq; const char* func; const void* sendbuf; void* recvbuf; size_t count; int root;
             const char* dtype; uint8_t channels; uint8_t warps; const char* algo; const char* proto; } coll;
    struct { const char* func; void* buf; const char* dtype; size_t count; int peer; uint8_t channels; } p2p;
    struct proxy_op_descr proxy_op;
    struct proxy_step_descr proxy_step;
    struct { uint8_t channel; uint64_t ptimer; } kernel_ch;
    struct { int64_t id; void* data; } net;
  };
};
struct descr_v5 {
  uint64_t type; void* parent; int rank;
  union {
    struct { uint64_t seq; const char* func; const void* sendbuf; void* recvbuf; size_t count; int root;
             const char* dtype; uint8_t channels; uint8_t warps; const char* algo; const char* proto;
             void* parent_group; } coll;
    struct { const char* func; void* buf; const char* dtype; size_t count; int peer; uint8_t channels;
             void* parent_group; } p2p;
    struct proxy_op_descr proxy_op;
    struct proxy_step_descr proxy_step;
    struct { uint8_t channel; uint64_t ptimer; } kernel_ch;
    struct { int64_t id; void* data; } net;
  };
};
/* State arguments: a proxy op's (v1-v3) and a proxy step's (v4+) transfer size come first in both. */
union state_args_v1 { struct { size_t trans_size; int steps; } proxy_op; struct { int appended; } proxy_ctrl; };
union state_args_v4 {
  struct { size_t trans_size; } proxy_step; struct { int appended; } proxy_ctrl; struct { void* data; } net;
  struct { uint64_t ptimer; } kernel_ch;
};

typedef struct {
  const char* name;
  nccl_result (*init)(void** context, int* mask);
  nccl_result (*start_event)(void* context, void** handle, struct descr_v1* descr);
  nccl_result (*stop_event)(void* handle);
  nccl_result (*record_event_state)(void* handle, int state, union state_args_v1* args);
  nccl_result (*finalize)(void* context);
} profiler_v1;
typedef struct {
  const char* name;
  nccl_result (*init)(void** context, int* mask);
  nccl_result (*start_event)(void* context, void** handle, struct descr_v2* descr);
  nccl_result (*stop_event)(void* handle);
  nccl_result (*record_event_state)(void* handle, int state, union state_args_v1* args);
  nccl_result (*finalize)(void* context);
} profiler_v2;
typedef struct {
  const char* name;
  nccl_result (*init)(void** context, int* mask);
  nccl_result (*start_event)(void* context, void** handle, struct descr_v3* descr);
  nccl_result (*stop_event)(void* handle);
  nccl_result (*record_event_state)(void* handle, int state, union state_args_v1* args);
  nccl_result (*finalize)(void* context);
} profiler_v3;
typedef struct {
  const char* name;
  nccl_result (*init)(void** context, int* mask, const char* comm_name, uint64_t comm_hash, int n_nodes,
                      int nranks, int rank, nccl_logger log);
  nccl_result (*start_event)(void* context, void** handle, struct descr_v4* descr);
  nccl_result (*stop_event)(void* handle);
  nccl_result (*record_event_state)(void* handle, int state, union state_args_v4* args);
  nccl_result (*finalize)(void* context);
} profiler_v4;
typedef struct {
  const char* name;
  nccl_result (*init)(void** context, uint64_t comm_id, int* mask, const char* comm_name, int n_nodes,
                      int nranks, int rank, nccl_logger log);
  nccl_result (*start_event)(void* context, void** handle, struct descr_v5* descr);
  nccl_result (*stop_event)(void* handle);
  nccl_result (*record_event_state)(void* handle, int state, union state_args_v4* args);
  nccl_result (*finalize)(void* context);
} profiler_v5;

/* ---- the records of ingest/nccl_peers.py ---- */

enum { REC_VERSION = 1, KIND_COMM = 0, KIND_PROXY_OP = 1, KIND_P2P_OP = 2, KIND_DROPS = 3 };

struct record {
  uint16_t version; uint8_t kind; uint8_t is_send; int32_t channel;
  uint64_t comm_hash; uint64_t seq;
  int32_t rank; int32_t nranks; int32_t peer; int32_t reserved;
  uint64_t coll_bytes; uint64_t bytes;
  int64_t start_ns; int64_t wait_ns; int64_t end_ns;
  char name[32];
};
/* RECORD's numpy layout (little-endian, no padding); x86-64 and aarch64 lay this struct out the same. */
_Static_assert(sizeof(struct record) == 112, "RECORD is 112 bytes");
_Static_assert(offsetof(struct record, comm_hash) == 8 && offsetof(struct record, rank) == 24 &&
               offsetof(struct record, coll_bytes) == 40 && offsetof(struct record, start_ns) == 56 &&
               offsetof(struct record, name) == 80, "RECORD's field offsets");

/* ---- counters (read by tests and the benchmark through stragglerscope_nccl_stats) ---- */

enum {
  C_EVENTS, C_RECORDS, C_WRITTEN, C_DROPPED, C_BAD_CALLS, C_DETACHED, C_UNTRACKED, C_CONTEXTS, C_N
};
static atomic_uint_fast64_t counters[C_N];
static atomic_int my_pid;  /* getpid() is a system call: read once per init (a forked child inits again) */
static inline void count(int which) { atomic_fetch_add_explicit(&counters[which], 1, memory_order_relaxed); }

/* ---- clock: CLOCK_MONOTONIC, as time.perf_counter_ns; a test may pin it ---- */

static atomic_int_fast64_t test_clock;  /* 0: the real clock */

static inline int64_t now_ns(void) {
  int64_t pinned = atomic_load_explicit(&test_clock, memory_order_relaxed);
  if (pinned) return pinned;
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ---- the ring: bounded multi-producer queue, one consumer (the writer thread) ----
 * Each cell carries a ticket: a producer may fill cell i of lap n when its ticket says so, and hands it to
 * the consumer by moving the ticket on. A producer that finds the ring full drops its record. */

#define RING_CELLS 16384u
struct cell { atomic_size_t ticket; struct record rec; };
static struct cell ring[RING_CELLS];
static atomic_size_t ring_head;  /* next ticket a producer takes */
static size_t ring_tail;         /* the consumer's next cell (writer thread only) */
static atomic_int ring_ready;

static void ring_reset(void) {
  for (size_t i = 0; i < RING_CELLS; i++) atomic_store_explicit(&ring[i].ticket, i, memory_order_relaxed);
  atomic_store_explicit(&ring_head, 0, memory_order_relaxed);
  ring_tail = 0;
  atomic_store_explicit(&ring_ready, 1, memory_order_release);
}

static bool ring_put(const struct record* rec) {
  if (!atomic_load_explicit(&ring_ready, memory_order_acquire)) { count(C_DROPPED); return false; }
  size_t pos = atomic_load_explicit(&ring_head, memory_order_relaxed);
  for (;;) {
    struct cell* c = &ring[pos % RING_CELLS];
    size_t t = atomic_load_explicit(&c->ticket, memory_order_acquire);
    intptr_t lag = (intptr_t)t - (intptr_t)pos;
    if (lag == 0) {
      if (atomic_compare_exchange_weak_explicit(&ring_head, &pos, pos + 1, memory_order_relaxed,
                                                memory_order_relaxed)) {
        c->rec = *rec;
        atomic_store_explicit(&c->ticket, pos + 1, memory_order_release);
        count(C_RECORDS);
        return true;
      }
    } else if (lag < 0) {  /* the consumer has not freed this cell since the last lap: full */
      count(C_DROPPED);
      return false;
    } else {
      pos = atomic_load_explicit(&ring_head, memory_order_relaxed);
    }
  }
}

static bool ring_take(struct record* out) {
  struct cell* c = &ring[ring_tail % RING_CELLS];
  if (atomic_load_explicit(&c->ticket, memory_order_acquire) != ring_tail + 1) return false;
  *out = c->rec;
  atomic_store_explicit(&c->ticket, ring_tail + RING_CELLS, memory_order_release);
  ring_tail++;
  return true;
}

/* ---- the writer thread ---- */

static pthread_mutex_t life = PTHREAD_MUTEX_INITIALIZER;  /* init, finalize, writer start and stop */
static pthread_t writer;
static bool writer_running;
static atomic_int writer_stop;
static atomic_uint_fast64_t writer_drained;  /* records the writer took (for flush) */
static atomic_int writer_paused;             /* tests: hold the writer to fill the ring */
static int out_fd = -1;
static uint64_t out_bytes, out_max_bytes;
static bool enabled;          /* a file is open: events are profiled */
static bool warned_open;

static void write_all(const void* buf, size_t len) {
  const char* p = buf;
  while (len) {
    if (out_max_bytes && out_bytes + len > out_max_bytes) {  /* the cap: the rest is counted as dropped */
      atomic_fetch_add(&counters[C_DROPPED], len / sizeof(struct record));
      return;
    }
    ssize_t n = write(out_fd, p, len);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {  /* a full disk: never retry in a loop, count and go on */
      atomic_fetch_add(&counters[C_DROPPED], len / sizeof(struct record));
      return;
    }
    p += n; len -= (size_t)n; out_bytes += (uint64_t)n;
    atomic_fetch_add(&counters[C_WRITTEN], (uint64_t)n / sizeof(struct record));
  }
}

/* One pass: everything queued, then a drops record if drops grew since the last one. */
static size_t drain(uint64_t* drops_reported) {
  static struct record batch[512];
  size_t n = 0, total = 0;
  while (ring_take(&batch[n])) {
    if (++n == 512) { write_all(batch, sizeof batch); total += n; n = 0; }
  }
  if (n) write_all(batch, n * sizeof(struct record));
  total += n;
  atomic_fetch_add(&writer_drained, total);
  uint64_t dropped = atomic_load(&counters[C_DROPPED]);
  if (dropped != *drops_reported) {
    struct record r = {0};
    r.version = REC_VERSION; r.kind = KIND_DROPS; r.nranks = 1; r.bytes = dropped; r.end_ns = now_ns();
    write_all(&r, sizeof r);
    *drops_reported = dropped;
  }
  return total;
}

static void* writer_main(void* arg) {
  (void)arg;
  uint64_t drops_reported = 0;
  long idle_us = 1000;
  while (!atomic_load(&writer_stop)) {
    /* Busy: come back soon; idle: back off to 20 ms, a few wake-ups a second cost nothing. */
    size_t took = atomic_load(&writer_paused) ? 0 : drain(&drops_reported);
    idle_us = took ? 1000 : (idle_us < 20000 ? idle_us * 2 : 20000);
    struct timespec ts = {0, idle_us * 1000};
    nanosleep(&ts, NULL);
  }
  drain(&drops_reported);
  return NULL;
}

static bool open_output(void) {
  const char* dir = getenv("STRAGGLERSCOPE_NCCL_PEERS_DIR");
  if (!dir || !*dir) return false;  /* not armed by stragglerscope: stay out of NCCL's way */
  mkdir(dir, 0755);                 /* the tracer makes it; this is for a plugin armed by hand */
  char path[4096];
  if (snprintf(path, sizeof path, "%s/nccl-peers-%d.bin", dir, (int)getpid()) >= (int)sizeof path) return false;
  out_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (out_fd < 0) {
    if (!warned_open) {
      fprintf(stderr, "stragglerscope NCCL profiler: cannot open %s (%s): per-peer times are off\n", path,
              strerror(errno));
      warned_open = true;
    }
    return false;
  }
  struct stat st;
  out_bytes = fstat(out_fd, &st) == 0 ? (uint64_t)st.st_size : 0;
  const char* cap = getenv("STRAGGLERSCOPE_NCCL_PEERS_MAX_MB");
  out_max_bytes = (uint64_t)(cap && *cap ? atoll(cap) : 1024) << 20;
  return true;
}

/* Called with `life` held. */
static void writer_start(void) {
  if (writer_running) return;
  if (out_fd < 0 && !open_output()) { enabled = false; return; }
  ring_reset();
  atomic_store(&writer_stop, 0);
  if (pthread_create(&writer, NULL, writer_main, NULL) != 0) {
    atomic_store(&ring_ready, 0);
    enabled = false;
    return;
  }
  writer_running = enabled = true;
}

/* Called with `life` held: the last record is written before NCCL may unload us (dlclose with our
 * thread still in the library's code would crash the process). */
static void writer_halt(void) {
  if (!writer_running) return;
  atomic_store(&ring_ready, 0);
  atomic_store(&writer_stop, 1);
  pthread_join(writer, NULL);
  writer_running = enabled = false;
  if (out_fd >= 0) { close(out_fd); out_fd = -1; }
}

/* A process that exits without destroying its communicators (most training scripts) still flushes. */
__attribute__((destructor)) static void at_unload(void) {
  pthread_mutex_lock(&life);
  writer_halt();
  pthread_mutex_unlock(&life);
}

/* A child forked by the training process (a data loader's worker) inherits our state but not the writer
 * thread: it must neither join a thread it does not have at exit nor write to the parent's file. */
static void after_fork_in_child(void) {
  pthread_mutex_init(&life, NULL);  /* the fork may have come while another thread held it */
  atomic_store(&ring_ready, 0);
  writer_running = enabled = false;
  if (out_fd >= 0) { close(out_fd); out_fd = -1; }
}


/* ---- handles ---- */

enum { H_TASK = 1, H_OP = 2, H_STEP = 3 };

static inline void* handle_of(unsigned kind, unsigned slot, unsigned sub, uint32_t gen) {
  return (void*)(uintptr_t)(((uint64_t)kind << 60) | ((uint64_t)(sub & 0xF) << 56) |
                            ((uint64_t)(slot & 0xFFFFFF) << 32) | gen);
}
static inline unsigned handle_kind(const void* h) { return (unsigned)((uintptr_t)h >> 60); }
static inline unsigned handle_sub(const void* h) { return (unsigned)(((uintptr_t)h >> 56) & 0xF); }
static inline unsigned handle_slot(const void* h) { return (unsigned)(((uintptr_t)h >> 32) & 0xFFFFFF); }
static inline uint32_t handle_gen(const void* h) { return (uint32_t)(uintptr_t)h; }

/* ---- communicators (NCCL's profiler contexts) ----
 * A fixed table, never freed: a context pointer NCCL hands back after finalize, or one that is not ours,
 * is checked against it rather than followed. */

#define MAX_CONTEXTS 1024
#define P2P_KEYS 64
struct context {
  uint32_t magic;           /* CTX_LIVE while between init and finalize */
  int version;              /* the interface NCCL called init through */
  uint64_t comm_hash;       /* v4+: from init; v1-v3: from the first call's descriptor */
  int rank, nranks;         /* nranks 0: NCCL did not say (v1-v3) */
  char name[32];
  atomic_int comm_sent;     /* the KIND_COMM record is queued */
  atomic_uint_fast64_t colls;  /* collectives started: the sequence number of the next one */
  pthread_mutex_t p2p_lock; /* point-to-point numbering; taken on the enqueuing thread, never the proxy's */
  int p2p_key[P2P_KEYS];    /* peer * 2 + is_send, -1 empty */
  uint64_t p2p_next[P2P_KEYS];
};
#define CTX_LIVE 0x55cc11e5u
#define CTX_DONE 0x55cc0de5u
static struct context contexts[MAX_CONTEXTS];
static unsigned contexts_used;
static unsigned live_contexts;

static void forget_contexts_in_child(void) {
  for (unsigned i = 0; i < MAX_CONTEXTS; i++)
    if (contexts[i].magic == CTX_LIVE) contexts[i].magic = CTX_DONE;
  live_contexts = 0;
}

static struct context* context_of(void* p) {
  if (p < (void*)contexts || p >= (void*)(contexts + MAX_CONTEXTS)) return NULL;
  struct context* c = p;
  if ((char*)p != (char*)&contexts[c - contexts] || c->magic != CTX_LIVE) return NULL;
  return c;
}

static void send_comm_record(struct context* c) {
  if (atomic_load_explicit(&c->comm_sent, memory_order_relaxed) || !c->comm_hash) return;
  struct record r = {0};
  r.version = REC_VERSION; r.kind = KIND_COMM; r.comm_hash = c->comm_hash; r.rank = c->rank;
  r.nranks = c->nranks; r.peer = -1; r.end_ns = now_ns();
  memcpy(r.name, c->name, sizeof r.name);
  int expected = 0;
  if (atomic_compare_exchange_strong(&c->comm_sent, &expected, 1) && !ring_put(&r))
    atomic_store(&c->comm_sent, 0);  /* dropped: the next call tries again */
}

static int event_mask(void) { return EV_COLL | EV_P2P | EV_PROXY_OP | EV_PROXY_STEP; }

static void* context_new(int version, uint64_t comm_hash, const char* name, int nranks, int rank, int* mask) {
  pthread_mutex_lock(&life);
  atomic_store(&my_pid, (int)getpid());
  writer_start();
  struct context* c = NULL;
  if (enabled) {
    /* A free slot, else the oldest finished one (a job that makes and destroys communicators forever). */
    for (unsigned i = 0; i < MAX_CONTEXTS && !c; i++) {
      unsigned k = (contexts_used + i) % MAX_CONTEXTS;
      if (contexts[k].magic != CTX_LIVE) c = &contexts[k];
    }
  }
  if (c) {
    contexts_used = (unsigned)(c - contexts) + 1;
    if (c->magic != CTX_DONE) pthread_mutex_init(&c->p2p_lock, NULL);
    c->version = version; c->comm_hash = comm_hash; c->rank = rank; c->nranks = nranks > 0 ? nranks : 0;
    memset(c->name, 0, sizeof c->name);
    if (name) strncpy(c->name, name, sizeof c->name - 1);
    atomic_store(&c->comm_sent, 0);
    atomic_store(&c->colls, 0);
    for (int i = 0; i < P2P_KEYS; i++) c->p2p_key[i] = -1;
    c->magic = CTX_LIVE;
    live_contexts++;
    count(C_CONTEXTS);
  } else if (live_contexts == 0) {
    writer_halt();
  }
  pthread_mutex_unlock(&life);
  if (mask) *mask = c ? event_mask() : 0;
  if (c) send_comm_record(c);
  return c;
}

static void child_after_fork(void) {
  after_fork_in_child();
  forget_contexts_in_child();  /* NCCL's communicators do not work across fork: the child's calls are ignored */
}

__attribute__((constructor)) static void at_load(void) { pthread_atfork(NULL, NULL, child_after_fork); }

static nccl_result finalize(void* context) {
  pthread_mutex_lock(&life);
  struct context* c = context_of(context);
  if (c) {
    c->magic = CTX_DONE;
    if (--live_contexts == 0) writer_halt();  /* NCCL unloads us once its last communicator is gone */
  } else {
    count(C_BAD_CALLS);
  }
  pthread_mutex_unlock(&life);
  return 0;
}

/* ---- collective and point-to-point calls ("tasks") ----
 * A ring of slots overwritten in turn, never freed: NCCL stops a task as soon as it is enqueued, before
 * the proxy starts the task's operations, so the proxy must still find it afterwards. A slot is reused
 * only TASK_SLOTS calls later; its generation (in the handle) tells a proxy op it came too late. */

#define TASK_SLOTS 8192u
struct task {
  atomic_uint gen;          /* 0 while being written */
  uint8_t is_p2p;
  int32_t rank, nranks, peer;
  uint64_t comm_hash, seq, bytes;
  char name[32];
};
static struct task tasks[TASK_SLOTS];
static atomic_uint_fast64_t task_next;

static size_t dtype_size_v1(uint8_t t) {
  static const uint8_t size[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};  /* ncclInt8 ... ncclFloat8e5m2 */
  return t < sizeof size ? size[t] : 0;
}

static size_t dtype_size(const char* s) {
  if (!s || strncmp(s, "nccl", 4) != 0) return 0;
  s += 4;
  if (strstr(s, "8e")) return 1;  /* ncclFloat8e4m3, ncclFloat8e5m2 */
  size_t n = strlen(s);
  if (n >= 2 && !strcmp(s + n - 2, "64")) return 8;
  if (n >= 2 && (!strcmp(s + n - 2, "32"))) return 4;
  if (n >= 2 && !strcmp(s + n - 2, "16")) return 2;
  if (n >= 1 && s[n - 1] == '8') return 1;
  if (!strcmp(s, "Float") || !strcmp(s, "Int")) return 4;
  if (!strcmp(s, "Double")) return 8;
  if (!strcmp(s, "Half")) return 2;
  if (!strcmp(s, "Char")) return 1;
  return 0;
}

/* What a call event says, whatever the version. */
struct call {
  bool is_p2p, is_send;
  int peer, rank;
  uint64_t comm_hash;  /* 0: the context's */
  const char* comm_name;
  uint64_t bytes;
};

static uint64_t p2p_number(struct context* c, int peer, bool is_send) {
  int key = peer * 2 + (is_send ? 1 : 0);
  uint64_t n = UINT64_MAX;  /* more peers than we number: the record says "unknown" */
  pthread_mutex_lock(&c->p2p_lock);
  for (int i = 0; i < P2P_KEYS; i++) {
    int k = (key + i) % P2P_KEYS;
    if (c->p2p_key[k] == key || c->p2p_key[k] == -1) {
      c->p2p_key[k] = key;
      n = c->p2p_next[k]++;
      break;
    }
  }
  pthread_mutex_unlock(&c->p2p_lock);
  return n;
}

static void* task_start(struct context* c, const struct call* call) {
  if (call->comm_hash && !c->comm_hash) {  /* v1-v3: the communicator is learned from its first call */
    c->comm_hash = call->comm_hash;
    if (call->comm_name) strncpy(c->name, call->comm_name, sizeof c->name - 1);
    c->rank = call->rank;
  }
  send_comm_record(c);
  uint64_t seq = call->is_p2p ? p2p_number(c, call->peer, call->is_send)
                              : atomic_fetch_add_explicit(&c->colls, 1, memory_order_relaxed);
  uint64_t n = atomic_fetch_add_explicit(&task_next, 1, memory_order_relaxed);
  unsigned slot = (unsigned)(n % TASK_SLOTS);
  uint32_t gen = (uint32_t)(n / TASK_SLOTS) + 1;
  if (!gen) gen = 1;
  struct task* t = &tasks[slot];
  atomic_store_explicit(&t->gen, 0, memory_order_release);
  atomic_thread_fence(memory_order_release);
  t->is_p2p = call->is_p2p; t->rank = c->rank; t->nranks = c->nranks; t->peer = call->peer;
  t->comm_hash = c->comm_hash; t->seq = seq; t->bytes = call->bytes;
  memcpy(t->name, c->name, sizeof t->name);
  atomic_store_explicit(&t->gen, gen, memory_order_release);
  return handle_of(H_TASK, slot, 0, gen);
}

/* A copy of the task behind `h`, if it is still there (a seqlock read: the slot may be rewritten). */
static bool task_read(void* h, struct task* out) {
  if (handle_kind(h) != H_TASK || handle_slot(h) >= TASK_SLOTS) return false;
  struct task* t = &tasks[handle_slot(h)];
  uint32_t want = handle_gen(h);
  if (atomic_load_explicit(&t->gen, memory_order_acquire) != want) return false;
  out->is_p2p = t->is_p2p; out->rank = t->rank; out->nranks = t->nranks; out->peer = t->peer;
  out->comm_hash = t->comm_hash; out->seq = t->seq; out->bytes = t->bytes;
  atomic_thread_fence(memory_order_acquire);
  return atomic_load_explicit(&t->gen, memory_order_relaxed) == want;
}

/* ---- proxy operations and their steps ----
 * A pool of slots claimed with a compare-and-swap and released at stop. Steps live inside their op: NCCL
 * keeps at most 8 of an op's steps in flight (NCCL_STEPS), the step number modulo 8 picks the place. */

#define OP_SLOTS 4096u
#define OP_STEPS 8
struct step {
  int64_t step;             /* -1: free */
  int64_t on_wire;          /* send: when the transfer was posted to the network (0: not yet) */
};
struct op {
  atomic_int busy;
  atomic_uint gen;
  struct task task;
  int version, peer, channel, is_send, rank;
  int64_t started, begin, first_data, last_data, last_done;
  int64_t wire_busy, wire_cover;  /* send: the union of the steps' times on the wire */
  uint64_t step_bytes, op_bytes;
  struct step steps[OP_STEPS];
};
static struct op ops[OP_SLOTS];
static atomic_uint op_hint;
static atomic_uint op_gens;

static void* op_start(struct context* c, int version, void* parent, const struct proxy_op_descr* d, int rank) {
  /* PXN: an op of another process's proxy; its parent is a handle of that process's plugin. */
  if (d->pid != atomic_load_explicit(&my_pid, memory_order_relaxed)) { count(C_DETACHED); return NULL; }
  struct task t;
  if (!task_read(parent, &t)) { count(C_UNTRACKED); return NULL; }
  (void)c;
  unsigned first = atomic_fetch_add_explicit(&op_hint, 1, memory_order_relaxed);
  for (unsigned i = 0; i < 64; i++) {  /* bounded: a pool full of leaked ops must not slow NCCL down */
    unsigned slot = (first + i) % OP_SLOTS;
    int idle = 0;
    if (!atomic_compare_exchange_strong_explicit(&ops[slot].busy, &idle, 1, memory_order_acquire,
                                                 memory_order_relaxed))
      continue;
    struct op* o = &ops[slot];
    uint32_t gen = atomic_fetch_add_explicit(&op_gens, 1, memory_order_relaxed) + 1;
    if (!gen) gen = 1;
    o->task = t; o->version = version; o->peer = d->peer; o->channel = d->channel; o->is_send = d->is_send != 0;
    o->rank = rank;
    o->started = now_ns();
    o->begin = o->first_data = o->last_data = o->last_done = o->wire_busy = o->wire_cover = 0;
    o->step_bytes = o->op_bytes = 0;
    for (int k = 0; k < OP_STEPS; k++) o->steps[k].step = -1;
    atomic_store_explicit(&o->gen, gen, memory_order_release);
    return handle_of(H_OP, slot, 0, gen);
  }
  count(C_DROPPED);
  return NULL;
}

static struct op* op_of(void* h) {
  unsigned kind = handle_kind(h);
  if ((kind != H_OP && kind != H_STEP) || handle_slot(h) >= OP_SLOTS) return NULL;
  struct op* o = &ops[handle_slot(h)];
  if (!atomic_load_explicit(&o->busy, memory_order_acquire) ||
      atomic_load_explicit(&o->gen, memory_order_relaxed) != handle_gen(h))
    return NULL;
  return o;
}

/* The op's record. Its span starts when its first data was ready to move (the op itself starts when NCCL
 * enqueues it, long before the kernel runs) and ends with its last transfer. wait_ns is the part of the
 * span the path was not the limit: for a send, all but the union of its transfers' times on the network
 * (waiting for its GPU or the receiver's credits); for a receive, the wait for the first data. */
static void op_finish(struct op* o, int64_t stop) {
  struct record r = {0};
  r.version = REC_VERSION;
  r.kind = o->task.is_p2p ? KIND_P2P_OP : KIND_PROXY_OP;
  r.is_send = (uint8_t)o->is_send; r.channel = o->channel;
  r.comm_hash = o->task.comm_hash; r.seq = o->task.seq;
  r.rank = o->task.rank; r.nranks = o->task.nranks; r.peer = o->peer;
  r.reserved = o->task.is_p2p ? o->task.peer : 0;
  r.coll_bytes = o->task.bytes;
  /* v4+ report each step's size; v1-v3 a running total on the op. */
  r.bytes = o->step_bytes ? o->step_bytes : o->op_bytes;
  if (o->is_send) {
    int64_t end = o->last_done ? o->last_done : stop;
    int64_t start = o->begin ? o->begin : end;
    r.start_ns = start; r.end_ns = end;
    r.wait_ns = o->wire_busy ? (end - start) - o->wire_busy : 0;
  } else {
    int64_t end = o->last_data ? o->last_data : stop;
    int64_t start = o->begin ? o->begin : end;
    r.start_ns = start; r.end_ns = end;
    r.wait_ns = o->first_data ? o->first_data - start : 0;
  }
  if (r.wait_ns < 0) r.wait_ns = 0;
  if (r.end_ns < r.start_ns) r.end_ns = r.start_ns;
  ring_put(&r);
}

static void* step_start(void* parent, const struct proxy_step_descr* d) {
  struct op* o = op_of(parent);
  if (!o || handle_kind(parent) != H_OP || d->step < 0) { count(C_UNTRACKED); return NULL; }
  unsigned k = (unsigned)d->step % OP_STEPS;
  o->steps[k].step = d->step;
  o->steps[k].on_wire = 0;
  return handle_of(H_STEP, handle_slot(parent), k, handle_gen(parent));
}

static struct step* step_of(void* h, struct op** op) {
  struct op* o = op_of(h);
  if (!o || handle_kind(h) != H_STEP) return NULL;
  struct step* s = &o->steps[handle_sub(h) % OP_STEPS];
  if (s->step < 0) return NULL;
  *op = o;
  return s;
}

static void step_state(void* h, int state, size_t trans_size) {
  struct op* o;
  struct step* s = step_of(h, &o);
  if (!s) { count(C_BAD_CALLS); return; }
  int64_t t = now_ns();
  switch (state) {
  case ST_STEP_SEND_PEER_WAIT:  /* data ready, waiting for the receiver's credit (v4+) */
    if (!o->begin) o->begin = t;
    break;
  case ST_STEP_SEND_WAIT:       /* posted to the network */
    if (!o->begin) o->begin = t;
    s->on_wire = t;
    if (o->version >= 4) o->step_bytes += trans_size;
    break;
  case ST_STEP_RECV_WAIT:       /* receive posted: from here on the wait is for the sender */
    if (!o->begin) o->begin = t;
    break;
  case ST_STEP_RECV_FLUSH_WAIT: /* data arrived */
    if (!o->begin) o->begin = t;
    if (!o->first_data) o->first_data = t;
    o->last_data = t;
    if (o->version >= 4) o->step_bytes += trans_size;
    break;
  default:                      /* GPU waits: the op's own side, counted in the span's gaps */
    break;
  }
}

static void step_stop(void* h) {
  struct op* o;
  struct step* s = step_of(h, &o);
  if (!s) { count(C_BAD_CALLS); return; }
  int64_t t = now_ns();
  if (o->is_send && s->on_wire) {
    /* Steps go on the wire and complete in order, so the union grows at its end only. */
    int64_t from = s->on_wire > o->wire_cover ? s->on_wire : o->wire_cover;
    if (t > from) o->wire_busy += t - from;
    if (t > o->wire_cover) o->wire_cover = t;
    o->last_done = t;
  }
  s->step = -1;
}

static void op_state(void* h, int state, size_t trans_size) {
  struct op* o = op_of(h);
  if (!o || handle_kind(h) != H_OP) { count(C_BAD_CALLS); return; }
  switch (state) {  /* v1-v3 only: the bytes moved so far */
  case ST_OP_SEND_TRANSMITTED: case ST_OP_SEND_DONE: case ST_OP_RECV_RECEIVED: case ST_OP_RECV_DONE:
    if (o->version < 4 && trans_size > o->op_bytes) o->op_bytes = trans_size;
    break;
  default:
    break;
  }
}

static void op_stop(void* h) {
  struct op* o = op_of(h);
  if (!o || handle_kind(h) != H_OP) { count(C_BAD_CALLS); return; }
  op_finish(o, now_ns());
  atomic_store_explicit(&o->gen, 0, memory_order_relaxed);
  atomic_store_explicit(&o->busy, 0, memory_order_release);
}

/* ---- the common entry points ---- */

static nccl_result stop_event(void* h) {
  count(C_EVENTS);
  if (!h) { count(C_BAD_CALLS); return 0; }
  switch (handle_kind(h)) {
  case H_TASK: break;  /* enqueued: nothing to do, the slot stays for the proxy */
  case H_OP: op_stop(h); break;
  case H_STEP: step_stop(h); break;
  default: count(C_BAD_CALLS); break;
  }
  return 0;
}

static void record_state(void* h, int state, size_t trans_size) {
  count(C_EVENTS);
  if (!h) { count(C_BAD_CALLS); return; }
  switch (handle_kind(h)) {
  case H_OP: op_state(h, state, trans_size); break;
  case H_STEP: step_state(h, state, trans_size); break;
  default: count(C_BAD_CALLS); break;  /* tasks have no states */
  }
}

static nccl_result record_state_v1(void* h, int state, union state_args_v1* args) {
  record_state(h, state, args ? args->proxy_op.trans_size : 0);
  return 0;
}
static nccl_result record_state_v4(void* h, int state, union state_args_v4* args) {
  record_state(h, state, args ? args->proxy_step.trans_size : 0);
  return 0;
}

/* Returns the handle for a proxy op or step; NULL for everything else (calls NCCL need not tell us). */
static void* start_proxy(struct context* c, int version, uint64_t type, void* parent, int rank, const void* u) {
  if (type == EV_PROXY_OP) return op_start(c, version, parent, u, rank);
  if (type == EV_PROXY_STEP) return step_start(parent, u);
  return NULL;
}

static bool func_is_send(const char* f) { return f && !strcmp(f, "Send"); }

static nccl_result start_v1(void* ctx, void** handle, struct descr_v1* d) {
  count(C_EVENTS);
  if (!handle) { count(C_BAD_CALLS); return 0; }
  *handle = NULL;
  struct context* c = context_of(ctx);
  if (!c || !d) { count(C_BAD_CALLS); return 0; }
  struct call call = {0};
  if (d->type == EV_COLL) {
    call.comm_hash = d->coll.comm_hash; call.comm_name = d->coll.comm_name; call.rank = d->rank; call.peer = -1;
    call.bytes = (uint64_t)d->coll.count * dtype_size_v1(d->coll.dtype);
    *handle = task_start(c, &call);
  } else if (d->type == EV_P2P) {
    call.is_p2p = true; call.is_send = d->p2p.func == 6;  /* ncclFuncSend; 7 is ncclFuncRecv */
    call.comm_hash = d->p2p.comm_hash; call.comm_name = d->p2p.comm_name; call.rank = d->rank;
    call.peer = d->p2p.peer; call.bytes = (uint64_t)d->p2p.count * dtype_size_v1(d->p2p.dtype);
    *handle = task_start(c, &call);
  } else {
    *handle = start_proxy(c, 1, d->type, d->parent, d->rank, &d->proxy_op);
  }
  return 0;
}

/* v2 and v3 differ after the datatype only, which we do not read. */
#define START_V23(NAME, DESCR, VERSION)                                                                  \
  static nccl_result NAME(void* ctx, void** handle, DESCR* d) {                                          \
    count(C_EVENTS);                                                                                     \
    if (!handle) { count(C_BAD_CALLS); return 0; }                                                       \
    *handle = NULL;                                                                                      \
    struct context* c = context_of(ctx);                                                                 \
    if (!c || !d) { count(C_BAD_CALLS); return 0; }                                                      \
    struct call call = {0};                                                                              \
    if (d->type == EV_COLL) {                                                                            \
      call.comm_hash = d->coll.comm_hash; call.comm_name = d->coll.comm_name; call.rank = d->rank;       \
      call.peer = -1; call.bytes = (uint64_t)d->coll.count * dtype_size(d->coll.dtype);                  \
      *handle = task_start(c, &call);                                                                    \
    } else if (d->type == EV_P2P) {                                                                      \
      call.is_p2p = true; call.is_send = func_is_send(d->p2p.func);                                      \
      call.comm_hash = d->p2p.comm_hash; call.comm_name = d->p2p.comm_name; call.rank = d->rank;         \
      call.peer = d->p2p.peer; call.bytes = (uint64_t)d->p2p.count * dtype_size(d->p2p.dtype);           \
      *handle = task_start(c, &call);                                                                    \
    } else {                                                                                             \
      *handle = start_proxy(c, VERSION, d->type, d->parent, d->rank, &d->proxy_op);                      \
    }                                                                                                    \
    return 0;                                                                                            \
  }
START_V23(start_v2, struct descr_v2, 2)
START_V23(start_v3, struct descr_v3, 3)

/* v4 and v5: the communicator is the context's; v5's type is 64 bits wide. */
#define START_V45(NAME, DESCR, VERSION)                                                                  \
  static nccl_result NAME(void* ctx, void** handle, DESCR* d) {                                          \
    count(C_EVENTS);                                                                                     \
    if (!handle) { count(C_BAD_CALLS); return 0; }                                                       \
    *handle = NULL;                                                                                      \
    struct context* c = context_of(ctx);                                                                 \
    if (!c || !d) { count(C_BAD_CALLS); return 0; }                                                      \
    struct call call = {0};                                                                              \
    if (d->type == EV_COLL) {                                                                            \
      call.rank = d->rank; call.peer = -1;                                                               \
      call.bytes = (uint64_t)d->coll.count * dtype_size(d->coll.dtype);                                  \
      *handle = task_start(c, &call);                                                                    \
    } else if (d->type == EV_P2P) {                                                                      \
      call.is_p2p = true; call.is_send = func_is_send(d->p2p.func); call.rank = d->rank;                 \
      call.peer = d->p2p.peer; call.bytes = (uint64_t)d->p2p.count * dtype_size(d->p2p.dtype);           \
      *handle = task_start(c, &call);                                                                    \
    } else {                                                                                             \
      *handle = start_proxy(c, VERSION, d->type, d->parent, d->rank, &d->proxy_op);                      \
    }                                                                                                    \
    return 0;                                                                                            \
  }
START_V45(start_v4, struct descr_v4, 4)
START_V45(start_v5, struct descr_v5, 5)

static nccl_result init_v1(void** ctx, int* mask) {
  if (!ctx) return 0;
  *ctx = context_new(1, 0, NULL, 0, 0, mask);
  return 0;
}
static nccl_result init_v2(void** ctx, int* mask) {
  if (!ctx) return 0;
  *ctx = context_new(2, 0, NULL, 0, 0, mask);
  return 0;
}
static nccl_result init_v3(void** ctx, int* mask) {
  if (!ctx) return 0;
  *ctx = context_new(3, 0, NULL, 0, 0, mask);
  return 0;
}
static nccl_result init_v4(void** ctx, int* mask, const char* name, uint64_t hash, int n_nodes, int nranks,
                           int rank, nccl_logger log) {
  (void)n_nodes; (void)log;
  if (!ctx) return 0;
  *ctx = context_new(4, hash, name, nranks, rank, mask);
  return 0;
}
static nccl_result init_v5(void** ctx, uint64_t comm_id, int* mask, const char* name, int n_nodes, int nranks,
                           int rank, nccl_logger log) {
  (void)n_nodes; (void)log;
  if (!ctx) return 0;
  *ctx = context_new(5, comm_id, name, nranks, rank, mask);
  return 0;
}

#define PLUGIN_NAME "stragglerscope"
EXPORT profiler_v5 ncclProfiler_v5 = {PLUGIN_NAME, init_v5, start_v5, stop_event, record_state_v4, finalize};
EXPORT profiler_v4 ncclProfiler_v4 = {PLUGIN_NAME, init_v4, start_v4, stop_event, record_state_v4, finalize};
EXPORT profiler_v3 ncclProfiler_v3 = {PLUGIN_NAME, init_v3, start_v3, stop_event, record_state_v1, finalize};
EXPORT profiler_v2 ncclProfiler_v2 = {PLUGIN_NAME, init_v2, start_v2, stop_event, record_state_v1, finalize};
EXPORT profiler_v1 ncclProfiler_v1 = {PLUGIN_NAME, init_v1, start_v1, stop_event, record_state_v1, finalize};

/* ---- for tests and the benchmark (NCCL never calls these) ---- */

/* Counters: events, records queued, written, dropped, bad calls, detached (PXN) ops, ops of unknown tasks,
 * contexts made. Returns how many were filled. */
EXPORT int stragglerscope_nccl_stats(uint64_t* out, int n) {
  if (!out) return 0;
  int k = n < C_N ? n : C_N;
  for (int i = 0; i < k; i++) out[i] = atomic_load(&counters[i]);
  return k;
}

/* Pin the clock at `ns` (0: the real clock again): a driver then decides every time NCCL would see. */
EXPORT void stragglerscope_nccl_test_clock(int64_t ns) { atomic_store(&test_clock, ns); }

/* Hold (1) or release (0) the writer: a test fills the ring to see records dropped and counted. */
EXPORT void stragglerscope_nccl_test_pause_writer(int paused) { atomic_store(&writer_paused, paused); }

/* Wait (up to timeout_ms) until the writer took everything queued so far; 1 if it did. */
EXPORT int stragglerscope_nccl_flush(int timeout_ms) {
  uint64_t target = atomic_load(&counters[C_RECORDS]);
  for (int waited = 0; waited <= timeout_ms; waited++) {
    if (atomic_load(&writer_drained) >= target) return 1;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  return 0;
}
