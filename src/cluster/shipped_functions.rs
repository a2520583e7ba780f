//! Functions shipped with the task plans that call them: a function whose code lives in
//! another runtime than flumen's Rust (a Python model class, a Python function) travels
//! inside each task plan that calls it, packed by a [`FunctionCarrier`] of that runtime, so
//! a worker that hosts the runtime runs it without being told of it beforehand.
//!
//! - A process that can pack or unpack such functions registers a carrier
//!   ([`register_carrier`]): flumen's Python module does, in the driver and in its workers
//!   (`python -m flumen worker`). A worker announces the runtimes of its carriers
//!   ([`runtimes`]); a driver sends a shipped function only to workers that announce its
//!   runtime (the task runs on the driver otherwise). The `flumen` binary has no carrier:
//!   it refuses any shipped function, as a function it does not know.
//! - In a task plan, the call's `fun_definition` holds a [`ShippedFunction`] (runtime and
//!   packed bytes); a plain function's stays empty and the worker finds it by name.
//! - Unpacking happens once per process and packed function ([`unpack`] keeps what it
//!   made, by a digest of the bytes), so a model unpacked by a worker is the same function
//!   for every later task and stays loaded. A driver's own functions are kept under their
//!   digest when packed, so the driver's check that a worker decodes the planned plan
//!   finds the very function it planned.
//!
//! Packed bytes are code: only callers holding the driver's secret reach a worker
//! ([`crate::cluster::auth`]), only a worker started to host the runtime unpacks them, and
//! `--no-shipped-functions` makes even that one refuse them ([`refuse_all`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::ScalarUDF;
use prost::Message;

/// What the `kind` of a [`ShippedFunction`] says.
const SHIPPED_FUNCTION: &str = "flumen.shipped_function";

/// Packs and unpacks the functions of one runtime.
pub trait FunctionCarrier: Send + Sync + 'static {
    /// The runtime its functions need, as workers announce it (e.g. `python3.12`: packed
    /// bytes are read by the same language version only).
    fn runtime(&self) -> String;
    /// `udf` packed as bytes, when it is a function of this runtime that can travel.
    fn pack(&self, udf: &ScalarUDF) -> Option<Vec<u8>>;
    /// The function `packed` holds, as SQL function `name`.
    fn unpack(&self, name: &str, packed: &[u8]) -> Result<ScalarUDF>;
}

/// A shipped function in a task plan: its runtime and packed bytes.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ShippedFunction {
    /// Always [`SHIPPED_FUNCTION`].
    #[prost(string, tag = "1")]
    kind: String,
    /// The runtime that unpacks it.
    #[prost(string, tag = "2")]
    pub runtime: String,
    /// What the runtime's carrier packed.
    #[prost(bytes = "vec", tag = "3")]
    pub packed: Vec<u8>,
}

impl ShippedFunction {
    /// The encoding that goes into a call's `fun_definition`.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.encode_to_vec()
    }

    /// A `fun_definition` read back; `None` when it is not a shipped function's.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        Self::decode(bytes)
            .ok()
            .filter(|f| f.kind == SHIPPED_FUNCTION)
    }

    fn digest(&self) -> [u8; 32] {
        let mut hasher = blake3::Hasher::new();
        hasher.update(self.runtime.as_bytes());
        hasher.update(&[0]);
        hasher.update(&self.packed);
        *hasher.finalize().as_bytes()
    }
}

/// Set by [`refuse_all`]: this process unpacks nothing and announces no runtime.
static REFUSED: AtomicBool = AtomicBool::new(false);

/// Refuse every shipped function from now on (`flumen worker --no-shipped-functions`): the
/// worker announces no runtime, so drivers keep such tasks, and one sent anyway fails.
pub fn refuse_all() {
    REFUSED.store(true, Ordering::Relaxed);
}

fn carriers() -> &'static RwLock<Vec<Arc<dyn FunctionCarrier>>> {
    static CARRIERS: OnceLock<RwLock<Vec<Arc<dyn FunctionCarrier>>>> = OnceLock::new();
    CARRIERS.get_or_init(|| RwLock::new(Vec::new()))
}

/// The functions this process packed or unpacked, by digest of their shipped form.
fn unpacked() -> &'static Mutex<HashMap<[u8; 32], Arc<ScalarUDF>>> {
    static UNPACKED: OnceLock<Mutex<HashMap<[u8; 32], Arc<ScalarUDF>>>> = OnceLock::new();
    UNPACKED.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Let this process pack and unpack `carrier`'s functions (once per runtime: a second
/// carrier of a runtime already registered is ignored).
pub fn register_carrier(carrier: Arc<dyn FunctionCarrier>) {
    let mut all = carriers().write().unwrap();
    if all.iter().all(|c| c.runtime() != carrier.runtime()) {
        all.push(carrier);
    }
}

/// The runtimes whose functions this process can unpack (a worker announces them).
pub fn runtimes() -> Vec<String> {
    if REFUSED.load(Ordering::Relaxed) {
        return vec![];
    }
    carriers()
        .read()
        .unwrap()
        .iter()
        .map(|c| c.runtime())
        .collect()
}

