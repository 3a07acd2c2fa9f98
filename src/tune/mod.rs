//! Tuning sparsity to a model: `dejavu calibrate` ([`calibrate`]) trains the predictors from the
//! model's own activations (captured by the forward pass) and searches the policies.
pub mod allocation;
pub mod calibrate;
pub mod thresholds;
