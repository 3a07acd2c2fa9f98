//! Contextual sparsity (Deja Vu): the plan as data ([`plan`]), the policies that build it per
//! decoded token ([`policy`]), the learned predictors ([`predictor`]: `MlpPredictor`,
//! `HeadPredictor`) and the file that stores them with the output preview
//! ([`predictors_file`]), the neuron-major weight layout the sparse kernels read ([`layout`]),
//! and `dejavu calibrate` (`crate::tune::calibrate`). The forward pass (`exec`) runs the plan.
pub mod blocks;
pub mod head_bound;
pub mod input;
pub mod layout;
pub mod plan;
pub mod policy;
pub mod predictor;
pub mod predictors_file;

pub use plan::*;
