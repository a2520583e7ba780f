//! A `flumen serve` process on loopback for tests and benches: started with the given
//! arguments (after `serve --listen 127.0.0.1:0`), its address read from its first line of
//! output, its log in a file, killed when dropped.

#![allow(dead_code)]

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use arrow_flight::sql::client::FlightSqlServiceClient;
use tonic::transport::{Channel, Endpoint};

/// A running `flumen serve`.
pub struct ServeProcess {
    /// The process.
    pub child: Child,
    /// `host:port` it listens on.
    pub address: String,
    /// Its standard error (the log).
    pub log: PathBuf,
}

impl ServeProcess {
    /// Start `flumen serve --listen 127.0.0.1:0 ARGS...`, logging to `log`.
    pub fn start<I, S>(args: I, log: &Path) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut child = Command::new(env!("CARGO_BIN_EXE_flumen"))
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let address = line
            .trim()
            .strip_prefix("flumen serve listening on ")
            .unwrap_or_else(|| {
                panic!(
                    "no address from flumen serve: {line:?}; log: {}",
                    std::fs::read_to_string(log).unwrap_or_default()
                )
            })
            .to_string();
        Self {
            child,
            address,
            log: log.to_path_buf(),
        }
    }

    /// What it has logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A Rust Flight SQL client presenting `token`.
    pub async fn client(&self, token: &str) -> FlightSqlServiceClient<Channel> {
        let channel = Endpoint::from_shared(format!("http://{}", self.address))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut client = FlightSqlServiceClient::new(channel);
        client.set_token(token.to_string());
        client
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
