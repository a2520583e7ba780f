//! A real S3-compatible server for tests: moto's server mode, installed by `.ci/run`.

#![allow(dead_code)]

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

/// A real S3-compatible server (moto's server mode) on loopback, killed when dropped.
pub struct S3Server {
    child: std::process::Child,
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
}

impl S3Server {
    /// Start `moto_server` (`FLUMEN_MOTO_SERVER`, else `target/test-venv` as
    /// `tests/install-test-tools.sh` installs it, else on PATH); `None` when not installed.
    pub fn start() -> Option<Self> {
        let program = moto_program();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(&program)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let server = Self {
            child,
            endpoint: format!("http://127.0.0.1:{port}"),
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "moto_server did not start"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Some(server)
    }

    /// Create a bucket (a plain `PUT /bucket`).
    pub fn create_bucket(&self, bucket: &str) {
        create_bucket_at(&self.endpoint, bucket);
    }

    /// `OPTIONS (...)` pointing a statement at this server.
    pub fn options(&self) -> String {
        format!(
            "OPTIONS ('aws.endpoint' '{}', 'aws.access_key_id' 'test', \
             'aws.secret_access_key' 'test', 'aws.region' 'us-east-1')",
            self.endpoint
        )
    }
}

/// `moto_server`: `FLUMEN_MOTO_SERVER`, else `target/test-venv` as
/// `tests/install-test-tools.sh` installs it, else the one on PATH.
pub fn moto_program() -> String {
    std::env::var("FLUMEN_MOTO_SERVER").unwrap_or_else(|_| {
        let installed = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/target/test-venv/bin/moto_server"
        );
        if std::path::Path::new(installed).exists() {
            installed.into()
        } else {
            "moto_server".into()
        }
    })
}

/// Create `bucket` on the S3 server at `endpoint` (`http://host:port`; a plain `PUT`).
pub fn create_bucket_at(endpoint: &str, bucket: &str) {
    use std::io::Read;
    let address = endpoint.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    write!(
        stream,
        "PUT /{bucket} HTTP/1.1\r\nHost: {address}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
