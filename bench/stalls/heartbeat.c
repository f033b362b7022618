// A witness for soak.sh: wakes every 1 ms (CLOCK_MONOTONIC) and prints
// `G <wall time of the wake-up> <gap in ms>` for every gap over 5 ms and
// `S <second> <ms>` with each second's longest. Run under `chrt -f` and
// `taskset`, a late wake-up means the CPU did not run it: the vCPU was not
// scheduled, or kernel code held the CPU without a preemption point.
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <time.h>

static int64_t now_ns(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    int64_t prev = now_ns(CLOCK_MONOTONIC), second = now_ns(CLOCK_REALTIME) / 1000000000LL, longest = 0;
    const struct timespec period = {0, 1000000};
    for (;;) {
        clock_nanosleep(CLOCK_MONOTONIC, 0, &period, NULL);
        int64_t now = now_ns(CLOCK_MONOTONIC), wall = now_ns(CLOCK_REALTIME);
        int64_t gap = now - prev;
        prev = now;
        if (gap > longest) longest = gap;
        if (gap > 5000000) printf("G %.3f %.2f\n", wall / 1e9, gap / 1e6);
        if (wall / 1000000000LL != second) {
            printf("S %lld %.2f\n", (long long)second, longest / 1e6);
            longest = 0;
            second = wall / 1000000000LL;
        }
    }
}
