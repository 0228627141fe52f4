// Replays an op stream through allocatorSim's C++ core (github.com/Lin-Mao/allocatorSim), for
// benchmarks/bench_replay.py and bench_allocator.py, which build this file against a checkout
// (ALLOCATORSIM_SRC) and write the stream (op_stream.h: its format, and the optional START).
// Prints {"ops", "seconds", "seconds_after", "peak_allocated", "peak_reserved"}: the timed part is
// the loop only.
#include "allocator_simulator.h"
#include "op_stream.h"

using c10::cuda::AllocatorSim::allocatorSim;
using c10::cuda::AllocatorSim::Block;

int main(int argc, char** argv) {
    allocatorSim sim;
    Timed t;
    int rc = replay_ops<Block>(
        argc, argv, [&](size_t size, int64_t stream) { return sim.malloc(0, size, static_cast<int>(stream)); },
        [&](Block* b) { sim.free(b); }, &t);
    if (rc) return rc;
    auto peak = sim.get_max_memory_usage();
    printf("{\"ops\": %zu, \"seconds\": %.6f, \"seconds_after\": %.6f, \"peak_allocated\": %zu, "
           "\"peak_reserved\": %zu}\n", t.ops, t.seconds, t.seconds_after, peak.first, peak.second);
    return 0;
}
