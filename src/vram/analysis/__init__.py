"""Answers on top of replay: why a run ran out of memory (`explain`), which allocator settings
fit best (`tune`), and many replays in parallel (`fleet`). Everything here is measured by
replaying recordings through the allocator (`vram.replay`), never estimated."""
