//! Backward ops for LoRA training (being written).
