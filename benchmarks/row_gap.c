// Bandwidth of an in-place pass over rows with gaps between them (q and k of a packed qkv: 10 KiB of
// each 12 KiB token row read and written, v skipped), with and without software prefetch.
// benchmarks/cpu-zen4.md. Build and run: gcc -O2 -mavx512f benchmarks/row_gap.c -o /tmp/row_gap && /tmp/row_gap
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { USED = 10240, TOKENS = 8192, SETS = 4, RUNS = 24 };
static volatile float one = 1.0f;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// Scales USED bytes of each row in place; level 0: no hints, 1: prefetcht0, 2: prefetcht1 of the
// line `ahead` bytes further on in the pass (in the next row past this one's end).
static void pass(char* base, long row, int level, long ahead) {
  const __m512 s = _mm512_set1_ps(one);
  for (long t = 0; t < TOKENS; ++t) {
    float* p = (float*)(base + t * row);
    for (long i = 0; i < USED; i += 64) {
      if (level) {
        const long off = i + ahead, tt = t + off / USED;
        const char* h = base + tt * row + off % USED;
        if (tt < TOKENS) level == 1 ? _mm_prefetch(h, _MM_HINT_T0) : _mm_prefetch(h, _MM_HINT_T1);
      }
      _mm512_storeu_ps(p + i / 4, _mm512_mul_ps(_mm512_loadu_ps(p + i / 4), s));
    }
  }
}

static int cmp(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(void) {
  const long gaps[] = {0, 128, 2048};
  const struct { int level; long ahead; } hints[] = {{0, 0}, {1, 2048}, {1, 8192}, {2, 2048}, {2, 8192}};
  for (int g = 0; g < 3; ++g) {
    const long row = USED + gaps[g];
    char* sets[SETS];
    for (int s = 0; s < SETS; ++s) {
      sets[s] = aligned_alloc(4096, (size_t)row * TOKENS);
      memset(sets[s], 0, (size_t)row * TOKENS);
    }
    for (int h = 0; h < 5; ++h) {
      double ts[RUNS];
      for (int r = 0; r < RUNS; ++r) {
        const double t0 = now();
        pass(sets[r % SETS], row, hints[h].level, hints[h].ahead);
        ts[r] = now() - t0;
      }
      qsort(ts, RUNS, sizeof(double), cmp);
      printf("gap %5ld B, hints %s %5ld B ahead: median %.2f ms, %.1f GB/s read + written\n", gaps[g],
             hints[h].level == 0 ? "none" : hints[h].level == 1 ? "L1  " : "L2  ", hints[h].ahead,
             ts[RUNS / 2] * 1e3, 2.0 * USED * TOKENS / ts[RUNS / 2] / 1e9);
    }
    for (int s = 0; s < SETS; ++s) free(sets[s]);
  }
  return 0;
}
