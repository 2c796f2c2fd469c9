//! `[admin]`: the operations listener and its token.

use super::{addr, in_range, secret, Problems};
use crate::config::env::Env;
use crate::config::file::AdminSection;
use crate::config::runtime::AdminConfig;

/// `None` when the listen address is unusable (that is a problem already).
pub(super) fn admin(p: &mut Problems, a: &AdminSection, env: &dyn Env) -> Option<AdminConfig> {
    let listen = addr(
        p,
        "admin.listen",
        a.listen.as_deref().unwrap_or("127.0.0.1:9090"),
        env,
    )?;
    let token = secret(p, "admin.token", &a.token, env);
    if token.is_none() && !listen.ip().is_loopback() {
        p.push(
            "admin.token",
            "is required when admin.listen is not a loopback address",
        );
    }
    let max_connections = in_range(
        p,
        "admin.max_connections",
        a.max_connections,
        256,
        1..=1 << 20,
    );
    Some(AdminConfig {
        listen,
        token,
        max_connections,
    })
}
