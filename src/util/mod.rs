//! Small shared helpers: atomic file writes, a seeded RNG, progress bars, JSONL reading, PNG plots.
pub mod fs;
pub mod prof;
pub mod rng;
