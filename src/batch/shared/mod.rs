//! Several replicas sharing the work of their batches (`[batch] shared = true`): the job
//! state on the folder they all mount ([`folder`]), the work shared out through the Redis of
//! `[limits] redis_url` as leases on chunks of lines ([`lease`]), and the runner that takes
//! them ([`runner`]).
//!
//! Why not the single replica's database: redb locks its file for one process (a second
//! `open` fails while the first holds it), so two replicas cannot share one. Redis could hold
//! the state, but the Redis of the limits is often run without persistence; a flush would
//! lose acknowledged batches. So everything durable is a file on the shared folder, written
//! whole and committed by rename or hard link; Redis holds only leases, which may be lost:
//! without them two replicas may run the same chunk, and the first commit still wins.
//!
//! ```text
//! POST /v1/batches (any replica) ─► <batch>/batch.json
//! a runner ─► validates: <batch>/started (first one wins) with the chunking
//!          ─► SET lease:<batch>:<n> NX PX ttl ─► runs chunk n's lines, renewing the lease
//!          ─► <batch>/chunks/<n> committed whole by hard link (first one wins)
//!          ─► every chunk committed: lease <batch>:final ─► output and error files from the
//!             chunks in order ─► <batch>/finished (first one wins)
//! a replica killed mid-chunk ─► its lease expires ─► another replica takes chunk n, runs it again
//! ```
//!
//! Invariants:
//! - Every `custom_id` of the input reaches the output or error file exactly once: each
//!   chunk's results are committed once and whole, the finalizer reads committed chunks only,
//!   and only the first finalizer's files are kept.
//! - `GET /v1/batches/{id}` is the same on every replica: the status and counts are read from
//!   the folder, not kept in one replica's memory.

pub mod folder;
pub mod lease;
pub mod runner;

pub use folder::Folder;

/// A random name for this process's leases and files: 16 hex digits.
pub fn token() -> String {
    use rand::RngCore;
    let mut bytes = [0u8; 8];
    rand::rng().fill_bytes(&mut bytes);
    hex::encode(bytes)
}
