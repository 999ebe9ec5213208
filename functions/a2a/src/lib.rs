//! loams-a2a: A2A 1.0 on the official `a2a-lf` types for Loams' agents.
//!
//! - [`router`] / [`router_with`] serve an agent: its signed card (with Cache-Control and ETag),
//!   the JSON-RPC binding at the base URL and the HTTP+JSON binding under it (also
//!   tenant-prefixed), every RPC of A2A 1.0: SendMessage (blocking or `returnImmediately`),
//!   SendStreamingMessage and SubscribeToTask over SSE, GetTask, ListTasks, CancelTask, the four
//!   push-notification config RPCs with webhook delivery, GetExtendedAgentCard. Each skill call
//!   runs once per message id (its stored task is the claim), except a read the caller waits for, which is stored
//!   once it has run and may run again on a repeat; tasks and push configs live in the platform `Store`, so a
//!   restarted process (or another one) serves tasks it did not start. Calls need a bearer token
//!   the host's [`CallerAuth`] accepts; destructive skills need an approval the host's
//!   [`ApprovalGate`] admits.
//! - [`CardSigner`] / [`verify_card`] sign and check cards (detached ES256 JWS over RFC 8785 JCS).
//! - [`A2aClient`] verifies a card against trusted keys and speaks either binding: skill calls,
//!   the protocol operations, streams ([`EventStream`]) and [`A2aClient::follow`], which
//!   resubscribes after a dropped stream.

mod auth;
mod card;
mod client;
mod conformance;
mod push;
mod server;
mod skills;
mod tasks;

pub use auth::{
    ApprovalGate, AuthError, CallerAuth, GateError, Guards, MAX_BEARER_BYTES, Principal,
    TokenError, TokenSource,
};
pub use card::{
    APP_EXTENSION, BEARER_SCHEME, CARD_PATH, CardError, CardSigner, Jwk, Jwks, PRINCIPAL_EXTENSION,
    app_links, build_card, canonical_payload, verify_card,
};
pub use client::{A2aClient, Binding, CallError, ClientOptions, EventStream};
pub use push::{PUSH_KIND, PushOptions};
pub use server::{
    A2A_JSON, APPROVAL_ID_KEY, CALLER_LIMITS_EXTENSION, MAX_MESSAGE_ID, MAX_REQUEST_BYTES,
    ServerOptions, TASK_KIND, router, router_with,
};
pub use skills::{
    AgentSpec, AppLinks, Risk, SkillError, SkillSpec, Skills, agent_principal, every_scope,
};
pub use tasks::task_item_id;
