/* vram.replay._ccore: the replay engine's event loop in C.
 *
 * The readable reference is Python: vram/allocator/caching.py, block.py, stats.py, release.py and
 * the loop `_run` in vram/replay/engine.py. This file repeats exactly what they do, for the subset
 * of configurations and traces vram/replay/ccore.py hands it (default caching allocator with any
 * rounding / max_split_size / segment size, any streams; no expandable segments, garbage
 * collection, history, events or OOMs). Whatever it meets outside that subset, it stops and
 * returns the reason as a str; the caller then replays with the Python engine from the start.
 * The Python device stays in charge of cudaMalloc / cudaFree (called back, once per segment), so
 * recorded and synthetic addresses come from the same code as in a pure-Python replay.
 *
 * Follows c10/cuda/CUDACachingAllocator.cpp (DeviceCachingAllocator): malloc -> get_free_block
 * (best fit in a std::set ordered by BlockComparatorSize: stream, size, address) -> alloc_block
 * (cudaMalloc) -> alloc_found_block (split, stats); free -> free_block (merge with free
 * neighbours, stats); release_cached_blocks (empty_cache). Statistics follow `Stat` / `DeviceStats`.
 *
 * Pools: one ordered set of (size << 64 | address) keys per (stream, small/large), kept as a
 * sorted list of sorted chunks of at most CHUNK keys (the layout of vram.allocator.block's
 * SortedKeys): a search is two binary searches, an insert or delete moves at most CHUNK entries.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#ifndef CCORE_SOURCE_SHA256  /* setup.py defines it: the SHA-256 of this file, checked by ccore.py */
#define CCORE_SOURCE_SHA256 ""
#endif

typedef unsigned __int128 u128;
typedef __int128 i128;

/* ------------------------------------------------------------------ constants (spec §2) */
#define K_MIN_BLOCK_SIZE 512ULL
#define K_SMALL_SIZE 1048576ULL
#define K_SMALL_BUFFER 2097152ULL
#define K_MIN_LARGE_ALLOC 10485760ULL
#define K_ROUND_LARGE 2097152ULL
#define ONE_EB (1ULL << 60)
#define STREAM_MAX ((1ULL << 63) - 1)
#define EMPTY UINT64_MAX /* the hash maps' empty slot: no address or stream is 2**64-1 */

/* ------------------------------------------------------------------ blocks (block.py Block) */
typedef struct Block {
    uint64_t ptr, size, requested, stream, seq; /* seq: when it last entered its pool or `active` */
    struct Block *prev, *next;
    PyObject *frames, *seg_frames; /* owned references or NULL (None) */
    int small, allocated;
} Block;

static Block *block_new(uint64_t stream, uint64_t size, int small, uint64_t ptr) {
    Block *b = PyMem_Calloc(1, sizeof(Block));
    if (b) { b->stream = stream; b->size = size; b->small = small; b->ptr = ptr; }
    return b;
}

static void block_del(Block *b) {
    Py_XDECREF(b->frames);
    Py_XDECREF(b->seg_frames);
    PyMem_Free(b);
}

/* ------------------------------------------------------------------ u64 -> u64 hash map */
typedef struct { uint64_t *keys, *vals; size_t cap, n; int shift; } Map; /* linear probing, cap a power of 2 */

/* Fibonacci hashing: the top bits of k * 2**64/phi (addresses are multiples of 512: their low
 * bits, and so the product's low bits, carry nothing) */
static size_t slot_of(const Map *m, uint64_t k) {
    return (size_t)((k * 0x9E3779B97F4A7C15ULL) >> m->shift);
}

static int map_init(Map *m, size_t cap) {
    m->cap = cap; m->n = 0;
    m->shift = 64 - __builtin_ctzll(cap);
    m->keys = PyMem_Malloc(cap * sizeof(uint64_t));
    m->vals = PyMem_Malloc(cap * sizeof(uint64_t));
    if (!m->keys || !m->vals) return -1;
    memset(m->keys, 0xff, cap * sizeof(uint64_t));
    return 0;
}

static void map_free(Map *m) { PyMem_Free(m->keys); PyMem_Free(m->vals); m->keys = m->vals = NULL; }

static int map_get(const Map *m, uint64_t k, uint64_t *v) {
    for (size_t i = slot_of(m, k);; i = (i + 1) & (m->cap - 1)) {
        if (m->keys[i] == k) { if (v) *v = m->vals[i]; return 1; }
        if (m->keys[i] == EMPTY) return 0;
    }
}

static int map_put(Map *m, uint64_t k, uint64_t v);

static int map_grow(Map *m) {
    Map old = *m;
    if (map_init(m, old.cap * 2) < 0) return -1;
    for (size_t i = 0; i < old.cap; i++)
        if (old.keys[i] != EMPTY) map_put(m, old.keys[i], old.vals[i]);
    map_free(&old);
    return 0;
}

static int map_put(Map *m, uint64_t k, uint64_t v) {
    if (2 * (m->n + 1) > m->cap && map_grow(m) < 0) return -1;
    size_t i = slot_of(m, k);
    for (; m->keys[i] != EMPTY; i = (i + 1) & (m->cap - 1))
        if (m->keys[i] == k) { m->vals[i] = v; return 0; }
    m->keys[i] = k; m->vals[i] = v; m->n++;
    return 0;
}

static int map_pop(Map *m, uint64_t k, uint64_t *v) { /* backward-shift deletion */
    size_t mask = m->cap - 1, i = slot_of(m, k);
    for (;; i = (i + 1) & mask) {
        if (m->keys[i] == EMPTY) return 0;
        if (m->keys[i] == k) break;
    }
    if (v) *v = m->vals[i];
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (m->keys[j] == EMPTY) break;
        size_t home = slot_of(m, m->keys[j]);
        /* move j back to i unless its home lies cyclically in (i, j] */
        if ((j > i && (home <= i || home > j)) || (j < i && (home <= i && home > j))) {
            m->keys[i] = m->keys[j]; m->vals[i] = m->vals[j]; i = j;
        }
    }
    m->keys[i] = EMPTY; m->n--;
    return 1;
}

/* ------------------------------------------------------------------ ordered sets of free blocks */
#define CHUNK 64
typedef struct { int n; u128 keys[CHUNK]; Block *vals[CHUNK]; } Chunk;
typedef struct { Chunk **chunks; u128 *maxes; size_t n, cap, len; } Set;

static u128 key_of(const Block *b) { return ((u128)b->size << 64) | b->ptr; }

static size_t lower(const u128 *a, size_t n, u128 k) { /* first index with a[i] >= k */
    size_t lo = 0, hi = n;
    while (lo < hi) { size_t mid = (lo + hi) / 2; if (a[mid] < k) lo = mid + 1; else hi = mid; }
    return lo;
}

static int set_insert(Set *s, u128 k, Block *b) {
    if (s->n == 0 || (s->n + 1 > s->cap)) {
        if (s->n + 1 > s->cap) {
            size_t cap = s->cap ? 2 * s->cap : 4;
            Chunk **c = PyMem_Realloc(s->chunks, cap * sizeof(Chunk *));
            if (!c) return -1;
            s->chunks = c;
            u128 *m = PyMem_Realloc(s->maxes, cap * sizeof(u128));
            if (!m) return -1;
            s->maxes = m; s->cap = cap;
        }
        if (s->n == 0) {
            Chunk *c = PyMem_Malloc(sizeof(Chunk));
            if (!c) return -1;
            c->n = 1; c->keys[0] = k; c->vals[0] = b;
            s->chunks[0] = c; s->maxes[0] = k; s->n = 1; s->len = 1;
            return 0;
        }
    }
    size_t i = lower(s->maxes, s->n, k);
    if (i == s->n) i--;
    Chunk *c = s->chunks[i];
    if (c->n == CHUNK) { /* split: the upper half becomes chunk i + 1 */
        Chunk *d = PyMem_Malloc(sizeof(Chunk));
        if (!d) return -1;
        int h = CHUNK / 2;
        d->n = CHUNK - h;
        memcpy(d->keys, c->keys + h, d->n * sizeof(u128));
        memcpy(d->vals, c->vals + h, d->n * sizeof(Block *));
        c->n = h;
        memmove(s->chunks + i + 2, s->chunks + i + 1, (s->n - i - 1) * sizeof(Chunk *));
        memmove(s->maxes + i + 2, s->maxes + i + 1, (s->n - i - 1) * sizeof(u128));
        s->chunks[i + 1] = d; s->maxes[i + 1] = s->maxes[i]; s->maxes[i] = c->keys[h - 1];
        s->n++;
        if (k > s->maxes[i]) { i++; c = d; }
    }
    size_t j = lower(c->keys, c->n, k);
    memmove(c->keys + j + 1, c->keys + j, (c->n - j) * sizeof(u128));
    memmove(c->vals + j + 1, c->vals + j, (c->n - j) * sizeof(Block *));
    c->keys[j] = k; c->vals[j] = b; c->n++;
    if (k > s->maxes[i]) s->maxes[i] = k;
    s->len++;
    return 0;
}

static void set_remove(Set *s, u128 k) { /* k is in the set */
    size_t i = lower(s->maxes, s->n, k);
    Chunk *c = s->chunks[i];
    size_t j = lower(c->keys, c->n, k);
    memmove(c->keys + j, c->keys + j + 1, (c->n - j - 1) * sizeof(u128));
    memmove(c->vals + j, c->vals + j + 1, (c->n - j - 1) * sizeof(Block *));
    c->n--; s->len--;
    if (c->n == 0) {
        PyMem_Free(c);
        memmove(s->chunks + i, s->chunks + i + 1, (s->n - i - 1) * sizeof(Chunk *));
        memmove(s->maxes + i, s->maxes + i + 1, (s->n - i - 1) * sizeof(u128));
        s->n--;
    } else if (j == (size_t)c->n) {
        s->maxes[i] = c->keys[c->n - 1];
    }
}

static Block *set_ceiling(const Set *s, u128 k) { /* the block of the smallest key >= k, or NULL */
    size_t i = lower(s->maxes, s->n, k);
    if (i == s->n) return NULL;
    const Chunk *c = s->chunks[i];
    return c->vals[lower(c->keys, c->n, k)];
}

static void set_free(Set *s) {
    for (size_t i = 0; i < s->n; i++) PyMem_Free(s->chunks[i]);
    PyMem_Free(s->chunks); PyMem_Free(s->maxes);
    memset(s, 0, sizeof(Set));
}

/* ------------------------------------------------------------------ statistics (stats.py) */
enum { ALLOCATION, SEGMENT, ACTIVE, INACTIVE_SPLIT, ALLOCATED_BYTES, RESERVED_BYTES, ACTIVE_BYTES,
       INACTIVE_SPLIT_BYTES, REQUESTED_BYTES, N_ARRAY };
enum { NUM_ALLOC_RETRIES, NUM_OOMS, NUM_SYNC_ALL_STREAMS, NUM_DEVICE_ALLOC, NUM_DEVICE_FREE,
       NUM_OOM_REJECTIONS, N_COUNTERS };
typedef struct { i128 current, peak, allocated, freed; } Stat;

static inline void stat_increase(Stat *s, i128 n) {
    s->current += n;
    if (s->current > s->peak) s->peak = s->current;
    s->allocated += n;
}
static inline void stat_decrease(Stat *s, i128 n) { s->current -= n; s->freed += n; }
/* `_change`: increase (n > 0) or decrease (n < 0) the `all` stat and the pool's (i: 1 small, 2 large) */
static inline void change(Stat *arr, int i, i128 n) {
    if (n > 0) { stat_increase(&arr[0], n); stat_increase(&arr[i], n); }
    else if (n < 0) { stat_decrease(&arr[0], -n); stat_decrease(&arr[i], -n); }
}

