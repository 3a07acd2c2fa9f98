//! Text in and out: the model's tokenizer and chat template, sampling, streaming generation.
pub mod chat;
pub mod constrain;
pub mod gbnf;
pub mod generate;
pub mod sampling;
pub mod speculate;
pub mod stop;
pub mod tools;
