//! Small shared helpers: the binary's caching allocator, atomic file writes, a seeded RNG, progress bars, JSONL reading, PNG plots.
pub mod alloc;
pub mod fs;
pub mod interrupt;
pub mod plot;
pub mod prof;
pub mod progress;
pub mod rng;