/* ------------------------------------------------------------------ the allocator's state */
typedef struct { uint64_t stream; Set pool[2]; } Streams; /* pool[1] small, pool[0] large */

typedef struct {
    /* config (config.py AllocatorConfig) */
    uint64_t divisions[16], max_split, max_non_split, large_segment, allowed_max;
    int has_allowed_max;
    /* state (caching.py CachingAllocator) */
    Stat arr[N_ARRAY][3], oversize_allocations, oversize_segments;
    i128 counters[N_COUNTERS], total_allocated;
    Map active;  /* our address -> Block* of allocated blocks */
    Map stream_ix;  /* stream -> index into `streams` */
    Streams *streams; size_t nstreams, capstreams;
    uint64_t seq;
    PyObject *dev_malloc, *dev_free;  /* the Python device's malloc / free */
    const char *refused;  /* why the replay stopped, or NULL */
} Alloc;

static Streams *streams_of(Alloc *a, uint64_t stream) {
    uint64_t ix;
    if (map_get(&a->stream_ix, stream, &ix)) return &a->streams[ix];
    if (a->nstreams == a->capstreams) {
        size_t cap = a->capstreams ? 2 * a->capstreams : 4;
        Streams *s = PyMem_Realloc(a->streams, cap * sizeof(Streams));
        if (!s) return NULL;
        a->streams = s; a->capstreams = cap;
    }
    Streams *s = &a->streams[a->nstreams];
    memset(s, 0, sizeof(Streams));
    s->stream = stream;
    if (map_put(&a->stream_ix, stream, a->nstreams) < 0) return NULL;
    a->nstreams++;
    return s;
}

/* BlockPool.insert / remove */
static int pool_insert(Alloc *a, Block *b) {
    Streams *s = streams_of(a, b->stream);
    if (!s) return -1;
    b->seq = a->seq++;
    return set_insert(&s->pool[b->small], key_of(b), b);
}

static void pool_remove(Alloc *a, Block *b) {
    uint64_t ix = 0;  /* (every pooled block's stream has an entry) */
    map_get(&a->stream_ix, b->stream, &ix);
    set_remove(&a->streams[ix].pool[b->small], key_of(b));
}

/* caching.py round_size (spec §4) */
static uint64_t bitlen(uint64_t x) { return x ? 64 - (uint64_t)__builtin_clzll(x) : 0; }

static uint64_t round_size(const Alloc *a, uint64_t size) {
    if (size < K_MIN_BLOCK_SIZE) return K_MIN_BLOCK_SIZE;
    int64_t bucket = (int64_t)bitlen(size) - 21;
    uint64_t d = a->divisions[bucket < 0 ? 0 : (bucket > 15 ? 15 : bucket)];
    if (d > 1 && (u128)size > (u128)K_MIN_BLOCK_SIZE * d) {
        if ((size & (size - 1)) == 0) return size;
        uint64_t floor = 1ULL << (bitlen(size) - 1);
        uint64_t step = floor >> (bitlen(d) - 1);
        if (step == 0) return floor << 1;
        uint64_t rounded = size & ~(step - 1);
        return rounded == size ? size : rounded + step;
    }
    return (size + 511) & ~511ULL;
}

/* caching.py allocation_size (spec §6) */
static uint64_t allocation_size(const Alloc *a, uint64_t size) {
    if (size <= K_SMALL_SIZE) return K_SMALL_BUFFER;
    if (size < K_MIN_LARGE_ALLOC) return a->large_segment;
    return (size + K_ROUND_LARGE - 1) / K_ROUND_LARGE * K_ROUND_LARGE;
}

/* CachingAllocator._get_free_block: best fit (spec §7), no expandable segments or GC */
static Block *get_free_block(Alloc *a, int small, uint64_t stream, uint64_t size) {
    uint64_t ix;
    if (!map_get(&a->stream_ix, stream, &ix)) return NULL;
    Set *set = &a->streams[ix].pool[small];
    Block *b = set_ceiling(set, (u128)size << 64);
    if (!b) return NULL;
    if (size < a->max_split) {
        if (b->size >= a->max_split) return NULL;
    } else if ((u128)b->size >= (u128)size + a->max_non_split) {
        return NULL;
    }
    set_remove(set, key_of(b));
    return b;
}

/* CachingAllocator._alloc_block: a new segment from the device (spec §9.1). NULL and no
 * `refused`: out of memory; NULL and `refused` (or a Python error): stop. */
static Block *alloc_block(Alloc *a, int small, uint64_t stream, uint64_t alloc_size) {
    if (a->has_allowed_max && (u128)(a->total_allocated + alloc_size) > (u128)a->allowed_max) return NULL;
    PyObject *r = PyObject_CallFunction(a->dev_malloc, "K", (unsigned long long)alloc_size);
    if (!r) return NULL;
    if (r == Py_None) { Py_DECREF(r); return NULL; }
    uint64_t ptr = PyLong_AsUnsignedLongLong(r);
    Py_DECREF(r);
    if (PyErr_Occurred()) { PyErr_Clear(); a->refused = "the device returned an address outside [0, 2**64)"; return NULL; }
    if (ptr == EMPTY) { a->refused = "the device returned address 2**64-1"; return NULL; }
    Block *b = block_new(stream, alloc_size, small, ptr);
    if (!b) { PyErr_NoMemory(); return NULL; }
    a->total_allocated += alloc_size;
    change(a->arr[SEGMENT], small ? 1 : 2, 1);
    change(a->arr[RESERVED_BYTES], small ? 1 : 2, alloc_size);
    if (alloc_size >= a->max_split) stat_increase(&a->oversize_segments, 1);
    a->counters[NUM_DEVICE_ALLOC] += 1;
    return b;
}

/* ReleaseMixin._release_block: cudaFree a whole free segment (spec §11.1); it leaves its pool */
static int release_block(Alloc *a, Block *b) {
    PyObject *r = PyObject_CallFunction(a->dev_free, "K", (unsigned long long)b->ptr);
    if (!r) return -1;
    Py_DECREF(r);
    int i = b->small ? 1 : 2;
    a->total_allocated -= b->size;
    change(a->arr[SEGMENT], i, -1);
    change(a->arr[RESERVED_BYTES], i, -(i128)b->size);
    a->counters[NUM_DEVICE_FREE] += 1;
    if (b->size >= a->max_split) stat_decrease(&a->oversize_segments, 1);
    pool_remove(a, b);
    block_del(b);
    return 0;
}

static int cmp_stream(const void *x, const void *y) {
    uint64_t s = ((const Streams *)x)->stream, t = ((const Streams *)y)->stream;
    return s < t ? -1 : s > t;
}

/* ReleaseMixin._release_cached_blocks (empty_cache, spec §11.1): no events to wait for, then every
 * whole free segment of the large pool, then of the small pool, in pool order (stream, size, address) */
static int release_cached_blocks(Alloc *a) {
    a->counters[NUM_SYNC_ALL_STREAMS] += 1;  /* synchronize_and_free_events */
    qsort(a->streams, a->nstreams, sizeof(Streams), cmp_stream);
    for (size_t k = 0; k < a->nstreams; k++) map_put(&a->stream_ix, a->streams[k].stream, k);
    for (int small = 0; small < 2; small++) {
        for (size_t k = 0; k < a->nstreams; k++) {
            Set *set = &a->streams[k].pool[small];
            size_t n = 0, len = set->len;
            Block **todo = PyMem_Malloc((len ? len : 1) * sizeof(Block *));
            if (!todo) { PyErr_NoMemory(); return -1; }
            for (size_t c = 0; c < set->n; c++)
                for (int j = 0; j < set->chunks[c]->n; j++) {
                    Block *b = set->chunks[c]->vals[j];
                    if (!b->prev && !b->next) todo[n++] = b;
                }
            for (size_t j = 0; j < n; j++)
                if (release_block(a, todo[j]) < 0) { PyMem_Free(todo); return -1; }
            PyMem_Free(todo);
        }
    }
    return 0;
}

/* CachingAllocator._alloc_found_block: split (spec §8), mark allocated, stats (spec §16) */
static int alloc_found_block(Alloc *a, Block *block, uint64_t stream, uint64_t size, uint64_t orig, uint64_t *out) {
    int small = block->small, i = small ? 1 : 2;
    uint64_t remaining = block->size - size;
    int split = small ? remaining >= K_MIN_BLOCK_SIZE : (size < a->max_split && remaining > K_SMALL_SIZE);
    int already_split = block->prev || block->next;
    if (split) {
        Block *rest = block;
        block = block_new(stream, size, small, rest->ptr);
        if (!block) { PyErr_NoMemory(); return -1; }
        block->seg_frames = rest->seg_frames;  /* the segment's stack stays with its head */
        rest->seg_frames = NULL;
        block->prev = rest->prev;
        if (block->prev) block->prev->next = block;
        block->next = rest;
        rest->prev = block;
        rest->ptr += size;
        rest->size = remaining;
        if (pool_insert(a, rest) < 0) { PyErr_NoMemory(); return -1; }
        if (already_split) {  /* an inactive split block shrinks by `size` */
            change(a->arr[INACTIVE_SPLIT_BYTES], i, -(i128)size);
        } else {  /* a whole segment becomes split: its remainder is a new inactive split block */
            change(a->arr[INACTIVE_SPLIT], i, 1);
            change(a->arr[INACTIVE_SPLIT_BYTES], i, remaining);
        }
    } else if (already_split) {  /* an inactive split block becomes active */
        change(a->arr[INACTIVE_SPLIT], i, -1);
        change(a->arr[INACTIVE_SPLIT_BYTES], i, -(i128)block->size);
    }
    block->allocated = 1;
    block->requested = orig;
    Py_CLEAR(block->frames);
    block->seq = a->seq++;
    if (map_put(&a->active, block->ptr, (uint64_t)(uintptr_t)block) < 0) { PyErr_NoMemory(); return -1; }
    uint64_t bsize = block->size;
    /* DeviceStats.on_alloc */
    stat_increase(&a->arr[ALLOCATION][0], 1); stat_increase(&a->arr[ALLOCATION][i], 1);
    stat_increase(&a->arr[ACTIVE][0], 1); stat_increase(&a->arr[ACTIVE][i], 1);
    stat_increase(&a->arr[ALLOCATED_BYTES][0], bsize); stat_increase(&a->arr[ALLOCATED_BYTES][i], bsize);
    stat_increase(&a->arr[ACTIVE_BYTES][0], bsize); stat_increase(&a->arr[ACTIVE_BYTES][i], bsize);
    stat_increase(&a->arr[REQUESTED_BYTES][0], orig); stat_increase(&a->arr[REQUESTED_BYTES][i], orig);
    if (bsize >= a->max_split) stat_increase(&a->oversize_allocations, 1);
    *out = block->ptr;
    return 0;
}

/* CachingAllocator._malloc (size checked: 0 < size < 2**60). 0 done, -1 Python error or refused. */
static int do_malloc(Alloc *a, uint64_t size, uint64_t stream, uint64_t *out) {
    uint64_t rounded = round_size(a, size);
    int small = rounded <= K_SMALL_SIZE;
    uint64_t alloc_size = allocation_size(a, rounded);
    Block *b = get_free_block(a, small, stream, rounded);
    if (!b) {
        b = alloc_block(a, small, stream, alloc_size);
        if (!b) {
            if (!PyErr_Occurred() && !a->refused)
                a->refused = "a cudaMalloc failed (the retry and OOM paths run in Python)";
            return -1;
        }
    }
    return alloc_found_block(a, b, stream, rounded, size, out);
}

