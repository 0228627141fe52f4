// A plain best-fit-with-coalescing loop, the core of PyTorch's DeviceCachingAllocator for the large
// pool and nothing else (c10/cuda/CUDACachingAllocator.cpp: a std::set of Block* ordered by
// (stream, size, ptr), best fit by lower_bound, split when more than kSmallSize would remain,
// merge with free neighbours on free; 20 MiB segments below 10 MiB, else rounded to 2 MiB): the
// yardstick benchmarks/bench_allocator.py compares vram's C loop with on its scaling stream. No
// statistics, no small pool, no rounding beyond 512 bytes, no device. Same op stream (op_stream.h)
// and output as allocatorsim_harness.cpp. Built with g++ -O2 by bench_allocator.py.
#include <cstdint>
#include <cstdio>
#include <set>

#include "op_stream.h"

struct Block {
    int64_t stream;
    size_t size, ptr;
    Block *prev = nullptr, *next = nullptr;
    bool allocated = false;
};

struct BySize {
    bool operator()(const Block* a, const Block* b) const {
        if (a->stream != b->stream) return a->stream < b->stream;
        if (a->size != b->size) return a->size < b->size;
        return a->ptr < b->ptr;
    }
};

static std::set<Block*, BySize> pool;
static size_t next_address = size_t{1} << 40;
constexpr size_t kSmallSize = size_t{1} << 20, kMinLargeAlloc = size_t{10} << 20, kRoundLarge = size_t{2} << 20;

static Block* do_malloc(size_t request, int64_t stream) {
    size_t size = request < 512 ? 512 : (request + 511) / 512 * 512;
    Block key{stream, size, 0};
    auto it = pool.lower_bound(&key);
    Block* b;
    if (it != pool.end() && (*it)->stream == stream) {
        b = *it;
        pool.erase(it);
    } else {
        size_t segment = size < kMinLargeAlloc ? size_t{20} << 20 : (size + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
        b = new Block{stream, segment, next_address};
        next_address += segment;
    }
    if (b->size - size > kSmallSize) {  // split: the rest stays cached
        Block* rest = b;
        b = new Block{stream, size, rest->ptr};
        b->prev = rest->prev;
        if (b->prev) b->prev->next = b;
        b->next = rest;
        rest->prev = b;
        rest->ptr += size;
        rest->size -= size;
        pool.insert(rest);
    }
    b->allocated = true;
    return b;
}

static void merge(Block* dst, Block* src) {
    if (!src || src->allocated) return;
    if (dst->prev == src) {
        dst->ptr = src->ptr;
        dst->prev = src->prev;
        if (dst->prev) dst->prev->next = dst;
    } else {
        dst->next = src->next;
        if (dst->next) dst->next->prev = dst;
    }
    dst->size += src->size;
    pool.erase(src);
    delete src;
}

static void do_free(Block* b) {
    b->allocated = false;
    merge(b, b->prev);
    merge(b, b->next);
    pool.insert(b);
}

int main(int argc, char** argv) {
    Timed t;
    int rc = replay_ops<Block>(argc, argv, do_malloc, do_free, &t);
    if (rc) return rc;
    printf("{\"ops\": %zu, \"seconds\": %.6f, \"seconds_after\": %.6f, \"cached\": %zu}\n", t.ops, t.seconds,
           t.seconds_after, pool.size());
    return 0;
}
