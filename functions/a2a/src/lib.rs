//! loams-a2a: a thin A2A 1.0 slice on the official `a2a-lf` types for Loams' agents.
//!
//! - [`router`] serves an agent's signed card and JSON-RPC `SendMessage` / `GetTask` / `CancelTask`,
//!   running each skill call once per message id (tasks live in the platform `Store`).
//! - [`CardSigner`] / [`verify_card`] sign and check cards (detached ES256 JWS over RFC 8785 JCS).
//! - [`A2aClient`] verifies a card against trusted keys and calls skills.

mod card;
mod client;
mod server;
mod skills;

pub use card::{
    CARD_PATH, CardError, CardSigner, Jwk, Jwks, build_card, canonical_payload, verify_card,
};
pub use client::{A2aClient, CallError, ClientOptions};
pub use server::{MAX_MESSAGE_ID, MAX_REQUEST_BYTES, TASK_KIND, router};
pub use skills::{AgentSpec, Risk, SkillError, SkillSpec, Skills};