/// `udf` as it ships, when a carrier of this process packs it; it is kept under its
/// digest, so unpacking the same bytes here gives `udf` back.
pub fn pack(udf: &ScalarUDF) -> Option<ShippedFunction> {
    let shipped = carriers().read().unwrap().iter().find_map(|c| {
        Some(ShippedFunction {
            kind: SHIPPED_FUNCTION.into(),
            runtime: c.runtime(),
            packed: c.pack(udf)?,
        })
    })?;
    unpacked()
        .lock()
        .unwrap()
        .entry(shipped.digest())
        .or_insert_with(|| Arc::new(udf.clone()));
    Some(shipped)
}

/// The function `shipped` holds, as SQL function `name`: made once per process and
/// packed bytes, then kept.
pub fn unpack(name: &str, shipped: &ShippedFunction) -> Result<Arc<ScalarUDF>> {
    if REFUSED.load(Ordering::Relaxed) {
        return Err(DataFusionError::NotImplemented(format!(
            "function {name} is shipped {} code, which this worker refuses \
             (--no-shipped-functions)",
            shipped.runtime
        )));
    }
    let digest = shipped.digest();
    if let Some(udf) = unpacked().lock().unwrap().get(&digest) {
        return Ok(Arc::clone(udf));
    }
    let carrier = carriers()
        .read()
        .unwrap()
        .iter()
        .find(|c| c.runtime() == shipped.runtime)
        .cloned()
        .ok_or_else(|| {
            DataFusionError::NotImplemented(format!(
                "function {name} is {} code, which this process does not run (a worker \
                 started as `python -m flumen worker` runs Python functions)",
                shipped.runtime
            ))
        })?;
    // Unpacked outside the lock: it runs the runtime's code (imports, class bodies).
    let udf = Arc::new(carrier.unpack(name, &shipped.packed)?);
    let mut kept = unpacked().lock().unwrap();
    Ok(Arc::clone(kept.entry(digest).or_insert(udf)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::datatypes::DataType;
    use datafusion::logical_expr::{ColumnarValue, ScalarFunctionArgs, Signature, Volatility};
    use datafusion::logical_expr::{ScalarUDFImpl, create_udf};

    /// A runtime whose packed form is the function's return value as text: `unpack` makes a
    /// function returning that constant.
    struct Constants;

    #[derive(Debug, PartialEq, Eq, Hash)]
    struct Constant {
        name: String,
        value: i64,
        signature: Signature,
    }

    impl ScalarUDFImpl for Constant {
        fn name(&self) -> &str {
            &self.name
        }
        fn signature(&self) -> &Signature {
            &self.signature
        }
        fn return_type(&self, _: &[DataType]) -> Result<DataType> {
            Ok(DataType::Int64)
        }
        fn invoke_with_args(&self, _: ScalarFunctionArgs) -> Result<ColumnarValue> {
            Ok(ColumnarValue::Scalar(self.value.into()))
        }
    }

    impl FunctionCarrier for Constants {
        fn runtime(&self) -> String {
            "constants1".into()
        }
        fn pack(&self, udf: &ScalarUDF) -> Option<Vec<u8>> {
            let constant = udf.inner().as_ref() as &dyn std::any::Any;
            let constant = constant.downcast_ref::<Constant>()?;
            Some(constant.value.to_string().into_bytes())
        }
        fn unpack(&self, name: &str, packed: &[u8]) -> Result<ScalarUDF> {
            let value = std::str::from_utf8(packed)
                .ok()
                .and_then(|t| t.parse().ok())
                .ok_or_else(|| DataFusionError::Execution("not a constant".into()))?;
            Ok(ScalarUDF::new_from_impl(Constant {
                name: name.into(),
                value,
                signature: Signature::nullary(Volatility::Immutable),
            }))
        }
    }

    #[test]
    fn a_packed_function_unpacks_once_per_process_and_plain_ones_do_not_ship() {
        register_carrier(Arc::new(Constants));
        assert!(runtimes().contains(&"constants1".to_string()));
        let plain = create_udf(
            "plain",
            vec![],
            DataType::Int64,
            Volatility::Immutable,
            Arc::new(|_: &[ColumnarValue]| Ok(ColumnarValue::Scalar(1i64.into()))),
        );
        assert!(pack(&plain).is_none());
        // Bytes packed elsewhere (another process) unpack here once, then are kept.
        let shipped = ShippedFunction {
            kind: SHIPPED_FUNCTION.into(),
            runtime: "constants1".into(),
            packed: b"42".to_vec(),
        };
        let bytes = shipped.to_bytes();
        let read = ShippedFunction::from_bytes(&bytes).unwrap();
        let first = unpack("answer", &read).unwrap();
        let again = unpack("answer", &read).unwrap();
        assert!(Arc::ptr_eq(&first, &again));
        assert_eq!(first.name(), "answer");
        // A function packed here unpacks as itself.
        let own = ScalarUDF::new_from_impl(Constant {
            name: "seven".into(),
            value: 7,
            signature: Signature::nullary(Volatility::Immutable),
        });
        let shipped = pack(&own).unwrap();
        let back = unpack("seven", &shipped).unwrap();
        assert!(Arc::ptr_eq(back.inner(), own.inner()));
        // A runtime nobody here runs is a clear error; bytes of another kind are not shipped.
        let foreign = ShippedFunction {
            kind: SHIPPED_FUNCTION.into(),
            runtime: "cobol85".into(),
            packed: vec![1],
        };
        let err = unpack("old", &foreign).unwrap_err().to_string();
        assert!(err.contains("old") && err.contains("cobol85"), "{err}");
        assert!(ShippedFunction::from_bytes(b"\x0a\x03abc").is_none());
    }
}
