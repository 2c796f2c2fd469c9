//! `sluice plan`: capacity planning. It owns the fleet in virtual time ([`fleet`]): the
//! [`crate::batching`] engine model that `sluice sim` runs in real time, driven by an event
//! queue, with every request routed by [`crate::routing`]'s own policies.
//!
//! Invariant: the planner never re-implements the engine model or the routing policies; it
//! only supplies a clock and the bookkeeping the proxy would do.

pub mod fleet;
