//! Loopback ports for processes the test starts itself (the `sluice` binary, `redis-server`):
//! in-process servers bind port 0 and report their address instead.

/// A loopback port free at the time of the call (bound and released; the kernel hands out
/// ephemeral ports in turn, so it is not given to another test's port-0 bind right away).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("no free loopback port: {e}"))
}