/* block.py try_merge_blocks for a free neighbour (no events, all mapped): bytes absorbed */
static uint64_t try_merge(Alloc *a, Block *dst, Block *src) {
    if (!src || src->allocated) return 0;
    if (dst->prev == src) {
        dst->ptr = src->ptr;
        dst->prev = src->prev;
        if (dst->prev) dst->prev->next = dst;
        Py_XSETREF(dst->seg_frames, src->seg_frames);
        src->seg_frames = NULL;
    } else {
        dst->next = src->next;
        if (dst->next) dst->next->prev = dst;
    }
    dst->size += src->size;
    pool_remove(a, src);
    uint64_t size = src->size;
    block_del(src);
    return size;
}

/* CachingAllocator._free then _free_block (spec §10.1, §10.2) of an allocated block */
static int do_free(Alloc *a, Block *block) {
    int i = block->small ? 1 : 2;
    uint64_t bsize = block->size, requested = block->requested;
    block->allocated = 0;
    /* DeviceStats.on_free_requested */
    stat_decrease(&a->arr[ALLOCATION][0], 1); stat_decrease(&a->arr[ALLOCATION][i], 1);
    stat_decrease(&a->arr[ALLOCATED_BYTES][0], bsize); stat_decrease(&a->arr[ALLOCATED_BYTES][i], bsize);
    if (bsize >= a->max_split) stat_decrease(&a->oversize_allocations, 1);
    Py_CLEAR(block->frames);
    map_pop(&a->active, block->ptr, NULL);
    i128 net_blocks = 0, net_bytes = 0;
    Block *prev = block->prev, *next = block->next;
    uint64_t absorbed;
    if ((absorbed = try_merge(a, block, prev))) { net_blocks -= 1; net_bytes -= absorbed; }
    if ((absorbed = try_merge(a, block, next))) { net_blocks -= 1; net_bytes -= absorbed; }
    if (pool_insert(a, block) < 0) { PyErr_NoMemory(); return -1; }
    if (block->prev || block->next) { net_blocks += 1; net_bytes += block->size; }
    change(a->arr[INACTIVE_SPLIT], i, net_blocks);  /* on_inactive_split */
    change(a->arr[INACTIVE_SPLIT_BYTES], i, net_bytes);
    /* DeviceStats.on_free_completed */
    stat_decrease(&a->arr[ACTIVE][0], 1); stat_decrease(&a->arr[ACTIVE][i], 1);
    stat_decrease(&a->arr[ACTIVE_BYTES][0], bsize); stat_decrease(&a->arr[ACTIVE_BYTES][i], bsize);
    stat_decrease(&a->arr[REQUESTED_BYTES][0], requested); stat_decrease(&a->arr[REQUESTED_BYTES][i], requested);
    return 0;
}

/* engine.py _largest_free: the largest free block of either pool, visiting each stream's largest;
 * -1 once more than `budget` streams were visited (when `has_budget`). */
static i128 largest_free(Alloc *a, int has_budget, i128 budget, i128 *steps) {
    uint64_t best = 0;
    *steps = 0;
    for (int small = 1; small >= 0; small--)
        for (size_t k = 0; k < a->nstreams; k++) {
            Set *s = &a->streams[k].pool[small];
            if (!s->len) continue;
            Chunk *c = s->chunks[s->n - 1];
            uint64_t size = (uint64_t)(c->keys[c->n - 1] >> 64);
            if (size > best) best = size;
            *steps += 1;
            if (has_budget && *steps > budget) return -1;
        }
    return best;
}

/* ------------------------------------------------------------------ Python ints <-> C */
static PyObject *from_i128(i128 v) {
    if (v >= INT64_MIN && v <= INT64_MAX) return PyLong_FromLongLong((long long)v);
    /* hi * 2**64 + lo, for a statistic that outgrew int64 */
    int neg = v < 0;
    u128 m = neg ? (u128)(-v) : (u128)v;
    PyObject *hi = PyLong_FromUnsignedLongLong((unsigned long long)(m >> 64));
    PyObject *lo = PyLong_FromUnsignedLongLong((unsigned long long)m);
    PyObject *sh = PyLong_FromLong(64), *t = NULL, *r = NULL;
    if (hi && lo && sh && (t = PyNumber_Lshift(hi, sh))) r = PyNumber_Or(t, lo);
    Py_XDECREF(hi); Py_XDECREF(lo); Py_XDECREF(sh); Py_XDECREF(t);
    if (r && neg) Py_SETREF(r, PyNumber_Negative(r));
    return r;
}

/* an exact int in [0, limit]: 1 and *out, or 0 (anything else, no error set) */
static int as_u64(PyObject *o, uint64_t limit, uint64_t *out) {
    if (!o || !PyLong_CheckExact(o)) return 0;
    int overflow = 0;  /* (PyLong_AsUnsignedLongLong goes through a byte array: slower, for >= 2**63 only) */
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    unsigned long long u = (unsigned long long)v;
    if (overflow > 0) u = PyLong_AsUnsignedLongLong(o);  /* OverflowError when too big */
    else if (overflow < 0 || v < 0) return 0;
    if (u == (unsigned long long)-1 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
    if (u > limit) return 0;
    *out = u;
    return 1;
}

static int as_i128(PyObject *o, i128 *out) { /* int64 range is all the statistics we take in */
    if (!o || !PyLong_Check(o)) return 0;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) { PyErr_Clear(); return 0; }
    *out = v;
    return 1;
}

/* ------------------------------------------------------------------ the op stream */
/* scan(trace): every event's dict read once, into one array of Op shared by the rewind (walking it
 * backwards) and the replay loop (forwards), instead of each reading every dict again. What the
 * readers need of an event that is not a plain number (a free_completed's size and frames, a
 * segment_free's stream) they take from the event itself, by its index, for the few that last. */
typedef struct { uint64_t addr, size, stream; uint8_t action, ok; } Op;
/* actions (A_OTHER: any other hashable action) */
enum { A_ALLOC, A_FREE_REQUESTED, A_FREE_COMPLETED, A_SEGMENT_ALLOC, A_SEGMENT_FREE, A_SEGMENT_MAP,
       A_SEGMENT_UNMAP, A_OOM, A_OTHER, N_ACTIONS };
static const char *const ACTION_NAMES[A_OTHER] = {"alloc", "free_requested", "free_completed", "segment_alloc",
                                                  "segment_free", "segment_map", "segment_unmap", "oom"};
/* engine.py _CODES: 0 alloc, 1 free_requested, 2 free_completed, 3 segment_free / unmap (a run of
 * them is one empty_cache()), 4 oom, 5 anything else */
static const int ENGINE_CODE[N_ACTIONS] = {0, 1, 2, 5, 3, 5, 3, 4, 5};
/* ok bits. OK_ADDR: the replay's address (``addr``, else ``device_free``, else 0) is an int in
 * [0, 2**64-1); ADDR_KEY: it is the ``addr`` key's; OK_SIZE: ``size`` is an int in [0, 2**60);
 * SIZE_U64: an int in [0, 2**64-1) (then in `size`); HAS_SIZE: the key is there; OK_STREAM: no
 * ``stream`` or an int in [0, 2**63) */
#define OK_ADDR 1
#define OK_SIZE 2
#define OK_STREAM 4
#define ADDR_KEY 8
#define SIZE_U64 16
#define HAS_SIZE 32

static PyObject *s_action, *s_addr, *s_device_free, *s_size, *s_stream, *s_pool_id, *action_codes;

/* The values of the keys an event's dict is read for (NULL: no such key). A dict whose keys are
 * all exact strs (as the loader's and PyTorch's are) is read in one pass over its entries (no
 * probing, nothing read for an absent key), each key's role found by pointer in `KeyCache`: the
 * unpickler shares one key object among all the dicts of a recording, so each distinct key object
 * is compared by value once. A dict with any other key is read by lookups, which is the same. */
typedef struct { PyObject *action, *addr, *device_free, *size, *stream, *pool_id; } Fields;
#define N_FIELDS 6
#define KEY_SLOTS 64  /* a power of 2; at most half of them used */
typedef struct { PyObject *key[KEY_SLOTS]; int8_t field[KEY_SLOTS]; int n; } KeyCache;  /* field -1: another key */

static PyObject *field_names[N_FIELDS];  /* s_action, s_addr, s_device_free, s_size, s_stream, s_pool_id */

static void key_cache_clear(KeyCache *c) {
    for (int j = 0; j < KEY_SLOTS; j++) Py_CLEAR(c->key[j]);
    c->n = 0;
}

/* the field of exact str `k` (-1: none of ours) */
static int key_field(KeyCache *c, PyObject *k) {
    size_t h = ((uintptr_t)k >> 4) & (KEY_SLOTS - 1);
    for (; c->key[h]; h = (h + 1) & (KEY_SLOTS - 1))
        if (c->key[h] == k) return c->field[h];
    int field = -1;
    for (int j = 0; j < N_FIELDS && field < 0; j++)
        if (k == field_names[j] || PyUnicode_Compare(k, field_names[j]) == 0) field = j;
    if (2 * (c->n + 1) <= KEY_SLOTS) {  /* (the key is held, so its address stays its own) */
        c->key[h] = Py_NewRef(k); c->field[h] = (int8_t)field; c->n++;
    }
    return field;
}

static int read_fields(PyObject *e, Fields *f, KeyCache *c) {
    PyObject **slots[N_FIELDS] = {&f->action, &f->addr, &f->device_free, &f->size, &f->stream, &f->pool_id};
    memset(f, 0, sizeof(*f));
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(e, &pos, &k, &v)) {
        if (!PyUnicode_CheckExact(k)) goto lookups;
        int field = key_field(c, k);
        if (field >= 0) *slots[field] = v;
    }
    return 0;
lookups:
    memset(f, 0, sizeof(*f));
    for (int j = 0; j < N_FIELDS; j++) {
        *slots[j] = PyDict_GetItemWithError(e, field_names[j]);
        if (!*slots[j] && PyErr_Occurred()) return -1;
    }
    return 0;
}

/* the action's A_* code (A_OTHER for any other hashable value), or -1 (unhashable; no error set);
 * exact strs are remembered by pointer in `c` (the unpickler shares each action's str too) */
static int action_code(PyObject *action, KeyCache *c) {
    int cache = PyUnicode_CheckExact(action);
    size_t h = ((uintptr_t)action >> 4) & (KEY_SLOTS - 1);
    if (cache)
        for (; c->key[h]; h = (h + 1) & (KEY_SLOTS - 1))
            if (c->key[h] == action) return c->field[h];
    PyObject *code = PyDict_GetItemWithError(action_codes, action);
    if (!code && PyErr_Occurred()) { PyErr_Clear(); return -1; }
    int ac = code ? (int)PyLong_AsLong(code) : A_OTHER;
    if (cache && 2 * (c->n + 1) <= KEY_SLOTS) { c->key[h] = Py_NewRef(action); c->field[h] = (int8_t)ac; c->n++; }
    return ac;
}

/* the first n Ops of a bytes object made by scan (all of them: exact) */
static const Op *ops_of(PyObject *ops, Py_ssize_t n, int exact) {
    Py_ssize_t have = PyBytes_Check(ops) ? PyBytes_GET_SIZE(ops) : -1;
    if (have < 0 || have % (Py_ssize_t)sizeof(Op) || n < 0 || n > have / (Py_ssize_t)sizeof(Op)
            || (exact && n != have / (Py_ssize_t)sizeof(Op))) {
        PyErr_SetString(PyExc_ValueError, "ops must be scan()'s bytes for this trace");
        return NULL;
    }
    const Op *o = (const Op *)(void *)PyBytes_AS_STRING(ops);
    for (Py_ssize_t i = 0; i < n; i++)
        if (o[i].action >= N_ACTIONS) { PyErr_SetString(PyExc_ValueError, "ops: not made by scan()"); return NULL; }
    return o;
}

