/*
 * The NCCL profiler plugin's cost, called from C as NCCL calls it (a ctypes driver would time Python).
 * Built and run by benchmarks/nccl_plugin_cost.py:
 *
 *   nccl_plugin_cost LIBRARY COLLECTIVES REPEATS
 *
 * One collective is what one rank of a ring all-reduce on 2 channels asks of the plugin through
 * ncclProfiler_v5: the collective's start and stop, then per channel a send and a receive proxy op, each
 * with its in-progress state and 8 steps of 3 states. Prints, per repeat, the ns per collective and per
 * call, wall clock and this thread's CPU time, the real clock on (the plugin reads CLOCK_MONOTONIC at
 * every timed call, as in a job).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The parts of NCCL's v5 interface this driver fills in (NCCL's documented layout). */
struct op_d { pid_t pid; uint8_t channel; int peer; int n_steps; int chunk_size; int is_send; };
struct descr {
  uint64_t type; void* parent; int rank;
  union {
    struct { uint64_t seq; const char* func; const void* sb; void* rb; size_t count; int root; const char* dtype;
             uint8_t channels; uint8_t warps; const char* algo; const char* proto; void* parent_group; } coll;
    struct op_d op;
    struct { int step; } step;
  };
};
union args { struct { size_t trans_size; } step; };
typedef struct {
  const char* name;
  int (*init)(void**, uint64_t, int*, const char*, int, int, int, void*);
  int (*start)(void*, void**, struct descr*);
  int (*stop)(void*);
  int (*record)(void*, int, union args*);
  int (*finalize)(void*);
} profiler;

static int64_t clock_ns(clockid_t id) {
  struct timespec ts;
  clock_gettime(id, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  if (argc < 4) { fprintf(stderr, "usage: %s LIBRARY COLLECTIVES REPEATS\n", argv[0]); return 2; }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 1; }
  profiler* p = dlsym(lib, "ncclProfiler_v5");
  int (*flush)(int) = (int (*)(int))dlsym(lib, "stragglerscope_nccl_flush");
  int (*stats)(uint64_t*, int) = (int (*)(uint64_t*, int))dlsym(lib, "stragglerscope_nccl_stats");
  if (!p || !flush || !stats) { fprintf(stderr, "symbols missing\n"); return 1; }
  int n = atoi(argv[2]), repeats = atoi(argv[3]);
  pid_t self = getpid();
  void* ctx = NULL;
  int mask = 0;
  p->init(&ctx, 0x77, &mask, "bench", 1, 4, 2, NULL);
  if (!ctx) { fprintf(stderr, "plugin not armed (STRAGGLERSCOPE_NCCL_PEERS_DIR?)\n"); return 1; }
  const int channels = 2, steps = 8, calls_per_coll = 2 + channels * 2 * (3 + steps * 5);
  double* per = calloc((size_t)repeats, sizeof *per);
  double* cpu = calloc((size_t)repeats, sizeof *cpu);  /* this thread's CPU: a loaded host's other work is not ours */
  union args a = {.step = {1 << 20}};
  for (int r = 0; r < repeats; r++) {
    int64_t t0 = clock_ns(CLOCK_MONOTONIC), c0 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
    for (int k = 0; k < n; k++) {
      struct descr d = {0};
      d.type = 1 << 1; d.rank = 2; d.coll.func = "AllReduce"; d.coll.dtype = "ncclFloat32"; d.coll.count = 1 << 22;
      void* coll = NULL;
      p->start(ctx, &coll, &d);
      p->stop(coll);
      for (int ch = 0; ch < channels; ch++) {
        for (int send = 0; send <= 1; send++) {
          struct descr o = {0};
          o.type = 1 << 3; o.parent = coll; o.rank = 2;
          o.op.pid = self;  /* NCCL's proxy has it at hand: no system call per op here */
          o.op.channel = (uint8_t)ch; o.op.peer = send ? 3 : 1; o.op.n_steps = steps;
          o.op.is_send = send;
          void* op = NULL;
          p->start(ctx, &op, &o);
          p->record(op, 19, &a);
          for (int s = 0; s < steps; s++) {
            struct descr sd = {0};
            sd.type = 1 << 4; sd.parent = op; sd.step.step = s;
            void* st = NULL;
            p->start(ctx, &st, &sd);
            p->record(st, send ? 8 : 10, &a);
            p->record(st, send ? 20 : 11, &a);
            p->record(st, send ? 9 : 12, &a);
            p->stop(st);
          }
          p->stop(op);
        }
      }
    }
    per[r] = (double)(clock_ns(CLOCK_MONOTONIC) - t0) / n;
    cpu[r] = (double)(clock_ns(CLOCK_THREAD_CPUTIME_ID) - c0) / n;
    /* Between repeats the writer empties the queue, as it does while a real collective runs (far longer
     * than its calls here): a repeat's records (4 per collective) fit the queue, none is dropped. */
    flush(5000);
  }
  flush(5000);
  uint64_t st[8] = {0};
  stats(st, 8);
  p->finalize(ctx);
  qsort(per, (size_t)repeats, sizeof *per, cmp);
  qsort(cpu, (size_t)repeats, sizeof *cpu, cmp);
  printf("{\"calls_per_collective\": %d, \"ns_per_collective\": [", calls_per_coll);
  for (int r = 0; r < repeats; r++) printf("%s%.1f", r ? ", " : "", per[r]);
  printf("], \"cpu_ns_per_collective\": [");
  for (int r = 0; r < repeats; r++) printf("%s%.1f", r ? ", " : "", cpu[r]);
  printf("], \"records\": %llu, \"written\": %llu, \"dropped\": %llu}\n", (unsigned long long)st[1],
         (unsigned long long)st[2], (unsigned long long)st[3]);
  return 0;
}
