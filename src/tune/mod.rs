//! Tuning sparsity to a model: `dejavu calibrate` ([`calibrate`]) trains the predictors from the
//! model's own activations (captured by the forward pass) on text ([`corpus`]) and searches the
//! policies ([`search`]).
pub mod allocation;
pub mod calibrate;
pub mod corpus;
pub mod search;
pub mod thresholds;