/* scan(trace) -> None (an event that is not a dict, without a hashable action, or a segment_alloc
 * / segment_map without addr or size: the Python paths read such traces) or (ops, segment_allocs,
 * segment_maps, first_pool_id, rare): ops the Op array as bytes; segment_allocs / segment_maps the
 * (addr, size) of every segment_alloc / segment_map (engine.py's `recorded`, `recorded_maps`);
 * first_pool_id the index of the first event with a ``pool_id`` key, or None; rare the indices of
 * the events whose action is none of alloc, free_requested, free_completed, segment_alloc (the
 * only ones checks.py's verification has to read) */
static PyObject *scan(PyObject *self, PyObject *trace) {
    (void)self;
    PyObject *fast = PySequence_Fast(trace, "trace must be a sequence"), *bytes = NULL, *result = NULL;
    PyObject *segs[2] = {PyList_New(0), PyList_New(0)}, *rare = PyList_New(0);
    KeyCache keys, actions;  /* key -> field, action -> code */
    memset(&keys, 0, sizeof(keys));
    memset(&actions, 0, sizeof(actions));
    if (!fast || !segs[0] || !segs[1] || !rare) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), first_pool_id = -1;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    bytes = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(Op));
    if (!bytes) goto done;
    Op *ops = (Op *)(void *)PyBytes_AS_STRING(bytes);
    int refused = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = items[i];
        if (!PyDict_Check(e)) { refused = 1; break; }
        Fields f;
        if (read_fields(e, &f, &keys) < 0) goto done;
        if (!f.action) { refused = 1; break; }
        Op *op = &ops[i];
        int ac = action_code(f.action, &actions);
        if (ac < 0) { refused = 1; break; }  /* unhashable */
        memset(op, 0, sizeof(*op));  /* (padding too: the same trace gives the same bytes) */
        op->action = (uint8_t)ac;
        PyObject *addr_key = f.addr, *addr = addr_key ? addr_key : f.device_free, *size = f.size;
        if (addr_key) op->ok |= ADDR_KEY;
        if (!addr || as_u64(addr, EMPTY - 1, &op->addr)) op->ok |= OK_ADDR;
        else op->ok &= ~ADDR_KEY;
        if (size) {
            op->ok |= HAS_SIZE;
            if (as_u64(size, EMPTY - 1, &op->size)) op->ok |= op->size < ONE_EB ? SIZE_U64 | OK_SIZE : SIZE_U64;
        }
        if (!f.stream || as_u64(f.stream, STREAM_MAX, &op->stream)) op->ok |= OK_STREAM;
        if (first_pool_id < 0 && f.pool_id) first_pool_id = i;
        if (op->action > A_SEGMENT_ALLOC) {
            PyObject *ix = PyLong_FromSsize_t(i);
            int bad = !ix || PyList_Append(rare, ix) < 0;
            Py_XDECREF(ix);
            if (bad) goto done;
        }
        if (op->action == A_SEGMENT_ALLOC || op->action == A_SEGMENT_MAP) {
            if (!addr_key || !size) { refused = 1; break; }
            PyObject *t = PyTuple_Pack(2, addr_key, size);
            if (!t || PyList_Append(segs[op->action == A_SEGMENT_MAP], t) < 0) { Py_XDECREF(t); goto done; }
            Py_DECREF(t);
        }
    }
    if (PyErr_Occurred()) goto done;
    if (refused) { result = Py_NewRef(Py_None); goto done; }
    PyObject *fp = first_pool_id < 0 ? Py_NewRef(Py_None) : PyLong_FromSsize_t(first_pool_id);
    if (fp)
        result = PyTuple_Pack(5, bytes, segs[0], segs[1], fp, rare);
    Py_XDECREF(fp);
done:
    key_cache_clear(&keys);
    key_cache_clear(&actions);
    Py_XDECREF(fast); Py_XDECREF(bytes); Py_XDECREF(segs[0]); Py_XDECREF(segs[1]); Py_XDECREF(rare);
    return result;
}

/* the replay loop's refusals, in read order (engine.py replays these traces in Python) */
static const char *refusal(const Op *ops, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        const Op *op = &ops[i];
        int code = ENGINE_CODE[op->action];
        if (!(op->ok & HAS_SIZE)) return "an event without a size";
        if (code == 4) return "the trace has an oom event (replayed in Python)";
        if (code <= 2 && !(op->ok & OK_ADDR)) return "an address that is not an int in [0, 2**64-1)";
        if (code == 0 && !(op->ok & OK_SIZE)) return "an alloc size that is not an int in [0, 2**60)";
        if (code == 0 && !(op->ok & OK_STREAM)) return "a stream that is not an int in [0, 2**63)";
    }
    return NULL;
}

/* ------------------------------------------------------------------ state in and out */
/* every block (each is in `active` or in a pool), in no particular order; *n is their number */
static Block **all_blocks(Alloc *a, size_t *n) {
    size_t total = a->active.n;
    for (size_t k = 0; k < a->nstreams; k++) total += a->streams[k].pool[0].len + a->streams[k].pool[1].len;
    Block **out = PyMem_Malloc((total ? total : 1) * sizeof(Block *));
    if (!out) return NULL;
    *n = 0;
    if (a->active.keys)
        for (size_t i = 0; i < a->active.cap; i++)
            if (a->active.keys[i] != EMPTY) out[(*n)++] = (Block *)(uintptr_t)a->active.vals[i];
    for (size_t k = 0; k < a->nstreams; k++)
        for (int p = 0; p < 2; p++) {
            Set *s = &a->streams[k].pool[p];
            for (size_t c = 0; c < s->n; c++)
                for (int j = 0; j < s->chunks[c]->n; j++) out[(*n)++] = s->chunks[c]->vals[j];
        }
    return out;
}

static void alloc_clear(Alloc *a) {
    size_t n = 0;
    Block **blocks = all_blocks(a, &n);
    for (size_t i = 0; blocks && i < n; i++) block_del(blocks[i]);
    PyMem_Free(blocks);  /* (out of memory: the blocks leak, nothing worse) */
    for (size_t k = 0; k < a->nstreams; k++) { set_free(&a->streams[k].pool[0]); set_free(&a->streams[k].pool[1]); }
    PyMem_Free(a->streams);
    map_free(&a->active);
    map_free(&a->stream_ix);
}

/* blocks: (ptr, size, requested, stream, small, allocated, frames, segment_frames, seq, head) in
 * segment order, each segment's blocks in address order. 0 ok, 1 refused, -1 error. */
static int import_blocks(Alloc *a, PyObject *blocks, const char **why) {
    PyObject *fast = PySequence_Fast(blocks, "blocks must be a sequence");
    if (!fast) return -1;
    Block *prev = NULL;
    uint64_t maxseq = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(fast, i);
        uint64_t ptr, size, req, stream, seq;
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 10
                || !as_u64(PyTuple_GET_ITEM(t, 0), EMPTY - 1, &ptr) || !as_u64(PyTuple_GET_ITEM(t, 1), EMPTY - 1, &size)
                || !as_u64(PyTuple_GET_ITEM(t, 2), EMPTY - 1, &req)
                || !as_u64(PyTuple_GET_ITEM(t, 3), STREAM_MAX, &stream)
                || !as_u64(PyTuple_GET_ITEM(t, 8), EMPTY - 1, &seq)) {
            Py_DECREF(fast); *why = "a block outside the C core's integer ranges"; return 1;
        }
        Block *b = block_new(stream, size, PyObject_IsTrue(PyTuple_GET_ITEM(t, 4)), ptr);
        if (!b) { Py_DECREF(fast); PyErr_NoMemory(); return -1; }
        b->requested = req;
        b->allocated = PyObject_IsTrue(PyTuple_GET_ITEM(t, 5));
        b->seq = seq;
        if (seq >= maxseq) maxseq = seq + 1;
        PyObject *f = PyTuple_GET_ITEM(t, 6), *sf = PyTuple_GET_ITEM(t, 7);
        if (f != Py_None) { Py_INCREF(f); b->frames = f; }
        if (sf != Py_None) { Py_INCREF(sf); b->seg_frames = sf; }
        if (!PyObject_IsTrue(PyTuple_GET_ITEM(t, 9))) { b->prev = prev; prev->next = b; }
        prev = b;
        int err;
        if (b->allocated) {
            err = map_put(&a->active, ptr, (uint64_t)(uintptr_t)b);
        } else {
            Streams *s = streams_of(a, stream);
            err = s ? set_insert(&s->pool[b->small], key_of(b), b) : -1;
        }
        if (err < 0) { block_del(b); Py_DECREF(fast); PyErr_NoMemory(); return -1; }
    }
    Py_DECREF(fast);
    if (maxseq > a->seq) a->seq = maxseq;
    return 0;
}

static PyObject *block_tuple(const Block *b, int head) {
    return Py_BuildValue("(KKKKOOOOKO)", (unsigned long long)b->ptr, (unsigned long long)b->size,
                         (unsigned long long)b->requested, (unsigned long long)b->stream,
                         b->small ? Py_True : Py_False, b->allocated ? Py_True : Py_False,
                         b->frames ? b->frames : Py_None, b->seg_frames ? b->seg_frames : Py_None,
                         (unsigned long long)b->seq, head ? Py_True : Py_False);
}

static int cmp_block_ptr(const void *x, const void *y) {
    uint64_t p = (*(Block *const *)x)->ptr, q = (*(Block *const *)y)->ptr;
    return p < q ? -1 : p > q;
}

/* every block as import_blocks takes them, segments in address order */
static PyObject *export_blocks(Alloc *a) {
    size_t n = 0, heads = 0;
    Block **blocks = all_blocks(a, &n);
    if (!blocks) return PyErr_NoMemory();
    for (size_t i = 0; i < n; i++)
        if (!blocks[i]->prev) blocks[heads++] = blocks[i];
    qsort(blocks, heads, sizeof(Block *), cmp_block_ptr);
    PyObject *out = PyList_New(0);
    for (size_t h = 0; out && h < heads; h++)
        for (Block *b = blocks[h]; b; b = b->next) {
            PyObject *t = block_tuple(b, b == blocks[h]);
            if (!t || PyList_Append(out, t) < 0) { Py_XDECREF(t); Py_CLEAR(out); break; }
            Py_DECREF(t);
        }
    PyMem_Free(blocks);
    return out;
}

/* stats: 9 x 3 x (current, peak, allocated, freed), the two oversize stats, 6 counters, total */
#define N_STATS (N_ARRAY * 3 * 4 + 8 + N_COUNTERS + 1)

static i128 *stat_slot(Alloc *a, int k) {
    if (k < N_ARRAY * 12) { Stat *s = &a->arr[k / 12][(k / 4) % 3]; return &s->current + k % 4; }
    k -= N_ARRAY * 12;
    if (k < 8) { Stat *s = k < 4 ? &a->oversize_allocations : &a->oversize_segments; return &s->current + k % 4; }
    k -= 8;
    return k < N_COUNTERS ? &a->counters[k] : &a->total_allocated;
}

/* ------------------------------------------------------------------ the replay loop */
typedef struct { Py_ssize_t i; int kind; uint64_t expected, actual; } Note; /* kind 0 alloc address, 1 free */
#define MAX_NOTES 10

/* engine.py _run without cycle skipping, held-back frees or OOMs (refused: see the module doc).
 * run(ops, n, config, blocks, stats, live_at_start, dev_malloc, dev_free, verify, progress,
 *     timeline, track_peak) -> str (refused: the reason; nothing of the allocator was changed) or
 * (blocks, stats, reserved_peak_event, allocated_at_reserved_peak, largest_free_at_reserved_peak,
 *  allocs_total, allocs_matched, notes, timeline_allocated, timeline_reserved) */
