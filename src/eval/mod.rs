//! Measuring the engine: perplexity (llama.cpp's method), `dejavu bench` (llama-bench's tests),
//! the sparsity frontier report, speed against density, and resident memory.
pub mod bench;
pub mod memstat;
pub mod perplexity;
pub mod plot;
pub mod report;
pub mod speed_frontier;
