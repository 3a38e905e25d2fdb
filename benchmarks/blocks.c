/* The CPU allocator's blocks, counted where they are allocated: an LD_PRELOAD wrapper of posix_memalign and free.
 *
 * PyTorch's CPU allocator (c10::alloc_cpu) takes every tensor's storage, and the buffers kernels allocate
 * through it, from posix_memalign with 64-byte alignment, and gives them back with free. This library
 * records each such block at its requested size in a table of its own (static: it allocates nothing),
 * and forgets it when freed. blocks_begin() opens a count: from then on, the bytes of blocks allocated
 * since and still alive, and their peak, are what a call held at once; a block allocated before the
 * count and freed during it lowers nothing (a free of an older block is not the call's saving).
 *
 * Built and preloaded by benchmarks/blocks.py; read there through ctypes. Nothing here changes what
 * the process allocates or when: the wrapper only looks, beside the real posix_memalign and free.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define ALIGNMENT 64            /* c10::gAlignment */
#define SLOTS (1u << 21)        /* live blocks at most: far beyond a process's tensors */

typedef struct {
    uintptr_t ptr; /* 0: an empty slot */
    size_t size;
    uint64_t count; /* the count it was allocated in */
} Slot;

static Slot table[SLOTS];
static volatile int lock;
static uint64_t count;           /* the count now open (0: none yet) */
static size_t live, peak, total; /* the open count's live bytes and their peak; every tracked block's bytes */
static size_t overflow;          /* blocks the table had no room for: a count with any is void */

static int (*real_memalign)(void **, size_t, size_t);
static void (*real_free)(void *);

static void acquire(void) {
    while (__atomic_exchange_n(&lock, 1, __ATOMIC_ACQUIRE)) {
    }
}
static void release(void) { __atomic_store_n(&lock, 0, __ATOMIC_RELEASE); }

static size_t slot_of(uintptr_t p) { return (size_t)((p >> 6) * 0x9E3779B97F4A7C15ull >> 43) & (SLOTS - 1); }

static void insert(uintptr_t p, size_t size) {
    size_t i = slot_of(p);
    for (size_t n = 0; n < SLOTS; n++, i = (i + 1) & (SLOTS - 1)) {
        if (table[i].ptr == 0 || table[i].ptr == p) {
            table[i] = (Slot){p, size, count};
            total += size;
            live += size;
            if (live > peak) peak = live;
            return;
        }
    }
    overflow++;
}

/* Linear probing with backward-shift deletion: no tombstones, so lookups stay short for the process's life. */
static void erase(uintptr_t p) {
    size_t i = slot_of(p);
    while (table[i].ptr != p) {
        if (table[i].ptr == 0) return; /* not a tracked block */
        i = (i + 1) & (SLOTS - 1);
    }
    total -= table[i].size;
    if (table[i].count == count) live -= table[i].size;
    size_t hole = i;
    for (size_t j = (i + 1) & (SLOTS - 1); table[j].ptr != 0; j = (j + 1) & (SLOTS - 1)) {
        size_t home = slot_of(table[j].ptr);
        /* j's entry may move into the hole unless its home lies cyclically in (hole, j] */
        int stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
        if (!stays) {
            table[hole] = table[j];
            hole = j;
        }
    }
    table[hole].ptr = 0;
}

static volatile int resolving; /* dlsym may free: such a block is leaked, not passed to an unresolved free */

static void resolve(void) {
    resolving = 1;
    real_memalign = (int (*)(void **, size_t, size_t))dlsym(RTLD_NEXT, "posix_memalign");
    real_free = (void (*)(void *))dlsym(RTLD_NEXT, "free");
    resolving = 0;
}

__attribute__((constructor)) static void init(void) { resolve(); }

int posix_memalign(void **out, size_t alignment, size_t size) {
    if (!real_memalign) resolve();
    int err = real_memalign(out, alignment, size);
    if (err == 0 && alignment == ALIGNMENT && size > 0) {
        acquire();
        insert((uintptr_t)*out, size);
        release();
    }
    return err;
}

void free(void *p) {
    if (!real_free) {
        if (resolving) return;
        resolve();
    }
    if (p) {
        acquire();
        erase((uintptr_t)p);
        release();
    }
    real_free(p);
}

/* Opens a count: what blocks allocated from now on hold at once. */
void blocks_begin(void) {
    acquire();
    count++;
    live = peak = 0;
    overflow = 0;
    release();
}
size_t blocks_peak(void) { return peak; }
size_t blocks_live(void) { return live; }
size_t blocks_total(void) { return total; }
size_t blocks_overflow(void) { return overflow; }
