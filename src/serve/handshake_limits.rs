//! Bounds on handshakes: a password check (Argon2id, ~19 MiB and tens of milliseconds of a
//! core each) is what an unauthenticated caller can make the server do, so it is rationed.
//!
//! - At most `concurrent` checks run at once; at most `queued` more wait for one, and a
//!   handshake beyond that is refused at once ("too many handshakes").
//! - After [`FREE_FAILURES`] failed handshakes in a row, an address and a user name each
//!   back off: the next handshake from that address, or for that user, is refused without
//!   a check until a delay has passed, doubling with each further failure up to
//!   [`MAX_BACKOFF`]. A success clears both. So a flood of wrong passwords costs a few
//!   checks, not one per attempt, and guessing one user's password from many addresses
//!   slows down the same way. Such a refusal is answered after up to [`TARPIT`] (a timer),
//!   so a client retrying in a loop makes a few calls a second.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Failed handshakes in a row that cost nothing more.
pub const FREE_FAILURES: u32 = 3;
/// The first delay after the free failures.
pub const FIRST_BACKOFF: Duration = Duration::from_millis(500);
/// The longest delay.
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Longest a refused handshake of a caller backing off waits before its answer.
pub const TARPIT: Duration = Duration::from_millis(500);
/// Most addresses and user names remembered with failures (the oldest are forgotten).
const MAX_REMEMBERED: usize = 100_000;

/// Whose failures are counted.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Who {
    Address(IpAddr),
    User(String),
}

/// Failures in a row of one address or user.
#[derive(Debug, Clone, Copy)]
struct Failures {
    count: u32,
    /// No handshake is checked before this.
    until: Instant,
}

/// Why a handshake was refused before its check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Too many handshakes are being checked or wait.
    Busy,
    /// The address or user backs off after failures, this much longer.
    BackingOff(Duration),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Busy => {
                f.write_str("flumen serve: too many handshakes at once; try again in a moment")
            }
            Refusal::BackingOff(left) => write!(
                f,
                "flumen serve: too many failed handshakes; try again in {:.1} s",
                left.as_secs_f64()
            ),
        }
    }
}

/// The server's handshake bounds.
#[derive(Debug)]
pub struct HandshakeLimits {
    checks: Arc<Semaphore>,
    waiting: AtomicUsize,
    queued: usize,
    failures: Mutex<HashMap<Who, Failures>>,
}

impl HandshakeLimits {
    /// At most `concurrent` (≥ 1) checks at once and `queued` waiting.
    pub fn new(concurrent: usize, queued: usize) -> Self {
        Self {
            checks: Arc::new(Semaphore::new(concurrent.max(1))),
            waiting: AtomicUsize::new(0),
            queued,
            failures: Mutex::default(),
        }
    }

    /// Admit a handshake from `address` for `user` (`None`: a token) to a password check:
    /// refused while either backs off, or when the queue is full; else the check's permit,
    /// once one is free.
    pub async fn admit(
        &self,
        address: Option<IpAddr>,
        user: Option<&str>,
    ) -> Result<OwnedSemaphorePermit, Refusal> {
        self.backoff_left(address, user)?;
        if let Ok(permit) = Arc::clone(&self.checks).try_acquire_owned() {
            return Ok(permit);
        }
        if self.waiting.fetch_add(1, Ordering::AcqRel) >= self.queued {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(Refusal::Busy);
        }
        let permit = Arc::clone(&self.checks).acquire_owned().await;
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        let permit = permit.map_err(|_| Refusal::Busy)?;
        // Failures of the handshakes checked while this one waited count: a burst from one
        // address costs its free failures' checks, not one per handshake queued.
        self.backoff_left(address, user)?;
        Ok(permit)
    }

