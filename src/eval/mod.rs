//! Measuring the engine: perplexity (llama.cpp's method), `dejavu bench` (llama-bench's tests),
//! the sparsity frontier report, and speed against density.
pub mod bench;
pub mod perplexity;
pub mod plot;
pub mod report;
pub mod speed_frontier;
