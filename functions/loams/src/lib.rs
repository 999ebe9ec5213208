//! The `loams` binary's parts, as a library so the end-to-end tests drive the same code the binary runs.

pub mod backend;
pub mod config;
pub mod demo;
#[cfg(feature = "aws")]
pub mod lambda;
pub mod phone;
pub mod stack;
pub mod terminal;