    fn backoff_left(&self, address: Option<IpAddr>, user: Option<&str>) -> Result<(), Refusal> {
        let now = Instant::now();
        let failures = self.failures.lock().unwrap();
        let left = whos(address, user)
            .filter_map(|who| failures.get(&who))
            .filter(|f| f.until > now)
            .map(|f| f.until - now)
            .max();
        match left {
            Some(left) => Err(Refusal::BackingOff(left)),
            None => Ok(()),
        }
    }

    /// A handshake from `address` for `user` failed its check.
    pub fn failed(&self, address: Option<IpAddr>, user: Option<&str>) {
        let now = Instant::now();
        let mut failures = self.failures.lock().unwrap();
        if failures.len() >= MAX_REMEMBERED {
            failures.retain(|_, f| f.until > now);
            if failures.len() >= MAX_REMEMBERED {
                failures.clear();
            }
        }
        for who in whos(address, user) {
            let f = failures.entry(who).or_insert(Failures {
                count: 0,
                until: now,
            });
            f.count += 1;
            if f.count > FREE_FAILURES {
                f.until = now + backoff(f.count - FREE_FAILURES);
            }
        }
    }

    /// A handshake from `address` for `user` succeeded: both start afresh.
    pub fn succeeded(&self, address: Option<IpAddr>, user: Option<&str>) {
        let mut failures = self.failures.lock().unwrap();
        for who in whos(address, user) {
            failures.remove(&who);
        }
    }
}

impl Default for HandshakeLimits {
    /// As many checks at once as the machine has cores, 64 waiting.
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        Self::new(cores, 64)
    }
}

fn whos(address: Option<IpAddr>, user: Option<&str>) -> impl Iterator<Item = Who> {
    (address.map(Who::Address).into_iter()).chain(user.map(|u| Who::User(u.to_string())))
}

/// The delay after the `n`th failure (from 1) beyond the free ones.
fn backoff(n: u32) -> Duration {
    FIRST_BACKOFF
        .saturating_mul(1 << (n - 1).min(16))
        .min(MAX_BACKOFF)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOST: Option<IpAddr> = Some(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));

    #[tokio::test]
    async fn failures_back_off_by_address_and_user_and_a_success_clears_them() {
        let limits = HandshakeLimits::new(2, 4);
        for _ in 0..FREE_FAILURES {
            drop(limits.admit(HOST, Some("ana")).await.unwrap());
            limits.failed(HOST, Some("ana"));
        }
        drop(limits.admit(HOST, Some("ana")).await.unwrap());
        limits.failed(HOST, Some("ana"));
        // The address backs off for every user, the user from every address.
        let other = Some(IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 9)));
        for (address, user) in [(HOST, Some("bo")), (other, Some("ana")), (HOST, None)] {
            match limits.admit(address, user).await {
                Err(Refusal::BackingOff(left)) => assert!(left <= FIRST_BACKOFF),
                other => panic!("{address:?} {user:?}: {other:?}"),
            }
        }
        assert!(limits.admit(other, Some("bo")).await.is_ok());
        limits.succeeded(HOST, Some("ana"));
        assert!(limits.admit(HOST, Some("ana")).await.is_ok());
    }

    #[test]
    fn delays_double_up_to_the_most() {
        assert_eq!(backoff(1), FIRST_BACKOFF);
        assert_eq!(backoff(2), FIRST_BACKOFF * 2);
        assert_eq!(backoff(40), MAX_BACKOFF);
    }

    #[tokio::test]
    async fn beyond_the_checks_and_the_queue_a_handshake_is_refused_at_once() {
        let limits = Arc::new(HandshakeLimits::new(1, 1));
        let held = limits.admit(None, None).await.unwrap();
        let queued = {
            let limits = Arc::clone(&limits);
            tokio::spawn(async move { limits.admit(None, None).await.map(drop) })
        };
        while limits.waiting.load(Ordering::Acquire) == 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(limits.admit(None, None).await.err(), Some(Refusal::Busy));
        drop(held);
        assert!(queued.await.unwrap().is_ok());
    }
}
