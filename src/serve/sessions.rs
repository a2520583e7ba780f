//! Each client's own session: a `SessionContext` per session token (per ADBC connection),
//! made from the server's on first use. Catalogs and tables are shared (a table one client
//! creates, the others see), settings are not (`SET` changes its own session only), and the
//! pools, models and memory budget are the server's.

use std::collections::HashMap;
use std::sync::Mutex;

use datafusion::prelude::SessionContext;

use super::credentials::Caller;

/// The server's session and every client's.
pub struct Sessions {
    base: SessionContext,
    by_session: Mutex<HashMap<String, SessionContext>>,
}

impl Sessions {
    /// Clients' sessions start as copies of `base`.
    pub fn new(base: SessionContext) -> Self {
        Self {
            base,
            by_session: Mutex::default(),
        }
    }

    /// The session of `caller` (made on its first call).
    pub fn context(&self, caller: &Caller) -> SessionContext {
        let mut sessions = self.by_session.lock().unwrap();
        sessions
            .entry(caller.session.clone())
            .or_insert_with(|| {
                // A cloned state shares the catalog list (an `Arc`) and copies the settings.
                SessionContext::new_with_state(self.base.state())
            })
            .clone()
    }

    /// Forget the sessions of `ended` callers (their tokens expired).
    pub fn forget(&self, ended: &[Caller]) {
        let mut sessions = self.by_session.lock().unwrap();
        for caller in ended {
            sessions.remove(&caller.session);
        }
    }

    /// How many client sessions are held.
    pub fn len(&self) -> usize {
        self.by_session.lock().unwrap().len()
    }

    /// Whether no client session is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The server's own session (its tables are everyone's).
    pub fn base(&self) -> &SessionContext {
        &self.base
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn settings_are_per_session_and_tables_are_shared() {
        let sessions = Sessions::new(crate::session(crate::FlumenConfig::default()));
        let caller = |s: &str| Caller {
            user: "u".into(),
            session: s.into(),
        };
        let a = sessions.context(&caller("a"));
        let b = sessions.context(&caller("b"));
        a.sql("SET datafusion.execution.batch_size = 123")
            .await
            .unwrap();
        a.sql("CREATE TABLE shared AS VALUES (1)").await.unwrap();
        let batch = |ctx: &SessionContext| ctx.state().config().batch_size();
        assert_eq!(batch(&sessions.context(&caller("a"))), 123);
        assert_ne!(batch(&b), 123);
        assert!(b.table("shared").await.is_ok());
    }
}
