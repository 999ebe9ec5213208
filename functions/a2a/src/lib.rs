//! loams-a2a: a thin A2A 1.0 slice on the official `a2a-lf` types for Loams' agents.
//!
//! - [`router`] serves an agent's signed card and JSON-RPC `SendMessage` / `GetTask` / `CancelTask`,
//!   running each skill call once per message id (tasks live in the platform `Store`). Calls need a
//!   bearer token the host's [`CallerAuth`] accepts; destructive skills need an approval the host's
//!   [`ApprovalGate`] admits.
//! - [`CardSigner`] / [`verify_card`] sign and check cards (detached ES256 JWS over RFC 8785 JCS).
//! - [`A2aClient`] verifies a card against trusted keys and calls skills.

mod auth;
mod card;
mod client;
mod server;
mod skills;

pub use auth::{
    ApprovalGate, AuthError, CallerAuth, GateError, Guards, MAX_BEARER_BYTES, Principal,
    TokenError, TokenSource,
};
pub use card::{
    CARD_PATH, CardError, CardSigner, Jwk, Jwks, build_card, canonical_payload, verify_card,
};
pub use client::{A2aClient, CallError, ClientOptions};
pub use server::{APPROVAL_ID_KEY, MAX_MESSAGE_ID, MAX_REQUEST_BYTES, TASK_KIND, router};
pub use skills::{AgentSpec, Risk, SkillError, SkillSpec, Skills};
