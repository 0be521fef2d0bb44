//! CUDA backend (being written).