static PyObject *run(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ops_obj, *config, *blocks, *stats, *live_obj, *dev_malloc, *dev_free, *progress;
    Py_ssize_t n;
    int verify, timeline, track_peak;
    if (!PyArg_ParseTuple(args, "OnO!OOOOOpOpp", &ops_obj, &n, &PyTuple_Type, &config,
                          &blocks, &stats, &live_obj, &dev_malloc, &dev_free, &verify, &progress,
                          &timeline, &track_peak))
        return NULL;
    const Op *ops = ops_of(ops_obj, n, 0);
    if (!ops) return NULL;
    Alloc a;
    memset(&a, 0, sizeof(a));
    const char *why = NULL;
    PyObject *result = NULL, *notes_list = NULL;
    Note notes[MAX_NOTES];
    int nnotes = 0;
    int64_t *tl_a = NULL, *tl_r = NULL;
    Py_ssize_t ntl = 0;
    Map ptr_of = {0}, live = {0};
    a.dev_malloc = dev_malloc; a.dev_free = dev_free;
    if (map_init(&a.active, 1024) < 0 || map_init(&a.stream_ix, 16) < 0 || map_init(&ptr_of, 1024) < 0
            || map_init(&live, 64) < 0) { PyErr_NoMemory(); goto done; }

    /* config: (divisions[16], max_split_size, max_non_split_rounding, large_segment_size, allowed max or None) */
    {
        PyObject *div = PyTuple_GET_SIZE(config) == 5 ? PyTuple_GET_ITEM(config, 0) : NULL;
        if (!div || !PyList_Check(div) || PyList_GET_SIZE(div) != 16) { why = "an unexpected config"; goto done; }
        for (int k = 0; k < 16; k++)
            if (!as_u64(PyList_GET_ITEM(div, k), 1ULL << 40, &a.divisions[k])) { why = "roundup_power2_divisions out of range"; goto done; }
        if (!as_u64(PyTuple_GET_ITEM(config, 1), EMPTY, &a.max_split) || !as_u64(PyTuple_GET_ITEM(config, 2), EMPTY, &a.max_non_split)
                || !as_u64(PyTuple_GET_ITEM(config, 3), EMPTY, &a.large_segment)) { why = "a config size out of range"; goto done; }
        PyObject *mx = PyTuple_GET_ITEM(config, 4);
        a.has_allowed_max = mx != Py_None;
        if (a.has_allowed_max && !as_u64(mx, EMPTY, &a.allowed_max)) { why = "a memory fraction cap out of range"; goto done; }
    }
    {   /* statistics */
        PyObject *sf = PySequence_Fast(stats, "stats must be a sequence");
        if (!sf) goto done;
        int ok = PySequence_Fast_GET_SIZE(sf) == N_STATS;
        for (int k = 0; ok && k < N_STATS; k++) ok = as_i128(PySequence_Fast_GET_ITEM(sf, k), stat_slot(&a, k));
        Py_DECREF(sf);
        if (!ok) { why = "a statistic outside int64"; goto done; }
    }
    {   /* live_at_start: recorded addresses of the blocks live when the trace begins */
        PyObject *it = PyObject_GetIter(live_obj), *x;
        if (!it) goto done;
        while ((x = PyIter_Next(it))) {
            uint64_t v;
            int ok = as_u64(x, EMPTY - 1, &v);
            Py_DECREF(x);
            if (!ok) { why = "a live block address outside [0, 2**64-1)"; break; }
            if (map_put(&live, v, 1) < 0) { PyErr_NoMemory(); break; }
        }
        Py_DECREF(it);
        if (why || PyErr_Occurred()) goto done;
    }
    if ((why = refusal(ops, n))) goto done;
    int r = import_blocks(&a, blocks, &why);
    if (r) goto done;
    if (timeline) {
        tl_a = PyMem_Malloc((n ? n : 1) * sizeof(int64_t));
        tl_r = PyMem_Malloc((n ? n : 1) * sizeof(int64_t));
        if (!tl_a || !tl_r) { PyErr_NoMemory(); goto done; }
    }

    Stat *reserved = &a.arr[RESERVED_BYTES][0], *allocated = &a.arr[ALLOCATED_BYTES][0];
    i128 best_reserved = reserved->current, steps = 0, peak_steps = 0;
    i128 at_peak_allocated = allocated->current, peak_event = -1;
    i128 largest = largest_free(&a, 0, 0, &steps);
    long long allocs_total = 0, allocs_matched = 0;
    int in_empty_cache = 0;
    Py_ssize_t next_progress = 0;
    for (Py_ssize_t i = 0; i < n;) {
        if (progress != Py_None && i >= next_progress) {
            PyObject *pr = PyObject_CallFunction(progress, "nn", i, n);
            if (!pr) goto done;
            Py_DECREF(pr);
            next_progress = i + 0x10000;
        }
        const Op *op = &ops[i];
        const int code = ENGINE_CODE[op->action];
        Py_ssize_t nxt = i + 1;
        if (code != 3) in_empty_cache = 0;
        if (code == 0) {  /* alloc */
            uint64_t p = 0;
            if (op->size && do_malloc(&a, op->size, op->stream, &p) < 0) goto done;
            if (map_put(&ptr_of, op->addr, p) < 0) { PyErr_NoMemory(); goto done; }
            if (verify) {
                allocs_total++;
                if (p == op->addr) allocs_matched++;
                else if (nnotes < MAX_NOTES) notes[nnotes++] = (Note){i, 0, op->addr, p};
            }
            if (reserved->current > best_reserved) {
                best_reserved = reserved->current;
                peak_event = i;
                at_peak_allocated = allocated->current;
                if (track_peak && largest >= 0) {
                    largest = largest_free(&a, 1, 4096 + 32 * (i128)i - peak_steps, &steps);
                    peak_steps += steps;
                }
            }
        } else if (code == 1) {  /* free_requested */
            uint64_t p, bp;
            int known = map_pop(&ptr_of, op->addr, &p);
            if (!known) {  /* not allocated in the trace: live at the start, or unknown */
                known = map_pop(&live, op->addr, NULL);
                p = op->addr;
            }
            Block *block = known && p && map_get(&a.active, p, &bp) ? (Block *)(uintptr_t)bp : NULL;
            if (!block) {  /* (`active` holds only allocated blocks here) */
                if (known && p && verify && nnotes < MAX_NOTES) notes[nnotes++] = (Note){i, 1, 0, 0};
            } else if (nxt < n && ENGINE_CODE[ops[nxt].action] == 2 && ops[nxt].addr == op->addr) {
                if (do_free(&a, block) < 0) goto done;  /* completes at once: the next event is its free_completed */
                nxt++;
            } else {
                why = "a free that completes later (held back with an event: replayed in Python)";
                goto done;
            }
        } else if (code == 2) {  /* free_completed */
            uint64_t bp;
            if (map_pop(&live, op->addr, NULL) && map_get(&a.active, op->addr, &bp))
                if (do_free(&a, (Block *)(uintptr_t)bp) < 0) goto done;
        } else if (code == 3) {  /* a run of segment_free / segment_unmap: one empty_cache() */
            if (!in_empty_cache) {
                if (release_cached_blocks(&a) < 0) goto done;
                in_empty_cache = 1;
            }
        }
        if (timeline) {
            if (allocated->current > INT64_MAX || reserved->current > INT64_MAX) { why = "a timeline value outside int64"; goto done; }
            for (Py_ssize_t k = i; k < nxt; k++) { tl_a[ntl] = (int64_t)allocated->current; tl_r[ntl++] = (int64_t)reserved->current; }
        }
        i = nxt;
    }
    notes_list = PyList_New(0);
    for (int k = 0; notes_list && k < nnotes; k++) {
        PyObject *t = Py_BuildValue("(niKK)", notes[k].i, notes[k].kind, (unsigned long long)notes[k].expected,
                                    (unsigned long long)notes[k].actual);
        if (!t || PyList_Append(notes_list, t) < 0) { Py_XDECREF(t); Py_CLEAR(notes_list); }
        else Py_DECREF(t);
    }
    PyObject *stats_out = PyList_New(N_STATS);
    for (int k = 0; stats_out && k < N_STATS; k++) {
        PyObject *v = from_i128(*stat_slot(&a, k));
        if (!v) { Py_CLEAR(stats_out); break; }
        PyList_SET_ITEM(stats_out, k, v);
    }
    PyObject *blocks_out = export_blocks(&a);
    PyObject *tla = timeline ? PyBytes_FromStringAndSize((char *)tl_a, ntl * 8) : Py_NewRef(Py_None);
    PyObject *tlr = timeline ? PyBytes_FromStringAndSize((char *)tl_r, ntl * 8) : Py_NewRef(Py_None);
    PyObject *pe = from_i128(peak_event), *pa = from_i128(at_peak_allocated), *lg = from_i128(largest);
    if (notes_list && stats_out && blocks_out && tla && tlr && pe && pa && lg)
        result = Py_BuildValue("(OOOOOLLOOO)", blocks_out, stats_out, pe, pa, lg, allocs_total, allocs_matched,
                               notes_list, tla, tlr);
    Py_XDECREF(stats_out); Py_XDECREF(blocks_out); Py_XDECREF(tla); Py_XDECREF(tlr);
    Py_XDECREF(pe); Py_XDECREF(pa); Py_XDECREF(lg);
done:
    if (!result && !PyErr_Occurred()) {
        if (!why) why = a.refused ? a.refused : "an internal error";
        result = PyUnicode_FromString(why);
    }
    Py_XDECREF(notes_list);
    PyMem_Free(tl_a); PyMem_Free(tl_r);
    map_free(&ptr_of); map_free(&live);
    alloc_clear(&a);
    return result;
}

/* ------------------------------------------------------------------ the rewind's event loop */
/* rewind.py's backward walk over the trace, for non-expandable segments: the same segments, live
 * blocks and bounds (`_Segment.live`, `.bound`) at the trace's first event. Anything else -- an
 * expandable run, a segment_map/unmap, a value outside 64 bits, an event that contradicts the
 * state (rewind.py raises TraceError) -- returns None and rewind.py walks the trace in Python. */
typedef struct RSeg {
    uint64_t address, total, nlive;
    Py_ssize_t index;            /* in the segments given, or -1: restored by a segment_free */
    Py_ssize_t event;            /* (index -1) the segment_free that restored it: its stream */
    uint64_t *unknown; size_t nunk, capunk;  /* sorted addresses of live blocks of unknown size */
    PyObject *live;              /* (the result) its live blocks, owned */
    struct RSeg *next_all;       /* every RSeg made, for freeing */
} RSeg;

/* size NULL: -1 (unknown); frames NULL: a new empty list; pending: state == rewind.py's PENDING;
 * event >= 0: restored by that free_completed, whose size is `requested` and frames `frames` */
typedef struct { PyObject *size, *requested, *frames, *state; int pending; RSeg *seg; Py_ssize_t event; } Live;

static PyObject *s_frames, *s_minus_one;
static PyObject *minus_one(void) { return s_minus_one; }

static size_t lower64(const uint64_t *a, size_t n, uint64_t k) {
    size_t lo = 0, hi = n;
    while (lo < hi) { size_t mid = (lo + hi) / 2; if (a[mid] < k) lo = mid + 1; else hi = mid; }
    return lo;
}

static Block *set_floor(const Set *s, u128 k) { /* the value of the largest key <= k, or NULL */
    if (!s->n) return NULL;
    size_t i = lower(s->maxes, s->n, k + 1);
    if (i == s->n) { const Chunk *c = s->chunks[s->n - 1]; return c->vals[c->n - 1]; }
    const Chunk *c = s->chunks[i];
    size_t j = lower(c->keys, c->n, k + 1);
    if (j) return c->vals[j - 1];
    if (i) { c = s->chunks[i - 1]; return c->vals[c->n - 1]; }
    return NULL;
}

/* the segment holding addr (the Set's values are RSeg pointers), or NULL */
static RSeg *rseg_at(const Set *starts, uint64_t addr) {
    RSeg *g = (RSeg *)(void *)set_floor(starts, addr);
    return g && addr - g->address < g->total ? g : NULL;
}

