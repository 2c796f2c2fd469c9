//! The OpenAI API as Sluice speaks it: the request fields the gateway reads, the error body it
//! answers with, and the model list it serves.
//!
//! Invariant: nothing here allocates in proportion to a prompt except the one validating parse of
//! the body; the original bytes are forwarded untouched unless [`edit`] has to change a field.

pub mod edit;
pub mod error;
pub mod request;
pub mod usage;

pub use error::ApiError;
pub use request::{PromptField, RequestFields};
