// The op-stream loop of allocatorsim_harness.cpp and bfc_harness.cpp: reads OPS_FILE (little-endian
// int64 quadruples: (0, id, size, stream) a malloc, (1, id, 0, 0) the free of the block malloc `id`
// returned) and replays it through malloc_fn / free_fn, timing the loop and, from op index START
// (the optional second argument) on, that part apart. 0 done, else the exit status.
#pragma once
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <unordered_map>
#include <vector>

struct Timed {
    size_t ops;
    double seconds, seconds_after;
};

template <class Block, class Malloc, class Free>
int replay_ops(int argc, char** argv, Malloc malloc_fn, Free free_fn, Timed* out) {
    if (argc != 2 && argc != 3) {
        fprintf(stderr, "usage: %s OPS_FILE [START]\n", argv[0]);
        return 2;
    }
    FILE* f = fopen(argv[1], "rb");
    if (f == nullptr) {
        perror(argv[1]);
        return 1;
    }
    std::vector<int64_t> ops;
    int64_t quad[4];
    while (fread(quad, sizeof(int64_t), 4, f) == 4) ops.insert(ops.end(), quad, quad + 4);
    fclose(f);
    const size_t n = ops.size() / 4;
    const size_t start = argc == 3 ? strtoull(argv[2], nullptr, 10) : n;
    std::unordered_map<int64_t, Block*> live;
    live.reserve(n);
    auto t0 = std::chrono::steady_clock::now(), ts = t0;
    for (size_t i = 0; i < n; i++) {
        if (i == start) ts = std::chrono::steady_clock::now();
        const int64_t* op = &ops[4 * i];
        if (op[0] == 0) {
            live[op[1]] = malloc_fn(static_cast<size_t>(op[2]), op[3]);
        } else {
            auto it = live.find(op[1]);
            free_fn(it->second);
            live.erase(it);
        }
    }
    auto t1 = std::chrono::steady_clock::now();
    if (start >= n) ts = t1;
    *out = Timed{n, std::chrono::duration<double>(t1 - t0).count(), std::chrono::duration<double>(t1 - ts).count()};
    return 0;
}