static void live_del(Live *l) {
    Py_XDECREF(l->size); Py_XDECREF(l->requested); Py_XDECREF(l->frames); Py_XDECREF(l->state);
    PyMem_Free(l);
}

static int unknown_add(RSeg *g, uint64_t addr) {
    if (g->nunk == g->capunk) {
        size_t cap = g->capunk ? 2 * g->capunk : 8;
        uint64_t *u = PyMem_Realloc(g->unknown, cap * sizeof(uint64_t));
        if (!u) return -1;
        g->unknown = u; g->capunk = cap;
    }
    size_t k = lower64(g->unknown, g->nunk, addr);
    memmove(g->unknown + k + 1, g->unknown + k, (g->nunk - k) * sizeof(uint64_t));
    g->unknown[k] = addr; g->nunk++;
    return 0;
}

/* rewind(segments, ops, trace, allocated, pending) -> None (walk it in Python) or
 * [(index, address, total_size, stream, live, bound)] in address order: index into `segments`
 * ((address, total_size, live dict) each) or -1 with the stream of the segment_free that restored it */
static PyObject *rewind_walk(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *segments, *ops_obj, *trace, *allocated, *pending;
    if (!PyArg_ParseTuple(args, "O!OO!OO", &PyList_Type, &segments, &ops_obj, &PyList_Type, &trace,
                          &allocated, &pending))
        return NULL;
    const Op *ops = ops_of(ops_obj, PyList_GET_SIZE(trace), 1);
    if (!ops) return NULL;
    Set starts = {0};
    Map live = {0}, bound = {0};
    RSeg *all = NULL;
    PyObject *result = NULL;
    int refused = 0;
    if (map_init(&live, 1024) < 0 || map_init(&bound, 64) < 0) { PyErr_NoMemory(); goto done; }
#define REFUSE do { refused = 1; goto done; } while (0)
#define NEWSEG(g) do { g = PyMem_Calloc(1, sizeof(RSeg)); if (!g) { PyErr_NoMemory(); goto done; } \
                       g->next_all = all; all = g; } while (0)
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(segments); k++) {
        PyObject *t = PyList_GET_ITEM(segments, k);
        RSeg *g;
        NEWSEG(g);
        g->index = k;
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 3 || !PyDict_Check(PyTuple_GET_ITEM(t, 2))
                || !as_u64(PyTuple_GET_ITEM(t, 0), EMPTY - 1, &g->address)
                || !as_u64(PyTuple_GET_ITEM(t, 1), EMPTY - 1 - g->address, &g->total))
            REFUSE;
        if (set_floor(&starts, g->address) && ((RSeg *)(void *)set_floor(&starts, g->address))->address == g->address)
            REFUSE;  /* two segments at one address */
        if (set_insert(&starts, g->address, (Block *)(void *)g) < 0) { PyErr_NoMemory(); goto done; }
        Py_ssize_t pos = 0;
        PyObject *key, *val;
        while (PyDict_Next(PyTuple_GET_ITEM(t, 2), &pos, &key, &val)) {
            uint64_t a, size;
            if (!as_u64(key, EMPTY - 1, &a) || a - g->address >= g->total || map_get(&live, a, NULL)
                    || !PyTuple_Check(val) || PyTuple_GET_SIZE(val) != 4
                    || !as_u64(PyTuple_GET_ITEM(val, 0), EMPTY - 1, &size))
                REFUSE;
            int eq = PyObject_RichCompareBool(PyTuple_GET_ITEM(val, 3), pending, Py_EQ);
            if (eq < 0) goto done;
            Live *l = PyMem_Calloc(1, sizeof(Live));
            if (!l || map_put(&live, a, (uint64_t)(uintptr_t)l) < 0) { PyMem_Free(l); PyErr_NoMemory(); goto done; }
            l->size = Py_NewRef(PyTuple_GET_ITEM(val, 0));
            l->requested = Py_NewRef(PyTuple_GET_ITEM(val, 1));
            l->frames = Py_NewRef(PyTuple_GET_ITEM(val, 2));
            l->state = Py_NewRef(PyTuple_GET_ITEM(val, 3));
            l->pending = eq;
            l->seg = g;
            l->event = -1;
            g->nlive++;
        }
    }
    {   /* the segments given must not overlap (then each address has one segment) */
        uint64_t end = 0;
        int first = 1;
        for (size_t c = 0; c < starts.n; c++)
            for (int j = 0; j < starts.chunks[c]->n; j++) {
                RSeg *g = (RSeg *)(void *)starts.chunks[c]->vals[j];
                if (!first && g->address < end) REFUSE;
                first = 0; end = g->address + g->total;
            }
    }
    PyObject **items = PySequence_Fast_ITEMS(trace);  /* (a list: the events of ops, by index) */
    /* as rewind.py _walk acts: 0 alloc, 1 free_completed, 2 free_requested, 3 segment_alloc,
     * 4 segment_free, 5 segment_map / unmap (walked in Python only), -1 ignored */
    static const int REWIND_CODE[N_ACTIONS] = {0, 2, 1, 3, 4, 5, 5, -1, -1};
    RSeg *last = NULL;  /* the segment found last (a block's events come in runs at one address) */
    for (Py_ssize_t i = PyList_GET_SIZE(trace) - 1; i >= 0; i--) {
        const Op *op = &ops[i];
        int code = REWIND_CODE[op->action];
        if (code < 0) continue;  /* an action it ignores */
        if (code >= 5) REFUSE;  /* segment_map / segment_unmap */
        if (!(op->ok & ADDR_KEY)) REFUSE;
        uint64_t addr = op->addr;
        if (code == 0) {  /* alloc: its block was not there before */
            RSeg *g = last && addr - last->address < last->total ? last : (last = rseg_at(&starts, addr));
            uint64_t lp;
            if (!g || !map_pop(&live, addr, &lp)) REFUSE;
            Live *l = (Live *)(uintptr_t)lp;
            g->nlive--;
            if (!l->size) {
                size_t k = lower64(g->unknown, g->nunk, addr);
                memmove(g->unknown + k, g->unknown + k + 1, (g->nunk - k - 1) * sizeof(uint64_t));
                g->nunk--;
                map_pop(&bound, addr, NULL);
            }
            live_del(l);
            size_t k = lower64(g->unknown, g->nunk, addr);  /* _bound_below */
            if (k) {
                uint64_t u = g->unknown[k - 1], b;
                if (!map_get(&bound, u, &b) || addr < b)
                    if (map_put(&bound, u, addr) < 0) { PyErr_NoMemory(); goto done; }
            }
        } else if (code == 1) {  /* free_completed: live before, size unknown, pending */
            RSeg *g = last && addr - last->address < last->total ? last : (last = rseg_at(&starts, addr));
            if (!g || map_get(&live, addr, NULL) || !(op->ok & HAS_SIZE)) REFUSE;
            Live *l = PyMem_Calloc(1, sizeof(Live));
            if (!l || unknown_add(g, addr) < 0 || map_put(&live, addr, (uint64_t)(uintptr_t)l) < 0) {
                PyMem_Free(l); PyErr_NoMemory(); goto done;
            }
            l->event = i;  /* its size and frames: read from the event if it lasts to the first one */
            l->state = Py_NewRef(pending);
            l->pending = 1;
            l->seg = g;
            g->nlive++;
        } else if (code == 2) {  /* free_requested: a pending block was allocated before it */
            uint64_t lp;
            Live *l = map_get(&live, addr, &lp) ? (Live *)(uintptr_t)lp : NULL;
            if (l && l->pending) { Py_SETREF(l->state, Py_NewRef(allocated)); l->pending = 0; }
        } else if (code == 3) {  /* segment_alloc: the segment did not exist before */
            RSeg *g = (RSeg *)(void *)set_floor(&starts, addr);
            if (!g || g->address != addr || g->nlive) REFUSE;
            set_remove(&starts, addr);
            last = NULL;
        } else {  /* segment_free: an empty segment existed before */
            uint64_t size = op->size;
            if (!(op->ok & SIZE_U64) || size > EMPTY - 1 - addr) REFUSE;
            RSeg *below = size ? (RSeg *)(void *)set_floor(&starts, addr + size - 1) : NULL;
            if (size == 0 || size % K_MIN_BLOCK_SIZE || (below && below->address + below->total > addr)
                    || rseg_at(&starts, addr))
                REFUSE;
            RSeg *g;
            NEWSEG(g);
            g->index = -1; g->address = addr; g->total = size; g->event = i;
            if (set_insert(&starts, addr, (Block *)(void *)g) < 0) { PyErr_NoMemory(); goto done; }
            last = NULL;
        }
    }
    for (size_t c = 0; c < starts.n; c++)  /* a live dict per segment, filled in one scan of the map */
        for (int j = 0; j < starts.chunks[c]->n; j++)
            if (!(((RSeg *)(void *)starts.chunks[c]->vals[j])->live = PyDict_New())) goto done;
    for (size_t s = 0; s < live.cap; s++) {
        if (live.keys[s] == EMPTY) continue;
        Live *l = (Live *)(uintptr_t)live.vals[s];
        if (l->event >= 0) {  /* a free_completed's size, and its frames if any */
            PyObject *e = items[l->event];
            PyObject *size = PyDict_GetItemWithError(e, s_size), *frames = size ? PyDict_GetItemWithError(e, s_frames) : NULL;
            if (!size) { if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "trace changed"); goto done; }
            if (!frames && PyErr_Occurred()) goto done;
            int truth = frames ? PyObject_IsTrue(frames) : 0;
            if (truth < 0) goto done;
            l->requested = Py_NewRef(size);
            l->frames = truth ? Py_NewRef(frames) : NULL;
            l->event = -1;
        }
        PyObject *k = PyLong_FromUnsignedLongLong(live.keys[s]);
        PyObject *fr = l->frames ? Py_NewRef(l->frames) : PyList_New(0);
        PyObject *v = k && fr ? PyTuple_Pack(4, l->size ? l->size : minus_one(), l->requested, fr, l->state) : NULL;
        int ok = v && PyDict_SetItem(l->seg->live, k, v) == 0;
        Py_XDECREF(k); Py_XDECREF(fr); Py_XDECREF(v);
        if (!ok) goto done;
    }
    PyObject *out = PyList_New(0);
    for (size_t c = 0; out && c < starts.n; c++)
        for (int j = 0; out && j < starts.chunks[c]->n; j++) {
            RSeg *g = (RSeg *)(void *)starts.chunks[c]->vals[j];
            PyObject *bd = PyDict_New(), *t = NULL, *stream = NULL;
            if (g->index < 0) {  /* the segment_free's stream (0 without one) */
                stream = PyDict_GetItemWithError(items[g->event], s_stream);
                stream = stream ? Py_NewRef(stream) : PyErr_Occurred() ? NULL : PyLong_FromLong(0);
            }
            int ok = bd != NULL && (g->index >= 0 || stream);
            for (size_t s = 0; ok && s < g->nunk; s++) {
                uint64_t b;
                if (!map_get(&bound, g->unknown[s], &b)) continue;
                PyObject *k = PyLong_FromUnsignedLongLong(g->unknown[s]), *v = PyLong_FromUnsignedLongLong(b);
                ok = k && v && PyDict_SetItem(bd, k, v) == 0;
                Py_XDECREF(k); Py_XDECREF(v);
            }
            if (ok) t = Py_BuildValue("(nKKOOO)", g->index, (unsigned long long)g->address,
                                      (unsigned long long)g->total, stream ? stream : Py_None, g->live, bd);
            if (!t || PyList_Append(out, t) < 0) Py_CLEAR(out);
            Py_XDECREF(t); Py_XDECREF(bd); Py_XDECREF(stream);
        }
    result = out;
