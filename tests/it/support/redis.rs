//! A real redis-server for the tests of what replicas share, on a free port; `None` (the test
//! skips, saying so) when the binary is not installed, unless `CI` is set.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::process::skip;
use super::{eventually, free_port};

/// A redis-server of a test's own, stopped when dropped.
pub struct Redis {
    child: Child,
    pub port: u16,
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fresh redis-server, or `None` (skip) when the binary is missing outside CI.
pub async fn redis() -> Option<Redis> {
    let port = free_port();
    let spawned = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    let child = match spawned {
        Ok(c) => c,
        Err(e) => {
            skip(&format!(
                "redis-server not found ({e}); install redis-server to run this test"
            ));
            return None;
        }
    };
    let r = Redis { child, port };
    eventually(Duration::from_secs(10), "redis-server started", || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
    Some(r)
}

impl Redis {
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}
