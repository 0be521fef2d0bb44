//! Manual backward through the transformer for LoRA parameters (being written).
