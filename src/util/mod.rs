//! Small shared helpers: the binary's caching allocator, atomic file writes, run-directory locks, a seeded RNG, progress bars, JSONL reading, PNG plots, SHA-256.
pub mod alloc;
pub mod awake;
pub mod fs;
pub mod interrupt;
pub mod lock;
pub mod plot;
pub mod prof;
pub mod progress;
pub mod rng;
pub mod sha256;
