//! Each client's own session: a `SessionContext` per session token (per ADBC connection),
//! made from the server's on first use. Catalogs and tables are shared (a table one client
//! creates, the others see), settings are not (`SET` changes its own session only), and the
//! pools, models and memory budget are the server's. Object stores are the session's own
//! when it registers them (a `LOCATION` or `COPY` with its `OPTIONS`: an endpoint, keys),
//! else the server's: one client never reads a bucket through another's endpoint or keys.
//! What the operator granted the user ([`Grants`]) shapes its sessions: each query's memory
//! budget, and whether a store it opens may use the server's cloud identity.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use datafusion::execution::SessionStateBuilder;
use datafusion::execution::object_store::{DefaultObjectStoreRegistry, ObjectStoreRegistry};
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::prelude::SessionContext;
use object_store::ObjectStore;

#[cfg(feature = "delta")]
use crate::io::delta::DeltaAppNamespace;
use crate::io::object_stores::CloudIdentity;
use url::Url;

use super::credentials::Caller;
use super::grants::{Grants, UserAccess};

/// User `user`'s session made from the server's `base`: the catalog list shared (an `Arc`),
/// the settings copied, the memory pool and caches the server's, the object stores layered
/// ([`SessionStores`]), its Delta app ids under the user's name ([`DeltaAppNamespace`]),
/// what `access` grants it (a memory budget, the server's cloud identity or none).
fn client_session(base: &SessionContext, user: &str, access: &UserAccess) -> SessionContext {
    let state = base.state();
    let identity = match access.cloud_identity {
        true => CloudIdentity::Environment,
        false => CloudIdentity::OptionsOnly {
            user: user.to_string(),
        },
    };
    let mut config = state.config().clone().with_extension(Arc::new(identity));
    #[cfg(feature = "delta")]
    {
        config = config.with_extension(Arc::new(DeltaAppNamespace(user.to_string())));
    }
    if let Some(budget) = access.memory_budget {
        let flumen = config
            .options_mut()
            .extensions
            .get_mut::<crate::FlumenConfig>();
        if let Some(flumen) = flumen {
            flumen.memory_budget = budget;
        }
    }
    let server_stores = Arc::clone(&state.runtime_env().object_store_registry);
    let runtime = RuntimeEnvBuilder::from_runtime_env(state.runtime_env())
        .with_object_store_registry(Arc::new(SessionStores {
            own: DefaultObjectStoreRegistry::new(),
            server: server_stores,
        }))
        .build_arc();
    match runtime {
        // Path and URL tables (`SELECT * FROM 's3://b/t.parquet'`) resolve in this session,
        // through its own stores: the server's session has none, so that its resolver,
        // bound to the server's stores, is not the one clients meet.
        Ok(runtime) => SessionContext::new_with_state(
            SessionStateBuilder::new_from_existing(state)
                .with_config(config)
                .with_runtime_env(runtime)
                .build(),
        )
        .enable_url_table(),
        // Building from an existing runtime makes nothing new that could fail; should it,
        // the client gets the server's stores rather than no session.
        Err(e) => {
            log::warn!("flumen serve: a client session shares the server's object stores: {e}");
            SessionContext::new_with_state(state)
        }
    }
}

/// A client session's object stores: what it registers is its own; what it has not, it
/// reads through the server's registry (the stores the operator set up).
#[derive(Debug)]
struct SessionStores {
    own: DefaultObjectStoreRegistry,
    server: Arc<dyn ObjectStoreRegistry>,
}

impl ObjectStoreRegistry for SessionStores {
    fn register_store(
        &self,
        url: &Url,
        store: Arc<dyn ObjectStore>,
    ) -> Option<Arc<dyn ObjectStore>> {
        self.own.register_store(url, store)
    }

    fn deregister_store(&self, url: &Url) -> datafusion::error::Result<Arc<dyn ObjectStore>> {
        self.own.deregister_store(url)
    }

    fn get_store(&self, url: &Url) -> datafusion::error::Result<Arc<dyn ObjectStore>> {
        self.own
            .get_store(url)
            .or_else(|_| self.server.get_store(url))
    }
}