#undef REFUSE
#undef NEWSEG
done:
    if (refused && !PyErr_Occurred()) { Py_CLEAR(result); result = Py_NewRef(Py_None); }
    if (live.keys)
        for (size_t s = 0; s < live.cap; s++)
            if (live.keys[s] != EMPTY) live_del((Live *)(uintptr_t)live.vals[s]);
    map_free(&live); map_free(&bound);
    set_free(&starts);
    while (all) { RSeg *g = all; all = g->next_all; Py_XDECREF(g->live); PyMem_Free(g->unknown); PyMem_Free(g); }
    return result;
}

/* ------------------------------------------------------------------ the loader's walk of a trace */
/* loader.py _Walker.entries' loop over one device's trace: every entry of the ordinary kind (a
 * dict with a short str action other than oom, int addr / size in [0, 2**64), stream in [0,
 * `streams`) or none, time_us none or in [0, 2**64)) is checked and normalised here; every other one,
 * a frames list not seen before and a dict referenced twice go back to the walker's Python, which
 * names the problem.
 * entries(trace, known_actions, unknown, frame_lists, clean_frames, frames_of, shared, entry, streams)
 * -> the normalised list, where unknown, frame_lists and clean_frames are the walker's, frames_of(frames,
 * k) is _Walker._entry_frames, shared(k) raises for a dict referenced twice and entry(e, k) is
 * _Walker.entry's result */
static PyObject *s_time_us, *s_oom, *s_zero, *s_one;

/* _Walker._entry_frames: the normalised form of an entry's frames list `fr` (a new reference).
 * lists / clean: the walker's _frame_lists (id -> normalised list) and _clean_frames (ids of frame
 * dicts already in normalised form); clean_c: the pointers of the frames found in `clean` so far in
 * this walk (it only grows, as `clean` does), so that most frames are looked up without making
 * their id(). A list not in `lists` whose frames are all clean is its own normalised form; it is
 * not added to `lists` (as the Python walk does), since a later lookup there that misses finds the
 * same: the list itself. Every other list goes to the Python `frames_of` (`_Walker._entry_frames`). */
static PyObject *entry_frames(PyObject *fr, PyObject *lists, PyObject *clean, Map *clean_c, PyObject *frames_of,
                              Py_ssize_t k) {
    PyObject *key = PyLong_FromVoidPtr(fr);
    PyObject *got = key ? PyDict_GetItemWithError(lists, key) : NULL;
    Py_XDECREF(key);
    if (got || PyErr_Occurred()) return got ? Py_NewRef(got) : NULL;
    int all_clean = PyList_CheckExact(fr);
    for (Py_ssize_t j = 0; all_clean && j < PyList_GET_SIZE(fr); j++) {
        PyObject *f = PyList_GET_ITEM(fr, j);
        if (map_get(clean_c, (uint64_t)(uintptr_t)f, NULL)) continue;
        PyObject *fk = PyLong_FromVoidPtr(f);
        int c = fk ? PySet_Contains(clean, fk) : -1;
        Py_XDECREF(fk);
        if (c < 0) return NULL;
        if (!c) all_clean = 0;
        else if (map_put(clean_c, (uint64_t)(uintptr_t)f, 1) < 0) return PyErr_NoMemory();
    }
    return all_clean ? Py_NewRef(fr) : PyObject_CallFunction(frames_of, "On", fr, k);
}

static PyObject *walk_entries(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *trace, *known, *unknown, *lists_py, *clean, *frames_of, *shared, *entry;
    unsigned long long streams;
    if (!PyArg_ParseTuple(args, "O!OO!O!O!OOOK", &PyList_Type, &trace, &known, &PyDict_Type, &unknown,
                          &PyDict_Type, &lists_py, &PySet_Type, &clean, &frames_of, &shared, &entry, &streams)
            || !streams)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(trace);
    PyObject *out = PyList_New(n), *result = NULL;
    Map lists = {0}, clean_c = {0};  /* frames list -> its normalised form (a new reference), for this walk */
    if (!out || map_init(&lists, 256) < 0 || map_init(&clean_c, 256) < 0) { if (out) PyErr_NoMemory(); goto done; }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (k >= PyList_GET_SIZE(trace)) { PyErr_SetString(PyExc_RuntimeError, "the trace changed"); goto done; }
        PyObject *e = PyList_GET_ITEM(trace, k), *got = NULL;
        if (Py_REFCNT(e) > 1) {  /* (only the list holds an unshared entry) */
            PyObject *r = PyObject_CallFunction(shared, "n", k);
            if (!r) goto done;
            Py_DECREF(r);
        }
        Py_INCREF(e);
        if (PyDict_CheckExact(e)) {
            PyObject *action = PyDict_GetItemWithError(e, s_action), *addr = NULL, *size = NULL, *stream = NULL;
            PyObject *t = NULL, *fr = NULL;
            uint64_t v;
            if (action) addr = PyDict_GetItemWithError(e, s_addr);
            if (addr) size = PyDict_GetItemWithError(e, s_size);
            if (size) stream = PyDict_GetItemWithError(e, s_stream);
            if (size && !PyErr_Occurred()) t = PyDict_GetItemWithError(e, s_time_us);
            if (size && !PyErr_Occurred()) fr = PyDict_GetItemWithError(e, s_frames);
            if (PyErr_Occurred()) { Py_DECREF(e); goto done; }
            int ok = action && size && PyUnicode_CheckExact(action) && PyUnicode_GET_LENGTH(action) > 0
                && PyUnicode_GET_LENGTH(action) <= 64 && PyUnicode_Compare(action, s_oom) != 0
                && as_u64(addr, UINT64_MAX, &v) && as_u64(size, UINT64_MAX, &v)
                && (!stream || as_u64(stream, streams - 1, &v))
                && (!t || t == Py_None || as_u64(t, UINT64_MAX, &v));
            if (PyErr_Occurred()) { Py_DECREF(e); goto done; }
            if (ok) {
                int is_known = PySet_Contains(known, action);
                if (is_known < 0) { Py_DECREF(e); goto done; }
                if (!is_known) {
                    PyObject *c = PyDict_GetItemWithError(unknown, action);
                    PyObject *c1 = c ? PyNumber_Add(c, s_one) : PyErr_Occurred() ? NULL : Py_NewRef(s_one);
                    if (!c1 || PyDict_SetItem(unknown, action, c1) < 0) { Py_XDECREF(c1); Py_DECREF(e); goto done; }
                    Py_DECREF(c1);
                }
                PyObject *frames;  /* borrowed */
                uint64_t fp;
                if (!fr || fr == Py_None) frames = NULL;  /* a new empty list */
                else if (map_get(&lists, (uint64_t)(uintptr_t)fr, &fp)) frames = (PyObject *)(uintptr_t)fp;
                else {
                    frames = entry_frames(fr, lists_py, clean, &clean_c, frames_of, k);
                    if (!frames || map_put(&lists, (uint64_t)(uintptr_t)fr, (uint64_t)(uintptr_t)frames) < 0) {
                        if (frames) { Py_DECREF(frames); PyErr_NoMemory(); }
                        Py_DECREF(e); goto done;
                    }
                }
                if (PyDict_GET_SIZE(e) == 6 && frames && frames == fr && stream && t) got = Py_NewRef(e);
                else {
                    int has_pool = PyDict_Contains(e, s_pool_id);
                    if (has_pool < 0) { Py_DECREF(e); goto done; }
                    if (!has_pool) {  /* its normalised form, keys in the walker's order */
                        PyObject *fl = frames ? Py_NewRef(frames) : PyList_New(0);
                        got = fl ? PyDict_New() : NULL;
                        if (!got || PyDict_SetItem(got, s_action, action) < 0 || PyDict_SetItem(got, s_addr, addr) < 0
                                || PyDict_SetItem(got, s_size, size) < 0
                                || PyDict_SetItem(got, s_stream, stream ? stream : s_zero) < 0
                                || PyDict_SetItem(got, s_time_us, t ? t : Py_None) < 0
                                || PyDict_SetItem(got, s_frames, fl) < 0) {
                            Py_XDECREF(fl); Py_XDECREF(got); Py_DECREF(e); goto done;
                        }
                        Py_DECREF(fl);
                    }
                }
            }
        }
        if (!got) got = PyObject_CallFunction(entry, "On", e, k);
        Py_DECREF(e);
        if (!got) goto done;
        PyList_SET_ITEM(out, k, got);
    }
    result = Py_NewRef(out);
done:
    Py_XDECREF(out);
    if (lists.keys)
        for (size_t i = 0; i < lists.cap; i++)
            if (lists.keys[i] != EMPTY) Py_DECREF((PyObject *)(uintptr_t)lists.vals[i]);
    map_free(&lists); map_free(&clean_c);
    return result;
}

/* ------------------------------------------------------------------ pickle keys (pickle_keys.py scan_python)
 * pickle_keys(data) -> (verdict, offset, kind): the walk of vram/replay/pickle_keys.py scan_python, opcode
 * for opcode (the rules per opcode are Modules/_pickle.c's load_*): every stack item and memo entry is
 * only its kind, and a dict key or set member of any kind but PK_KEY is refused where it would be
 * hashed. Work and memory are linear in the file: one pass, a byte per stack item and memo entry. */
enum { PK_OK = 0, PK_REFUSED = 1, PK_UNMODELLED = 2 };
enum { PK_KEY = 0, PK_TUPLE, PK_FLOAT, PK_BIG_INT, PK_LONG_STR, PK_LONG_BYTES, PK_FROZENSET, PK_LIST, PK_DICT,
       PK_SET, PK_BYTEARRAY };
#define PK_MAX_KEY_CHARS 256  /* pickle_keys.MAX_KEY_CHARS */
#if defined(__GNUC__)
#define PK_LIKELY(x) __builtin_expect(!!(x), 1)
#define PK_UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define PK_LIKELY(x) (x)
#define PK_UNLIKELY(x) (x)
#endif
#define PK_HASH_MODULUS ((1LL << 61) - 1)

static int pk_grow(Py_ssize_t **v, size_t *cap, size_t need) {
    if (need <= *cap) return 0;
    size_t cap2 = *cap ? *cap * 2 : 64;
    while (cap2 < need) cap2 *= 2;
    Py_ssize_t *p = PyMem_Realloc(*v, cap2 * sizeof(Py_ssize_t));
    if (!p) { PyErr_NoMemory(); return -1; }
    *v = p; *cap = cap2;
    return 0;
}

static uint64_t pk_le(const unsigned char *p, int width) {
    uint64_t x = 0;
    for (int i = 0; i < width; i++) x |= (uint64_t)p[i] << (8 * i);
    return x;
}

/* UTF-8 as CPython decodes it with "surrogatepass" (surrogates allowed): the number of characters, or
 * -1 where the decoder would fail. */
static Py_ssize_t pk_utf8_chars(const unsigned char *s, size_t n) {
    Py_ssize_t chars = 0;
    size_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
        size_t len;
        uint32_t cp, min;
        if (c < 0x80) { i++; chars++; continue; }
        if (c >= 0xC2 && c <= 0xDF) { len = 2; cp = c & 0x1F; min = 0x80; }
        else if (c >= 0xE0 && c <= 0xEF) { len = 3; cp = c & 0x0F; min = 0x800; }
        else if (c >= 0xF0 && c <= 0xF4) { len = 4; cp = c & 0x07; min = 0x10000; }
        else return -1;
        if (i + len > n) return -1;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return -1;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF) return -1;
        i += len; chars++;
    }
    return chars;
}

