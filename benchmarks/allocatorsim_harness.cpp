// Replays an op stream through allocatorSim's C++ core (github.com/Lin-Mao/allocatorSim), for
// benchmarks/bench_replay.py, which builds this file against a checkout (ALLOCATORSIM_SRC) and
// writes the stream: little-endian int64 quadruples (0, id, size, stream) for a malloc and
// (1, id, 0, 0) for the free of the block that malloc `id` returned.
// Prints {"ops", "seconds", "peak_allocated", "peak_reserved"}: the timed part is the loop only.
#include "allocator_simulator.h"

#include <chrono>
#include <cstdio>
#include <unordered_map>
#include <vector>

using c10::cuda::AllocatorSim::allocatorSim;
using c10::cuda::AllocatorSim::Block;

int main(int argc, char** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s OPS_FILE\n", argv[0]);
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
    allocatorSim sim;
    std::unordered_map<int64_t, Block*> live;
    live.reserve(n);
    auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < n; i++) {
        const int64_t* op = &ops[4 * i];
        if (op[0] == 0) {
            live[op[1]] = sim.malloc(0, static_cast<size_t>(op[2]), static_cast<int>(op[3]));
        } else {
            auto it = live.find(op[1]);
            sim.free(it->second);
            live.erase(it);
        }
    }
    auto t1 = std::chrono::steady_clock::now();
    auto peak = sim.get_max_memory_usage();
    printf("{\"ops\": %zu, \"seconds\": %.6f, \"peak_allocated\": %zu, \"peak_reserved\": %zu}\n", n,
           std::chrono::duration<double>(t1 - t0).count(), peak.first, peak.second);
    return 0;
}