/// The server's session and every client's.
pub struct Sessions {
    base: SessionContext,
    by_session: Mutex<HashMap<String, SessionContext>>,
    grants: Grants,
}

impl Sessions {
    /// Clients' sessions start as copies of `base`.
    pub fn new(base: SessionContext) -> Self {
        Self {
            base,
            by_session: Mutex::default(),
            grants: Grants::default(),
        }
    }

    /// Give users what `grants` grant them (sessions made from now on).
    pub fn set_grants(&mut self, grants: Grants) {
        self.grants = grants;
    }

    /// What `user` may do.
    pub fn access(&self, user: &str) -> UserAccess {
        self.grants.of(user)
    }

    /// The session of `caller` (made on its first call).
    pub fn context(&self, caller: &Caller) -> SessionContext {
        let mut sessions = self.by_session.lock().unwrap();
        sessions
            .entry(caller.session.clone())
            .or_insert_with(|| {
                client_session(&self.base, &caller.user, &self.grants.of(&caller.user))
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

    /// User `u`'s caller in session `session`.
    fn caller(session: &str) -> Caller {
        Caller {
            user: "u".into(),
            session: session.into(),
        }
    }

    #[tokio::test]
    async fn settings_are_per_session_and_tables_are_shared() {
        let sessions = Sessions::new(crate::session(crate::FlumenConfig::default()));
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

    #[tokio::test]
    async fn a_users_grant_shapes_its_sessions() {
        use crate::config::ByteSize;
        use crate::serve::grants::UserGrant;
        let mut sessions = Sessions::new(crate::session(crate::FlumenConfig::default()));
        let grant = UserGrant {
            memory_budget: Some(ByteSize(64 << 20)),
            cloud_identity: true,
            ..UserGrant::default()
        };
        sessions.set_grants(
            Grants::default()
                .with_users(&HashMap::from([("u".to_string(), grant)]))
                .unwrap(),
        );
        let of = |user: &str| {
            let ctx = sessions.context(&Caller {
                user: user.into(),
                session: user.into(),
            });
            let state = ctx.state();
            let budget = (state.config().options().extensions)
                .get::<crate::FlumenConfig>()
                .unwrap()
                .memory_budget;
            (budget, CloudIdentity::of(state.config()))
        };
        assert_eq!(of("u"), (ByteSize(64 << 20), CloudIdentity::Environment));
        let (budget, identity) = of("v");
        assert_eq!(budget, crate::FlumenConfig::default().memory_budget);
        assert_eq!(identity, CloudIdentity::OptionsOnly { user: "v".into() });
    }

    #[tokio::test]
    async fn a_store_one_session_registers_is_not_anothers() {
        let sessions = Sessions::new(crate::session(crate::FlumenConfig::default()));
        let a = sessions.context(&caller("a"));
        let b = sessions.context(&caller("b"));
        let bucket = Url::parse("s3://bucket").unwrap();
        let theirs: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        a.register_object_store(&bucket, Arc::clone(&theirs));
        let store_of =
            |ctx: &SessionContext| ctx.runtime_env().object_store_registry.get_store(&bucket);
        assert!(Arc::ptr_eq(&store_of(&a).unwrap(), &theirs));
        assert!(
            store_of(&b).is_err(),
            "b reads a's bucket through a's store"
        );
        // The server's stores are everyone's; a session's own wins over them.
        let servers: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        sessions
            .base()
            .register_object_store(&Url::parse("s3://shared").unwrap(), Arc::clone(&servers));
        let shared = Url::parse("s3://shared").unwrap();
        let c = sessions.context(&caller("c"));
        assert!(Arc::ptr_eq(
            &c.runtime_env()
                .object_store_registry
                .get_store(&shared)
                .unwrap(),
            &servers
        ));
        assert!(Arc::ptr_eq(&store_of(&a).unwrap(), &theirs));
        // Local files are everyone's.
        assert!(
            b.runtime_env()
                .object_store_registry
                .get_store(&Url::parse("file:///").unwrap())
                .is_ok()
        );
    }
}
