"""Layer 4, replay of recorded snapshots: `loader` (safe reading of untrusted files), `rewind` (the
state at a trace's first event), `state` (importing a segment layout), `cycles` (exact skipping of
repeated periods) and `engine` (replay, what-if configs, verification)."""