/* The kind a length-prefixed opcode pushes for its `n` argument bytes at `p`; -1 where the C unpickler fails. */
static int pk_sized(unsigned char op, const unsigned char *p, size_t n) {
    switch (op) {
    case 0x8C: case 0x58: case 0x8D: {  /* SHORT_BINUNICODE, BINUNICODE, BINUNICODE8 */
        Py_ssize_t chars = pk_utf8_chars(p, n);
        if (chars < 0) return -1;
        return chars <= PK_MAX_KEY_CHARS ? PK_KEY : PK_LONG_STR;
    }
    case 0x55: case 0x54:  /* SHORT_BINSTRING, BINSTRING: ASCII */
        for (size_t i = 0; i < n; i++) if (p[i] >= 0x80) return -1;
        return n <= PK_MAX_KEY_CHARS ? PK_KEY : PK_LONG_STR;
    case 0x43: case 0x42: case 0x8E: return n <= PK_MAX_KEY_CHARS ? PK_KEY : PK_LONG_BYTES;
    case 0x96: return PK_BYTEARRAY;
    default: {  /* LONG1, LONG4: little-endian two's complement */
        if (n == 0) return PK_KEY;
        int negative = p[n - 1] >= 0x80;
        if (n > 8) {  /* fits 64 bits only if the rest is sign extension */
            for (size_t i = 8; i < n; i++) if (p[i] != (negative ? 0xFF : 0x00)) return PK_BIG_INT;
            if ((p[7] >= 0x80) != negative) return PK_BIG_INT;
        }
        size_t w = n < 8 ? n : 8;
        uint64_t u = pk_le(p, (int)w);
        if (negative && w < 8) u |= ~0ULL << (8 * w);
        int64_t v = (int64_t)u;
        return (v > -PK_HASH_MODULUS && v < PK_HASH_MODULUS) ? PK_KEY : PK_BIG_INT;
    }
    }
}

static PyObject *pickle_keys(PyObject *self, PyObject *arg) {
    Py_buffer buf;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *d = buf.buf;
    size_t n = (size_t)buf.len, pos = 0, at = 0;
    /* Each item pushed takes an opcode byte and each memo index is at most n (larger: unmodelled),
     * so both fit in n + 1 bytes; memo: kind + 1 per index, 0 for none. */
    unsigned char *stack = PyMem_Malloc(n + 1), *memo = PyMem_Calloc(n + 1, 1);
    Py_ssize_t *marks = NULL;
    size_t sp = 0, nmarks = 0, marks_cap = 0, memo_len = 0, fence = 0;
    int verdict = PK_UNMODELLED, kind = PK_KEY, failed = 0;
    if (!stack || !memo) { PyErr_NoMemory(); failed = 1; goto out; }
    while (pos < n) {
        at = pos;
        unsigned char op = d[pos++];
        /* BINGET and LONG_BINGET are most of a snapshot's opcodes (shared strs and frames): tested
         * first, outside the switch, whose one indirect jump mispredicts on their mix */
        if ((op | 2) == 0x6A) {  /* without a branch on which of the two it is */
            size_t long_get = op == 0x6A, width = 1 + 3 * long_get, idx;
            if (PK_LIKELY(pos + 4 <= n)) {
                uint32_t word;
                memcpy(&word, d + pos, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
                word = __builtin_bswap32(word);
#endif
                idx = word & (long_get ? 0xFFFFFFFFu : 0xFFu);
            } else if (pos + width <= n) idx = (size_t)pk_le(d + pos, (int)width);
            else goto out;
            pos += width;
            unsigned char got = PK_LIKELY(idx <= n) ? memo[idx] : 0;
            if (PK_UNLIKELY(!got)) goto out;
            stack[sp++] = got - 1;
            continue;
        }
        switch (op) {
        case 0x71: case 0x72: {  /* BINPUT, LONG_BINPUT */
            int width = op == 0x71 ? 1 : 4;
            if (pos + width > n) goto out;
            uint64_t idx = pk_le(d + pos, width);
            pos += width;
            if (sp <= fence || idx > n) goto out;
            if (!memo[idx]) memo_len++;
            memo[idx] = stack[sp - 1] + 1;
            break;
        }
        case 0x94:  /* MEMOIZE: at the count of entries stored (memo_len) */
            if (sp <= fence || memo_len > n) goto out;
            if (!memo[memo_len]) { memo[memo_len] = stack[sp - 1] + 1; memo_len++; }
            else memo[memo_len] = stack[sp - 1] + 1;
            break;
        case 0x4E: case 0x88: case 0x89: stack[sp++] = PK_KEY; break;  /* NONE, NEWTRUE, NEWFALSE */
        case 0x5D: stack[sp++] = PK_LIST; break;
        case 0x7D: stack[sp++] = PK_DICT; break;
        case 0x29: stack[sp++] = PK_TUPLE; break;
        case 0x8F: stack[sp++] = PK_SET; break;
        case 0x4B: pos += 1; stack[sp++] = PK_KEY; break;  /* BININT1 */
        case 0x4D: pos += 2; stack[sp++] = PK_KEY; break;  /* BININT2 */
        case 0x4A: pos += 4; stack[sp++] = PK_KEY; break;  /* BININT */
        case 0x47: pos += 8; stack[sp++] = PK_FLOAT; break;  /* BINFLOAT */
        case 0x8C: case 0x55: case 0x43: case 0x8A: case 0x58: case 0x54: case 0x42: case 0x8B:
        case 0x8D: case 0x8E: case 0x96: {
            int width = (op == 0x8C || op == 0x55 || op == 0x43 || op == 0x8A) ? 1
                      : (op == 0x58 || op == 0x54 || op == 0x42 || op == 0x8B) ? 4 : 8;
            if (pos + width > n) goto out;
            uint64_t size = pk_le(d + pos, width);
            pos += width;
            if ((op == 0x54 || op == 0x8B) && (size & 0x80000000ULL)) goto out;  /* a negative count */
            if (size > n - pos) goto out;
            int k = pk_sized(op, d + pos, (size_t)size);
            if (k < 0) goto out;
            pos += (size_t)size;
            stack[sp++] = (unsigned char)k;
            break;
        }
        case 0x28:  /* MARK */
            if (pk_grow(&marks, &marks_cap, nmarks + 1) < 0) { failed = 1; goto out; }
            marks[nmarks++] = (Py_ssize_t)sp;
            fence = sp;
            break;
        case 0x2E: verdict = PK_OK; goto out;  /* STOP */
        case 0x32:  /* DUP */
            if (sp <= fence) goto out;
            stack[sp] = stack[sp - 1];
            sp++;
            break;
        case 0x30:  /* POP: the mark, if nothing was pushed since it */
            if (nmarks && (size_t)marks[nmarks - 1] == sp) {
                nmarks--;
                fence = nmarks ? (size_t)marks[nmarks - 1] : 0;
            } else if (sp <= fence) goto out;
            else sp--;
            break;
        case 0x85: case 0x86: case 0x87: {  /* TUPLE1..3 */
            size_t count = op - 0x84;
            if (sp < count || sp - count < fence) goto out;
            sp -= count;
            stack[sp++] = PK_TUPLE;
            break;
        }
        case 0x61: case 0x73: {  /* APPEND, SETITEM */
            size_t back = op == 0x61 ? 1 : 2;
            if (sp < back + 1 || sp - back <= fence) goto out;
            size_t x = sp - back;
            if (stack[x - 1] != (op == 0x61 ? PK_LIST : PK_DICT)) goto out;  /* followed on lists and dicts only */
            if (op == 0x73 && stack[x] != PK_KEY) { verdict = PK_REFUSED; kind = stack[x]; goto out; }
            sp = x;
            break;
        }
        case 0x31: case 0x74: case 0x6C: case 0x64: case 0x91: case 0x65: case 0x75: case 0x90: {
            if (!nmarks) goto out;  /* POP_MARK, TUPLE, LIST, DICT, FROZENSET, APPENDS, SETITEMS, ADDITEMS */
            size_t mark = (size_t)marks[--nmarks], count = sp - mark;
            fence = nmarks ? (size_t)marks[nmarks - 1] : 0;
            if (op == 0x65 || op == 0x75 || op == 0x90) {  /* the target below the mark: a list, dict, set */
                unsigned char target = op == 0x65 ? PK_LIST : op == 0x75 ? PK_DICT : PK_SET;
                if (mark <= fence || (count && (stack[mark - 1] != target || (op == 0x75 && count % 2)))) goto out;
            } else if (op == 0x64 && count % 2) goto out;
            if (op == 0x64 || op == 0x75 || op == 0x91 || op == 0x90) {
                size_t step = (op == 0x64 || op == 0x75) ? 2 : 1;
                for (size_t i = mark; i < sp; i += step)
                    if (stack[i] != PK_KEY) { verdict = PK_REFUSED; kind = stack[i]; goto out; }
            }
            sp = mark;
            if (op == 0x74) stack[sp++] = PK_TUPLE;
            else if (op == 0x6C) stack[sp++] = PK_LIST;
            else if (op == 0x64) stack[sp++] = PK_DICT;
            else if (op == 0x91) stack[sp++] = PK_FROZENSET;
            break;
        }
        case 0x80:  /* PROTO */
            if (pos >= n || d[pos] > 5) goto out;
            pos++;
            break;
        case 0x95: pos += 8; break;  /* FRAME: its bytes are the opcodes that follow */
        default: goto out;  /* text opcodes, calls and objects, buffers, extensions, persistent ids, unknown */
        }
    }
out:
    PyMem_Free(stack); PyMem_Free(memo); PyMem_Free(marks);
    PyBuffer_Release(&buf);
    if (failed) return NULL;
    if (verdict == PK_UNMODELLED) at = pos < n ? pos : n;
    return Py_BuildValue("(inn)", verdict, (Py_ssize_t)at, (Py_ssize_t)kind);
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_O, "Read every event of a trace once, for rewind and run (see vram.replay.ccore)."},
    {"entries", walk_entries, METH_VARARGS, "Check and normalise a trace's entries (see vram.replay.loader)."},
    {"run", run, METH_VARARGS, "Replay a trace's events through the caching allocator (see vram.replay.ccore)."},
    {"pickle_keys", pickle_keys, METH_O, "Check a pickle's dict keys and set members on its opcodes (see vram.replay.pickle_keys)."},
    {"rewind", rewind_walk, METH_VARARGS, "Walk a trace backwards from the final segments (see vram.replay.rewind)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ccore", "The replay engine's event loop in C.", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__ccore(void) {
    if (!(s_action = PyUnicode_InternFromString("action")) || !(s_addr = PyUnicode_InternFromString("addr"))
            || !(s_device_free = PyUnicode_InternFromString("device_free"))
            || !(s_size = PyUnicode_InternFromString("size")) || !(s_stream = PyUnicode_InternFromString("stream"))
            || !(s_frames = PyUnicode_InternFromString("frames")) || !(s_minus_one = PyLong_FromLong(-1))
            || !(s_pool_id = PyUnicode_InternFromString("pool_id")) || !(action_codes = PyDict_New())
            || !(s_time_us = PyUnicode_InternFromString("time_us")) || !(s_oom = PyUnicode_InternFromString("oom"))
            || !(s_zero = PyLong_FromLong(0)) || !(s_one = PyLong_FromLong(1)))
        return NULL;
    PyObject *const fields[N_FIELDS] = {s_action, s_addr, s_device_free, s_size, s_stream, s_pool_id};
    memcpy(field_names, fields, sizeof(fields));
    for (int k = 0; k < A_OTHER; k++) {
        PyObject *name = PyUnicode_InternFromString(ACTION_NAMES[k]), *code = PyLong_FromLong(k);
        int bad = !name || !code || PyDict_SetItem(action_codes, name, code) < 0;
        Py_XDECREF(name); Py_XDECREF(code);
        if (bad) return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "N_STATS", N_STATS) < 0
              || PyModule_AddStringConstant(m, "SOURCE_SHA256", CCORE_SOURCE_SHA256) < 0)) Py_CLEAR(m);
    return m;
}
